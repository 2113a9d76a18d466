"""The nccl transport as the connector's worker half uses it: one byte range a transfer
(in a few chunks), posted and waited for without blocking the broker client's loop.

Threads: an op on a communicator this side already has is posted on the loop thread
itself (it does not block, and a hop to a worker thread sat inside D's turn), or, a send
started on D's receive, in the poller's thread that saw it (below); building one, or
aborting one the peer dropped, happens in a worker thread. Each transfer is
then handed to the link's `Poller` (one thread, the only one polling CUDA events) as
soon as it is posted (`Poller.carry`), and its task awaits the poller's report on the
loop; no thread sleeps for it. For a receive the poller sets it up and lands each chunk
as it sees its op end; for a send it waits for the last op. It wakes the loop once a
transfer (`_Watch.advance`: what to do once ops ended, as a step function). Past its
deadline a transfer goes to a worker thread, which aborts its communicator.

NCCL pairs a sender's ops with the receiver's by posting order alone, per communicator.
So the order of one pair's transfers is D's to set, and P follows it:

- D takes a ticket for each receive (`ticket`): the communicator it will post on (its
  nonce; "" when none is built yet) and the receive's place on it, and names both in its
  Ready. It holds the producer's turn (`receiving`) from the ticket until the receive is
  posted, so receives are posted in ticket order, and the next transfer's Ready may go
  while this one is still on the wire. The broker relays the ticket in the Go.
- P posts each send only when it is next on the communicator its Go names
  (`SendOrder`): Go messages are handled by tasks that run in no fixed order, and a
  transfer's copy may finish after the next one's.
- A ticket given up without its op posted, on either side, ends the communicator: an op
  of a later transfer would otherwise pair with its peer's op for this one. Transfers
  queued behind it on that pair then fail too (D's load fails, vLLM recomputes or fails
  per its policy), and the next transfer builds a new communicator. A send whose Go
  names a communicator P no longer has is not posted; P aborts the transfer, so D's
  load fails and D drops that communicator as well.

A transfer goes as a few ops, one per chunk (`chunks`: the transport's pipeline plan,
the same on both sides since both know the size and the staged block size), so D can
scatter chunk k into its cache while chunk k+1 is still on the wire: `wait` calls
`landed` for each chunk once its receive has ended and the communicator is still
whole, which is when the chunk's bytes are known to be the producer's.

A communicator is built for one transfer: P names it in its rendezvous data, and D joins
only a build for the transfer it is receiving (`CommunicatorCache.get`'s `purpose`). D
may give a transfer up after its Ready and before its receive is posted (its load was
cancelled); P's send for it may already be building a communicator. Joining that build
for D's next receive would pair P's send with it, and D would load another request's KV.

A send or receive that misses its deadline aborts its communicator (see
`workers.transports.nccl_comm.Completion`). Both sides then build a new one on their
next transfer, through the broker's `Relay` (`workers.rendezvous.BrokerRendezvous`).

Ordering against the model: P's send waits on an event recorded after the step's
gathers (`wait_for_save`), on the GPU and without a host wait; a send into D's blocks
(below) is instead posted at the Go, even during the forward pass, and follows the
step's `LayerFeed` (`Streaming.feed`): it is launched a group of layers at a time, each
behind an event recorded after that group's gathers. D's receive lands in a
receive-pool lease that has no GPU work pending (a lease goes back to the pool only
after the scatter that read it has run, see `connector.consumer`).

Over a backend that writes into blocks (`Communicator.writes_into_blocks`: ipc) a D with
the Triton copies (`into`) posts a transfer as one receive straight into its blocks
(`post_blocks`), after the point its blocks may be written (`start_load_kv`); P sees
that kind of receive (`next_receive_takes_blocks`) and sends its staged blocks whole
into them (`send_blocks`). One op each way, nothing to land: the
receive's end is the load's. D leases room only while the pair's communicator is not
built yet, never writes it, and gives it back as the bytes land.

Such a receive names its transfer (a digest of its id), so P need not wait for the Go
to know which send pairs with it: on a communicator already built, D posts it before
its Ready (`posts_first`) and rings P's bell (`workers.transports.bell`). P's poller
looks for it (`watch_receive`, from the Offer until the Go) at once and at each ring,
waiting for the next ring without the GIL, so a transfer waiting for a late claim costs
P's forward pass nothing. When that send is next in P's order there and needs no wait
on the host, the poller posts it there and then (`send_on_receive`), a broker round
trip (the Ready's hop and the Go's) earlier than the Go, and without a hop to the loop,
which then only awaits its end; it then looks at once for D's next receive on that
communicator, so a step's sends go back to back. Else the loop starts it as the Go
would (`ticket_at`). The Go, when it comes, finds the send started and sends nothing;
a transfer P did not see so goes on its Go as before.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
import structlog
import torch

from protocols.errors import KvBrokerError, TransferFailed
from workers.client import SyncBrokerClient
from workers.gpu_staging import pipeline_bounds, pipeline_defaults
from workers.pool import Lease
from workers.rendezvous import BrokerRendezvous
from workers.transports.bell import Bell, drain
from workers.transports.communicator import Communicator, LayerFeed
from workers.transports.ipc_mailbox import transfer_tag
from workers.transports.nccl_comm import CommunicatorCache
from workers.waker import make_waker

log = structlog.get_logger()

__all__ = ["Into", "NcclLink", "Poller", "RecvOrder", "SendOrder", "Streaming", "Waited", "chunks", "plan"]

Ticket = tuple[str, int]  # (communicator nonce, "" for one still to build; place on it)
# D's cache, the load's blocks in it and the event after which they may be written: where a
# receive over the ipc backend goes straight into the blocks (`NcclLink.post_recv`).
Into = tuple[Any, list[int], "torch.cuda.Event | None"]

# How long the link's poller spins after an op ended or a wait began before it pauses
# between polls. A spin holds the GIL (an event query does not release it), so the
# client's loop thread, which carries the next Ready or Go and posts the next transfer,
# waits as long as the spin lasts: with 8 transfers of a pair in flight, 1 ms spins cost
# 10-15% of their rate (docs/PERFORMANCE.md, "Figures the code quotes").
WAIT_SPIN_S = 50e-6
# The longest pause between polls once the poller has spun: it bounds how late an op's
# end is seen (the pauses double up to it).
WAIT_PAUSE_S = 1e-4

# How long past a carried transfer's deadline its task still waits for the poller's
# report (the poller hands an expired transfer back at once; this only bounds a poller
# that is stuck, say in a landing's launch).
CARRY_GRACE_S = 5.0

# Transfers cancelled before their op was posted, remembered so the post is refused: an
# Abort can come while the Go's send waits for its turn. The oldest are forgotten first.
CANCELLED_KEPT = 256

# Bump when `chunks` (or `pipeline_bounds`) cuts a transfer differently for the same
# parameters, or when the order of a pair's transfers changes: peers of two versions must
# then be refused at registration (`plan`). 2: a pair's transfers in D's ticket order.
PLAN_VERSION = 2


def plan() -> str:
    """What `chunks` depends on besides the transfer, as text: P and D must agree on it
    (an NCCL receive and the send it pairs with must have the same size), so it goes
    into the compatibility fields a peer registers with (`connector.worker`)."""
    d = pipeline_defaults()
    mib = {k: d[k] >> 20 for k in ("first_nbytes", "last_nbytes", "cap_nbytes")}
    return (f"chunks v{PLAN_VERSION} of {mib['first_nbytes']}..{mib['cap_nbytes']} MiB, last {mib['last_nbytes']} MiB, "
            f"growth {d['growth']}/{d['back_growth']}")


def chunks(nbytes: int, block_nbytes: int) -> list[tuple[int, int]]:
    """A transfer's chunks as block ranges ``[b0, b1)``, one NCCL op each: the
    transport's pipeline plan (`pipeline_bounds`) for whole staged blocks of
    `block_nbytes`, one chunk for anything else. Both sides must call it alike."""
    if block_nbytes <= 0 or nbytes <= 0 or nbytes % block_nbytes:
        return [(0, 1)]
    ends = pipeline_bounds(nbytes // block_nbytes, block_nbytes)
    return list(zip([0, *ends[:-1]], ends))


class RecvOrder:
    """D's tickets, per producer (no IO): the communicator its receives go on and the
    place of the next one there. Kept only while that communicator is the cache's."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[str, int]] = {}  # producer -> (nonce, next place)

    def ticket(self, producer: str, current: str | None) -> Ticket:
        """The next receive's ticket; `current`: the nonce of the communicator cached
        with `producer` now (None: none). Another communicator than the one the last
        receive went on starts over: ("", 0), and the post decides which one it is."""
        nonce, place = self._at.get(producer, ("", 0))
        if current is None or current != nonce:
            self._at.pop(producer, None)
            return ("", 0)
        return (nonce, place)

    def posted(self, producer: str, ticket: Ticket, nonce: str) -> None:
        """The receive of `ticket` was posted on the communicator `nonce`."""
        self._at[producer] = (nonce, 1 if not ticket[0] else ticket[1] + 1)

    def given_up(self, producer: str) -> None:
        """A ticket was given up without its receive posted: nothing more on that communicator."""
        self._at.pop(producer, None)


