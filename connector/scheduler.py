"""The scheduler half of the connector: decides what moves, never moves anything.

It runs inside vLLM's scheduler (the EngineCore process under ``vllm serve``) and
holds no torch, no sockets and no threads. It tells the worker half what to do through
one `KvBrokerMetadata` per step, built in `build_connector_meta` from pending dicts that
are then cleared (the NixlConnector pattern). Transfers are keyed by the proxy's
``kv_transfer_params["transfer_id"]``, never by vLLM's request id, which vLLM
suffixes with random characters and which differs between P and D.

Producer (prefill instance, ``kv_producer``)
    A request carrying a transfer id is remembered when it is allocated. When the step
    that completes its prompt is scheduled (one step, or the last chunk of a chunked
    prefill), its full block ids and token count go into ``metadata.saves``: the
    worker half copies those blocks out during that very forward pass. So
    `request_finished` returns ``(False, params)``: vLLM frees the blocks at once,
    because nothing reads them after the step.

Consumer (decode instance, ``kv_consumer``)
    `get_num_new_matched_tokens` claims every prompt token past the local prefix-cache
    hit, asynchronously (``load_async=True``), so the engine keeps decoding other
    requests while the KV moves. A request is claimed once: after a failed load vLLM
    asks again (policy "recompute"), and a second claim would loop forever, so it then
    gets ``(0, False)`` and is computed locally. `update_state_after_alloc` records the
    request's blocks and how many leading blocks are D's own prefix-cache hit: those
    are never written, and the worker asks the producer only for the blocks after
    them.

A request without a transfer id (or with a malformed one) runs as a plain request.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import msgspec
import structlog

from .config import ConnectorConfig

__all__ = ["ConnectorScheduler", "KvBrokerMetadata", "LoadSpec", "SaveSpec", "transfer_id_of"]

log = structlog.get_logger("kvbroker.connector")

MAX_TRANSFER_ID = 128  # protocols.messages.Id


class SaveSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Stage this request's blocks in this step (producer)."""

    req_id: str
    block_ids: list[int]
    num_tokens: int
    # The decode instance the proxy sent the request to, when it said so.
    decode: str = ""
    # Digest of the prompt's token ids: a transfer_id reused for another prompt is caught.
    tokens: str = ""


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Load this request's KV into `block_ids` after its first `num_cached_blocks` (consumer)."""

    req_id: str
    block_ids: list[int]
    num_cached_blocks: int
    num_tokens: int
    # Digest of the prompt's token ids, checked against the producer's in Prepare.
    tokens: str = ""
    # The prefill instance the proxy sent the request to, when it said so.
    prefill: str = ""


class KvBrokerMetadata(msgspec.Struct, kw_only=True):
    """One step's instructions from the scheduler half to the worker half, keyed by transfer id.

    A msgspec Struct: cheap to build every step and picklable for vLLM's executor.
    `connector.connector` registers it as a virtual `KVConnectorMetadata` subclass.
    """

    saves: dict[str, SaveSpec] = {}
    loads: dict[str, LoadSpec] = {}


def tokens_digest(request: Any) -> str:
    """A short digest of the request's prompt token ids ("" when vLLM has none, e.g. embeddings)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return ""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=12).hexdigest()


def transfer_id_of(request: Any) -> str | None:
    """The request's transfer id, or None when it has none or an unusable one."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    tid = params.get("transfer_id")
    if isinstance(tid, str) and 0 < len(tid.encode()) <= MAX_TRANSFER_ID:
        return tid
    if tid is not None:
        log.warning(
            "request.bad_transfer_id",
            req_id=getattr(request, "request_id", "?"),
            reason=f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} bytes; running it as a plain request",
            phase="claim",
        )
    return None


def _instance_param(params: dict[str, Any], key: str) -> str:
    """An instance id the proxy put in kv_transfer_params ("" when absent or unusable)."""
    value = params.get(key, "")
    return value if isinstance(value, str) and len(value) <= MAX_TRANSFER_ID else ""


class _Producing(msgspec.Struct, kw_only=True):
    transfer_id: str
    num_tokens: int
    decode: str
    tokens: str = ""
    block_ids: list[int] = []
    staged: bool = False


