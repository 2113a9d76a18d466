"""The shared page two workers on one host use to pair CUDA IPC sends with receives.

Plain code over a writable buffer (a shared-memory file in production, a bytearray in
tests); `workers.transports.cuda_ipc` maps it into both processes. Only hosts read and
write it: the counters the GPUs wait on live in GPU memory (`cuda_ipc`), because a GPU
reading host memory here cost about 8 us a read (measured on an H200 pair in a VM).

It holds:

* for each rank, where its GPU counters are (`Counters`): the IPC handle of their
  allocation, their offset in it, and the process and device they live in, and the
  token of its bell (`workers.transports.bell`: the peer rings it once it posted a
  receive straight into its blocks), written before the rendezvous answer, read after it;
* a dead flag: set by a side that gave up, so the peer's host stops waiting for it;
* for each direction (rank 0 to 1, rank 1 to 0):
  - a ring of receive descriptors the receiver's host writes: for receive number `seq`
    (1, 2, ...), the IPC handle of the allocation its bytes lie in, their offset in it,
    and their length; the sender's host reads descriptor `seq` for its send number
    `seq`. NCCL pairs by posting order; so does this;
  - `consumed`, written by the sender's host once it has read descriptor `seq`, so the
    receiver may reuse that slot;
  - the receiver's layer table (`LayerTable`): where each layer of its paged KV cache
    lies (IPC handle, offset) and the cache's shape, written once before the first
    receive straight into its blocks (`Descriptor.kind` BLOCKS). Such a receive's block
    ids do not pass through here: the receiver's GPU copies them into the sender's
    GPU memory (`cuda_ipc`).

Torn reads: the host writes a descriptor with plain stores, which another CPU may see
in any order; each slot carries a hash of its fields, and a reader that finds the hash
wrong treats the slot as not yet written and looks again. Words (the dead flag,
`consumed`) are read and written whole.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BLOCKS", "BYTES", "HANDLE_BYTES", "MAGIC", "MAX_LAYERS", "SLOTS", "UNTAGGED", "Counters", "Descriptor",
    "LayerTable", "Mailbox", "MailboxError", "Step", "group_steps", "pairing_error", "transfer_tag",
]

MAGIC = 0x6B76_6270_6970_6334  # "kvbpipc4"
SLOTS = 256
HANDLE_BYTES = 64  # a CUipcMemHandle
MAX_LAYERS = 512  # layers a layer table holds
BYTES, BLOCKS = 0, 1  # what a receive takes: a byte range, or whole blocks of the paged cache

_PAGE = 4096
_SLOT = 128
_HEADER = struct.Struct("<QQQ")  # magic, slots, dead
_FIELDS = struct.Struct("<QQQQQQ")  # seq, offset, nbytes, base, kind, count
_FIELDS_AT = 72  # a slot: the handle at 0, then `_FIELDS`, then the digest
_TABLE_HEAD = struct.Struct("<QQQQQ")  # version, layers, cache blocks, rows a block, row bytes
_TABLE_ENTRY = struct.Struct("<QQ")  # offset, base (after the handle)
_TABLE_SIZE = _PAGE + MAX_LAYERS * (HANDLE_BYTES + _TABLE_ENTRY.size)
_PEER = struct.Struct("<QQQQQQ")  # offset, set, process token, device ordinal, base, bell token
_DEAD_AT = 16  # the header's dead word
_FLAGS_AT = 64  # where each rank's GPU counters are: a handle, then `_PEER`
_FLAGS_SIZE = 128  # a rank's share of that
_DIRECTION = _PAGE + SLOTS * _SLOT + _TABLE_SIZE


class MailboxError(RuntimeError):
    """The shared page is not a mailbox of this version, or a receive has no free slot."""


@dataclass(frozen=True)
class Descriptor:
    """Where receive `seq` wants its bytes: `offset` bytes into the allocation `handle`
    (which lies at `base` in the receiver's process: a sender in that same process uses
    it as it is, since CUDA cannot open a handle in the process that made it).

    A BLOCKS receive takes `count` whole blocks (`nbytes` in all) straight into the
    receiver's paged cache, as its layer table of version `offset` describes; its block
    ids are in the sender's GPU memory by the time the sender's GPU sees `ready`. Its
    `handle` (no allocation to name) is the transfer's tag (`transfer_tag`), which the
    sender checks against its own send's (`pairing_error`)."""

    seq: int
    handle: bytes
    offset: int
    nbytes: int
    base: int = 0
    kind: int = BYTES
    count: int = 0


