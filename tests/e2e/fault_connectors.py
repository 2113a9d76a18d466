"""Faults the tests inject into a prefill connector: none of them is in the product.

`NegatingConnector` sends corrupted KV, for the end-to-end negative controls: they show
that D decodes from the KV it received. It is `KVBrokerConnector`, except that in a step
that saves a transfer whose id starts with "corrupt-" it negates each layer's cache
around the real `save_kv_layer`. The staged copy, materialized there in stream order,
holds the negated values; the cache is restored before the forward pass goes on, so P's
own tokens and prefix cache are untouched. Negation keeps every value finite: vLLM does
not zero reused blocks, so NaN patterns would leak into later requests. It negates the
whole layer, so a step must not mix such transfers with others (the tests send them alone).

`RefusingConnector` cannot send the transfers whose id starts with "refuse-": over tcp,
the real sender runs each such send, and its payload fails on the sending thread before
its first byte, as a layer that was never copied would (`tests.faults.refuse_sends`).
P then ends the transfer at the broker itself, and D's load fails at once.

    kv_connector "NegatingConnector" (or "RefusingConnector"),
    kv_connector_module_path "tests.e2e.fault_connectors"
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from connector import KVBrokerConnector
from tests.faults import refuse_sends

PREFIX = "corrupt-"
REFUSED = "refuse-"

log = structlog.get_logger("kvbroker.tests")


class NegatingConnector(KVBrokerConnector):
    _negated: set[str] | None = None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        saves = getattr(self._get_connector_metadata(), "saves", {})
        tids = sorted(t for t in saves if t.startswith(PREFIX))
        if not tids:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
            return
        kv_layer.neg_()
        try:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        finally:
            kv_layer.neg_()
        if self._negated is None:
            self._negated = set()
        for tid in tids:
            if tid not in self._negated:
                self._negated.add(tid)
                log.warning("transfer.fault_injected", transfer_id=tid, phase="fault", fault="negated_send")


class RefusingConnector(KVBrokerConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        if self._worker.producer is not None:
            refuse_sends(self._worker.producer, REFUSED)