class ConnectorScheduler:
    """The scheduler-side state of one engine; every method is called on the scheduler thread."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.config = config
        self.block_size = block_size
        self.is_producer = config.role == "producer"
        self._log = log.bind(role=config.role, instance=config.instance_id)
        # Producer: requests with a transfer id, from allocation until they finish.
        self._producing: dict[str, _Producing] = {}
        # Consumer: local prefix hit seen by the last claim (req_id -> tokens), and the
        # requests whose load was handed to the worker (claimed once, never again).
        self._claims: dict[str, int] = {}
        self._loading: set[str] = set()
        # Pending instructions for the next metadata, drained by build_connector_meta.
        self._saves: dict[str, SaveSpec] = {}
        self._loads: dict[str, LoadSpec] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- vLLM hooks ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Consumer: claim the prompt past the local hit, asynchronously, once per request."""
        if self.is_producer:
            return 0, False
        tid = transfer_id_of(request)
        if tid is None:
            return 0, False
        rid = request.request_id
        if rid in self._loading:
            # A recompute after a failed load (or a preemption): compute locally.
            return 0, False
        num = int(request.num_prompt_tokens) - num_computed_tokens
        if num <= 0:
            return 0, False
        # Remembered per call: if allocation fails, vLLM asks again next step.
        self._claims[rid] = num_computed_tokens
        return num, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record what the worker must stage (producer) or load (consumer) for this request."""
        tid = transfer_id_of(request)
        if tid is None:
            return
        rid = request.request_id
        if self.is_producer:
            if rid not in self._producing:
                self._producing[rid] = _Producing(
                    transfer_id=tid,
                    num_tokens=int(request.num_prompt_tokens),
                    decode=_instance_param(request.kv_transfer_params, "decode_instance_id"),
                    tokens=tokens_digest(request),
                )
            return
        if num_external_tokens <= 0 or rid in self._loading or rid not in self._claims:
            return  # not ours, or the second call after the load finished
        local = self._claims.pop(rid)
        num_tokens = int(request.num_prompt_tokens)
        (block_ids,) = blocks.get_block_ids()[:1]
        needed = self.blocks_for(num_tokens)
        self._loading.add(rid)
        self._loads[tid] = LoadSpec(
            req_id=rid,
            block_ids=list(block_ids[:needed]),
            num_cached_blocks=local // self.block_size,
            num_tokens=num_tokens,
            tokens=tokens_digest(request),
            prefill=_instance_param(request.kv_transfer_params, "prefill_instance_id"),
        )
        self._log.info(
            "transfer.claimed",
            transfer_id=tid,
            req_id=rid,
            phase="claim",
            tokens=num_external_tokens,
            local_hit_tokens=local,
            blocks=needed,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvBrokerMetadata:
        """This step's saves and loads; the pending dicts are emptied."""
        if self.is_producer:
            self._collect_saves(scheduler_output)
        meta = KvBrokerMetadata(saves=self._saves, loads=self._loads)
        self._saves, self._loads = {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Never hold blocks: the producer's KV is staged already, the consumer's is loaded or failed."""
        rid = request.request_id
        self._claims.pop(rid, None)
        self._loading.discard(rid)
        prod = self._producing.pop(rid, None)
        if prod is None:
            return False, None
        if not prod.staged:
            self._log.warning(
                "transfer.not_staged",
                transfer_id=prod.transfer_id,
                req_id=rid,
                phase="stage",
                reason="the request finished before its prompt was computed",
            )
        return False, {"transfer_id": prod.transfer_id, "prefill_instance_id": self.config.instance_id}

    # -- producer bookkeeping --------------------------------------------------------------

    def _collect_saves(self, so: Any) -> None:
        """Follow producing requests through this step; save those whose prompt completes."""
        if not self._producing:
            return
        scheduled: dict[str, int] = getattr(so, "num_scheduled_tokens", {}) or {}
        touched: list[tuple[str, _Producing, int]] = []
        for new in getattr(so, "scheduled_new_reqs", ()) or ():
            prod = self._producing.get(new.req_id)
            if prod is None or prod.staged:
                continue
            prod.block_ids = list(new.block_ids[0])
            touched.append((new.req_id, prod, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
            for i, rid in enumerate(cached.req_ids):
                prod = self._producing.get(rid)
                if prod is None or prod.staged:
                    continue
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:
                    prod.block_ids = list(new_ids[0]) if rid in resumed else prod.block_ids + list(new_ids[0])
                touched.append((rid, prod, cached.num_computed_tokens[i] + scheduled.get(rid, 0)))
        for rid, prod, computed in touched:
            if computed < prod.num_tokens:
                continue  # a chunked prefill: stage after its last chunk
            needed = self.blocks_for(prod.num_tokens)
            if len(prod.block_ids) < needed:
                self._log.error(
                    "transfer.stage_skipped",
                    transfer_id=prod.transfer_id,
                    req_id=rid,
                    phase="stage",
                    reason=f"the request holds {len(prod.block_ids)} blocks but its prompt needs {needed}",
                )
                prod.staged = True
                continue
            prod.staged = True
            first = self._saves.get(prod.transfer_id)
            if first is not None:
                same = first.tokens == prod.tokens
                self._log.warning(
                    "transfer.duplicate",
                    transfer_id=prod.transfer_id,
                    req_id=rid,
                    phase="stage",
                    reason="two requests in one step carry this transfer_id; "
                    + ("only the first is staged" if same else "their prompts differ, so neither is staged"),
                )
                if not same:
                    del self._saves[prod.transfer_id]
                continue
            self._saves[prod.transfer_id] = SaveSpec(
                req_id=rid,
                block_ids=prod.block_ids[:needed],
                num_tokens=prod.num_tokens,
                decode=prod.decode,
                tokens=prod.tokens,
            )
