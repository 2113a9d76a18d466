"""The ipc backend's shared page, without a GPU: how receives and sends pair through it,
what a torn or stale slot reads as, and what an abort leaves; and its rendezvous payload.

The GPU half (the copy kernel, the stream waits, abort under a live transfer) runs in
tests/gpu over the same page; these tests pin the host logic it relies on."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import RendezvousError
from workers.transports.ipc_mailbox import (
    BLOCKS,
    MAX_LAYERS,
    SLOTS,
    UNTAGGED,
    Counters,
    Descriptor,
    LayerTable,
    Mailbox,
    MailboxError,
    Step,
    group_steps,
    pairing_error,
    transfer_tag,
)
from workers.transports.nccl_setup import (
    IPC_PAGE_PREFIX,
    IPC_VERSION,
    SHM_DIR,
    parse_payload,
    resolve_backend,
)


def page() -> Mailbox:
    box = Mailbox(bytearray(Mailbox.SIZE))
    box.init()
    return box


def handle(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * 8


def test_a_receive_pairs_with_the_send_of_the_same_number_in_its_own_direction() -> None:
    box = page()
    box.post(1, Descriptor(1, handle(1), 4096, 1 << 20, 0x7F00_0000_0000))
    assert box.take(0, 1) is None  # the other direction has nothing
    assert box.take(1, 2) is None  # send 2 has no receive yet
    assert box.take(1, 1) == Descriptor(1, handle(1), 4096, 1 << 20, 0x7F00_0000_0000)


def test_a_slot_is_reused_only_after_the_sender_read_it() -> None:
    box = page()
    for seq in range(1, SLOTS + 1):
        box.post(0, Descriptor(seq, handle(seq), 0, seq))
    with pytest.raises(MailboxError, match="no free slot"):
        box.post(0, Descriptor(SLOTS + 1, handle(0), 0, 1))
    assert box.take(0, 1) is not None
    box.consume(0, 1)
    box.post(0, Descriptor(SLOTS + 1, handle(SLOTS + 1), 0, 7))
    assert box.take(0, 1) is None  # its slot now holds receive SLOTS + 1
    assert box.take(0, SLOTS + 1) == Descriptor(SLOTS + 1, handle(SLOTS + 1), 0, 7)


def test_a_torn_slot_reads_as_not_yet_written() -> None:
    """The sender's CPU may see the seq before the rest of the slot: the hash catches it."""
    box = page()
    box.post(0, Descriptor(1, handle(1), 8, 16))
    at = Mailbox._slot(0, 1)
    box.buf[at + 8 : at + 16] = (999).to_bytes(8, "little")  # the offset of a later write, its hash not yet
    assert box.take(0, 1) is None
    box.post(0, Descriptor(1, handle(1), 8, 16))  # the whole write lands
    assert box.take(0, 1) == Descriptor(1, handle(1), 8, 16)


def test_a_block_receive_names_its_count_and_layer_table() -> None:
    box = page()
    desc = Descriptor(3, bytes(64), 2, 8 * 4096, kind=BLOCKS, count=8)
    box.post(1, desc)
    assert box.take(1, 3) == desc
    with pytest.raises(ValueError, match="bad descriptor"):
        box.post(1, Descriptor(4, bytes(64), 2, 1, kind=7))


def table(version: int, layers: int = 3, blocks: int = 64) -> LayerTable:
    return LayerTable(version, blocks, 2, 32768, tuple((handle(k), 4096 * k, 0x7F00_0000_0000 + k)
                                                        for k in range(layers)))


def test_a_layer_table_is_read_whole_per_direction_and_only_rises() -> None:
    box = page()
    assert box.layers(0) is None and box.layers(1) is None
    box.publish_layers(1, table(1))
    assert box.layers(1) == table(1) and box.layers(0) is None
    box.publish_layers(1, table(2, layers=MAX_LAYERS, blocks=9))  # the receiver registered another cache
    assert box.layers(1) == table(2, layers=MAX_LAYERS, blocks=9)
    with pytest.raises(ValueError, match="must be at least 1 and rise"):
        box.publish_layers(1, table(2))
    with pytest.raises(ValueError, match=f"1 to {MAX_LAYERS} layers"):
        box.publish_layers(1, table(3, layers=MAX_LAYERS + 1))
    with pytest.raises(ValueError, match="1 to"):
        box.publish_layers(1, table(3, layers=0))


