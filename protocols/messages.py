"""Every message of the kvbroker wire protocol: frozen msgspec Structs in one tagged union.

One transfer, as the broker sees it (P = prefill peer, D = decode peer, B = broker)::

    P -> B  Offer(transfer_id, nbytes, layout)    P has staged the KV; it is safe from reuse.
    D -> B  Expect(transfer_id)                   optional: a request on D waits for it.
    B -> D  Prepare(transfer_id, nbytes, ...)     sent once D's pool has credit for nbytes.
    D -> B  Ready(transfer_id, offset, nbytes)    D reserved room; the byte range it wants.
    B -> P  Go(transfer_id, endpoints, ...)       P sends the range straight to D.
    D -> B  Done(transfer_id)                     the bytes are visible on D (not just sent).
    B -> P  Release(transfer_id)                  P frees its staging buffer.
    any     Abort(transfer_id, reason)            the broker tells both sides.

A front end (the gateway, a proxy) that gives up on a request says so, unregistered::

    F -> B  Cancel(transfer_id, reason)           nobody will decode it: end what has not moved.
    B -> F  Cancelled(transfer_id, ended, left)   how many ranks' transfers it ended, how many move on.

Fields are keyword-only and checked at decode time with `Meta` limits, so a peer
cannot make the broker hold an unbounded string or a negative size.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

# History: 1 = first release. 2 = heterogeneous TP: Register.kv_heads/kv_replicated,
# the head run a lane moves in Prepare and Go, the lane's source in Ready and Done.
PROTOCOL_VERSION = 2

Role = Literal["prefill", "decode"]
Id = Annotated[str, Meta(min_length=1, max_length=128)]
OptId = Annotated[str, Meta(max_length=128)]
Text = Annotated[str, Meta(max_length=2048)]
Digest = Annotated[str, Meta(max_length=128)]
Bytes = Annotated[int, Meta(ge=0, le=1 << 50)]
Count = Annotated[int, Meta(ge=0, le=1 << 31)]
Endpoints = Annotated[dict[Annotated[str, Meta(max_length=32)], Text], Meta(max_length=16)]
Seconds = Annotated[float, Meta(gt=0, le=86400)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=False):
    pass


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """How a staged transfer's bytes are arranged.

    Staging is block-major: block i of the request holds all `num_layers` layers
    of that block, `block_nbytes` bytes each. So skipping the first k blocks (those D
    already holds in its prefix cache) is a byte offset, and the tail is contiguous.
    """

    kind: Annotated[str, Meta(max_length=32)] = "opaque"
    dtype: Annotated[str, Meta(max_length=32)] = "uint8"
    num_layers: Count = 1
    num_blocks: Count = 1
    block_nbytes: Bytes = 0


class Register(_Msg, kw_only=True, tag="register"):
    role: Role
    instance_id: Id
    rank: Count = 0
    world_size: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    endpoints: Endpoints = {}
    pool_capacity: Bytes = 0
    # The pool leases whole multiples of this; the broker reserves credit the same way.
    pool_alignment: Annotated[int, Meta(ge=1, le=1 << 30)] = 1
    compat_hash: Annotated[str, Meta(max_length=128)] = ""
    # The fields behind compat_hash, so a refusal can name what differs.
    compat: Annotated[dict[Annotated[str, Meta(max_length=64)], Text], Meta(max_length=32)] = {}
    # Random per process: the same peer id registering with another one is a restart (its
    # old process will offer nothing more), with the same one a reconnect.
    incarnation: Digest = ""
    # Decode: takes only transfers meant for it (its Expect, or an Offer naming it), as a
    # vLLM instance, which loads KV only for requests it holds. The broker then never
    # guesses between several such peers for an Offer nobody claimed yet; it waits for
    # the Expect. False: any transfer routed here is welcome (a pool that serves anyone).
    claims_only: bool = False
    # The model's KV heads over all `world_size` ranks (0: not told, or a cache with no
    # head axis): with them a prefill and a decode instance of different TP sizes pair,
    # each decode rank receiving its heads from the prefill ranks that hold them
    # (`protocols.heads`). `kv_replicated`: every rank holds the whole cache (MLA's
    # latent), so any prefill rank's copy serves any decode rank.
    kv_heads: Count = 0
    kv_replicated: bool = False


class Registered(_Msg, kw_only=True, tag="registered"):
    peer_id: Id
    heartbeat_s: Seconds
    lease_s: Seconds


class Heartbeat(_Msg, kw_only=True, tag="heartbeat"):
    """Peer -> broker keeps the peer's lease; the broker echoes it back."""

    seq: Count = 0
    pool_free: Annotated[int, Meta(ge=-1, le=1 << 50)] = -1


class Goodbye(_Msg, kw_only=True, tag="goodbye"):
    """A peer leaves on purpose; its transfers are failed or re-routed at once."""


class Expect(_Msg, kw_only=True, tag="expect"):
    transfer_id: Id
    # Instance id of the prefill instance the request went to, when the proxy named it:
    # if that peer is lost before it offers, the broker ends the wait at once.
    prefill: OptId = ""
    # The bytes P will offer for the request into this decode rank, every lane together
    # (0: not known): the broker reserves that room in this peer's pool at the claim, so
    # the Offer finds it held, or waits in the pool's queue in claim order.
    nbytes: Bytes = 0
    # The KV goes straight into this rank's cache blocks (a CPU cache over tcp): it takes no
    # room in the receive pool, and the broker reserves none, whatever its size.
    into_blocks: bool = False