@dataclass
class _Pair:
    nonce: str | None = None  # the communicator P last posted to this peer on
    next: int = 0  # the place the next send takes on it
    posting: bool = False  # a post is under way (it may build the communicator)
    gone: set[str] = field(default_factory=set)  # communicators this side no longer posts on


@dataclass
class SendOrder:
    """P's side of each pair's order (no IO): whether a send whose Go names `ticket` may
    be posted now ("post"), must wait for an earlier one ("wait"), or can never be
    posted in order ("stale": it names a communicator this side no longer posts on, or a
    place already taken). A communicator P has not posted on yet is waited for: D names
    one only after P's first post on it began, but that Go's task may run later."""

    pairs: dict[str, _Pair] = field(default_factory=dict)

    def verdict(self, peer: str, ticket: Ticket) -> Literal["post", "wait", "stale"]:
        pair = self.pairs.setdefault(peer, _Pair())
        if pair.posting:
            return "wait"
        nonce, place = ticket
        if not nonce:
            return "post"  # D posts on whichever communicator this post builds or finds
        if nonce in pair.gone or (pair.nonce == nonce and place < pair.next):
            return "stale"
        return "post" if pair.nonce == nonce and place == pair.next else "wait"

    def next_on(self, peer: str, nonce: str) -> Ticket | None:
        """The ticket of the next send on communicator `nonce`, if this side posted there
        last and no post is under way: its verdict is "post". None: not known here."""
        pair = self.pairs.get(peer)
        if pair is None or pair.posting or not nonce or pair.nonce != nonce:
            return None
        return (nonce, pair.next)

    def begin(self, peer: str) -> None:
        self.pairs.setdefault(peer, _Pair()).posting = True

    def posted(self, peer: str, ticket: Ticket, nonce: str) -> None:
        pair = self.pairs.setdefault(peer, _Pair())
        if pair.nonce is not None and pair.nonce != nonce:
            pair.gone.add(pair.nonce)
        pair.nonce, pair.next, pair.posting = nonce, 1 if not ticket[0] else ticket[1] + 1, False

    def abandon(self, peer: str, ticket: Ticket) -> bool:
        """A Go whose send will never be posted: if it names P's communicator at or after
        its next place, nothing more goes on that communicator (`given_up`); False when
        the ticket changes nothing (a new communicator, or one already gone)."""
        pair = self.pairs.get(peer)
        if not ticket[0] or pair is None or pair.nonce != ticket[0] or ticket[1] < pair.next:
            return False
        self.given_up(peer)
        return True

    def given_up(self, peer: str, also: str | None = None) -> None:
        """A send that was, or would have been, next is not posted: no later one may go on
        that communicator (it would pair with D's receive for this one), nor on `also`
        (one the failed post built)."""
        pair = self.pairs.setdefault(peer, _Pair())
        pair.gone.update(n for n in (pair.nonce, also) if n is not None)
        pair.nonce, pair.next, pair.posting = None, 0, False


# A staged transfer's seen receive: (transfer id, decode peer, communicator nonce, the
# receive's number on it, its bytes); called in the poller's thread (`NcclLink.watch_receive`).
# True: its send was posted there and then (`NcclLink.send_on_receive`).
Seen = Callable[[str, str, str, int, int], bool | None]


class ReceiveWatch:
    """P's staged transfers whose receive D may post before their Go reaches P (no IO),
    each by the tag such a receive names it with (`transfer_tag`), until dropped."""

    def __init__(self) -> None:
        self._by_tag: dict[bytes, tuple[str, Seen]] = {}
        self._tags: dict[str, bytes] = {}

    def __bool__(self) -> bool:
        return bool(self._by_tag)

    def add(self, transfer_id: str, seen: Seen) -> None:
        tag = self._tags[transfer_id] = transfer_tag(transfer_id)
        self._by_tag[tag] = (transfer_id, seen)

    def drop(self, transfer_id: str) -> None:
        tag = self._tags.pop(transfer_id, None)
        if tag is not None:
            self._by_tag.pop(tag, None)

    def take(self, tag: bytes) -> tuple[str, Seen] | None:
        """The transfer watched with `tag` and what to call, no longer watched; None: none is."""
        watched = self._by_tag.pop(tag, None)
        if watched is None:
            return None
        del self._tags[watched[0]]
        return watched


class Streaming(Protocol):
    """A send that may be posted while its copy is still being staged (P's forward pass
    may still be running on the GPU): what the link needs from the producer."""

    # Where P's step counts its layers gathered: a send into D's blocks follows it, and is
    # launched a group of layers at a time as they are (`Communicator.send_blocks`).
    feed: LayerFeed

    def wait(self) -> torch.cuda.Event | None:
        """Block until the copy is staged; the event after its gathers.

        Raises:
            TransferFailed: the copy was dropped, or not staged within its deadline.
        """


@dataclass
class Posted:
    """A transfer's ops, posted; `NcclLink.wait` sees them end."""

    peer: str
    op: str
    transfer_id: str
    comm: Any
    completions: list[Any]
    parts: list[tuple[int, int]]
    flag: threading.Event
    into_blocks: bool = False  # one op straight into D's blocks (ipc): nothing to land


@dataclass(frozen=True)
class Waited:
    """When a transfer's end was seen (`time.monotonic()` values): the poller saw its last
    op end (`seen`; the waiting thread itself if it never slept), the one that goes on
    with it resumed (`resumed`: the same moment when the poller carried it), and it was
    done with the transfer, its landings included (`ended`)."""

    seen: float
    resumed: float
    ended: float

    def log_fields(self, now: float | None = None) -> dict[str, int]:
        """For a transfer's log line: how long the waiting thread took to resume, then to
        land, and (written at `now` by that thread) then until the line (us)."""
        fields = {"wake_us": round((self.resumed - self.seen) * 1e6), "land_us": round((self.ended - self.resumed) * 1e6)}
        if now is not None:
            fields["hop_us"] = round((now - self.ended) * 1e6)
        return fields


