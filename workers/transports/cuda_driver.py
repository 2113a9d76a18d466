"""The few CUDA driver calls the ipc backend needs (libcuda, which any CUDA process has),
loaded once; and the host's boot id, which tells whether two workers share a host.

Its own module so that choosing a backend (`nccl_setup.resolve_backend`) can ask whether
the driver is there without importing the backend itself.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .ipc_mailbox import HANDLE_BYTES

__all__ = ["CudaDriver", "boot_id", "driver", "driver_error"]

_WAIT_GEQ = 0x0
_LAZY_PEER_ACCESS = 0x1


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
        held = {"cuCtxSetCurrent", "cuStreamWaitValue64", "cuStreamWriteValue64", "cuMemcpyAsync"}
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
        ):
            fn = None
            via = kept if name in held else lib
            for symbol in (*alts, name):  # the versioned symbol first: the plain one may be the old ABI
                fn = getattr(via, symbol, None)
                if fn is not None:
                    break
            if fn is None:
                raise OSError(f"libcuda has no {name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[name] = fn

    def _call(self, name: str, *args: Any) -> None:
        rc = self._fns[name](*args)
        if rc:
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
