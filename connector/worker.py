"""The worker half of the connector: owns the broker client, the pool and the transport.

`ConnectorWorker` does what both roles share: it reads the KV cache layout from the
tensors vLLM registers and the cache spec (never from attn_metadata, which may be None
or a dict), computes the compatibility fields, starts the transport, allocates the
pool (staging on a producer, receive on a consumer) and registers with the broker. The
role's work is in `connector.producer.ProducerSide` or `connector.consumer.ConsumerSide`.

Threads
-------
vLLM calls the hooks on its worker thread ("main"). The broker client runs on an anyio
loop in a background thread (`workers.client.SyncBrokerClient`) and calls this object
as its `TransferHandler` there. The TCP transport moves bytes on threads of its own;
the nccl transport (`connector.nccl_link`) posts on that loop (or a worker thread of
it), and one poller thread of its own watches the ops and wakes the loop when a
transfer ended; the GPU copies are ordered against the model by CUDA events. State shared between threads sits behind `lock`, which is never held
across a portal call, so neither thread can block the other. KV cache tensors are read
and written on the main thread (gather in the layer hooks, scatter between forward
passes), except over nccl with the transport's copy kernel: there D scatters each chunk
from the link's poller thread, on a stream of its own ordered after the compute stream's work at
`start_load_kv`, into blocks no forward pass uses before the request is reported, and
the compute stream waits for those copies when it is (`connector.consumer`).

Hybrid models
-------------
A hybrid model (several KV cache groups, `EngineInfo.layer_groups`) moves over tcp and
nccl with equal TP sizes: each layer is staged from and scattered into its own group's
block ids, a sliding-window group's rows only from where its window starts
(`workers.groups`), and the groups themselves are a compatibility field. Its rows differ
in width, which the transport's copy kernel and a receive straight into the blocks
assume they do not; so over nccl it takes the staged path (`register_kv_caches` decides,
once): P gathers each layer with torch into its staging on the compute stream, the
staged byte range goes in chunks of whole cells (`chunk_nbytes`), and D scatters each
layer from its receive lease in `get_finished`, as over tcp.

Compatibility
-------------
P and D must agree on everything that shapes a block's bytes: model, dtype, KV cache
dtype, block size, layer count, KV heads, head size, layout kind and attention kernel
variant (the CPU kernel stores K transposed per ISA); and on how the bytes travel: the
transport and, over nccl, how a transfer is cut into ops (`nccl_link.plan`). Those
fields travel in ``Register.compat`` with their hash; the broker refuses a peer that
matches no peer of the other role and names the fields that differ
("dtype: float16 vs bfloat16").

The tensor-parallel size may differ, over tcp and nccl alike, when the model's KV heads
are known (`EngineInfo.kv_heads`) or the cache is MLA's replicated latent: the hash then
holds the model's KV heads instead of a rank's, and the broker plans lanes between the
ranks (`connector.lanes`), refusing sizes that do not split the heads. Otherwise the TP
sizes must be equal.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
import torch

from protocols.channel import curve_client_keys
from protocols.heads import rank_heads
from protocols.messages import Abort, Go, Prepare, Register, Relay, Release
from workers.client import BrokerClient, ClientConfig, SyncBrokerClient
from workers.cpus import PlacementError, format_cpu_list, read_host, thread_cpus, threads_started_on
from workers.gpu_staging import PagedKv
from workers.groups import KvGroups
from workers.layout import CachePlaces, CacheRows, CacheSpec, LayerLayout, detect_layout
from workers.pool import BufferPool

from .config import ConfigError, ConnectorConfig, EngineInfo, read_secret_key
from .consumer import ConsumerSide
from .nccl_link import NcclLink, plan
from .producer import ProducerSide
from .scheduler import KvBrokerMetadata

__all__ = ["ConnectorWorker", "compat_fields", "compat_hash"]

ALIGN = 4096
# Longest one message to the broker may wait while the client reconnects; a message
# that cannot go out by then is re-sent after reconnecting (offers, expects) or made
# moot by the broker's transfer lease (done, abort).
SEND_TIMEOUT_S = 2.0


def compat_fields(info: EngineInfo, layout: LayerLayout, num_layers: int, transport: str,
                  groups: KvGroups | None = None) -> dict[str, str]:
    """The fields P and D must agree on, as text, so a refusal can name what differs.
    `transport` is the config's; over nccl both sides must also cut a transfer into the
    same chunks (`connector.nccl_link.plan`). A hybrid model's `groups` must match too,
    and its TP sizes (its staging's rows differ in width, which lanes do not cut)."""
    spec = CacheSpec.from_vllm(info.spec)
    hetero = info.kv_heads > 0 or spec.use_mla
    if transport == "nccl":
        transport = f"nccl, {plan()}"
    elif groups is None:  # both sides must read a save's bytes in the order they are sent
        transport = "tcp, layer by layer"
    if groups is not None:  # a hybrid model's staged rows differ in width, which lanes do not cut
        hetero = False
    if hetero:  # what a rank holds may differ: the model's heads, the cache's shape per head must not
        return {
            "transport": transport,
            "model": info.model,
            "dtype": str(layout.dtype).removeprefix("torch."),
            "kv_cache_dtype": info.kv_cache_dtype,
            "block_size": str(info.block_size),
            "num_layers": str(num_layers),
            "kv_heads": "mla" if spec.use_mla else str(info.kv_heads),
            "head_size": str(spec.head_size),
            "layout": layout.kind,
            "backend": info.backend or "unknown",
        }
    return {
        "transport": transport,
        "model": info.model,
        "dtype": str(layout.dtype).removeprefix("torch."),
        "kv_cache_dtype": info.kv_cache_dtype,
        "block_size": str(info.block_size),
        "num_layers": str(num_layers),
        "num_kv_heads": str(spec.num_kv_heads),
        "head_size": str(spec.head_size),
        "layout": layout.kind,
        "block_nbytes": str(layout.block_nbytes),
        "backend": info.backend or "unknown",
        "world_size": str(info.world_size),
        **({"kv_groups": groups.describe()} if groups is not None else {}),
    }


def compat_hash(fields: dict[str, str]) -> str:
    text = ";".join(f"{k}={v}" for k, v in sorted(fields.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def allow_amx_tiles(attention: str) -> bool:
    """Ask Linux for the AMX tile state when vLLM's CPU attention runs its AMX kernel
    (`attention` is `EngineInfo.backend`, "CPU_ATTN/amx"); whether it was granted.

    vLLM picks that kernel when the CPU has AMX tiles, but its check does not ask the
    kernel for the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM); until something in the
    process does (oneDNN does at its first AMX matmul, in a long prefill), the first tile
    instruction kills the process with SIGILL. A decode instance fed by this connector
    starts with the one-token queries of loaded prompts and got there first: asked here,
    before the first step. Asking again changes nothing.
    """
    if attention != "CPU_ATTN/amx":
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        structlog.get_logger("kvbroker.connector").warning(
            "connector.amx_denied", attention=attention,
            hint="Linux refused the AMX tile state, and vLLM's AMX attention will fail; serve with --dtype float32")
    return granted


class ConnectorWorker:
    """One worker process's half of the connector (see the module docstring)."""

    def __init__(self, config: ConnectorConfig, info: EngineInfo) -> None:
        self.config = config
        self.info = info
        self.role = config.role
        self.is_producer = config.role == "producer"
        self.log = structlog.get_logger("kvbroker.connector").bind(
            role=config.role, instance=config.instance_id, rank=info.rank
        )
        self.lock = threading.Lock()
        self.layers: dict[str, int] = {}  # layer name -> index in the staged bytes
        self.layouts: dict[str, LayerLayout] = {}
        self.caches: dict[str, torch.Tensor] = {}
        self.staged_layers: list[tuple[torch.Tensor, LayerLayout]] = []  # (cache, layout) in staged order
        self.places = CachePlaces([])
        self.rows = CacheRows([])
        self.paged: PagedKv | None = None  # GPU caches: the transport's copy kernel moves the blocks
        self.block_nbytes = 0
        self.chunk_nbytes = 0  # the unit nccl cuts a transfer into chunks at (`nccl_link.chunks`)
        self.heads = (0, 0)  # the model's KV heads this rank holds (`protocols.heads`)
        self.groups: KvGroups | None = None  # a hybrid model's KV cache groups, by staged layer
        self.compat: dict[str, str] = {}
        self.pool: BufferPool | None = None
        self.client: SyncBrokerClient | None = None
        self.nccl: NcclLink | None = None  # transport "nccl": made once registered (it is named by the peer id)
        self.meta = KvBrokerMetadata()
        # sent_on_receive: of "sent", those started on D's receive, seen before their Go;
        # done_at_landing: loads whose Done went as they landed in their blocks, before the
        # engine's get_finished reported them (counted then, as "loaded"); seen_waiting: idle
        # steps whose get_finished saw a load land (or fail) while it waited, so reported it
        # without another engine step
        self.counters = dict.fromkeys(
            ("staged", "offered", "sent", "sent_on_receive", "released", "aborted", "loaded", "done_at_landing",
             "seen_waiting", "failed", "bytes"), 0)
        self.producer = ProducerSide(self) if self.is_producer else None
        self.consumer = None if self.is_producer else ConsumerSide(self)

    # -- setup -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Detect the layout, start the transport and register with the broker.

        Raises:
            ConfigError: a cache this connector cannot move (GPU, mixed layouts).
            LayoutError: a tensor that fits no known layout for the cache spec.
            BrokerUnavailable: the broker did not answer within register_timeout_s.
            Refused: the broker turned this peer away (e.g. incompatible with the other role).
        """
        if not kv_caches:
            raise ConfigError("vLLM registered no KV cache layers; the KVBrokerConnector has nothing to move.")
        spec = CacheSpec.from_vllm(self.info.spec)
        nccl = self.config.transport == "nccl"
        device = next(iter(kv_caches.values())).device
        hybrid = bool(self.info.layer_groups)
        if hybrid and (missing := [n for n in kv_caches if n not in self.info.layer_groups]):
            raise ConfigError(f"layer {missing[0]} belongs to no KV cache group; the KVBrokerConnector cannot place it.")
        for idx, (name, tensor) in enumerate(kv_caches.items()):
            if not nccl and tensor.device.type != "cpu":
                raise ConfigError(
                    f'layer {name} keeps its KV cache on {tensor.device}; the "tcp" transport moves CPU KV caches '
                    'only: set transport "nccl" for GPU caches.'
                )
            if nccl and tensor.device.type != "cuda":
                raise ConfigError(
                    f'layer {name} keeps its KV cache on {tensor.device}; the "nccl" transport moves GPU KV caches: '
                    'set transport "tcp" for CPU caches.'
                )
            if nccl and tensor.device != device:
                raise ConfigError(
                    f"layer {name} keeps its KV cache on {tensor.device} and the first layer on {device}; one "
                    "connector moves the caches of one GPU, so give each GPU's worker its own."
                )
            self.layers[name] = idx
            group_spec = CacheSpec.from_vllm(self.info.group_specs[self.info.layer_groups[name]]) if hybrid else spec
            self.layouts[name] = detect_layout(tensor, group_spec)
            self.caches[name] = tensor
        kinds = {(lay.kind, lay.block_nbytes, lay.dtype) for lay in self.layouts.values()}
        if len(kinds) != 1:
            raise ConfigError(
                f"the KV cache layers differ in layout ({sorted(map(str, kinds))}); they cannot be staged together."
            )
        first = next(iter(self.layouts.values()))
        self.block_nbytes = first.block_nbytes
        # nccl cuts a transfer into chunks of this unit: a staged block of every layer, or
        # one cell (a layer's block) of a hybrid model, whose rows differ in width.
        self.chunk_nbytes = self.block_nbytes if hybrid else len(self.layers) * self.block_nbytes
        self.staged_layers = [(self.caches[name], self.layouts[name]) for name in self.layers]
        self.places = CachePlaces(self.staged_layers)  # where a tcp receive lands in a CPU cache
        self.rows = CacheRows(self.staged_layers)  # where a save's copies read it, without the copy kernel
        if hybrid:
            self.groups = KvGroups(layer_group=tuple(self.info.layer_groups[n] for n in self.layers),
                                   windows=self.info.windows, block_size=self.info.block_size)
        self.compat = compat_fields(self.info, first, len(self.layers), self.config.transport, self.groups)
        lanes = "kv_heads" in self.compat  # this rank may pair with ranks of another TP size
        if lanes:
            self.heads = rank_heads(self.info.kv_heads, self.info.world_size, self.info.rank, replicated=spec.use_mla)
        else:
            self.heads = (0, spec.num_kv_heads)
        if nccl:
            # The one place a hybrid model is sent down the staged path: its rows differ in
            # width, and the copy kernel and a receive straight into the blocks assume not.
            self.paged = None if hybrid else self._triton_copies(first)
        else:
            allow_amx_tiles(self.info.backend)
        size = self.config.staging_bytes if self.is_producer else self.config.pool_bytes
        # nccl: the pool lives on the caches' GPU, so gathers, sends, receives and
        # scatters never leave it.
        self.pool = BufferPool(-(-size // ALIGN) * ALIGN, alignment=ALIGN, device=device if nccl else "cpu")
        side = self.producer or self.consumer
        assert side is not None
        # The transport's threads and the broker client's loop start here: on the CPUs
        # vLLM's binding keeps off the forward pass, where it keeps any (`workers.cpus`).
        cpus = None if nccl else self._thread_cpus()
        with threads_started_on(cpus):
            endpoints = side.start_transport()
        registration = Register(
            role="prefill" if self.is_producer else "decode",
            instance_id=self.config.instance_id,
            rank=self.info.rank,
            world_size=self.info.world_size,
            endpoints=endpoints,
            pool_capacity=0 if self.is_producer else self.pool.capacity,
            pool_alignment=1 if self.is_producer else self.pool.alignment,
            compat_hash=compat_hash(self.compat),
            compat=self.compat,
            claims_only=not self.is_producer,  # vLLM loads KV only for requests it holds
            kv_heads=self.info.kv_heads if lanes and not spec.use_mla else 0,
            kv_replicated=lanes and spec.use_mla,
        )
        pool = self.pool
        client = BrokerClient(
            ClientConfig(
                broker=self.config.broker,
                register_timeout_s=self.config.register_timeout_s,
                curve=curve_client_keys(
                    self.config.curve_server_key,
                    read_secret_key(self.config.curve_client_secret_file) if self.config.curve_client_secret_file else None,
                ),
            ),
            registration,
            handler=self,
            pool_free=None if self.is_producer else (lambda: pool.statistics().free),
        )
        try:
            with threads_started_on(cpus):
                self.client = SyncBrokerClient(client, on_task_error=self._task_failed)
            if nccl:
                self.nccl = NcclLink(self.client, device, connect_timeout_s=self.config.load_timeout_s,
                                     backend=self.config.nccl_backend or None,
                                     capacity=self.config.nccl_communicators)
        except BaseException:
            self.close()
            raise
        self.log.info(
            "connector.registered",
            phase="register",
            broker=self.config.broker,
            peer=self.client.registered.peer_id,
            layers=len(self.layers),
            layout=first.describe(),
            endpoints=endpoints,
            pool_bytes=self.pool.capacity,
        )

    def _thread_cpus(self) -> frozenset[int] | None:
        """Where this CPU worker's connector threads start (`thread_cpus`), logged once."""
        try:
            placement = thread_cpus(self.config.thread_cpus, read_host())
        except PlacementError as exc:
            raise ConfigError(str(exc)) from None
        try:  # Linux refuses CPUs outside this process's cgroup: then they stay where they are
            with threads_started_on(placement.cpus):
                pass
        except OSError as exc:
            self.log.warning("connector.thread_cpus", phase="register", cpus=None,
                             reason=f"Linux refused CPUs {format_cpu_list(placement.cpus or set())}: {exc}")
            return None
        self.log.info("connector.thread_cpus", phase="register",
                      cpus=format_cpu_list(placement.cpus) if placement.cpus is not None else None,
                      reason=placement.reason)
        return placement.cpus

    def _triton_copies(self, layout: LayerLayout) -> PagedKv | None:
        """Word views of the GPU caches for `PagedKv`'s Triton copy: P gathers a layer with
        it in `save_kv_layer`, D scatters every layer of a transfer with it in one kernel.
        On an H200 it copies about 1.2 TB/s, against about 0.09 TB/s for an `index_select`
        into block-major staging's strided rows. None (the torch copies stay) without
        Triton, or for caches it cannot view in place (not contiguous, an unknown kind)."""
        if layout.kind not in ("kv_first", "blocks_first", "mla"):
            return None
        try:
            paged = PagedKv(list(self.caches.values()), block_dim=1 if layout.kind == "kv_first" else 0)
        except (ValueError, RuntimeError) as exc:
            self.log.info("connector.per_layer_copies", phase="register", reason=str(exc))
            return None
        if not paged.use_triton or paged.block_nbytes != layout.block_nbytes:
            self.log.info("connector.per_layer_copies", phase="register",
                          reason="no Triton" if not paged.use_triton else "the block sizes disagree")
            return None
        # Every copy compiled now, not in the first transfer (a D's first scatter would
        # compile while its receive is posted).
        try:
            paged.precompile()
        except Exception as exc:  # noqa: BLE001 - each copy then compiles on first use, as before
            self.log.warning("connector.precompile_failed", phase="register", reason=repr(exc))
        return paged

    def close(self) -> None:
        """Say goodbye to the broker and stop the transport (vLLM's shutdown hook)."""
        if self.consumer is not None:
            self.consumer.send_held()
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 (shutting down: report, do not raise)
                self.log.warning("connector.close_failed", error=repr(exc))
        side = self.producer or self.consumer
        if side is not None:
            side.close()
        if self.nccl is not None:
            self.nccl.close()
        self.log.info("connector.closed", phase="close", **self.counters)

    # -- vLLM hooks (main thread) ------------------------------------------------------------

    def bind(self, meta: Any) -> None:
        """Keep this step's metadata; a producer stages the step's saves at its first save_kv_layer."""
        self.meta = meta if isinstance(meta, KvBrokerMetadata) else KvBrokerMetadata()
        if self.producer is not None and (self.meta.saves or self.meta.cancels):
            self.producer.bind(self.meta)

    def clear(self) -> None:
        self.meta = KvBrokerMetadata()

    def start_load_kv(self) -> None:
        if self.consumer is not None and self.meta.loads:
            self.consumer.start_load_kv(self.meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Producer: copy this layer of the step's staged requests; complete on return (CPU)."""
        if self.producer is not None:
            self.producer.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Producer: return once this step's transfers are staged; their Offers leave from
        the client's loop thread, so the step never waits on the broker."""
        if self.producer is not None:
            self.producer.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(sending, receiving) request ids: blocks are never held on send, so sending is None."""
        if self.consumer is None:
            return None, None
        return None, self.consumer.get_finished(finished_req_ids, idle=self.meta.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.consumer is None else self.consumer.get_block_ids_with_load_errors()

    def get_failed_requests(self) -> set[str]:
        """A hybrid model's failed loads, by request id (its block ids go nowhere: see `ConsumerSide`)."""
        return set() if self.consumer is None else self.consumer.take_failed_requests()

    # -- TransferHandler (the client's loop thread) ------------------------------------------

    async def on_prepare(self, msg: Prepare) -> None:
        if self.consumer is None:
            self.log.warning(
                "transfer.unexpected", transfer_id=msg.transfer_id, phase="prepare", reason="Prepare sent to a producer"
            )
            return
        await self.consumer.on_prepare(msg)

    async def on_go(self, msg: Go) -> None:
        if self.producer is None:
            self.log.warning(
                "transfer.unexpected", transfer_id=msg.transfer_id, phase="send", reason="Go sent to a consumer"
            )
            return
        await self.producer.on_go(msg)

    async def on_release(self, msg: Release) -> None:
        if self.producer is not None:
            await self.producer.on_release(msg)

    async def on_abort(self, msg: Abort) -> None:
        side = self.producer or self.consumer
        assert side is not None
        await side.on_abort(msg)

    async def on_relay(self, msg: Relay) -> None:
        if self.nccl is not None:  # rendezvous data for a communicator with a peer
            await self.nccl.rendezvous.on_relay(msg)

    # -- messages to the broker --------------------------------------------------------------

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` on the client's loop without waiting: a step never waits on the broker."""
        client = self.client
        if client is None:
            self.log.warning("connector.not_connected", task=getattr(fn, "__name__", "?"))
            return
        try:
            client.spawn(fn, *args)  # returns at once: vLLM's thread never waits for the loop thread
        except Exception as exc:  # the loop has stopped (shutdown): never fail vLLM's step
            self.log.error("connector.task_not_started", task=getattr(fn, "__name__", "?"), error=repr(exc))

    def _task_failed(self, name: str, exc: Exception) -> None:
        self.log.error("connector.task_failed", task=name, error=repr(exc))

    async def send_bounded(self, what: str, tid: str, send: Callable[..., Awaitable[None]], *args: Any) -> bool:
        """Await ``send(*args)`` for at most SEND_TIMEOUT_S (shielded, so cleanup code may use it).

        Never raises: a failed send (closed session, broker gone) is logged and gives False;
        the lease or the staging TTL cleans up after it.
        """
        with anyio.move_on_after(SEND_TIMEOUT_S, shield=True) as scope:
            try:
                await send(*args)
            except Exception as exc:
                self.log.warning("broker.send_failed", transfer_id=tid, phase=what, error=repr(exc))
                return False
        if scope.cancelled_caught:
            self.log.warning("broker.send_timeout", transfer_id=tid, phase=what, timeout_s=SEND_TIMEOUT_S)
        return True

    # -- bookkeeping -------------------------------------------------------------------------

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n

    def statistics(self) -> dict[str, int]:
        """Counters, and what is in flight, for logs and tests."""
        with self.lock:
            stats = dict(self.counters)
        stats["staged_now"] = self.producer.staged_now if self.producer else 0
        stats["loading_now"] = self.consumer.loading_now if self.consumer else 0
        return stats