@dataclass(eq=False)
class _Watch:
    """A posted transfer being waited for. `advance` does what can be done now (lands the
    chunks whose ops ended, in order) and never waits for the GPU; `NcclLink.wait`
    calls it until the transfer ended.

    `at_once` (a sender: nothing is done chunk by chunk): only the last op is waited for,
    and `landed`, if any, is called once, for every chunk. A transfer's ops end in order
    (one NCCL stream), so its waiter wakes once a transfer instead of once a chunk, and
    each wake-up takes the GIL from the engine's thread.
    """

    posted: Posted
    deadline: float
    landed: Callable[[int, int, int], None] | None
    before: Callable[[], None] | None
    discard: Callable[[str], None]  # drops the communicator with a peer
    at_once: bool = False
    next: int = 0  # the first chunk not landed yet
    started: bool = False
    error: BaseException | None = None

    def pending(self) -> Any:
        """The op whose end the next `advance` needs."""
        done = self.posted.completions
        return done[-1] if self.at_once else done[self.next]

    def advance(self, now: float) -> bool:
        """True once the transfer ended: every chunk landed, or `error` says why not."""
        try:
            return self._advance(now)
        except BaseException as exc:  # handed to the waiter, raised there
            self.error = exc
            return True

    def _advance(self, now: float) -> bool:
        posted, landed = self.posted, self.landed
        comm, peer, op = posted.comm, posted.peer, posted.op
        if not self.started:
            self.started = True
            if landed is not None and not posted.parts:  # posted whole: nothing may follow it on this communicator
                self.discard(peer)
                raise ValueError(f"a receive reported chunk by chunk must be whole blocks, not {posted.transfer_id}'s")
            if self.before is not None:
                self.before()
        done, n = posted.completions, len(posted.completions)
        while self.next < n:
            k = last = self.next
            if not self.pending().done() and now < self.deadline:
                return False
            done[k].wait(self.deadline)  # ended: returns at once; past the deadline: aborts, raises
            if self.at_once or landed is not None:
                # Chunks whose ops ended meanwhile land with this one, as one copy: a waiter
                # that fell behind the wire (several transfers in flight, a busy host)
                # catches up instead of paying a launch for each chunk.
                while last + 1 < n and done[last + 1].done():
                    last += 1
                    done[last].wait(self.deadline)  # ended: returns at once, and lets go of what the op kept
            # After seeing the ops end: an abort ends a kernel early, and is seen here.
            if comm.closed or comm.broken:  # aborted meanwhile (`cancel`, a timeout): the kernel ended early
                raise TransferFailed(posted.transfer_id,
                                     f"the NCCL {op} with {peer} was cut short: its communicator was aborted")
            if landed is not None:
                try:
                    landed(posted.parts[k][0], posted.parts[last][1], n - 1 - last)
                except BaseException:
                    if last < n - 1:  # later chunks' ops are posted: they would pair with the next transfer's
                        self.discard(peer)
                    raise
            self.next = last + 1
        return True


