"""The few CUDA driver calls the ipc backend needs (libcuda, which any CUDA process has),
loaded once; and the host's boot id, which tells whether two workers share a host.

Its own module so that choosing a backend (`nccl_setup.resolve_backend`) can ask whether
the driver is there without importing the backend itself.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from .ipc_mailbox import HANDLE_BYTES

__all__ = ["CompiledKernel", "CudaDriver", "KernelLaunch", "boot_id", "driver", "driver_error"]

_WAIT_GEQ = 0x0
_LAZY_PEER_ACCESS = 0x1
_WORD_MASK = (1 << 64) - 1
_PLAIN_SHARED_BYTES = 228 * 1024  # beyond it Triton launches with an oversized-shared-memory attribute


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class CudaDriver:
    """The few CUDA driver calls this backend needs (libcuda, which any CUDA process has)."""

    def __init__(self, lib: ctypes.CDLL, kept: ctypes.PyDLL) -> None:
        u64, ptr, uint, vp = ctypes.c_uint64, ctypes.POINTER, ctypes.c_uint, ctypes.c_void_p
        self._fns: dict[str, Any] = {}
        # The calls a transfer's post makes (a context made current, a stream's wait or
        # write of a word, a copy of a few block ids) are bound through `kept`, which
        # keeps the GIL for the call, as `nccl_lib` binds its enqueues: each takes
        # microseconds, but a thread that lets go of the GIL for one may then wait for
        # another thread, a spinning poller or the engine's, to give it back. None of
        # them blocks: the others (IPC handles opened and closed) let go of it.
        # Kernel launches too (`KernelLaunch`): Triton's own launcher lets go of the GIL
        # around each, and the gathers launch one a layer from the engine's thread.
        held = {"cuCtxSetCurrent", "cuStreamWaitValue64", "cuStreamWriteValue64", "cuMemcpyAsync", "cuLaunchKernel",
                "cuFuncGetParamInfo"}
        for name, args, alts in (
            ("cuGetErrorString", [ctypes.c_int, ptr(ctypes.c_char_p)], ()),
            ("cuDeviceGet", [ptr(ctypes.c_int), ctypes.c_int], ()),
            ("cuDevicePrimaryCtxRetain", [ptr(vp), ctypes.c_int], ()),
            ("cuCtxSetCurrent", [vp], ()),
            ("cuCtxEnablePeerAccess", [vp, uint], ()),
            ("cuMemGetAddressRange", [ptr(u64), ptr(ctypes.c_size_t), u64], ("cuMemGetAddressRange_v2",)),
            ("cuIpcGetMemHandle", [ptr(_IpcHandle), u64], ()),
            ("cuIpcOpenMemHandle", [ptr(u64), _IpcHandle, uint], ("cuIpcOpenMemHandle_v2",)),
            ("cuIpcCloseMemHandle", [u64], ()),
            ("cuStreamWaitValue64", [vp, u64, u64, uint], ("cuStreamWaitValue64_v2",)),
            ("cuStreamWriteValue64", [vp, u64, u64, uint], ("cuStreamWriteValue64_v2",)),
            ("cuMemcpyAsync", [u64, u64, ctypes.c_size_t, vp], ()),
            ("cuLaunchKernel", [vp, uint, uint, uint, uint, uint, uint, uint, vp, vp, vp], ()),
            ("cuFuncGetParamInfo", [vp, ctypes.c_size_t, ptr(ctypes.c_size_t), ptr(ctypes.c_size_t)], ()),
        ):
            fn = None
            via = kept if name in held else lib
            for symbol in (*alts, name):  # the versioned symbol first: the plain one may be the old ABI
                fn = getattr(via, symbol, None)
                if fn is not None:
                    break
            if fn is None and name == "cuFuncGetParamInfo":  # CUDA 12.4 on: launches then go through Triton
                continue
            if fn is None:
                raise OSError(f"libcuda has no {name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[name] = fn

    def _call(self, name: str, *args: Any) -> None:
        rc = self._fns[name](*args)
        if rc:
            self.fail(name, rc)

    def fail(self, name: str, rc: int) -> None:
        """Raise the error `name` returned as `rc`."""
        text = ctypes.c_char_p()
        self._fns["cuGetErrorString"](rc, ctypes.byref(text))
        raise RuntimeError(f"{name} failed: CUDA error {rc} ({(text.value or b'?').decode()})")

    def primary_context(self, ordinal: int) -> int:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        return int(ctx.value or 0)

    def make_current(self, ctx: int) -> None:
        self._call("cuCtxSetCurrent", ctypes.c_void_p(ctx))

    def enable_peer_access(self, peer_ctx: int) -> None:
        """Let kernels of the current context reach the memory of `peer_ctx`'s device
        (one process driving both GPUs); already enabled is fine."""
        rc = self._fns["cuCtxEnablePeerAccess"](ctypes.c_void_p(peer_ctx), 0)
        if rc not in (0, 704):  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            self._call("cuCtxEnablePeerAccess", ctypes.c_void_p(peer_ctx), 0)

    def export(self, ptr: int) -> tuple[bytes, int, int]:
        """The IPC handle of the allocation holding `ptr`, `ptr`'s offset in it, and the
        allocation's address."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ptr)
        handle = _IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), base.value)
        # All 64 bytes: `.reserved` of a char array would stop at the first zero byte.
        return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES), ptr - base.value, base.value

    def open(self, handle: bytes) -> int:
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, HANDLE_BYTES)
        out = ctypes.c_uint64()
        self._call("cuIpcOpenMemHandle", ctypes.byref(out), h, _LAZY_PEER_ACCESS)
        return int(out.value)

    def close(self, dptr: int) -> None:
        self._call("cuIpcCloseMemHandle", dptr)

    def wait_value(self, stream: int, addr: int, value: int) -> None:
        """`stream` waits until the 64-bit word at `addr` is at least `value`."""
        self._call("cuStreamWaitValue64", ctypes.c_void_p(stream), addr, value, _WAIT_GEQ)

    def write_value(self, stream: int, addr: int, value: int) -> None:
        """`stream` writes `value` at `addr` after its earlier work, behind a system-wide fence."""
        self._call("cuStreamWriteValue64", ctypes.c_void_p(stream), addr, value, 0)

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """`stream` copies `nbytes` from `src` to `dst` (any two addresses this context reaches)."""
        self._call("cuMemcpyAsync", dst, src, nbytes, ctypes.c_void_p(stream))

    def param_sizes(self, function: int) -> list[int] | None:
        """The byte size of each parameter of the loaded kernel `function`, in order, or
        None where this driver cannot say."""
        info = self._fns.get("cuFuncGetParamInfo")
        if info is None or not function:
            return None
        sizes: list[int] = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        while len(sizes) < 256 and info(ctypes.c_void_p(function), len(sizes), ctypes.byref(offset),
                                        ctypes.byref(size)) == 0:
            sizes.append(int(size.value))
        return sizes


