"""A byte pool carved out of one preallocated tensor.

Theory of operation
-------------------
A decode worker receives KV straight into pool memory, and a prefill worker stages
KV there until the decode side confirms; both need many short-lived, variably sized
buffers without asking the allocator (or the CUDA caching allocator) each time, and
without ever handing out more memory than the broker granted as credit. So the pool
owns ONE uint8 tensor, allocated once, and leases out byte ranges of it.

* Ranges are rounded up to `alignment` bytes, so every lease starts aligned and can be
  viewed as any dtype up to that alignment (and is friendly to DMA and NCCL).
* Free space is a list of ``(offset, size)`` ranges kept sorted by offset. Allocation
  is best-fit (the smallest free range that fits, lowest offset on ties), taken from
  the low end of that range; release re-inserts the range and merges it with its free
  neighbours. So free ranges are never adjacent, freeing everything always gives back
  one range of `capacity` bytes, and fragmentation stays bounded in practice (see the
  fragmentation test for measured figures).
* ``reserved + free == capacity`` holds after every call, faults included: it is the
  credit invariant the broker relies on.

Waiting and fairness
--------------------
`acquire()` waits until room frees up. Waiters are served strictly FIFO, and room
is *handed over* to the head waiter inside `release()`, under the lock, so no later
caller can take it first. `acquire_nowait()` does not barge past waiters either: while
anyone waits it raises `PoolExhausted`. Without that, a stream of small requests
could starve a large one forever.

Threads
-------
All state sits behind one `threading.Lock`, so `acquire_nowait()`, `release()` and
`statistics()` may be called from any thread (the transport's worker thread, the
client's event loop thread). `acquire()` runs in an anyio event loop (asyncio or trio).
When a waiter is created it captures its loop's native token; `release()` on another
thread wakes it with ``loop.call_soon_threadsafe`` (asyncio) or
``TrioToken.run_sync_soon`` (trio), which never block the releasing thread, and on the
waiter's own thread it sets the event directly. If the waiter's loop has already
finished, the handed-over room is taken back at once, so nothing leaks.

A cancelled `acquire()` leaves no reservation: either it was still queued (it leaves
the queue, which may let the next waiter in) or room had been handed to it (it is
released again).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass
from math import prod
from types import TracebackType

import anyio
import anyio.lowlevel
import torch

from protocols.errors import KvBrokerError
from workers.waker import make_waker

__all__ = [
    "BufferPool",
    "InvalidRelease",
    "Lease",
    "PoolError",
    "PoolExhausted",
    "PoolStats",
    "PoolTooSmall",
]


class PoolError(KvBrokerError):
    """Base of the buffer pool's errors."""


class PoolExhausted(PoolError, anyio.WouldBlock):
    """No contiguous room now; `acquire()` would have waited."""


class PoolTooSmall(PoolError, ValueError):
    """The request can never fit, however much is released."""


class InvalidRelease(PoolError, RuntimeError):
    """A lease was released twice, or released to a pool that does not own it."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool, taken under its lock.

    `reserved` counts rounded (aligned) sizes, so ``reserved + free == capacity``.
    """

    capacity: int
    reserved: int
    free: int
    largest_free: int
    leases: int
    waiting: int


class Lease:
    """A byte range of a pool, held until `release()`.

    `tensor` is a uint8 view of exactly `nbytes` pool bytes: no copy. Using it after
    release is a bug the pool cannot detect, as with any allocator.
    """

    __slots__ = ("_pool", "offset", "nbytes", "reserved", "_tensor", "_released")

    def __init__(self, pool: BufferPool, offset: int, nbytes: int, reserved: int) -> None:
        self._pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.reserved = reserved
        self._tensor: torch.Tensor | None = None
        self._released = False

    @property
    def tensor(self) -> torch.Tensor:
        # Made on first use: a GPU transfer addresses its lease as `base` + `offset`
        # and never needs the view (a slice costs host time on its critical path).
        if self._tensor is None:
            self._tensor = self._pool.tensor[self.offset : self.offset + self.nbytes]
        return self._tensor

    @property
    def base(self) -> torch.Tensor:
        """The whole pool's uint8 tensor; this lease is bytes ``[offset, offset + nbytes)`` of it."""
        return self._pool.tensor

    @property
    def released(self) -> bool:
        return self._released

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        """View the first ``prod(shape) * itemsize`` bytes as `dtype` with `shape`, no copy.

        Raises:
            ValueError: the shape needs more bytes than the lease holds.
        """
        need = prod(shape) * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(
                f"a {tuple(shape)} {dtype} view needs {need} B but the lease holds "
                f"{self.nbytes} B; acquire a larger lease."
            )
        return self.tensor[:need].view(dtype).view(tuple(shape))

    def release(self) -> None:
        self._pool.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.release(self)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Lease offset={self.offset} nbytes={self.nbytes} {state}>"


