"""How long completed transfers took, by phase, as fixed-bucket histograms.

Pure counting over the core's injected clock: the core observes, `kvbroker status`
and `/metrics` read the buckets. Phases, each measured at the broker:

    handshake   P's Offer to the Go: routing, room in D's pool, D's Ready
    data        the Go to D's Done: P's send, D's receive and scatter, the Done's hop
    total       P's Offer to D's Done
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from protocols.messages import LatencyInfo

# Upper bounds in seconds: a same-host NCCL transfer takes a millisecond or two, a
# congested or retried one seconds; past the last bound counts as +Inf.
BOUNDS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)
PHASES = ("handshake", "data", "total")


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_S) + 1))  # the last: +Inf
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # a clock that stepped back counts as instant
        self.counts[bisect_left(BOUNDS_S, seconds)] += 1  # the first bound at or over it
        self.sum_s += seconds

    def info(self) -> LatencyInfo:
        return LatencyInfo(bounds_s=list(BOUNDS_S), counts=list(self.counts), sum_s=round(self.sum_s, 6))


def quantile_bound(info: LatencyInfo, q: float) -> float | None:
    """The bucket bound at or under which a fraction `q` of the observations fall
    (inf past the last bound; None with no observations)."""
    total = sum(info.counts)
    if not total:
        return None
    seen = 0
    for i, n in enumerate(info.counts):
        seen += n
        if seen >= q * total:
            return info.bounds_s[i] if i < len(info.bounds_s) else float("inf")
    return float("inf")
