"""A broker's state as `kvbroker status` prints it: tables of peers, pools and transfers."""

from __future__ import annotations

from protocols.ask import STATUS_MAX_FRAME, ask, cancel_transfer, fetch_status
from protocols.messages import Status

from .latency import quantile_bound

# The questions live beside the wire, so the gateway asks without importing the broker.
__all__ = ["STATUS_MAX_FRAME", "ask", "cancel_transfer", "fetch_status", "render_status"]


def _table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def render_status(s: Status) -> str:
    parts = [
        f"peers ({len(s.peers)})",
        _table(
            ["peer", "role", "rank", "lease_left_s", "transfers", "takes", "endpoints"],
            [[p.peer_id, p.role, p.rank, p.lease_left_s, p.transfers,
              ("its claims" if p.claims_only else "any") if p.role == "decode" else "",
              " ".join(f"{k}={v}" for k, v in p.endpoints.items())] for p in s.peers],
        ),
        "",
        f"pools ({len(s.pools)})",
        _table(
            ["peer", "capacity_MiB", "reserved_MiB", "free_MiB", "waiting"],
            [[p.peer_id, _mib(p.capacity), _mib(p.reserved), _mib(p.free), p.waiting] for p in s.pools],
        ),
        "",
        f"transfers in flight ({len(s.transfers)})",
        _table(
            ["transfer_id", "rank", "state", "prefill", "decode", "MiB", "room", "attempt", "lease_left_s", "waiting_for"],
            [[t.transfer_id, t.rank, t.state, t.prefill, t.decode, _mib(t.nbytes), "none: into blocks" if t.in_place else "pool",
              t.attempt, t.lease_left_s, t.waiting_for]
             for t in s.transfers],
        ),
        "",
        "completed transfers, seconds (at or under the bucket bound)",
        _table(
            ["phase", "count", "p50", "p90", "p99", "mean"],
            [[phase, sum(h.counts), *(_bound(quantile_bound(h, q)) for q in (0.5, 0.9, 0.99)),
              f"{h.sum_s / sum(h.counts):.4f}" if sum(h.counts) else "-"] for phase, h in s.latency.items()],
        ),
        "",
        "counters: " + ", ".join(f"{k}={v}" for k, v in sorted(s.counters.items())),
    ]
    return "\n".join(parts)


def _bound(seconds: float | None) -> str:
    return "-" if seconds is None else f"<={seconds:g}"