class Poller:
    """One thread that polls the ops a link's transfers wait for: it carries each
    transfer (`carry`) and wakes its task on the loop once it ended, or wakes a thread
    that waits for one op (`wait`) once that op ended. Nobody else polls meanwhile.

    Each waiting thread used to poll its own CUDA events every 10-100 us, taking the GIL
    each time; with eight transfers in flight that is eight threads waking 10,000 times
    a second beside the engine. Here only this thread polls: it spins `WAIT_SPIN_S` after
    each end it saw or wait it was given, then pauses in steps that double up to
    `WAIT_PAUSE_S` (a new wait ends the pause). A send that follows a forward pass
    cannot end before its last layers are launched (`Completion.until_launched`): while
    every op carried is such a send, this thread sleeps until a launch wakes it
    (`_launched`), instead of taking the GIL from the forward pass's thread at each pause.

    A transfer's watch is `carry`-ed: this thread sets a receive up, lands each chunk
    itself as it sees its op end, and wakes the transfer's waiter (its task, on the
    loop) once, when the transfer has landed or been sent. With eight in flight, waking
    a thread per chunk to launch its landing cost the landing 1.3-2.5 ms at the median,
    waiting for D's GIL; launched here, by the thread that just saw the end, 0.44-0.73
    ms (docs/PERFORMANCE.md). A carried watch whose deadline passes is handed back to its
    waiter (`_Ended.expired`), which aborts the op: an abort blocks for up to a second,
    and done here it would stall every other watch.

    A probe (`probe`: P's look for D's receives) comes with a bell that D rings: with
    nothing but probes left, this thread waits on their bells in `poll()`, which holds no
    GIL, rather than on a timer; while it polls ops, it drains them at each pause.
    """

    def __init__(self, name: str = "kvbroker-nccl-poller") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._waits: list[tuple[Any, _Ended]] = []
        self._carried: list[tuple[_Watch, _Ended]] = []  # watches this thread advances itself
        # Looked at until they return None (`probe`), each with the bell that asks for a look.
        self._probes: list[tuple[Callable[[], float | None], Bell | None]] = []
        self._wake: tuple[int, int] | None = None  # a pipe: ends this thread's wait on bells (`_notify`)
        self._listening = False  # this thread waits on bells (under `_cond`)
        self._look_at = 0.0  # when the probes want their next look (`time.monotonic()`)
        self._asked = 0  # counts the probes started and looks asked for (`look_soon`)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._looked = 0  # `_asked` at the last look (this thread's own)
        self._launches = 0  # counts the last parts of carried ops launched (`_launched`)

    def wait(self, op: Any, timeout: float) -> float | None:
        """Block the calling thread until `op` (a completion: ``done()``) has ended, or
        `timeout` seconds passed: when its end was seen (`time.monotonic()`, by the poller
        or this thread), or None if it did not end."""
        if op.done():
            return time.monotonic()
        ended = _Ended()
        with self._cond:
            closed = self._closed
            if not closed:
                self._waits.append((op, ended))
                self._start()
                self._notify()
        if closed:  # nobody polls any more: look again after a pause (ops end when aborted)
            time.sleep(min(max(timeout, 0.0), 1e-3))
            return time.monotonic() if op.done() else None
        if not ended.wait(None if math.isinf(timeout) else max(timeout, 0.0)):
            with self._cond:
                self._waits = [w for w in self._waits if w[1] is not ended]
        if not op.done():
            return None
        return ended.at if ended.is_set() else time.monotonic()

    def carry(self, watch: _Watch, wake: Callable[[], None] | None = None) -> _Ended | None:
        """Have the poller itself advance `watch` from now on: set it up (`before`) at
        once, then land each chunk as its op ends. The returned event is set, and `wake`
        (which must not block: `workers.waker.make_waker`) called, once the watch ended
        (`at`: when the poller saw its last op end; `landed_at`: when it was done
        landing) or once its deadline passed with an op still on the wire (`expired`:
        the caller then advances the watch itself, which aborts the op), so waiting for
        it is bounded. None: the poller is closed, and the caller advances the watch
        itself."""
        ended = _Ended()
        ended.wake = wake
        with self._cond:
            if self._closed:
                return None
            self._carried.append((watch, ended))
            self._start()
            self._notify()
        return ended

    def probe(self, look: Callable[[], float | None], bell: Bell | None = None) -> bool:
        """Call `look()` in this thread, between the polls of the ops, until it returns
        None; it must not block. Otherwise it returns how soon it wants the next look: 0
        at the next turn (at most `WAIT_PAUSE_S` away), more to be left alone that long
        (the poller then sleeps on, if nothing else waits), `math.inf` until `bell`
        rings or `look_soon`. Only this thread drains `bell`, and it does so before each
        look it asks for. False: the poller is closed, and nothing will call it."""
        with self._cond:
            if self._closed:
                return False
            self._probes.append((look, bell))
            self._asked += 1
            self._start()
            self._notify()
        return True

    def look_soon(self) -> None:
        """Have the probes looked at the next turn, whatever pace they asked for (what
        they watch for changed)."""
        with self._cond:
            self._asked += 1
            self._notify()

    def _notify(self) -> None:
        """Wake this thread from its pause, or from its wait on bells (under `_cond`)."""
        self._cond.notify()
        if self._listening and self._wake is not None:
            try:
                os.write(self._wake[1], b"\x01")
            except BlockingIOError:  # full: it wakes anyway
                pass

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop once no wait is pending (abort their ops first, so they end); later waits
        look for themselves."""
        with self._cond:
            self._closed = True
            self._notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._cond:
            if self._wake is not None and (thread is None or not thread.is_alive()):
                for fd in self._wake:
                    os.close(fd)
                self._wake = None

    def _launched(self) -> None:
        """The last part of a carried op was launched (`Completion.until_launched`): its
        end may come now."""
        with self._cond:
            self._launches += 1
            self._notify()

    def _await_launches(self, carried: list[tuple[_Watch, _Ended]]) -> bool:
        """Whether every carried watch waits for an op whose last part is still to be
        launched (a send following the forward pass): none can end before `_launched`."""
        for watch, _ in carried:
            until = getattr(watch.pending(), "until_launched", None) if watch.started else None
            if until is None or not until(self._launched):
                return False
        return bool(carried)

    def _run(self) -> None:
        pause, progress, known, launches = 0.0, time.monotonic(), 0, 0
        while True:
            with self._cond:
                if self._closed:  # a probe is a shortcut: nobody needs it once the link closes
                    self._probes.clear()
                while not self._waits and not self._carried and not self._probes:
                    if self._closed:
                        return
                    self._cond.wait()
                    pause, progress = 0.0, time.monotonic()
                waits, carried, probes = list(self._waits), list(self._carried), list(self._probes)
                asked, look_at = self._asked, self._look_at
                if self._launches != launches:  # an op's end may come any moment now: spin again
                    launches, pause, progress = self._launches, 0.0, time.monotonic()
            if probes and (asked != self._looked or time.monotonic() >= look_at):
                self._looked = asked
                pace = self._look(probes)
                with self._cond:
                    self._look_at = time.monotonic() + pace
            ended = [w for w in waits if _ended_or_broken(w[0])]
            now = time.monotonic()
            if ended:
                with self._cond:
                    self._waits = [w for w in self._waits if w not in ended]
                for _, event in ended:
                    event.at = now
                    event.set()
            moved, finished = self._advance(carried)
            if ended or moved or len(waits) + len(carried) > known:  # an end, or a new wait: spin for the next
                pause, progress = 0.0, now
            elif now - progress > WAIT_SPIN_S:
                # No sleep(0) while spinning: it gives up the GIL and the CPU, and on a busy
                # host an end was then seen 20-50 us late (measured on an H200 pair).
                pause = min(max(pause * 2, 1e-5), WAIT_PAUSE_S)
                # Sends that follow a forward pass cannot end before their last launch:
                # polling them every pause took the GIL from the forward pass's thread
                # 10,000 times a second, for the whole pass.
                held = not waits and self._await_launches(carried)
                with self._cond:
                    rest = pause
                    idle = not self._waits and (not self._carried or held and len(self._carried) == len(carried)
                                                and self._launches == launches)
                    if idle and not (self._probes and self._asked != self._looked):
                        until = self._look_at if self._probes else math.inf
                        if self._carried:  # until a last launch (`_launched` wakes this), or a deadline
                            until = min(until, *(watch.deadline for watch, _ in carried))
                        rest = max(pause, until - time.monotonic())  # nothing to do before then
                    bells = [b for _, b in self._probes if b is not None]
                    # Nothing to poll, and no probe wants a look for a while: wait on their
                    # bells (a `poll` in whole milliseconds); else pause as for an op.
                    listen = idle and bool(bells) and rest >= 1e-3
                    if not listen:
                        # A new wait, probe or look asked for ends the pause.
                        self._cond.wait(None if math.isinf(rest) else rest)
                    elif self._wake is None:
                        self._wake = os.pipe()
                        for fd in self._wake:
                            os.set_blocking(fd, False)
                    self._listening = listen
                if self._listening:
                    self._listen(bells, rest)
                elif bells:  # between the polls of ops
                    self._rung(bells)
            known = len(waits) - len(ended) + len(carried) - finished

    def _listen(self, bells: list[Bell], rest: float) -> None:
        """Wait up to `rest` seconds (`math.inf`: until woken) with the GIL released, for
        a ring of `bells` (it asks the probes for a look) or `_notify`. A wait this long
        only comes when no op can end before a notify (nothing but probes is left, or
        sends waiting for their last launch), so `poll`'s milliseconds do."""
        assert self._wake is not None
        waiting = select.poll()
        waiting.register(self._wake[0], select.POLLIN)
        fds: dict[int, Bell] = {}
        for bell in bells:
            fd = bell.fileno()
            if fd is not None:
                fds[fd] = bell
                waiting.register(fd, select.POLLIN)
        try:
            woken = {fd for fd, _ in waiting.poll(None if math.isinf(rest) else rest * 1e3)}
        except OSError:  # a bell closed meanwhile (its link is closing): look at the others again
            woken = set()
        with self._cond:
            self._listening = False
            drain(self._wake[0])
        self._rung([fds[fd] for fd in woken if fd in fds])

    def _rung(self, bells: list[Bell]) -> None:
        """Drain `bells` (every one: a ring left in one would wake the next wait at once);
        if any rang, the probes are asked for a look."""
        if any([bell.drain() for bell in bells]):
            with self._cond:
                self._asked += 1

    def _look(self, probes: list[tuple[Callable[[], float | None], Bell | None]]) -> float:
        """Call each probe once; forget those that are done, or that raised (a probe is
        a shortcut: what it watches for also comes another way). How soon the others
        want the next look (`math.inf`: when a bell rings or a look is asked for)."""
        done, pace = [], math.inf
        for probe in probes:
            try:
                wants = probe[0]()
            except Exception as exc:
                log.warning("nccl.probe_failed", error=repr(exc))
                wants = None
            if wants is None:
                done.append(probe)
            else:
                pace = min(pace, wants)
        if done:
            with self._cond:
                # One entry for each that finished, the oldest: a look asked for again
                # meanwhile (the same callable, appended while this one ended) stays.
                for probe in done:
                    self._probes.remove(probe)
        return pace

    def _advance(self, carried: list[tuple[_Watch, _Ended]]) -> tuple[bool, int]:
        """Advance the carried watches whose next op ended (or whose deadline passed):
        their chunks land here, in this thread. Wakes the callers of those that ended;
        whether any moved, and how many ended."""
        moved, finished = False, []
        for watch, event in carried:
            now = time.monotonic()
            if watch.started and not _ended_or_broken(watch.pending()):
                if now < watch.deadline:
                    continue
                event.expired = True  # its waiter aborts the op (it blocks), not this thread
                finished.append((watch, event))
            elif watch.advance(min(now, math.nextafter(watch.deadline, -math.inf))):
                # Never raises (an error is kept on the watch for its caller), and never
                # aborts: `now` is kept before the deadline, so an op still on the wire is
                # left for the next look, or for the waiter once the deadline passed.
                event.at, event.landed_at = now, time.monotonic()
                finished.append((watch, event))
            moved = True
        if finished:
            with self._cond:
                self._carried = [c for c in self._carried if c not in finished]
            for _, event in finished:
                event.set()
                if event.wake is not None:
                    try:
                        event.wake()
                    except RuntimeError:  # its loop has ended: nobody is waiting any more
                        pass
        return moved, len(finished)


