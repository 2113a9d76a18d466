"""The ipc backend's shared page, without a GPU: how receives and sends pair through it,
what a torn or stale slot reads as, and what an abort leaves; and its rendezvous payload.

The GPU half (the copy kernel, the stream waits, abort under a live transfer) runs in
tests/gpu over the same page; these tests pin the host logic it relies on."""

from __future__ import annotations

import json
import mmap
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.errors import RendezvousError
from workers.transports.ipc_mailbox import (
    SLOTS,
    Counters,
    Descriptor,
    Mailbox,
    MailboxError,
)
from workers.transports.nccl_setup import (
    IPC_PAGE_PREFIX,
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


def test_an_abort_marks_the_page_dead_and_counters_are_found_where_published() -> None:
    box = page()
    assert box.flags_of(0) is None and box.flags_of(1) is None
    box.publish_flags(1, Counters(handle(5), 4096, 4242, 1, 0x7F00_0000_0000))
    assert box.flags_of(1) == Counters(handle(5), 4096, 4242, 1, 0x7F00_0000_0000) and box.flags_of(0) is None
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
    info = parse_payload(json.dumps({"v": 3, "backend": "ipc", "page": page_path, "boot": "b-1", "nonce": "n",
                                     "for": "t1"}).encode())
    assert info == {"backend": "ipc", "page": page_path, "boot": "b-1", "nonce": "n", "for": "t1"}
    for bad in ("/etc/passwd", os.path.join(SHM_DIR, "other"), f"{SHM_DIR}/../tmp/{IPC_PAGE_PREFIX}x", 7):
        with pytest.raises(RendezvousError, match="unusable"):
            parse_payload(json.dumps({"v": 3, "backend": "ipc", "page": bad, "boot": "b", "nonce": "n"}).encode())


def test_asking_for_ipc_without_a_cuda_driver_says_what_to_use() -> None:
    from workers.transports import cuda_ipc

    if cuda_ipc.driver() is not None:
        pytest.skip("this host has a CUDA driver")
    with pytest.raises(ValueError, match="ipc backend needs the CUDA driver"):
        resolve_backend("ipc")