@dataclass(frozen=True)
class LayerTable:
    """Where a receiver's paged KV cache lies, for a sender that writes straight into its
    blocks: each layer's allocation (IPC handle), the layer's offset in it and the
    allocation's address in the receiver's process (`entries`), and the cache's shape,
    which must match the sender's staging (`rows_per_block` rows of `row_nbytes` for
    each layer of a block). `version` rises with each table a receiver publishes."""

    version: int
    num_blocks: int
    rows_per_block: int
    row_nbytes: int
    entries: tuple[tuple[bytes, int, int], ...]


@dataclass(frozen=True)
class Counters:
    """Where a rank's GPU counters are: `offset` bytes into the allocation `handle`,
    which lies at `base` in the process named `process` (a random token, since process
    ids repeat across containers), on its device `ordinal`; and the token of the rank's
    bell (`workers.transports.bell`), 0 for none."""

    handle: bytes
    offset: int
    process: int
    ordinal: int
    base: int
    bell: int = 0


UNTAGGED = bytes(HANDLE_BYTES)  # a BLOCKS receive or send that names no transfer


def transfer_tag(transfer_id: str) -> bytes:
    """What a BLOCKS descriptor names its transfer by: a digest of its id, as long as the
    handle field it takes (which such a receive leaves unused)."""
    return hashlib.blake2b(transfer_id.encode(), digest_size=HANDLE_BYTES, person=b"kvb-transfer").digest()


def pairing_error(peer: str, desc: Descriptor, num_blocks: int, tag: bytes) -> str | None:
    """Why send number `desc.seq`, a staged transfer of `num_blocks` blocks tagged `tag`,
    must not go into `peer`'s receive `desc`; None when they pair.

    Sends and receives pair by their numbers. A fault in the order both sides post them
    in would pair a send with another transfer's receive: of another size, or of the same
    size, whose blocks would then hold the wrong request's KV with no error. The tag
    turns that case into a refused send."""
    if desc.kind != BLOCKS or desc.count != num_blocks:
        what = f"{desc.count} blocks" if desc.kind == BLOCKS else f"{desc.nbytes} bytes into a buffer"
        return (f"{peer}'s receive {desc.seq} takes {what}, but this send is a staged transfer of {num_blocks} "
                "blocks: both sides must post the same transfers in the same order.")
    if desc.handle != tag:
        return (f"{peer}'s receive {desc.seq} is for another transfer than this send of {num_blocks} blocks: both "
                "sides must post the same transfers in the same order.")
    return None


def _digest(fields: bytes, handle: bytes) -> bytes:
    return hashlib.blake2b(fields + handle, digest_size=8).digest()