class KernelLaunch:
    """Launches one compiled Triton kernel through `cuLaunchKernel`, keeping the GIL.

    Triton's launcher lets go of the GIL for every launch; the thread that launched then
    waits for whichever thread took it (the client's loop, the poller) to give it back.
    P's engine thread launches a gather a layer, so its saves stretched by the other
    threads' turns. A launch takes microseconds and never blocks, so this one keeps it.

    The kernel's parameters are its run-time arguments in order, then the pointers
    Triton appends (scratch space, passed as null): the driver says how many there are
    and each one's size. `make` returns None where the kernel needs anything else (a
    cluster, scratch memory, oversized shared memory, a cooperative or dependent
    launch), and the caller keeps Triton's launch. It launches in the calling thread's
    current context, which every caller has made the kernel's GPU's (torch's device on
    the engine's thread, `make_current` on the others); Triton's would fall back to
    GPU 0's.
    """

    def __init__(self, drv: CudaDriver, kernel: Any, sizes: list[int], runtime: int) -> None:
        self._launch = drv._fns["cuLaunchKernel"]
        self._drv = drv
        self.function = ctypes.c_void_p(kernel.function)
        self.threads = int(kernel.metadata.num_warps) * 32
        self.shared = int(kernel.metadata.shared)
        self.count = len(sizes)
        self.runtime = runtime
        self._words = ctypes.c_uint64 * self.count
        self._ptrs = ctypes.c_void_p * self.count
        self._offsets = tuple(8 * i for i in range(self.count))

    @classmethod
    def make(cls, drv: CudaDriver | None, kernel: Any, runtime: int) -> KernelLaunch | None:
        if drv is None:
            return None
        meta = getattr(kernel, "metadata", None)
        sizes = drv.param_sizes(getattr(kernel, "function", 0) or 0)
        if meta is None or sizes is None or len(sizes) < runtime or any(s not in (4, 8) for s in sizes):
            return None
        plain = (getattr(meta, "num_ctas", 1) == 1 and int(meta.shared) <= _PLAIN_SHARED_BYTES
                 and not getattr(meta, "launch_cooperative_grid", False)
                 and not getattr(meta, "launch_pdl", False) and not getattr(meta, "global_scratch_size", 0)
                 and not getattr(meta, "profile_scratch_size", 0) and all(s == 8 for s in sizes[runtime:]))
        return cls(drv, kernel, sizes, runtime) if plain else None

    def __call__(self, grid: int, stream: int, args: Sequence[int]) -> None:
        """Launch `grid` programs on `stream` (its raw handle) with the run-time `args`
        (ints: addresses and values), in the current context."""
        words = self._words(*(a & _WORD_MASK for a in args[: self.runtime]))
        base = ctypes.addressof(words)
        params = self._ptrs(*(base + o for o in self._offsets))
        rc = self._launch(self.function, grid, 1, 1, self.threads, 1, 1, self.shared, ctypes.c_void_p(stream), params,
                          None)
        if rc:
            self._drv.fail("cuLaunchKernel", rc)