class _Ended(threading.Event):
    """A waiting thread's wake-up, and when the poller saw its op end (and, for a watch
    it carried, when it was done landing it, or that its deadline passed first)."""

    at = 0.0
    landed_at = 0.0
    expired = False
    wake: Callable[[], None] | None = None


def _ended_or_broken(op: Any) -> bool:
    """Whether `op` ended, for the poller: one whose poll raises (a CUDA error) wakes its
    waiter too, which then meets the error itself instead of sleeping to its deadline."""
    try:
        return bool(op.done())
    except Exception:  # the waiter's own poll raises it
        return True


def _reported(carried: _Ended) -> Waited | None:
    """What the poller reported for a watch it carried: when the transfer ended, or None
    if it handed the watch back past its deadline (its waiter then aborts the op)."""
    return None if carried.expired else Waited(carried.at, carried.at, carried.landed_at)


def _wait_until_ended(watch: _Watch, poller: Poller) -> Waited:
    """Until `watch`'s transfer ended (or its deadline passed: `advance` then aborts and
    raises); when. This thread advances it, sleeping until `poller` saw its next op end."""
    seen = resumed = time.monotonic()
    while not watch.advance(time.monotonic()):
        if (at := poller.wait(watch.pending(), watch.deadline - time.monotonic())) is not None:
            seen, resumed = at, time.monotonic()
    return Waited(seen, resumed, time.monotonic())