def test_a_torn_layer_table_reads_as_not_yet_written() -> None:
    box = page()
    box.publish_layers(0, table(1))
    at = Mailbox._table(0) + 4096  # the first entry's handle, rewritten before the head that covers it
    box.buf[at : at + 8] = b"\xff" * 8
    assert box.layers(0) is None
    box.publish_layers(0, table(2))
    assert box.layers(0) == table(2)


def test_an_abort_marks_the_page_dead_and_counters_are_found_where_published() -> None:
    box = page()
    assert box.flags_of(0) is None and box.flags_of(1) is None
    box.publish_flags(1, Counters(handle(5), 4096, 4242, 1, 0x7F00_0000_0000, 0x5EED))
    assert box.flags_of(1) == Counters(handle(5), 4096, 4242, 1, 0x7F00_0000_0000, 0x5EED) and box.flags_of(0) is None
    assert not box.dead
    box.abort()
    assert box.dead


def test_a_page_of_another_layout_is_refused() -> None:
    box = Mailbox(bytearray(Mailbox.SIZE))
    with pytest.raises(MailboxError, match="same kvbroker version"):
        box.check()
    with pytest.raises(MailboxError, match="needs"):
        Mailbox(bytearray(100))


def test_the_page_works_over_a_shared_mapping() -> None:
    """What the two workers actually share: one mapping seen through two views."""
    mm = mmap.mmap(-1, Mailbox.SIZE)
    writer, reader = Mailbox(memoryview(mm)), Mailbox(memoryview(mm))
    writer.init()
    reader.check()
    writer.post(1, Descriptor(1, handle(9), 64, 128))
    assert reader.take(1, 1) == Descriptor(1, handle(9), 64, 128)
    writer.release()
    reader.release()
    mm.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1]), st.sampled_from(["post", "take"])), max_size=400))
def test_any_interleaving_pairs_each_send_with_its_receive(steps: list[tuple[int, str]]) -> None:
    """Receivers post, senders take, in any interleaving of the two directions: a send
    gets exactly its own receive's descriptor, never one of the other direction or of a
    later or earlier number, and a receive is refused only with SLOTS unread."""
    box = page()
    posted, taken = [0, 0], [0, 0]
    for direction, step in steps:
        if step == "post":
            seq = posted[direction] + 1
            desc = Descriptor(seq, handle(seq * 2 + direction), seq * 64, seq + direction, seq << 20)
            if seq - taken[direction] > SLOTS:
                with pytest.raises(MailboxError):
                    box.post(direction, desc)
            else:
                box.post(direction, desc)
                posted[direction] = seq
        else:
            seq = taken[direction] + 1
            got = box.take(direction, seq)
            if seq > posted[direction]:
                assert got is None
            else:
                assert got == Descriptor(seq, handle(seq * 2 + direction), seq * 64, seq + direction, seq << 20)
                box.consume(direction, seq)
                taken[direction] = seq


def test_ipc_payloads_parse_and_bad_pages_are_refused() -> None:
    page_path = os.path.join(SHM_DIR, f"{IPC_PAGE_PREFIX}ab12")
    info = parse_payload(json.dumps({"v": IPC_VERSION, "backend": "ipc", "page": page_path, "boot": "b-1", "nonce": "n",
                                     "for": "t1"}).encode())
    assert info == {"backend": "ipc", "page": page_path, "boot": "b-1", "nonce": "n", "for": "t1",
                    "fallback": ""}
    for bad in ("/etc/passwd", os.path.join(SHM_DIR, "other"), f"{SHM_DIR}/../tmp/{IPC_PAGE_PREFIX}x", 7):
        with pytest.raises(RendezvousError, match="unusable"):
            parse_payload(json.dumps({"v": IPC_VERSION, "backend": "ipc", "page": bad, "boot": "b", "nonce": "n"}).encode())


def test_asking_for_ipc_without_a_cuda_driver_says_what_to_use() -> None:
    from workers.transports import cuda_ipc

    if cuda_ipc.driver() is not None:
        pytest.skip("this host has a CUDA driver")
    with pytest.raises(ValueError, match="ipc backend needs the CUDA driver"):
        resolve_backend("ipc")


# -- the order of a group's steps, against a model of both hosts and both GPU streams --------


