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
    prefill), its full block ids (each KV cache group's, for a hybrid model) and token
    count go into ``metadata.saves``: the
    worker half copies those blocks out during that very forward pass. So
    `request_finished` returns ``(False, params)``: vLLM frees the blocks at once,
    because nothing reads them after the step.

Consumer (decode instance, ``kv_consumer``)
    `get_num_new_matched_tokens` claims every prompt token past the local prefix-cache
    hit, asynchronously (``load_async=True``), so the engine keeps decoding other
    requests while the KV moves. A request is claimed once: after a failed load vLLM
    asks again (policy "recompute"), and a second claim would loop forever, so it then
    gets ``(0, False)`` and is computed locally. `update_state_after_alloc` records the
    request's blocks (each KV cache group's, for a hybrid model; a sliding-window
    group's retired blocks are vLLM's null block) and how many leading blocks are D's
    own prefix-cache hit: those are never written, and the worker asks the producer
    only for the blocks after them.

Router protocols (what `kv_transfer_params` may say; README "Behind the P/D routers you already run")
    native      P and D both get ``{"transfer_id": ...}`` (the gateway adds the other
                instance's id).
    sequential  NixlConnector's, spoken by vLLM's toy proxy, llm-d's sidecar, vllm-router
                and Dynamo: P gets ``{"do_remote_decode": true, ...}`` without an id, makes
                one, and returns in its response the params the router forwards to D
                unchanged (``do_remote_prefill: true``, ``transfer_id``,
                ``remote_engine_id`` = this instance, ...).
    concurrent  Mooncake's: P gets ``{"do_remote_decode": true, "transfer_id": ...}``, D
                gets ``{"do_remote_prefill": true, "transfer_id": ..., "remote_engine_id":
                ...}`` at the same time.
    On D, ``do_remote_prefill: true`` without a usable transfer id, a grant that does not
    verify (with ``grant_key_file``), or a transfer id another request here is loading
    already, is a load failure at once (`LoadSpec.refused`): vLLM then recomputes or
    fails the request per ``kv_load_failure_policy``. A request without a transfer id,
    or a native one with a malformed id, runs as a plain request.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from protocols import grants

from .config import ConnectorConfig

__all__ = ["ConnectorScheduler", "KvBrokerMetadata", "LoadSpec", "SaveSpec", "refusal_key", "transfer_id_of"]

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
    # A hybrid model: every KV cache group's block ids (`block_ids` is the first group's).
    groups: list[list[int]] = []


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
    # Why this request may not load (one sentence): the worker fails it at once, so vLLM
    # applies kv_load_failure_policy. Keyed in `KvBrokerMetadata.loads` by
    # `refusal_key(req_id)`, never by a transfer id.
    refused: str = ""
    # A hybrid model: every KV cache group's block ids (`block_ids` is the first group's;
    # a sliding-window group's retired blocks are vLLM's null block, 0).
    groups: list[list[int]] = []


class KvBrokerMetadata(msgspec.Struct, kw_only=True):
    """One step's instructions from the scheduler half to the worker half, keyed by transfer id.

    A msgspec Struct: cheap to build every step and picklable for vLLM's executor.
    `connector.connector` registers it as a virtual `KVConnectorMetadata` subclass.
    """

    saves: dict[str, SaveSpec] = {}
    loads: dict[str, LoadSpec] = {}
    # The step schedules no tokens: the worker runs no model, and vLLM's engine sleeps
    # after it, so the worker's get_finished may wait for a landing (`consumer.IDLE_WAIT_S`).
    idle: bool = False
    # Producer: transfers named by the router (so a decode instance may hold a claim) that
    # this instance will never stage, with why: the worker cancels them at the broker, and
    # the decode side's load fails at once instead of at its deadline.
    cancels: dict[str, str] = {}


def tokens_digest(request: Any) -> str:
    """A short digest of the request's prompt token ids ("" when vLLM has none, e.g. embeddings)."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return ""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=12).hexdigest()


def refusal_key(req_id: str) -> str:
    """The key of a refused load in `KvBrokerMetadata.loads` (longer than any transfer id)."""
    return "refused:" + "_" * MAX_TRANSFER_ID + req_id


def _usable_id(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value.encode()) <= MAX_TRANSFER_ID else None


def _params(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def transfer_id_of(request: Any) -> str | None:
    """The request's transfer id, or None when it has none or an unusable one."""
    params = _params(request)
    if params is None:
        return None
    tid = params.get("transfer_id")
    if _usable_id(tid) is not None:
        return tid
    if tid is not None:
        log.warning(
            "request.bad_transfer_id",
            req_id=getattr(request, "request_id", "?"),
            reason=f"transfer_id must be a string of 1 to {MAX_TRANSFER_ID} bytes; running it as a plain request",
            phase="claim",
        )
    return None


def _instance_param(params: dict[str, Any], *keys: str) -> str:
    """The first instance id the proxy put under one of `keys` ("" when absent or unusable)."""
    for key in keys:
        value = params.get(key)
        if isinstance(value, str) and 0 < len(value) <= MAX_TRANSFER_ID:
            return value
    return ""


class _Ask(msgspec.Struct, kw_only=True):
    """What a decode request's kv_transfer_params ask for: a load, or a refused one."""

    transfer_id: str  # "" when refused for want of a usable one
    prefill: str
    grant: Any = None
    refused: str = ""


def _consumer_ask(request: Any) -> _Ask | None:
    """Read a decode request's params (any protocol); None: a plain request."""
    params = _params(request)
    if params is None:
        return None
    remote = params.get("do_remote_prefill")
    if remote is True:
        tid = _usable_id(params.get("transfer_id"))
        prefill = _instance_param(params, "remote_engine_id", "prefill_instance_id")
        if tid is None:
            return _Ask(
                transfer_id="",
                prefill=prefill,
                refused="do_remote_prefill came without a usable transfer_id (a string of 1 to "
                f"{MAX_TRANSFER_ID} bytes): the router must forward the prefill's kv_transfer_params unchanged",
            )
        return _Ask(transfer_id=tid, prefill=prefill, grant=params.get(grants.GRANT_PARAM))
    if remote is not None:
        return None  # do_remote_prefill false (or garbage): nothing to load
    tid = transfer_id_of(request)
    if tid is None:
        return None
    return _Ask(transfer_id=tid, prefill=_instance_param(params, "prefill_instance_id"), grant=params.get(grants.GRANT_PARAM))


class _Producing(msgspec.Struct, kw_only=True):
    transfer_id: str
    num_tokens: int
    decode: str
    tokens: str = ""
    # Asked in the router protocols' form (do_remote_decode): answer in that form too.
    remote_decode: bool = False
    # The transfer id came with the request (native, concurrent): D may have claimed it.
    named: bool = True
    block_ids: list[list[int]] = []  # per KV cache group
    staged: bool = False


class ConnectorScheduler:
    """The scheduler-side state of one engine; every method is called on the scheduler thread."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, *, tp_size: int = 1, wall: Callable[[], float] = time.time
    ) -> None:
        """`tp_size` is only reported to routers; `wall` (Unix time) signs and checks grants."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self._wall = wall
        self.is_producer = config.role == "producer"
        self._log = log.bind(role=config.role, instance=config.instance_id)
        # Producer: requests with a transfer id, from allocation until they finish.
        self._producing: dict[str, _Producing] = {}
        # Consumer: the last claim's local prefix hit (tokens) and what the request asks
        # for, by req_id; and the requests whose load was handed to the worker (claimed
        # once, never again).
        self._claims: dict[str, tuple[int, _Ask]] = {}
        self._loading: set[str] = set()
        # Pending instructions for the next metadata, drained by build_connector_meta.
        self._saves: dict[str, SaveSpec] = {}
        self._cancels: dict[str, str] = {}
        self._loads: dict[str, LoadSpec] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- vLLM hooks ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Consumer: claim the prompt past the local hit, asynchronously, once per request."""
        if self.is_producer:
            return 0, False
        rid = request.request_id
        if rid in self._loading:
            # A recompute after a failed load (or a preemption): compute locally.
            return 0, False
        ask = _consumer_ask(request)
        if ask is None:
            return 0, False
        num = int(request.num_prompt_tokens) - num_computed_tokens
        if num <= 0:
            return 0, False
        if not ask.refused and self.config.grant_key is not None:
            why = grants.verify(
                self.config.grant_key,
                ask.grant,
                transfer_id=ask.transfer_id,
                prefill=ask.prefill,
                prompt=tokens_digest(request),
                now=self._wall(),
            )
            if why is not None:
                ask.refused = f"transfer_id {ask.transfer_id!r} is refused: {why}"
        # Remembered per call: if allocation fails, vLLM asks again next step.
        self._claims[rid] = (num_computed_tokens, ask)
        return num, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record what the worker must stage (producer) or load (consumer) for this request."""
        rid = request.request_id
        if self.is_producer:
            if rid not in self._producing:
                self._start_producing(request)
            return
        if num_external_tokens <= 0 or rid in self._loading or rid not in self._claims:
            return  # not ours, or the second call after the load finished
        local, ask = self._claims.pop(rid)
        num_tokens = int(request.num_prompt_tokens)
        per_group = [list(ids[: self.blocks_for(num_tokens)]) for ids in blocks.get_block_ids()]
        needed = self.blocks_for(num_tokens)
        self._loading.add(rid)
        refused = ask.refused
        if not refused and ask.transfer_id in self._loads:
            refused = f"transfer_id {ask.transfer_id!r} is refused: another request on this instance is loading it"
        spec = LoadSpec(
            req_id=rid,
            block_ids=per_group[0],
            groups=per_group if len(per_group) > 1 else [],
            num_cached_blocks=local // self.block_size,
            num_tokens=num_tokens,
            tokens=tokens_digest(request),
            prefill=ask.prefill,
            refused=refused,
        )
        if refused:
            self._loads[refusal_key(rid)] = spec
            return  # the worker's transfer.load_failed line says why
        self._loads[ask.transfer_id] = spec
        self._log.info(
            "transfer.claimed",
            transfer_id=ask.transfer_id,
            req_id=rid,
            phase="claim",
            tokens=num_external_tokens,
            local_hit_tokens=local,
            blocks=needed,
        )

    def _start_producing(self, request: Any) -> None:
        """Producer: follow this request if it carries a transfer id, or asks for one."""
        params = _params(request)
        if params is None:
            return
        remote_decode = params.get("do_remote_decode") is True
        tid = transfer_id_of(request)
        named = tid is not None
        if tid is None:
            if not remote_decode:
                return
            tid = grants.new_transfer_id("kv")  # the sequential protocol: P names the transfer
        self._producing[request.request_id] = _Producing(
            transfer_id=tid,
            named=named,
            num_tokens=int(request.num_prompt_tokens),
            decode=_instance_param(params, "decode_instance_id"),
            tokens=tokens_digest(request),
            remote_decode=remote_decode,
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvBrokerMetadata:
        """This step's saves and loads; the pending dicts are emptied."""
        if self.is_producer:
            self._collect_saves(scheduler_output)
        meta = KvBrokerMetadata(saves=self._saves, loads=self._loads, cancels=self._cancels,
                                idle=getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0)
        self._saves, self._loads, self._cancels = {}, {}, {}
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Never hold blocks: the producer's KV is staged already, the consumer's is loaded or failed.
        `block_ids` (one group's list, or every group's tuple) is not needed for that."""
        rid = request.request_id
        self._claims.pop(rid, None)
        self._loading.discard(rid)
        prod = self._producing.pop(rid, None)
        if prod is None:
            return False, None
        if not prod.staged:
            self._not_staged(rid, prod, "the request finished before its prompt was computed", level="warning")
        return False, self._answer(rid, prod)

    def _not_staged(self, rid: str, prod: _Producing, reason: str, *, level: str = "error") -> None:
        """Log that `prod` will never be staged; a transfer the router named is cancelled at
        the broker by the next step's worker (`KvBrokerMetadata.cancels`), since its decode
        instance may already wait for it. (Sent with the next step: an engine with nothing
        left to run sends it with its next request's first step.)"""
        getattr(self._log, level)("transfer.not_staged", transfer_id=prod.transfer_id, req_id=rid, phase="stage",
                                  reason=reason)
        if prod.named:
            self._cancels[prod.transfer_id] = f"the prefill instance will not compute it: {reason}"


    def _answer(self, rid: str, prod: _Producing) -> dict[str, Any]:
        """The kv_transfer_params P returns: what a router forwards to D (never the client's values)."""
        inst = self.config.instance_id
        out: dict[str, Any] = {"transfer_id": prod.transfer_id, "prefill_instance_id": inst}
        if prod.remote_decode:
            out.update(
                # Nothing staged (the request ended before its prompt was computed): D
                # computes at once instead of waiting for KV that never comes.
                do_remote_prefill=prod.staged,
                do_remote_decode=False,
                remote_engine_id=inst,
                remote_request_id=rid[:MAX_TRANSFER_ID],
                # NixlConnector's keys, which some routers expect to find: KV moves by
                # transfer_id through the broker, so no block ids or address are needed.
                remote_block_ids=[],
                remote_host="",
                remote_port=0,
                tp_size=self.tp_size,
            )
        if self.config.grant_key is not None:
            out[grants.GRANT_PARAM] = grants.sign(
                self.config.grant_key,
                transfer_id=prod.transfer_id,
                prefill=inst,
                prompt=prod.tokens,
                expires=self._wall() + self.config.staging_ttl_s,
            )
        return out

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
            prod.block_ids = [list(ids) for ids in new.block_ids]
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
                    if rid in resumed or not prod.block_ids:
                        prod.block_ids = [list(ids) for ids in new_ids]
                    else:
                        prod.block_ids = [old + list(ids) for old, ids in zip(prod.block_ids, new_ids)]
                touched.append((rid, prod, cached.num_computed_tokens[i] + scheduled.get(rid, 0)))
        for rid, prod, computed in touched:
            if computed < prod.num_tokens:
                continue  # a chunked prefill: stage after its last chunk
            needed = self.blocks_for(prod.num_tokens)
            held = min((len(ids) for ids in prod.block_ids), default=0)
            if held < needed:
                self._not_staged(rid, prod, f"the request holds {held} blocks but its prompt needs {needed}")
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
                    if prod.named:
                        self._cancels[prod.transfer_id] = ("the prefill instance will not compute it: two requests "
                                                           "in one step carried its transfer_id with different prompts")
                continue
            self._saves[prod.transfer_id] = SaveSpec(
                req_id=rid,
                block_ids=prod.block_ids[0][:needed],
                groups=[ids[:needed] for ids in prod.block_ids] if len(prod.block_ids) > 1 else [],
                num_tokens=prod.num_tokens,
                decode=prod.decode,
                tokens=prod.tokens,
            )