class _Waiter:
    __slots__ = ("nbytes", "size", "event", "wake", "lease", "settled")

    def __init__(self, nbytes: int, size: int) -> None:
        self.nbytes = nbytes
        self.size = size
        self.event = anyio.Event()
        self.wake = make_waker(self.event)
        self.lease: Lease | None = None
        # Set once the waiting task (or the pool, when that task's loop is gone) owns
        # the outcome; after that the pool never touches this waiter again.
        self.settled = False


class BufferPool:
    """Leases aligned byte ranges of one preallocated uint8 tensor.

    Args:
        capacity: bytes in the pool; a multiple of `alignment`.
        alignment: every lease starts at a multiple of this (a power of two).
        device: where the tensor lives ("cpu", "cuda:0", ...).
        pin_memory: page-lock a CPU pool so device copies from it can be asynchronous.

    Raises:
        ValueError: a bad capacity or alignment.
    """

    def __init__(
        self,
        capacity: int,
        *,
        alignment: int = 256,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"pool alignment must be a power of two, not {alignment}.")
        if capacity <= 0 or capacity % alignment:
            raise ValueError(
                f"pool capacity must be a positive multiple of the {alignment} B "
                f"alignment, not {capacity} B."
            )
        self.capacity = capacity
        self.alignment = alignment
        self.tensor = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted by offset
        self._leases: dict[int, Lease] = {}  # offset -> live lease
        self._reserved = 0
        # One entry per blocked task, so its length is bounded by the caller's concurrency.
        self._waiters: deque[_Waiter] = deque()

    # -- public API ------------------------------------------------------------------

    def acquire_nowait(self, nbytes: int) -> Lease:
        """Lease `nbytes` contiguous bytes now.

        Raises:
            PoolTooSmall: `nbytes` exceeds the capacity; waiting cannot help.
            PoolExhausted: no room now, or others are already waiting (FIFO).
            ValueError: `nbytes` is not positive.
        State after an error: unchanged.
        """
        size = self.size_for(nbytes)
        with self._lock:
            lease = None if self._waiters else self._allocate_locked(nbytes, size)
            if lease is None:
                raise PoolExhausted(self._exhausted_message_locked(size))
            return lease

    async def acquire(self, nbytes: int) -> Lease:
        """Lease `nbytes` contiguous bytes, waiting (FIFO) until they are free.

        Takes no timeout: wrap it in ``anyio.fail_after``. Cancelled, it leaves no
        reservation behind.

        Raises:
            PoolTooSmall: `nbytes` exceeds the capacity (raised at once, no wait).
            ValueError: `nbytes` is not positive.
        """
        size = self.size_for(nbytes)
        await anyio.lowlevel.checkpoint_if_cancelled()
        with self._lock:
            lease = None if self._waiters else self._allocate_locked(nbytes, size)
            if lease is None:
                waiter = _Waiter(nbytes, size)
                self._waiters.append(waiter)
        if lease is not None:
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return lease
        try:
            await waiter.event.wait()
        except BaseException:
            self._abandon(waiter)
            raise
        with self._lock:
            waiter.settled = True
            lease = waiter.lease
        if lease is None:  # the pool took it back because our loop looked finished
            raise PoolError("the pool reclaimed a lease whose waiting task could not be woken.")
        return lease

    def release(self, lease: Lease) -> None:
        """Give a lease's bytes back; the head waiters get them if they now fit.

        Raises:
            InvalidRelease: the lease was already released, or belongs to another pool.
        State after an error: unchanged.
        """
        with self._lock:
            self._release_locked(lease)
            woken = self._serve_waiters_locked()
        self._wake(woken)

    def split(self, lease: Lease, sizes: list[int]) -> list[Lease]:
        """Cut a held lease into adjacent leases of `sizes` bytes, each released on its
        own; `lease` itself is then spent. The last one keeps whatever the cut leaves
        of the reservation. One lease cut up gives requests staged together adjacent
        bytes, so a copy can cover them all at once.

        Raises:
            ValueError: a size is not positive, one before the last is not a multiple of
                the alignment, or they add up to more than `lease.nbytes`.
            InvalidRelease: the lease is not held from this pool.
        State after an error: unchanged.
        """
        if not sizes or any(n <= 0 for n in sizes) or any(n % self.alignment for n in sizes[:-1]):
            raise ValueError(
                f"split sizes must be positive, and multiples of the pool's alignment ({self.alignment} B) "
                f"but for the last; got {sizes}."
            )
        if sum(sizes) > lease.nbytes:
            raise ValueError(f"split sizes add up to {sum(sizes)} B, more than the lease's {lease.nbytes} B.")
        with self._lock:
            if lease._pool is not self or self._leases.get(lease.offset) is not lease:
                raise InvalidRelease(f"{lease!r} is not held from this pool; only a held lease can be split.")
            del self._leases[lease.offset]
            lease._released = True
            parts, at = [], lease.offset
            for k, n in enumerate(sizes):
                reserved = n if k < len(sizes) - 1 else lease.offset + lease.reserved - at
                part = Lease(self, at, n, reserved)
                self._leases[at] = part
                parts.append(part)
                at += n
            return parts

    def statistics(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                capacity=self.capacity,
                reserved=self._reserved,
                free=self.capacity - self._reserved,
                largest_free=max((size for _, size in self._free), default=0),
                leases=len(self._leases),
                waiting=len(self._waiters),
            )

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ``(offset, size)`` ranges, sorted by offset (for tests and debugging)."""
        with self._lock:
            return list(self._free)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<BufferPool capacity={s.capacity} reserved={s.reserved} "
            f"leases={s.leases} waiting={s.waiting} device={self.tensor.device}>"
        )

    def size_for(self, nbytes: int) -> int:
        """The bytes a lease of `nbytes` takes: rounded up to the alignment.

        Raises:
            PoolTooSmall: that exceeds the capacity. ValueError: `nbytes` is not positive.
        """
        if nbytes <= 0:
            raise ValueError(f"a lease needs a positive number of bytes, not {nbytes}.")
        size = -(-nbytes // self.alignment) * self.alignment
        if size > self.capacity:
            raise PoolTooSmall(
                f"the pool holds {self.capacity} B but {nbytes} B were asked "
                f"({size} B aligned); raise the pool capacity or transfer fewer blocks at once."
            )
        return size

    # -- internals -------------------------------------------------------------------

    def _exhausted_message_locked(self, size: int) -> str:
        largest = max((s for _, s in self._free), default=0)
        return (
            f"no contiguous {size} B free now in the {self.capacity} B pool "
            f"({self.capacity - self._reserved} B free, largest free range {largest} B, "
            f"{len(self._leases)} leases, {len(self._waiters)} waiting); "
            f"await acquire() or release leases."
        )

    def _allocate_locked(self, nbytes: int, size: int) -> Lease | None:
        best = -1
        best_size = self.capacity + 1
        for i, (_, free_size) in enumerate(self._free):
            if size <= free_size < best_size:
                best, best_size = i, free_size
                if free_size == size:
                    break
        if best < 0:
            return None
        offset, free_size = self._free[best]
        if free_size == size:
            del self._free[best]
        else:
            self._free[best] = (offset + size, free_size - size)
        self._reserved += size
        lease = Lease(self, offset, nbytes, size)
        self._leases[offset] = lease
        return lease

    def _release_locked(self, lease: Lease) -> None:
        if lease._pool is not self:
            raise InvalidRelease(f"{lease!r} belongs to another pool; release it there.")
        if self._leases.get(lease.offset) is not lease:
            raise InvalidRelease(
                f"{lease!r} was already released; each lease must be released exactly once."
            )
        del self._leases[lease.offset]
        lease._released = True
        self._reserved -= lease.reserved
        start, end = lease.offset, lease.offset + lease.reserved
        i = bisect.bisect_left(self._free, start, key=lambda r: r[0])
        if i > 0 and sum(self._free[i - 1]) == start:
            i -= 1
            start = self._free[i][0]
            del self._free[i]
        if i < len(self._free) and self._free[i][0] == end:
            end = sum(self._free[i])
            del self._free[i]
        self._free.insert(i, (start, end - start))

    def _serve_waiters_locked(self) -> list[_Waiter]:
        woken: list[_Waiter] = []
        while self._waiters:
            head = self._waiters[0]
            lease = self._allocate_locked(head.nbytes, head.size)
            if lease is None:
                break
            self._waiters.popleft()
            head.lease = lease
            woken.append(head)
        return woken

    def _wake(self, woken: list[_Waiter]) -> None:
        for waiter in woken:
            try:
                waiter.wake()
            except (RuntimeError, anyio.RunFinishedError):
                # The waiter's event loop is gone, so it will never claim its room.
                with self._lock:
                    lease, waiter.lease = waiter.lease, None
                    if waiter.settled or lease is None:
                        continue
                    waiter.settled = True
                    self._release_locked(lease)
                    more = self._serve_waiters_locked()
                self._wake(more)

    def _abandon(self, waiter: _Waiter) -> None:
        """Undo a waiter whose task was cancelled: dequeue it or give its room back."""
        with self._lock:
            if waiter.settled:  # the pool already took its room back
                return
            waiter.settled = True
            lease, waiter.lease = waiter.lease, None
            if lease is not None:
                self._release_locked(lease)
            else:
                self._waiters.remove(waiter)
            woken = self._serve_waiters_locked()
        self._wake(woken)
