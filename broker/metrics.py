"""Prometheus `/metrics` for the broker, read from the daemon's latest status snapshot,
and for the gateway, read from its counters and router.

The HTTP server runs in its own thread; it reads only the frozen snapshot the loop
publishes each tick, never the live core, so a scrape cannot race a transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

if TYPE_CHECKING:
    from .daemon import BrokerDaemon
    from .gateway import Gateway


class StatusCollector:
    def __init__(self, daemon: BrokerDaemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        snap = self.daemon.snapshot
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


def serve_metrics(daemon: BrokerDaemon, host: str, port: int) -> Any:
    """Start `/metrics` on host:port; returns the server (call `.shutdown()` to stop it)."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(daemon))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


class GatewayCollector:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Any]:
        gw, now = self.gateway, self.gateway.clock()
        answers = CounterMetricFamily("kvbroker_gateway_answers", "Answers sent to clients, by HTTP status", labels=["status"])
        for status, n in sorted(gw.answers.items()):
            answers.add_metric([str(status)], n)
        yield answers
        for key in ("decode_retries", "prefill_retries", "clients_gone", "transfers_cancelled"):
            yield CounterMetricFamily(f"kvbroker_gateway_{key}", f"Gateway counter {key}", value=gw.events[key])
        in_flight = GaugeMetricFamily("kvbroker_gateway_in_flight", "The gateway's requests in flight on an instance",
                                      labels=["role", "instance"])
        usable = GaugeMetricFamily("kvbroker_gateway_instance_usable",
                                   "1 if a request could go to the instance now (registered, not failed lately)",
                                   labels=["role", "instance"])
        for role in ("prefill", "decode"):
            ok = {u.instance_id for u in gw.router.candidates(role, now)}  # type: ignore[arg-type]
            for u in gw.router.upstreams:
                if u.role == role:
                    in_flight.add_metric([role, u.instance_id], gw.router.in_flight(u))
                    usable.add_metric([role, u.instance_id], int(u.instance_id in ok))
        yield in_flight
        yield usable


def gateway_metrics(gateway: Gateway) -> tuple[bytes, str]:
    """The gateway's metrics in Prometheus' text format, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(gateway))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE_LATEST
