"""Transfer states and the one table of which message may move a transfer where.

A transfer is keyed by (transfer_id, lane): a lane is one (P rank, D rank) pair and
the KV heads that move on it (`protocols.heads`). With equal TP sizes each rank of P
sends its shard to the same rank of D and the lane is that rank; with different sizes
a D rank gets a lane from each P rank that holds some of its heads, and a P rank feeds
each D rank that needs some of its heads. States, in order::

    EXPECTED        D announced it waits; no Offer yet.
    UNROUTED        P offered; no live, compatible decode peer yet.
    WAITING_CREDIT  routed to D; queued FIFO until D's pool has room.
    PREPARING       credit reserved on D; Prepare sent; waiting for Ready.
    SENDING         Go sent to P; waiting for D's Done (remote visibility).

Done and Abort end a transfer: it leaves the table and its credit returns. So does a
front end's Cancel, while the transfer is `cancellable`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from protocols.errors import RemoteProtocolError
from protocols.messages import Abort, Done, Expect, Layout, Offer, Ready


class TransferState(enum.Enum):
    EXPECTED = "expected"
    UNROUTED = "unrouted"
    WAITING_CREDIT = "waiting_credit"
    PREPARING = "preparing"
    SENDING = "sending"


S = TransferState

# TRANSITIONS[state][message type] -> the role allowed to send it there.
# A (state, message) pair missing here is a protocol violation.
TRANSITIONS: dict[TransferState, dict[type, str]] = {
    # Expect again from the decode peer that expects it: a client re-sending after a
    # reconnect (accepted, changes nothing).
    S.EXPECTED: {Offer: "prefill", Expect: "decode", Abort: "decode"},
    S.UNROUTED: {Expect: "decode", Abort: "prefill"},
    S.WAITING_CREDIT: {Expect: "decode", Abort: "any"},
    # Expect may trail a hinted route: accepted from the decode peer it was granted to.
    S.PREPARING: {Ready: "decode", Expect: "decode", Abort: "any"},
    S.SENDING: {Done: "decode", Expect: "decode", Abort: "any"},
}

# States that hold credit on the decode peer's pool.
HOLDS_CREDIT = frozenset({S.PREPARING, S.SENDING})


class ProtocolViolation(RemoteProtocolError):
    """A peer sent a message the transfer's state does not accept."""

    code = "protocol"

    def __init__(self, msg_type: type, state: TransferState | None, transfer_id: str, why: str = "") -> None:
        where = state.value if state else "unknown transfer"
        text = f"{msg_type.__name__} is not accepted for transfer {transfer_id} in state {where}"
        super().__init__(f"{text}: {why}" if why else text)
        self.msg_type = msg_type
        self.state = state
        self.transfer_id = transfer_id


def check_transition(state: TransferState, msg_type: type, role: str, transfer_id: str) -> None:
    """Raise ProtocolViolation unless `role` may send `msg_type` to a transfer in `state`."""
    allowed = TRANSITIONS[state].get(msg_type)
    if allowed is None:
        raise ProtocolViolation(msg_type, state, transfer_id)
    if allowed != "any" and allowed != role:
        raise ProtocolViolation(msg_type, state, transfer_id, f"only a {allowed} peer may send it")


TransferKey = tuple[str, int]


def lane_id(source_rank: int, rank: int) -> int:
    """The key's lane for P rank `source_rank` to D rank `rank`: the rank itself when
    they are equal (so equal TP keys by rank), a number past every rank otherwise."""
    return rank if source_rank == rank else (source_rank + 1) << 16 | rank


def cancellable(state: TransferState, claimed: bool) -> bool:
    """Whether a front end's Cancel ends a transfer in `state` (`claimed`: a decode peer
    that holds its request expects it). Not once the Go is sent, nor once a decode peer
    holding the request has its credit: then its receive may be posted (over NCCL, only
    an aborted communicator would end it), and it ends within moments on its own."""
    return state in (S.EXPECTED, S.UNROUTED, S.WAITING_CREDIT) or (state is S.PREPARING and not claimed)


@dataclass
class Transfer:
    transfer_id: str
    rank: int  # the D rank
    state: TransferState
    lease_until: float
    source_rank: int = -1  # the P rank (-1: the same as `rank`)
    # The model's KV heads this lane moves ((0, 0): all of the P rank's), and the TP size
    # of the decode instance the lane was planned for: a re-delivery goes to the same
    # rank of an instance of that size.
    heads: tuple[int, int] = (0, 0)
    decode_tp: int = 0
    prefill: str | None = None
    decode: str | None = None
    expected_by: str | None = None
    expected_from: str = ""  # the prefill instance the expecting peer named, if any
    # Set while the instance the transfer names is not registered (an Expect's prefill
    # instance; an unrouted Offer's decode instance, when the decode peers take only their
    # own transfers): by then it must be, or the transfer ends. A broker that restarted
    # while that instance was down never hears of it.
    absent_until: float | None = None
    # A second decode peer that claimed the transfer while another held it (a proxy that
    # sent the request again after the first instance failed it): it gets the transfer if
    # the holder is lost, and the transfer's ending otherwise.
    waiting_claim: str | None = None
    offered_at: float | None = None  # when P's Offer came, for the latency histograms
    go_at: float | None = None  # when the (last) Go left
    decode_hint: str = ""
    prompt: str = ""
    nbytes: int = 0
    layout: Layout = Layout()  # frozen: one shared default
    compat_hash: str = ""
    credit_deadline: float | None = None
    reserved: int = 0
    # The claimant whose Expect said it receives straight into its cache blocks, for a lane
    # of every head of its source rank: while the transfer goes to that peer, it takes no
    # room in its pool (`credit`).
    in_place_by: str | None = None
    # The decode peer this transfer was routed to on its Offer's word but is larger than
    # the pool of: it waits, unrouted, for that peer's claim, which may take it in place.
    oversize_for: str = ""
    attempt: int = 0
    tried: set[str] = field(default_factory=set)
    # Where the broker files it: (transfer_id, lane), fixed at creation (`lane_id`).
    key: TransferKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.source_rank < 0:
            self.source_rank = self.rank
        self.key = (self.transfer_id, lane_id(self.source_rank, self.rank))

    @property
    def in_place(self) -> bool:
        """Received straight into its decode peer's blocks (`in_place_at`)."""
        return self.decode is not None and self.in_place_at(self.decode)

    def in_place_at(self, peer_id: str) -> bool:
        """Whether decode peer `peer_id` would receive it straight into its blocks: that peer
        claimed it so, and the lane moves every head of its source rank (a lane of some
        heads is joined in D's pool)."""
        return self.in_place_by == peer_id and self.heads == (0, 0)

    def credit(self, credit_for: Callable[[int], int]) -> int:
        """The room this transfer takes in its decode peer's pool (`Pool.credit_for`): none
        when it is received in place."""
        return 0 if self.in_place else credit_for(self.nbytes)