class NcclLink:
    """One worker's NCCL communicators and the posts of its transfers.

    Args:
        client: the worker's broker client (its peer id names this side; it relays the
            rendezvous data).
        device: the GPU of this worker's KV cache and pools.
        connect_timeout_s: longest a communicator may take to build.
        backend: what this side builds as the initiator (`CommunicatorCache`'s; None: the
            environment's, else direct or torch).
        capacity: communicators kept at once.
    """

    def __init__(self, client: SyncBrokerClient, device: torch.device, *, connect_timeout_s: float,
                 backend: str | None = None, capacity: int = 8) -> None:
        self.device = device
        self.rendezvous = BrokerRendezvous(client, timeout_s=connect_timeout_s)
        self.cache = CommunicatorCache(
            client.registered.peer_id, device, self.rendezvous, capacity=capacity,
            connect_timeout_s=connect_timeout_s, backend=backend,
        )
        self.stream = torch.cuda.Stream(device)  # the stream the posts hang off (each communicator has its own)
        self._receiving: dict[str, anyio.Lock] = {}
        self._recv_order = RecvOrder()
        # P's order of sends: the loop's Go tasks and the thread that sees D's receive
        # (`send_on_receive`) take a turn in it; `_order_lock` makes that one step.
        self._send_order = SendOrder()
        self._order_lock = threading.Lock()
        self._spawn = client.spawn  # on the client's loop, from any thread
        self._order_changed: dict[str, anyio.Event] = {}
        self._inflight: dict[str, dict[str, threading.Event]] = {}  # peer -> transfer id -> cancel flag
        # (peer, transfer id) cancelled before their op was posted: the post is refused (`cancel`)
        self._cancelled: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()
        self.poller = Poller()
        self._watch = ReceiveWatch()  # under `_lock`
        self._probing = False  # `_look` is the poller's probe (under `_lock`)

    # -- D ---------------------------------------------------------------------------------

    def receiving(self, producer: str) -> anyio.Lock:
        """D: hold this from `ticket` until `post_recv` has posted (or the ticket is given up)."""
        with self._lock:
            return self._receiving.setdefault(producer, anyio.Lock())

    def ticket(self, producer: str) -> Ticket:
        """D, holding `receiving(producer)`: where the next receive from `producer` goes;
        name it in the Ready."""
        comm = self.cache.current(producer)
        return self._recv_order.ticket(producer, None if comm is None else comm.nonce)

    async def post_recv(self, producer: str, transfer_id: str, lease: Lease | None, nbytes: int, deadline: float,
                        ticket: Ticket, *, block_nbytes: int = 0, into: Into | None = None) -> Posted:
        """D: post the receive of `nbytes` from `producer` into the start of `lease`, in the
        sender's chunks, on the communicator `ticket` names (Ready sent first: the
        producer builds a new communicator only once it has the Go). Over the ipc
        backend, with `into`, one receive straight into those blocks instead
        (`Posted.into_blocks`); `lease` may then be None (`receives_into_blocks`), and the
        post fails if it cannot go into the blocks after all.

        Raises:
            TransferFailed: not posted (no communicator, cancelled, or not the ticket's);
                the ticket is given up and the communicator dropped.
        """
        try:
            posted = await self._post(producer, "recv", transfer_id, lease, 0 if lease is None else lease.offset, nbytes,
                                      None, deadline, block_nbytes, ticket, into)
        except BaseException:
            self._recv_order.given_up(producer)
            raise
        self._recv_order.posted(producer, ticket, posted.comm.nonce)
        return posted

    def receives_into_blocks(self, producer: str, paged: Any, count: int) -> bool:
        """D: whether a receive of `count` blocks from `producer` posted now would go straight
        into the cache blocks (`paged`): a communicator built with it writes into blocks
        and takes that many. Such a receive needs no room in the receive pool."""
        comm = self.cache.current(producer)
        return comm is not None and comm.writes_into_blocks and comm.takes_blocks(paged, count)

    def posts_first(self, producer: str, ticket: Ticket) -> bool:
        """D: whether to post the receive of `ticket` before sending its Ready: on a
        built communicator that writes into blocks, whose sender watches for such a
        receive and may start on it (`watch_receive`). Elsewhere the Ready goes first:
        the post would only delay it (and a new communicator is built on the Go)."""
        comm = self.cache.current(producer) if ticket[0] else None
        return comm is not None and comm.nonce == ticket[0] and comm.writes_into_blocks

    async def give_up(self, producer: str) -> None:
        """D: a ticket whose Ready may have gone out is given up before its receive was
        posted: drop the communicator, so the producer's send cannot pair with a later
        transfer's receive."""
        self._recv_order.given_up(producer)
        await anyio.to_thread.run_sync(self.cache.discard, producer)  # an abort blocks: off the loop

    # -- P ---------------------------------------------------------------------------------

    async def send(self, decode: str, transfer_id: str, lease: Lease, offset: int, nbytes: int,
                   after: torch.cuda.Event | None, deadline: float, *, block_nbytes: int = 0,
                   ticket: Ticket = ("", 0), paged: Any = None, streaming: Streaming | None = None) -> Waited:
        """P: send bytes ``[offset, offset + nbytes)`` of the staged `lease` to `decode`,
        once `after` (the step's gathers) has completed on the GPU, in `chunks` of staged
        blocks of `block_nbytes` (0: one op), when it is next in `ticket`'s order (the Go's);
        when its end was seen. Over the ipc backend, when D posted its receive straight
        into its blocks, as one op into them (`paged`: this side's cache, its shape).

        `streaming` (with `after` None): the copy may still be being gathered on the GPU.
        Sent into D's blocks, the op is posted now and launched a group of layers at a
        time as the step gathers them (`Streaming.feed`); any other op waits for the
        copy in a worker thread (`Streaming.wait`) and is posted after its gathers.

        Raises:
            TransferFailed: not in order, not sent by `deadline` (a `time.monotonic()`
                value; the communicator is then aborted), no communicator, or it was aborted.
        """
        await self._turn(decode, transfer_id, ticket, deadline)
        try:
            posted = await self._post(decode, "send", transfer_id, lease, lease.offset + offset, nbytes, after,
                                      deadline, block_nbytes, ticket, paged, streaming)
        except BaseException:
            built = self.cache.current(decode)
            await self._end_pair(decode, None if built is None else built.nonce)
            raise
        with self._order_lock:
            self._send_order.posted(decode, ticket, posted.comm.nonce)
        self._changed(decode)
        # D posts a step's receives back to back: the next may be there already. Looked
        # for now, its send starts without waiting for the poller's next look.
        self._look_now()
        return await self.wait(posted, deadline)

    def abandon(self, decode: str, ticket: Ticket) -> None:
        """P, on the client's loop: a Go whose send will not be posted (its copy is gone, or
        the send was refused). Later sends on that communicator would pair with D's
        receive for this one: they are not posted either (D, aborted, drops it)."""
        with self._order_lock:
            abandoned = self._send_order.abandon(decode, ticket)
        if abandoned:
            self._changed(decode)

    # -- P: a send started by D's receive ---------------------------------------------------

    def watch_receive(self, transfer_id: str, seen: Seen) -> None:
        """P: look (the poller, between its polls: now, then each time an ipc peer rings
        this side's bell, until `unwatch_receive`) for D's receive of `transfer_id`
        straight into its blocks, on any communicator built with a D that writes into
        blocks; once it is the next receive there, call `seen` (in the poller's thread,
        or on the client's loop right after a send was posted: it must not block). D
        posts such a receive before its Ready (`posts_first`) and rings once it has, so
        P may start the send then (`ticket_at`), without the Ready's trip to the broker
        and the Go's back. Nothing to look for while no communicator built writes into
        blocks (a peer's first transfer builds one on its Go)."""
        bell = self.cache.bell
        if bell is None or not any(comm.writes_into_blocks for comm in self.cache.built()):
            return
        with self._lock:
            self._watch.add(transfer_id, seen)
            start, self._probing = not self._probing, True
        if not start:
            self.poller.look_soon()  # D may have rung before this transfer was watched
        elif not self.poller.probe(self._look, bell):
            with self._lock:
                self._probing = False

    def unwatch_receive(self, transfer_id: str) -> None:
        """P: stop looking for `transfer_id`'s receive (its Go came, or it ended)."""
        with self._lock:
            self._watch.drop(transfer_id)

    def _look(self) -> float | None:
        """The poller's probe: each built communicator's next receive, if it names a
        watched transfer. How soon to look again: at the next ring of the bell, or soon
        if a communicator was busy; None once nothing is watched (the probe ends)."""
        busy = self._find_receives()
        with self._lock:
            if not self._watch:  # a watch added after this ends it starts a probe of its own
                self._probing = False
                return None
        return WAIT_PAUSE_S if busy else math.inf

    def _look_now(self) -> None:
        """P, on the client's loop, right after a send was posted: the probe's look, if
        one is running (the poller alone ends it). Never raises: the send is posted."""
        with self._lock:
            if not self._probing:
                return
        try:
            self._find_receives()
        except Exception as exc:  # a shortcut: the poller looks too, and the Go still comes
            log.warning("nccl.probe_failed", error=repr(exc))

    def _find_receives(self) -> bool:
        """Call the watch of each built communicator's next receive that names a watched
        transfer (`watch_receive`), once: the watch is taken under the lock; while the
        watch posts the send there and then, look at that communicator's next receive too.
        Whether a communicator was busy (a post held it), so it was not looked at."""
        busy = False
        for comm in self.cache.built():
            while comm.writes_into_blocks:
                try:
                    found = comm.next_block_receive()
                except BlockingIOError:
                    busy = True
                    break
                except Exception:  # closed meanwhile: its transfers go by their Go
                    break
                if found is None:
                    break
                seq, tag, nbytes = found
                with self._lock:
                    watched = self._watch.take(tag)
                # Sent there and then: D's next receive may be posted already (a step's
                # come back to back), and its send goes right behind this one.
                if watched is None or not watched[1](watched[0], comm.peer, comm.nonce, seq, nbytes):
                    break
        return busy

    def send_on_receive(self, decode: str, transfer_id: str, nonce: str, seq: int, lease: Lease, offset: int,
                        nbytes: int, *, block_nbytes: int, paged: Any, streaming: Streaming,
                        claim: Callable[[], bool]) -> Posted | None:
        """P, in the thread that saw D's receive `seq` of `transfer_id` straight into its
        blocks on communicator `nonce` (the poller's, or the loop's right after a send):
        post the send of bytes ``[offset, offset + nbytes)`` of the staged `lease` into
        them there and then, as `send` would on its Go. Only when it is next in this
        side's order there and nothing needs a wait on the host (D's descriptor is
        written, the send whose counters it reuses is launched whole); `claim()`, called
        in that same step, says whether the transfer is still this side's to send, and
        takes it. None: nothing posted or claimed (the caller leaves it to its Go).
        The caller awaits `wait` on the loop.

        Raises:
            TransferFailed: claimed, but not posted; nothing more goes on that communicator.
        """
        with self._order_lock:
            found = self._next_at(decode, nonce, seq)
            whole = block_nbytes > 0 and nbytes % block_nbytes == 0
            if found is None or not whole or not found[1].send_ready() or not claim():
                return None
            ticket, comm = found
            self._send_order.begin(decode)
        flag: threading.Event | None = None
        try:
            flag = self._track(decode, "send", transfer_id)
            with torch.cuda.device(self.device):
                posted = self._post_blocks(comm, decode, "send", transfer_id, lease, lease.offset + offset,
                                           nbytes // block_nbytes, None, flag, paged, streaming)
            if posted is None:  # `next_send`'s receive was D's blocks' a moment ago: it cannot change
                raise RuntimeError(f"{decode}'s receive {seq} no longer takes blocks")
        except BaseException as exc:
            if flag is not None:
                self._untrack(decode, transfer_id, flag)
            with self._order_lock:
                self._send_order.given_up(decode)
            self._spawn(self._dropped, decode)
            if isinstance(exc, TransferFailed) or not isinstance(exc, Exception):
                raise
            raise TransferFailed(transfer_id, f"NCCL send with {decode} failed: {exc}") from exc
        with self._order_lock:
            self._send_order.posted(decode, ticket, comm.nonce)
        self._spawn(self._changed_soon, decode)
        return posted

    async def _dropped(self, decode: str) -> None:
        """On the loop, once the pair's order is given up (`_end_pair`, or a send on
        receive that failed to post): its communicator goes, and the sends waiting for
        their turn see that."""
        with anyio.CancelScope(shield=True):  # an abort blocks: off the loop
            await anyio.to_thread.run_sync(self.cache.discard, decode)
        self._changed(decode)

    async def _changed_soon(self, decode: str) -> None:
        """On the loop: the poller ended a turn in `decode`'s order; sends waiting for it look again."""
        self._changed(decode)

    def ticket_at(self, decode: str, nonce: str, seq: int) -> Ticket | None:
        """P, on the client's loop: the ticket of the send that pairs with `decode`'s
        receive number `seq` on communicator `nonce`, when that send is next in this
        side's order and may be posted now; None: leave it to the Go."""
        with self._order_lock:
            found = self._next_at(decode, nonce, seq)
        return None if found is None else found[0]

    def _next_at(self, decode: str, nonce: str, seq: int) -> tuple[Ticket, Communicator] | None:
        """Under `_order_lock`: the ticket of the send next in this side's order on
        communicator `nonce` with `decode`, and that communicator, when it is built,
        writes into blocks and numbers that send `seq`; None otherwise."""
        ticket = self._send_order.next_on(decode, nonce)
        comm = self.cache.current(decode) if ticket is not None else None
        if ticket is None or comm is None or comm.nonce != nonce or not comm.writes_into_blocks:
            return None
        return (ticket, comm) if comm.next_send == seq else None

    async def _turn(self, decode: str, transfer_id: str, ticket: Ticket, deadline: float) -> None:
        """Until the send of `ticket` is next in the pair's order; it then holds the turn
        (`SendOrder.begin`) until it is posted or given up."""
        verdict = self._take_turn(decode, ticket)
        if verdict == "post":  # the usual case: no deadline to set up (a cancel scope costs the loop)
            return
        with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)):
            while verdict == "wait":
                # A turn the poller ends is told here on the loop, after it (`_changed_soon`).
                event = self._order_changed.setdefault(decode, anyio.Event())
                await event.wait()
                verdict = self._take_turn(decode, ticket)
            if verdict == "post":
                return
            raise TransferFailed(
                transfer_id, f"its Go names communicator {ticket[0] or '(new)'} place {ticket[1]} with {decode}, "
                "but that communicator is gone or the place passed: D's receive cannot be paired in order")
        # The turn never came: an earlier transfer of this pair never posted. Nothing later
        # may go on this communicator either.
        await self._end_pair(decode)
        raise TransferFailed(transfer_id, f"its turn to send to {decode} did not come by the load deadline")

    def _take_turn(self, decode: str, ticket: Ticket) -> Literal["post", "wait", "stale"]:
        """`ticket`'s verdict in the pair's order, and the turn taken if it is "post" (the
        poller may take a turn too: `send_on_receive`)."""
        with self._order_lock:
            verdict = self._send_order.verdict(decode, ticket)
            if verdict == "post":
                self._send_order.begin(decode)
            return verdict

    async def _end_pair(self, decode: str, also: str | None = None) -> None:
        """P: nothing more goes on this pair's communicator (nor on `also`); drop it, and
        let the sends waiting for their turn see that."""
        with self._order_lock:
            self._send_order.given_up(decode, also)
        await self._dropped(decode)

    def _changed(self, peer: str) -> None:
        event = self._order_changed.pop(peer, None)
        if event is not None:
            event.set()

    # -- both ------------------------------------------------------------------------------

    def cancel(self, peer: str, transfer_id: str) -> None:
        """End `transfer_id`'s op with `peer` before its deadline: posted or being posted,
        its communicator is aborted (an op left posted would pair with the next
        transfer's, and the ops queued behind it on that pair end too); not posted yet
        (waiting for its turn, or its caller not there yet), its post is refused when it
        comes. Its `send`/`wait` then raises. A communicator still being built for it
        stops waiting for the peer's rendezvous data."""
        with self._lock:
            flag = self._inflight.get(peer, {}).get(transfer_id)
            if flag is None:
                self._cancelled[(peer, transfer_id)] = None
                while len(self._cancelled) > CANCELLED_KEPT:
                    self._cancelled.popitem(last=False)
                return
            flag.set()
        self.rendezvous.wake()  # a communicator still being built for it stops waiting for the peer
        self.cache.discard(peer)

    async def wait(self, posted: Posted, deadline: float,
                   landed: Callable[[int, int, int], None] | None = None,
                   before: Callable[[], None] | None = None) -> Waited:
        """Until `posted`'s ops have ended; when that was seen. `landed(b0, b1, left)` is
        called (in the poller's thread; past the deadline, or once the poller closed, in
        a worker thread) as each chunk's blocks have arrived whole, in order; `left`:
        chunks still to come. `before()` is called in that thread before the first chunk
        is waited for. Without `landed` (a sender) only the last op's end is waited for.

        Raises:
            TransferFailed: not ended by `deadline` (the communicator is then aborted), or
                cut short (the communicator was aborted: `cancel`, a timeout).
        """
        watch = _Watch(posted, deadline, landed, before, self.cache.discard, at_once=landed is None)
        try:
            # Shielded: the ops read or write the lease until they end, so no caller may
            # go on (and free it) before; `cancel` or the deadline end them early.
            with anyio.CancelScope(shield=True):
                waited = await self._until_ended(watch)
            if watch.error is not None:
                raise watch.error
            return waited
        except TransferFailed:
            raise
        except (KvBrokerError, RuntimeError) as exc:  # the op timed out, or the copy after it failed
            raise TransferFailed(posted.transfer_id, f"NCCL {posted.op} with {posted.peer} failed: {exc}") from exc
        finally:
            self._untrack(posted.peer, posted.transfer_id, posted.flag)

    async def _until_ended(self, watch: _Watch) -> Waited:
        """Carried by the poller and awaited here; once the poller closed, or handed back
        past its deadline, advanced in a worker thread."""
        waited = await self._carried(watch)
        return waited if waited is not None else await anyio.to_thread.run_sync(_wait_until_ended, watch, self.poller)

    async def _carried(self, watch: _Watch) -> Waited | None:
        """Hand `watch` to the poller, which sets a receive up and lands its chunks as
        their ops end (or sees a send's last op end), and wait for that here, on the
        loop: no thread sleeps for it, and the poller's report wakes the loop directly
        (`make_waker`). None: the poller is closed, or handed the watch back past its
        deadline; the caller then advances it in a worker thread (where an expired op's
        blocking abort belongs).

        Raises:
            TransferFailed: the poller did not report within `CARRY_GRACE_S` of the
                deadline (its communicator is dropped, which ends the ops).
        """
        reported = anyio.Event()
        carried = self.poller.carry(watch, wake=make_waker(reported))
        if carried is None:
            return None
        with anyio.move_on_after(max(watch.deadline - time.monotonic(), 0.0) + CARRY_GRACE_S):
            await reported.wait()
        if not carried.is_set():
            peer = watch.posted.peer
            await anyio.to_thread.run_sync(self.cache.discard, peer)  # an abort blocks: off the loop
            raise TransferFailed(watch.posted.transfer_id, f"the NCCL {watch.posted.op} with {peer} was not seen "
                                 f"to end within {CARRY_GRACE_S:g} s of its deadline; its communicator was dropped")
        return _reported(carried)

    async def _post(self, peer: str, op: Any, transfer_id: str, lease: Lease | None, start: int, nbytes: int,
                    after: torch.cuda.Event | None, deadline: float, block_nbytes: int, ticket: Ticket,
                    blocks: Any = None, streaming: Streaming | None = None) -> Posted:
        # In a worker thread: building a communicator blocks (its rendezvous goes through
        # this loop). Not abandoned on cancellation: whether the ops were posted must be
        # known before the caller lets the next transfer post; `cancel` ends it early.
        flag = self._track(peer, op, transfer_id)
        try:
            comm = self._postable_now(peer, op, ticket, flag, streaming)
            if comm is not None:
                with torch.cuda.device(self.device):
                    return self._post_on(comm, peer, op, transfer_id, lease, start, nbytes, after, flag, block_nbytes,
                                         blocks, streaming)
            return await anyio.to_thread.run_sync(self._post_ops, peer, op, transfer_id, lease, start, nbytes, after,
                                                  flag, block_nbytes, ticket, blocks, streaming)
        except BaseException as exc:
            self._untrack(peer, transfer_id, flag)
            if isinstance(exc, (KvBrokerError, RuntimeError)) and not isinstance(exc, TransferFailed):
                # no communicator (rendezvous, NCCL init), or a refused post
                raise TransferFailed(transfer_id, f"NCCL {op} with {peer} failed: {exc}") from exc
            raise

    def _track(self, peer: str, op: str, transfer_id: str) -> threading.Event:
        """The flag `cancel` sets for `transfer_id`'s op about to be posted.

        Raises:
            TransferFailed: it was cancelled already.
        """
        flag = threading.Event()
        with self._lock:
            if (peer, transfer_id) in self._cancelled:
                del self._cancelled[(peer, transfer_id)]
                raise TransferFailed(transfer_id, f"the NCCL {op} with {peer} was cancelled before it was posted")
            self._inflight.setdefault(peer, {})[transfer_id] = flag
        return flag

    def _untrack(self, peer: str, transfer_id: str, flag: threading.Event) -> None:
        with self._lock:
            ours = self._inflight.get(peer, {})
            if ours.get(transfer_id) is flag:
                del ours[transfer_id]

    def _post_ops(self, peer: str, op: Any, transfer_id: str, lease: Lease | None, start: int, nbytes: int,
                  after: torch.cuda.Event | None, cancelled: threading.Event, block_nbytes: int,
                  ticket: Ticket, blocks: Any = None, streaming: Streaming | None = None) -> Posted:
        if ticket[0]:
            # A ticket names a communicator this side had when it was taken; if it is gone
            # now (an abort of a transfer ahead dropped it), it is gone for good: building
            # one would only wait, until the deadline, for a peer that will not build it.
            current = self.cache.current(peer)
            if current is None or current.nonce != ticket[0]:
                raise TransferFailed(transfer_id, f"the communicator with {peer} its ticket names "
                                     f"({ticket[0]}) was dropped: its op cannot be paired in order")
        torch.cuda.set_device(self.device)
        if not ticket[0] and not cancelled.is_set() and self.cache.current(peer) is not None:
            # D names no communicator: it has none with us, so it joins only a new one,
            # built for this transfer. Ours is one D dropped; what is on it is lost anyway.
            self.cache.discard(peer)
        # A communicator built now is for this transfer only: D never joins a build P made
        # for a transfer D gave up after its Ready, whose send would pair with D's next receive.
        comm = None if cancelled.is_set() else self.cache.get(peer, initiator=op == "send", cancelled=cancelled,
                                                              purpose=transfer_id)
        if comm is None or cancelled.is_set():
            raise TransferFailed(transfer_id, f"the NCCL {op} with {peer} was cancelled before it was posted")
        if ticket[0] and comm.nonce != ticket[0]:
            raise TransferFailed(transfer_id, f"the communicator with {peer} changed since its Ready "
                                 f"({ticket[0]} then, {comm.nonce} now): its op cannot be paired in order")
        return self._post_on(comm, peer, op, transfer_id, lease, start, nbytes, after, cancelled, block_nbytes,
                             blocks, streaming)

    def _postable_now(self, peer: str, op: Any, ticket: Ticket, cancelled: threading.Event,
                      streaming: Streaming | None = None) -> Any:
        """The communicator `ticket` names, when the op may be posted on it from the loop
        thread: built, nothing to abort, and (a send) nothing to wait for on the host; None:
        post from a worker thread. Posting on the loop spares a hop to a worker thread and
        back, which sat inside D's turn for the producer and P's order of sends."""
        if not ticket[0] or cancelled.is_set():
            return None
        comm = self.cache.usable(peer, ticket[0], initiator=op == "send")
        if op == "send" and comm is not None and not comm.send_ready():
            return None  # it would wait on the host for D's receive: not on the loop
        if streaming is not None and comm is not None and not (comm.writes_into_blocks
                                                               and comm.next_receive_takes_blocks()):
            return None  # it would wait on the host for the staging: not on the loop
        return comm

    def _post_on(self, comm: Communicator, peer: str, op: Any, transfer_id: str, lease: Lease | None, start: int,
                 nbytes: int, after: torch.cuda.Event | None, cancelled: threading.Event, block_nbytes: int,
                 blocks: Any = None, streaming: Streaming | None = None) -> Posted:
        """Post the transfer's chunks on `comm`; never blocks (the communicator is built;
        over the ipc backend a send first waits for its receive's descriptor, which D
        writes right after its Ready). `blocks`: D's `Into`, or P's cache (`PagedKv`):
        over the ipc backend the transfer then goes as one op into D's blocks."""
        whole = block_nbytes > 0 and nbytes % block_nbytes == 0
        if whole and blocks is not None and comm.writes_into_blocks:
            posted = self._post_blocks(comm, peer, op, transfer_id, lease, start, nbytes // block_nbytes, after,
                                       cancelled, blocks, streaming)
            if posted is not None:
                return posted
        if lease is None:  # D leased no room: only a receive into its blocks was possible
            raise TransferFailed(transfer_id, f"the NCCL {op} with {peer} cannot go straight into the blocks, "
                                 "and no room was leased for it")
        if streaming is not None:  # these ops read the staging whole: after its gathers (a worker thread)
            after = streaming.wait()
        parts = chunks(nbytes, block_nbytes) if whole else [(0, 1)]
        step = block_nbytes if whole else nbytes
        with comm.lock:  # the chunks back to back: nothing of another transfer may come between
            works = [comm.post_range(op, lease.base, start + b0 * step, (b1 - b0) * step, self.stream,
                                     after if k == 0 else None)  # one NCCL stream: later ops follow the first
                     for k, (b0, b1) in enumerate(parts)]
            done = [comm.completion([work], self.stream, op, transfer_id) for work in works]
        return Posted(peer=peer, op=op, transfer_id=transfer_id, comm=comm, completions=done,
                      parts=parts if whole else [], flag=cancelled)

    def _post_blocks(self, comm: Communicator, peer: str, op: Any, transfer_id: str, lease: Lease | None, start: int,
                     count: int, after: torch.cuda.Event | None, cancelled: threading.Event,
                     blocks: Any, streaming: Streaming | None = None) -> Posted | None:
        """The transfer as one op straight into D's blocks, if both sides can: D when its
        cache takes `count` blocks so; P when D's receive is of that kind. None: chunks."""
        tag = transfer_tag(transfer_id)  # D's receive names it, and P's send checks it
        with comm.lock:
            if op == "recv":
                paged, ids, ready_after = blocks
                if not comm.takes_blocks(paged, count):
                    return None
                work = comm.post_blocks(paged, ids, after=[ready_after], tag=tag)
            else:
                assert lease is not None  # P's staging
                if not comm.next_receive_takes_blocks():
                    return None
                # Streaming: each group of layers is launched once its gathers are enqueued.
                work = comm.send_blocks(comm.next_send, blocks, lease.base.data_ptr() + start, count, after=[after],
                                        keep=[lease.base], feed=None if streaming is None else streaming.feed,
                                        tag=tag)
            done = [comm.completion([work], self.stream, op, transfer_id)]
        return Posted(peer=peer, op=op, transfer_id=transfer_id, comm=comm, completions=done, parts=[(0, count)],
                      flag=cancelled, into_blocks=True)

    def close(self) -> None:
        self.cache.close()  # aborts what is still on the wire: the waits end
        self.poller.close()