class Offer(_Msg, kw_only=True, tag="offer"):
    transfer_id: Id
    nbytes: Bytes
    layout: Layout = Layout()
    # Instance id of the decode instance the request went to, when the proxy chose one.
    decode: OptId = ""
    # A digest of the prompt the KV was computed for ("" unknown); relayed in Prepare,
    # so D refuses KV computed for another prompt under the same transfer_id.
    prompt: Digest = ""


class Prepare(_Msg, kw_only=True, tag="prepare"):
    transfer_id: Id
    nbytes: Bytes
    layout: Layout = Layout()
    source: Id
    attempt: Count = 0
    prompt: Digest = ""
    # The model's KV heads [head_start, head_stop) this lane brings (both 0: all of the
    # source rank's, which are the receiving rank's: equal TP). `layout.block_nbytes` is
    # then that run's share of a block.
    head_start: Count = 0
    head_stop: Count = 0


class Ready(_Msg, kw_only=True, tag="ready"):
    transfer_id: Id
    # The byte range of the staged transfer that D wants; the head it already holds is skipped.
    offset: Bytes = 0
    nbytes: Bytes
    # nccl: the communicator D posts this receive on ("" one not built yet) and its place
    # among D's receives from this producer on it; relayed in Go, so P posts its sends
    # on the same communicator in the same order (NCCL pairs ops by posting order).
    comm: OptId = ""
    seq: Count = 0
    # The Prepare's source: with several lanes into one rank, the one this answers.
    source: OptId = ""


class Go(_Msg, kw_only=True, tag="go"):
    transfer_id: Id
    decode: Id
    endpoints: Endpoints
    offset: Bytes = 0
    nbytes: Bytes
    attempt: Count = 0
    comm: OptId = ""  # Ready's, relayed
    seq: Count = 0
    # The heads to send, as in Prepare: the sender cuts them out of its staging.
    head_start: Count = 0
    head_stop: Count = 0


class Done(_Msg, kw_only=True, tag="done"):
    transfer_id: Id
    nbytes: Bytes = 0
    source: OptId = ""  # as in Ready


class Release(_Msg, kw_only=True, tag="release"):
    transfer_id: Id


class Abort(_Msg, kw_only=True, tag="abort"):
    transfer_id: Id
    reason: Text = ""


class Error(_Msg, kw_only=True, tag="error"):
    code: Annotated[str, Meta(max_length=64)]
    detail: Text = ""
    transfer_id: OptId = ""


class Relay(_Msg, kw_only=True, tag="relay"):
    """Opaque rendezvous data (an NCCL unique id) passed between two peers via the broker."""

    to: Id
    key: Annotated[str, Meta(max_length=256)]
    payload: Annotated[bytes, Meta(max_length=4096)] = b""
    sender: OptId = ""


class StatusRequest(_Msg, kw_only=True, tag="status_request"):
    pass


class Cancel(_Msg, kw_only=True, tag="cancel"):
    """The request behind `transfer_id` was given up (its client left, no decode instance
    took it): P's staged copy and D's credit for it are freed now, not at a deadline."""

    transfer_id: Id
    reason: Text = ""


class Cancelled(_Msg, kw_only=True, tag="cancelled"):
    transfer_id: Id
    ended: Count = 0  # ranks whose transfer the Cancel ended
    left: Count = 0  # ranks whose bytes already move: those end on their own


class PeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    peer_id: str
    role: str
    instance_id: str
    rank: int
    endpoints: dict[str, str]
    lease_left_s: float
    transfers: int
    claims_only: bool = False  # a decode peer that takes only transfers it claims (Register.claims_only)


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    peer_id: str
    capacity: int
    reserved: int
    free: int
    waiting: int


class TransferInfo(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    rank: int
    state: str
    prefill: str
    decode: str
    nbytes: int
    attempt: int
    lease_left_s: float
    # What the transfer waits for now, in words ("Ready from d0:0", "a claim: ...").
    waiting_for: str = ""
    # Received straight into its decode peer's blocks: it takes no room in that pool.
    in_place: bool = False


class LatencyInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A histogram of completed transfers' durations: counts[i] fell at or under
    bounds_s[i] (and over the bound before); the last count is past every bound."""

    bounds_s: list[float]
    counts: list[int]
    sum_s: float


class Status(_Msg, kw_only=True, tag="status"):
    peers: list[PeerInfo] = []
    pools: list[PoolInfo] = []
    transfers: list[TransferInfo] = []
    counters: dict[str, int] = {}
    # By phase ("handshake", "data", "total"): see broker/latency.py.
    latency: dict[str, LatencyInfo] = {}


Message = Union[
    Register,
    Registered,
    Heartbeat,
    Goodbye,
    Expect,
    Offer,
    Prepare,
    Ready,
    Go,
    Done,
    Release,
    Abort,
    Error,
    Relay,
    StatusRequest,
    Status,
    Cancel,
    Cancelled,
]

MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]