class CompiledKernel:
    """One compiled Triton kernel, launched again without Triton's per-call argument
    binding: through `KernelLaunch` where the driver allows (which keeps the GIL), else
    through the compiled kernel's own launcher.

    `runtime` is how many of the kernel's arguments come before its constexprs; a
    launch passes those as ints (addresses and values), and the constexprs, which only
    Triton's launcher takes, separately.
    """

    def __init__(self, kernel: Any, runtime: int, drv: CudaDriver | None) -> None:
        self.kernel = kernel
        self.kept = KernelLaunch.make(drv, kernel, runtime)

    def __call__(self, grid: int, stream: int, args: Sequence[int], constexprs: Sequence[Any]) -> None:
        if self.kept is not None:
            self.kept(grid, stream, args)
            return
        kernel = self.kernel
        kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *constexprs)


_DRIVER: list[CudaDriver | None] = []
_DRIVER_ERROR: list[str] = []
_DRIVER_LOCK = threading.Lock()


def driver() -> CudaDriver | None:
    """The CUDA driver binding, or None (`driver_error` says why); loads once."""
    with _DRIVER_LOCK:
        if not _DRIVER:
            try:
                _DRIVER.append(CudaDriver(ctypes.CDLL("libcuda.so.1"), ctypes.PyDLL("libcuda.so.1")))
            except OSError as exc:
                _DRIVER.append(None)
                _DRIVER_ERROR.append(f"the CUDA driver library is not usable here ({exc})")
        return _DRIVER[0]


def driver_error() -> str:
    driver()
    return _DRIVER_ERROR[0] if _DRIVER_ERROR else ""


def boot_id() -> str:
    """This host's boot id: two workers with the same one run on one host (one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
