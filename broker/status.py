"""Ask a running broker for its state, and print it as tables; tell it a request was given up."""

from __future__ import annotations

from typing import TypeVar

import anyio
import zmq

from protocols.channel import ZmqChannel, curve_client_keys, dealer
from protocols.codec import Codec
from protocols.messages import Cancel, Cancelled, Error, Message, Status, StatusRequest

from .latency import quantile_bound

# A status reply lists up to 1,000 transfers: allow it a larger frame than requests get.
STATUS_MAX_FRAME = 64 << 20
A = TypeVar("A")


async def ask(
    broker: str, msg: Message, answer: type[A], timeout: float = 3.0, curve_server_key: str | None = None,
    curve_client_secret: bytes | None = None,
) -> A:
    """One round trip, unregistered; raises TimeoutError if the broker is silent, and
    RuntimeError with the broker's sentence if it refuses `msg`."""
    codec = Codec(STATUS_MAX_FRAME)
    ctx = zmq.Context()
    curve = curve_client_keys(curve_server_key, curve_client_secret)
    try:
        async with ZmqChannel(dealer(ctx, broker, curve=curve, max_frame=STATUS_MAX_FRAME)) as chan:
            with anyio.fail_after(timeout):
                await chan.send([codec.encode(msg)])
                while True:
                    frames = await chan.receive()
                    got = codec.decode(frames[-1])
                    if isinstance(got, answer):
                        return got
                    if isinstance(got, Error):
                        raise RuntimeError(f"the broker at {broker} refused {type(msg).__name__}: {got.detail}")
    finally:
        ctx.destroy(linger=0)


async def fetch_status(
    broker: str, timeout: float = 3.0, curve_server_key: str | None = None, curve_client_secret: bytes | None = None
) -> Status:
    """One StatusRequest round trip; raises TimeoutError if the broker is silent."""
    return await ask(broker, StatusRequest(), Status, timeout, curve_server_key, curve_client_secret)


async def cancel_transfer(
    broker: str, transfer_id: str, reason: str = "", timeout: float = 3.0, curve_server_key: str | None = None,
    curve_client_secret: bytes | None = None,
) -> Cancelled:
    """Tell the broker the request behind `transfer_id` was given up (`Cancel`)."""
    return await ask(broker, Cancel(transfer_id=transfer_id, reason=reason[:2000]), Cancelled, timeout,
                     curve_server_key, curve_client_secret)


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
            ["transfer_id", "rank", "state", "prefill", "decode", "MiB", "attempt", "lease_left_s", "waiting_for"],
            [[t.transfer_id, t.rank, t.state, t.prefill, t.decode, _mib(t.nbytes), t.attempt, t.lease_left_s, t.waiting_for]
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