def run_pair(groups: dict[int, list[list[str]]], steps_of: Callable[..., list[Step]], pick: Callable[[int], int]
             ) -> dict[int, list[int]] | None:
    """Play both ranks' groups through `steps_of` on a model of the backend: a host
    posts its groups in order, and its send waits (on the host) for the peer's
    descriptor of the same number; a GPU stream runs its items in order, a copy once its
    own `ready` counter reaches the send's number, a receive's wait once its `arrived`
    does. `pick` chooses which runnable actor moves next. Returns, per rank, the send
    number each of its receives got, in order; None if nothing can move (a deadlock)."""
    posted = {0: 0, 1: 0}  # receives each rank's host has announced
    ready = {0: 0, 1: 0}  # rank r's `ready`: how far r's sends may copy (the peer writes it)
    arrived = {0: 0, 1: 0}  # rank r's `arrived`
    got: dict[int, list[int]] = {0: [], 1: []}
    hosts = {r: _planned(groups[r], steps_of) for r in (0, 1)}
    streams: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    while any(hosts.values()) or any(streams.values()):
        movable = []
        for r in (0, 1):
            if hosts[r]:
                kind, seq = hosts[r][0]
                if kind != "send" or posted[1 - r] >= seq:  # a send needs the peer's descriptor
                    movable.append(("host", r))
            if streams[r]:
                kind, seq = streams[r][0]
                if (kind == "ready" or (kind == "copy" and ready[r] >= seq)
                        or (kind == "await" and arrived[r] >= seq)):
                    movable.append(("gpu", r))
        if not movable:
            return None
        who, r = movable[pick(len(movable))]
        if who == "host":
            kind, seq = hosts[r].pop(0)
            posted[r] = seq if kind == "announce" else posted[r]
            streams[r].append(({"announce": "ready", "send": "copy", "await": "await"}[kind], seq))
        else:
            kind, seq = streams[r].pop(0)
            if kind == "ready":
                ready[1 - r] = max(ready[1 - r], seq)
            elif kind == "copy":
                arrived[1 - r] = seq
                got[1 - r].append(seq)
    return got


def _planned(groups: list[list[str]], steps_of: Callable[..., list[Step]]) -> list[tuple[str, int]]:
    """A rank's steps over all its groups; numbers continue across groups, as a
    communicator's counts do."""
    out: list[tuple[str, int]] = []
    sent = received = 0
    for group in groups:
        out += [(kind, seq) for kind, _, seq in steps_of(group, sent, received)]
        sent += group.count("send")
        received += group.count("recv")
    return out


def in_posting_order(ops: list[str], sent: int, received: int) -> list[Step]:
    """Each op as it comes, its receive's wait right after it."""
    steps: list[Step] = []
    for i, op in enumerate(ops):
        if op == "recv":
            received += 1
            steps += [("announce", i, received), ("await", i, received)]
        else:
            sent += 1
            steps.append(("send", i, sent))
    return steps


@st.composite
def matched_groups(draw: st.DrawFn) -> dict[int, list[list[str]]]:
    """What NCCL can finish, in the two shapes it allows: exchanges (each rank's group k
    pairs with the peer's group k, each side ordering its ops as it likes), or one way
    (rank 0 sends, rank 1 receives, each cutting its ops into groups of its own)."""
    if draw(st.booleans()):
        out: dict[int, list[list[str]]] = {0: [], 1: []}
        for _ in range(draw(st.integers(1, 4))):
            a, b = draw(st.integers(0, 3)), draw(st.integers(0, 3))
            out[0].append(draw(st.permutations(["send"] * a + ["recv"] * b)))
            out[1].append(draw(st.permutations(["send"] * b + ["recv"] * a)))
        return out
    n = draw(st.integers(1, 8))

    def cut(op: str) -> list[list[str]]:
        points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        return [[op] * (j - i) for i, j in zip([0, *points], [*points, n])]

    return {0: cut("send"), 1: cut("recv")}


@settings(max_examples=300, deadline=None)
@given(matched_groups(), st.randoms(use_true_random=False))
def test_groups_nccl_can_finish_finish_here_each_receive_with_its_own_send(
        groups: dict[int, list[list[str]]], rnd: Any) -> None:
    """Whatever the groups and the interleaving of both hosts and both GPUs: every
    receive gets exactly the send of its number, and nothing waits forever."""
    got = run_pair(groups, group_steps, lambda n: rnd.randrange(n))
    assert got is not None, f"deadlock: {groups}"
    for r in (0, 1):
        expected = sum(op == "recv" for g in groups[r] for op in g)
        assert got[r] == list(range(1, expected + 1))


