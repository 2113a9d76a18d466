"""`KVBrokerConnector`: the vLLM KVConnectorBase_V1 facade over two halves.

vLLM builds one connector per role in each engine: a SCHEDULER one (in the scheduler,
the EngineCore process under ``vllm serve``) and a WORKER one (in each worker
process). The constructor dispatches on the role once and builds exactly one half;
every hook asserts its half and forwards in one line, so all behaviour lives in
`connector.scheduler` (what to move; no torch, no sockets) and `connector.worker`
(moving it). The halves talk only through the per-step `KvBrokerMetadata`.

Settings come from ``kv_transfer_config.kv_connector_extra_config`` and are checked
here, at construction (see `connector.config`), so a bad one stops the engine at
startup with one sentence instead of failing a request later.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from protocols.logs import configure_logging

from .config import engine_info_from_vllm, kv_cache_spec_of, parse_config
from .scheduler import ConnectorScheduler, KvBrokerMetadata
from .worker import ConnectorWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBrokerConnector"]

# A msgspec Struct cannot inherit from an ABC; register it as a virtual subclass.
KVConnectorMetadata.register(KvBrokerMetadata)

_logging_lock = threading.Lock()
_logging_done = False


def _configure_logging_once() -> None:
    """structlog for the whole process, once: JSON lines unless stderr is a terminal."""
    global _logging_done
    with _logging_lock:
        if not _logging_done:
            configure_logging("console" if sys.stderr.isatty() else "json")
            _logging_done = True


class KVBrokerConnector(KVConnectorBase_V1, SupportsHMA):
    """Moves each request's KV cache from a prefill to a decode engine through kvbroker.

    `SupportsHMA`: vLLM keeps its hybrid KV cache manager on, so a hybrid model (full
    plus sliding-window attention) runs with one KV cache group per kind, and each
    group's blocks move into that group's blocks (`workers.groups`).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _configure_logging_once()
        ktc = self._kv_transfer_config
        config = parse_config(ktc.kv_connector_extra_config, kv_role=ktc.kv_role, engine_id=ktc.engine_id)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                config,
                int(kv_cache_spec_of(kv_cache_config).block_size),
                tp_size=int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)),
            )
        else:
            self._worker = ConnectorWorker(config, engine_info_from_vllm(vllm_config, kv_cache_config))

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)  # type: ignore[return-value]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        assert self._worker is not None
        self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None  # loads are asynchronous: nothing to wait for per layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and a hybrid model's failed loads as requests (vLLM refuses block
        ids for several KV cache groups); a failed request is among the finished too."""
        assert self._worker is not None
        sending, receiving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(receiving or ()),
            failed_recving=self._worker.get_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