class Mailbox:
    """The two directions' rings and counters over `buf` (at least `Mailbox.SIZE` bytes)."""

    SIZE = _PAGE + 2 * _DIRECTION

    def __init__(self, buf: memoryview | bytearray) -> None:
        view = memoryview(buf).cast("B")
        if len(view) < self.SIZE:
            raise MailboxError(f"a mailbox needs {self.SIZE} bytes, not {len(view)}.")
        self.buf = view
        # Counters are read and written as whole aligned 64-bit words: `struct` writes a
        # word byte by byte, and a reader on another CPU then saw a count go back.
        self._words = {at: ctypes.c_uint64.from_buffer(view, at)
                       for at in (_DEAD_AT, self._consumed(0), self._consumed(1))}

    def release(self) -> None:
        """Let go of the buffer (a mapping can only be closed once nothing views it)."""
        self._words.clear()
        self.buf.release()

    # -- the page as a whole ------------------------------------------------------------

    def init(self) -> None:
        """Write the header of a new mailbox (the file is zero, so every count starts at 0)."""
        _HEADER.pack_into(self.buf, 0, MAGIC, SLOTS, 0)

    def check(self) -> None:
        """Raise unless the page holds a mailbox of this layout."""
        magic, slots, _ = _HEADER.unpack_from(self.buf, 0)
        if magic != MAGIC or slots != SLOTS:
            raise MailboxError("the shared page is not a kvbroker IPC mailbox of this version; "
                               "run the same kvbroker version on both sides.")

    @property
    def dead(self) -> bool:
        """Whether either side aborted the communicator."""
        return bool(self._words[_DEAD_AT].value)

    def abort(self) -> None:
        """One side gave up: the peer's host stops waiting for its descriptors."""
        self._words[_DEAD_AT].value = 1

    # -- where each rank's GPU counters are ---------------------------------------------

    def publish_flags(self, rank: int, where: Counters) -> None:
        """Say where rank `rank`'s GPU counters are."""
        if rank not in (0, 1) or len(where.handle) != HANDLE_BYTES:
            raise ValueError(f"bad counters for rank {rank}")
        at = _FLAGS_AT + rank * _FLAGS_SIZE
        self.buf[at : at + HANDLE_BYTES] = where.handle
        _PEER.pack_into(self.buf, at + HANDLE_BYTES, where.offset, 1, where.process, where.ordinal, where.base,
                        where.bell)

    def flags_of(self, rank: int) -> Counters | None:
        """Where rank `rank`'s GPU counters are, once it said so."""
        at = _FLAGS_AT + rank * _FLAGS_SIZE
        offset, is_set, process, ordinal, base, bell = _PEER.unpack_from(self.buf, at + HANDLE_BYTES)
        if not is_set:
            return None
        return Counters(bytes(self.buf[at : at + HANDLE_BYTES]), offset, process, ordinal, base, bell)

    # -- consumed ---------------------------------------------------------------------

    @staticmethod
    def _consumed(direction: int) -> int:
        if direction not in (0, 1):
            raise ValueError(f"direction is 0 or 1, not {direction}")
        return _PAGE + direction * _DIRECTION

    def consumed(self, direction: int) -> int:
        """The last descriptor the sender in `direction` has read."""
        return int(self._words[self._consumed(direction)].value)

    # -- descriptors ------------------------------------------------------------------

    @staticmethod
    def _slot(direction: int, seq: int) -> int:
        return _PAGE + direction * _DIRECTION + _PAGE + (seq % SLOTS) * _SLOT

    def room(self, direction: int, seq: int) -> bool:
        """Whether receive `seq` has a free slot: the sender read the descriptor that
        last used it."""
        return seq - self.consumed(direction) <= SLOTS

    def post(self, direction: int, desc: Descriptor) -> None:
        """Write receive `desc.seq`'s descriptor (receiver's host).

        Raises:
            MailboxError: its slot still holds a descriptor the sender has not read.
            ValueError: a handle of the wrong size, or a negative offset or length.
        """
        if len(desc.handle) != HANDLE_BYTES:
            raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes, not {len(desc.handle)}")
        if min(desc.seq - 1, desc.offset, desc.nbytes, desc.base, desc.count) < 0 or desc.kind not in (BYTES, BLOCKS):
            raise ValueError(f"bad descriptor {desc}")
        if not self.room(direction, desc.seq):
            raise MailboxError(f"receive {desc.seq} has no free slot: the sender is {SLOTS} receives behind.")
        fields = _FIELDS.pack(desc.seq, desc.offset, desc.nbytes, desc.base, desc.kind, desc.count)
        at = self._slot(direction, desc.seq)
        end = at + _FIELDS_AT + _FIELDS.size
        self.buf[at : at + HANDLE_BYTES] = desc.handle
        self.buf[at + _FIELDS_AT : end] = fields
        self.buf[end : end + 8] = _digest(fields, desc.handle)

    def take(self, direction: int, seq: int) -> Descriptor | None:
        """Descriptor `seq` if the receiver has written it whole, else None (sender's host)."""
        at = self._slot(direction, seq)
        raw = bytes(self.buf[at : at + _FIELDS_AT + _FIELDS.size + 8])
        handle, fields, digest = raw[:HANDLE_BYTES], raw[_FIELDS_AT:-8], raw[-8:]
        got_seq, offset, nbytes, base, kind, count = _FIELDS.unpack(fields)
        if got_seq != seq or digest != _digest(fields, handle):
            return None
        return Descriptor(seq, handle, offset, nbytes, base, kind, count)

    def consume(self, direction: int, seq: int) -> None:
        """The sender has read descriptor `seq`: its slot may be reused."""
        self._words[self._consumed(direction)].value = seq

    # -- the receiver's layer table -------------------------------------------------------

    @staticmethod
    def _table(direction: int) -> int:
        return _PAGE + direction * _DIRECTION + _PAGE + SLOTS * _SLOT

    def publish_layers(self, direction: int, table: LayerTable) -> None:
        """Write the receiver's layer table for `direction` (receiver's host), before the
        descriptor of the first receive that names its version.

        Raises:
            ValueError: more layers than `MAX_LAYERS`, a handle of the wrong size, or a
                version that does not rise.
        """
        if not 0 < len(table.entries) <= MAX_LAYERS:
            raise ValueError(f"a layer table holds 1 to {MAX_LAYERS} layers, not {len(table.entries)}.")
        if any(len(h) != HANDLE_BYTES for h, _, _ in table.entries):
            raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes")
        old = self.layers(direction)
        if table.version < 1 or (old is not None and table.version <= old.version):
            raise ValueError(f"layer table version {table.version} must be at least 1 and rise")
        at = self._table(direction)
        body = bytearray()
        for handle, offset, base in table.entries:
            body += handle + _TABLE_ENTRY.pack(offset, base)
        head = _TABLE_HEAD.pack(table.version, len(table.entries), table.num_blocks, table.rows_per_block,
                                table.row_nbytes)
        self.buf[at + _PAGE : at + _PAGE + len(body)] = body
        self.buf[at : at + _TABLE_HEAD.size] = head
        self.buf[at + _TABLE_HEAD.size : at + _TABLE_HEAD.size + 8] = _digest(head, bytes(body))

    def layers(self, direction: int) -> LayerTable | None:
        """The receiver's layer table for `direction`, if one was written whole."""
        at = self._table(direction)
        head = bytes(self.buf[at : at + _TABLE_HEAD.size])
        version, n, num_blocks, rows, row_nbytes = _TABLE_HEAD.unpack(head)
        if version == 0 or not 0 < n <= MAX_LAYERS:
            return None
        step = HANDLE_BYTES + _TABLE_ENTRY.size
        body = bytes(self.buf[at + _PAGE : at + _PAGE + n * step])
        if bytes(self.buf[at + _TABLE_HEAD.size : at + _TABLE_HEAD.size + 8]) != _digest(head, body):
            return None
        entries = []
        for k in range(n):
            e = body[k * step : (k + 1) * step]
            offset, base = _TABLE_ENTRY.unpack(e[HANDLE_BYTES:])
            entries.append((e[:HANDLE_BYTES], offset, base))
        return LayerTable(version, num_blocks, rows, row_nbytes, tuple(entries))


# -- the order of one group's steps -------------------------------------------------------

Step = tuple[Literal["announce", "send", "await"], int, int]  # what, the op's place in its group, its number


def group_steps(ops: Sequence[Literal["send", "recv"]], sent: int, received: int) -> list[Step]:
    """The steps one group of ops is enqueued as, after `sent` sends and `received`
    receives on the same communicator.

    Every receive is announced first (its descriptor, and its `ready` on this side's
    stream), then every send runs (its host waits for the peer's descriptor, its kernel
    for the peer's `ready`), then every receive's stream waits for its `arrived`. NCCL
    lets the two sides of an exchange post one group each in any order; so does this:
    neither side's send then waits on a receive its peer has queued behind a wait of
    its own.
    """
    steps: list[Step] = []
    waits: list[Step] = []
    for i, op in enumerate(ops):
        if op == "recv":
            received += 1
            steps.append(("announce", i, received))
            waits.append(("await", i, received))
    for i, op in enumerate(ops):
        if op == "send":
            sent += 1
            steps.append(("send", i, sent))
    return steps + waits