def test_an_exchange_in_one_group_needs_the_receives_announced_first() -> None:
    """Both ranks post [send, recv] as one group, as the warm-up does: with each op in
    posting order both hosts wait for a descriptor the other never writes."""
    groups = {0: [["send", "recv"]], 1: [["send", "recv"]]}
    assert run_pair(groups, group_steps, lambda n: 0) == {0: [1], 1: [1]}
    assert run_pair(groups, in_posting_order, lambda n: 0) is None


def test_a_block_receive_names_its_transfer_and_a_send_for_another_is_refused() -> None:
    """Sends and receives pair by number. A fault in the order of posts would pair a send
    with another transfer's receive; of the same size, that request's blocks would hold
    the other's KV with no error. The receive names its transfer, and such a send is
    refused, naming the peer and the receive."""
    box = page()
    mine, other = transfer_tag("req-1"), transfer_tag("req-2")
    assert len(mine) == 64 and mine != other and mine == transfer_tag("req-1") and UNTAGGED not in (mine, other)
    box.post(1, Descriptor(5, mine, 2, 8 * 4096, kind=BLOCKS, count=8))
    desc = box.take(1, 5)
    assert desc is not None and desc.handle == mine
    assert pairing_error("d0:0", desc, 8, mine) is None
    crossed = pairing_error("d0:0", desc, 8, other)
    assert crossed is not None and "d0:0's receive 5 is for another transfer" in crossed
    assert pairing_error("d0:0", desc, 8, UNTAGGED) == crossed
    sized = pairing_error("d0:0", desc, 7, mine)
    assert sized is not None and "takes 8 blocks, but this send is a staged transfer of 7 blocks" in sized
    into_buffer = Descriptor(6, handle(6), 0, 4096)
    wrong_kind = pairing_error("d0:0", into_buffer, 1, mine)
    assert wrong_kind is not None and "takes 4096 bytes into a buffer" in wrong_kind


@given(st.text(max_size=40), st.text(max_size=40))
def test_two_transfer_ids_share_a_tag_only_when_equal(a: str, b: str) -> None:
    assert (transfer_tag(a) == transfer_tag(b)) == (a == b)


def test_the_sender_sees_its_next_block_receive_without_waiting_and_nothing_once_closed() -> None:
    """`IpcCommunicator.next_block_receive`, the producer's look for a receive posted before
    the Go (`NcclLink.watch_receive`), over a real page: only a BLOCKS receive for the
    next send counts; it never waits, not even for a post holding the communicator."""
    import threading
    from types import SimpleNamespace

    from workers.transports.cuda_ipc import IpcCommunicator

    box = page()
    comm = IpcCommunicator.__new__(IpcCommunicator)  # the host half only: no GPU, no peer
    comm.lock, comm.closed, comm.sent, comm.out, comm.page = threading.RLock(), False, 3, 0, SimpleNamespace(box=box)
    comm.peer = "d0:0"
    assert comm.next_block_receive() is None  # nothing posted
    box.post(0, Descriptor(4, UNTAGGED, 0, 4096, 0x7F00_0000_0000))
    assert comm.next_block_receive() is None  # a receive of bytes: its Go sends it
    box.consume(0, 4)
    comm.sent = 4
    box.post(0, Descriptor(6, transfer_tag("t6"), 1, 8192, kind=BLOCKS, count=2))
    assert comm.next_block_receive() is None  # receive 6 is not the next send's (5)
    box.post(0, Descriptor(5, transfer_tag("t5"), 1, 8192, kind=BLOCKS, count=2))
    assert comm.next_block_receive() == (5, transfer_tag("t5"), 8192)
    held, release = threading.Event(), threading.Event()

    def post_under_way() -> None:
        with comm.lock:
            held.set()
            release.wait(10)

    poster = threading.Thread(target=post_under_way)
    poster.start()
    try:
        assert held.wait(10)
        with pytest.raises(BlockingIOError):  # busy: looked at again soon, not waited for
            comm.next_block_receive()
    finally:
        release.set()
        poster.join(10)
    assert comm.next_block_receive() == (5, transfer_tag("t5"), 8192)
    comm.closed = True
    assert comm.next_block_receive() is None
