"""Prometheus `/metrics` for the broker, read from the daemon's latest status snapshot.

The HTTP server runs in its own thread; it reads only the frozen snapshot the loop
publishes each tick, never the live core, so a scrape cannot race a transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from protocols.messages import Status


class StatusCollector:
    """Reads `snapshot()`, the daemon's latest frozen status, at each scrape."""

    def __init__(self, snapshot: Callable[[], Status]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot()
        peers = GaugeMetricFamily("kvbroker_peers", "Registered peers", labels=["role"])
        for role in ("prefill", "decode"):
            peers.add_metric([role], sum(1 for p in snap.peers if p.role == role))
        yield peers
        states = GaugeMetricFamily("kvbroker_transfers_in_flight", "Transfers held by the broker", labels=["state"])
        for state in ("expected", "unrouted", "waiting_credit", "preparing", "sending"):
            states.add_metric([state], sum(1 for t in snap.transfers if t.state == state))
        yield states
        for name, attr, doc in (
            ("kvbroker_pool_capacity_bytes", "capacity", "Decode receive pool capacity"),
            ("kvbroker_pool_reserved_bytes", "reserved", "Credit reserved on a decode pool"),
            ("kvbroker_pool_waiting", "waiting", "Transfers queued for credit"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["peer"])
            for pool in snap.pools:
                g.add_metric([pool.peer_id], getattr(pool, attr))
            yield g
        for key, value in sorted(snap.counters.items()):
            yield CounterMetricFamily(f"kvbroker_{key}", f"Broker counter {key}", value=value)
        seconds = HistogramMetricFamily(
            "kvbroker_transfer_seconds", "Completed transfers by phase: handshake (Offer to Go), "
            "data (Go to Done), total (Offer to Done)", labels=["phase"])
        for phase, info in sorted(snap.latency.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, info.bounds_s), "+Inf"], info.counts):
                cumulative += n
                buckets.append((bound, cumulative))
            seconds.add_metric([phase], buckets, sum_value=info.sum_s)
        yield seconds


def serve_metrics(snapshot: Callable[[], Status], host: str, port: int) -> Any:
    """Start `/metrics` on host:port; returns the server (call `.shutdown()` to stop it)."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(snapshot))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
