"""Prometheus `/metrics` for the gateway, read from its counters and its router."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .routes import Router

EVENTS = ("decode_retries", "prefill_retries", "decode_alone", "clients_gone", "transfers_cancelled")


class GatewayCollector:
    def __init__(self, answers: Counter[int], events: Counter[str], router: Router, now: float) -> None:
        self.answers, self.events, self.router, self.now = answers, events, router, now

    def collect(self) -> Iterator[Any]:
        answers = CounterMetricFamily("kvbroker_gateway_answers", "Answers sent to clients, by HTTP status", labels=["status"])
        for status, n in sorted(self.answers.items()):
            answers.add_metric([str(status)], n)
        yield answers
        for key in EVENTS:
            yield CounterMetricFamily(f"kvbroker_gateway_{key}", f"Gateway counter {key}", value=self.events[key])
        in_flight = GaugeMetricFamily("kvbroker_gateway_in_flight", "The gateway's requests in flight on an instance",
                                      labels=["role", "instance"])
        usable = GaugeMetricFamily("kvbroker_gateway_instance_usable",
                                   "1 if the instance is a first choice now: registered (or the broker silent), not failed lately",
                                   labels=["role", "instance"])
        for role in ("prefill", "decode"):
            ok = self.router.usable(role, self.now)  # type: ignore[arg-type]
            for u in self.router.upstreams:
                if u.role == role:
                    in_flight.add_metric([role, u.instance_id], self.router.in_flight(u))
                    usable.add_metric([role, u.instance_id], int(u.instance_id in ok))
        yield in_flight
        yield usable
        # What the router ranks by beside its own requests: the broker's count, as of its
        # last status (none while that status is stale).
        seen = GaugeMetricFamily("kvbroker_gateway_broker_transfers",
                                 "Transfers the broker has in flight on the instance, from any gateway, as of the "
                                 "router's last fresh status", labels=["role", "instance"])
        view = self.router.fresh_view(self.now)
        if view is not None:
            for u in self.router.upstreams:
                seen.add_metric([u.role, u.instance_id], view.transfers.get(u.instance_id, 0))
        yield seen
        yield GaugeMetricFamily("kvbroker_gateway_degraded", "1 while the broker is silent or lists no instance of a "
                                "role: requests then go to every instance given", value=int(self.router.degraded(self.now) is not None))


def gateway_metrics(answers: Counter[int], events: Counter[str], router: Router, now: float) -> tuple[bytes, str]:
    """The gateway's metrics in Prometheus' text format, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GatewayCollector(answers, events, router, now))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE_LATEST
