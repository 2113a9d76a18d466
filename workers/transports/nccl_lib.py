"""A thin ctypes binding to the NCCL library that torch already ships.

Why not torch's `ProcessGroupNCCL`: every op posted through it costs the host 0.1-0.25
ms (work objects, coalescing state, watchdog bookkeeping), measured on an H200 pair
with torch 2.11; a chunked transfer posts several, so the first byte left about 0.25
ms after a bare send's and the wire idled between chunk posts. A 2-rank communicator
driven through the C API directly costs a few microseconds an op. vLLM's `pynccl`
takes the same approach for the same reason.

Only what a 2-party point-to-point transport needs is bound: unique ids, rank init,
send/recv of bytes on a given CUDA stream, groups, abort/destroy and the async error.
The library is looked up by `KVBROKER_NCCL_LIBRARY`, then as the copy already mapped
into the process (torch's), then where torch's wheel puts it (the `nvidia-nccl-cu*`
package, ``nvidia/nccl/lib/libnccl.so.2``), then through the loader. Loading never raises: `load()` returns None and `load_error()` says why, so a
host without NCCL or CUDA falls back to torch's process groups or to no GPU transport.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys
import threading
from typing import Any

__all__ = ["NcclError", "NcclLib", "UNIQUE_ID_BYTES", "load", "load_error"]

UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  # ncclUint8 in ncclDataType_t
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7


class NcclError(RuntimeError):
    """An NCCL call returned an error code."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: NCCL error {code} ({text})")
        self.call, self.code = call, code


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_Comm = ctypes.c_void_p
_Result = ctypes.c_int


def _candidates() -> list[str]:
    out: list[str] = []
    env = os.environ.get("KVBROKER_NCCL_LIBRARY")
    if env:
        out.append(env)
    roots = list(sys.path)
    try:
        roots += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # pragma: no cover - embedded interpreters
        pass
    try:  # beside the torch that is imported, whatever path it came from
        import torch

        roots.append(os.path.dirname(os.path.dirname(torch.__file__)))
    except Exception:  # pragma: no cover - torch is optional for this module
        pass
    out += _mapped()  # the copy torch itself loaded, if it did
    seen = set()
    for root in roots:
        if not root or root in seen:
            continue
        seen.add(root)
        for pattern in (("nvidia", "nccl", "lib"), ("nvidia", "*", "lib")):  # cu12 and cu13 wheel layouts
            out += sorted(glob.glob(os.path.join(root, *pattern, "libnccl.so*")))
    found = ctypes.util.find_library("nccl")
    if found:
        out.append(found)
    out.append("libnccl.so.2")
    return out


def _mapped() -> list[str]:
    """libnccl files already mapped into this process (Linux), e.g. by torch."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isabs(p) and os.path.basename(p).startswith("libnccl.so"))


class NcclLib:
    """The bound functions of one loaded `libnccl`; every method raises `NcclError` on failure."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        p = ctypes.POINTER

        # The enqueueing calls are bound twice: through `lib`, which lets go of the GIL for
        # the call as ctypes does, and through `kept`, which keeps it (`held=True`). An
        # enqueue takes microseconds, but a thread that lets go of the GIL for it may then
        # wait for another thread to give the GIL back; with a busy poller and loop, D's
        # post of a four-chunk receive took 0.4-1.2 ms that way. Only for ops that cannot
        # block: the first op with a peer connects the pair, which waits for the peer to
        # post too (`DirectCommunicator`).
        kept = ctypes.PyDLL(path)

        def bind(name: str, args: list[Any], res: Any = _Result, via: Any = lib) -> Any:
            fn = getattr(via, name)
            fn.argtypes, fn.restype = args, res
            return fn

        op_args = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, ctypes.c_void_p]

        self._get_version = bind("ncclGetVersion", [p(ctypes.c_int)])
        self._get_error_string = bind("ncclGetErrorString", [_Result], ctypes.c_char_p)
        self._get_unique_id = bind("ncclGetUniqueId", [p(_UniqueId)])
        self._init_rank = bind("ncclCommInitRank", [p(_Comm), ctypes.c_int, _UniqueId, ctypes.c_int])
        self._send, self._send_kept = bind("ncclSend", op_args), bind("ncclSend", op_args, via=kept)
        self._recv, self._recv_kept = bind("ncclRecv", op_args), bind("ncclRecv", op_args, via=kept)
        self._group_start, self._group_start_kept = bind("ncclGroupStart", []), bind("ncclGroupStart", [], via=kept)
        self._group_end, self._group_end_kept = bind("ncclGroupEnd", []), bind("ncclGroupEnd", [], via=kept)
        self._abort = bind("ncclCommAbort", [_Comm])
        self._destroy = bind("ncclCommDestroy", [_Comm])
        self._async_error = bind("ncclCommGetAsyncError", [_Comm, p(_Result)])
        v = ctypes.c_int()
        self._check("ncclGetVersion", self._get_version(ctypes.byref(v)))
        # 2.9.0 and later encode the version as major*10000 + minor*100 + patch.
        self.version = (v.value // 10000, v.value // 100 % 100, v.value % 100)

    def error_string(self, code: int) -> str:
        text = self._get_error_string(code)
        return text.decode(errors="replace") if text else f"code {code}"

    def _check(self, call: str, code: int) -> None:
        if code != NCCL_SUCCESS:
            raise NcclError(call, code, self.error_string(code))

    # -- communicators -------------------------------------------------------------

    def unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes) for rank 0 to hand to its peer."""
        uid = _UniqueId()
        self._check("ncclGetUniqueId", self._get_unique_id(ctypes.byref(uid)))
        return bytes(uid.internal)

    def init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """ncclCommInitRank on the current CUDA device; blocks until every rank joined.

        Returns the communicator handle (an opaque pointer as an int).
        """
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, not {len(unique_id)}.")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = _Comm()
        self._check("ncclCommInitRank", self._init_rank(ctypes.byref(comm), nranks, uid, rank))
        return int(comm.value or 0)

    def abort(self, comm: int) -> None:
        self._check("ncclCommAbort", self._abort(_Comm(comm)))

    def destroy(self, comm: int) -> None:
        self._check("ncclCommDestroy", self._destroy(_Comm(comm)))

    def async_error(self, comm: int) -> int:
        """The communicator's asynchronous error code (0: none, 7: still in progress)."""
        res = _Result()
        self._check("ncclCommGetAsyncError", self._async_error(_Comm(comm), ctypes.byref(res)))
        return res.value

    # -- point to point --------------------------------------------------------------

    # `held`: keep the GIL for the call (see `__init__`); only for a connected pair.

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int, held: bool = False) -> None:
        self._check("ncclSend", (self._send_kept if held else self._send)(ptr, nbytes, NCCL_UINT8, peer, comm, stream))

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int, held: bool = False) -> None:
        self._check("ncclRecv", (self._recv_kept if held else self._recv)(ptr, nbytes, NCCL_UINT8, peer, comm, stream))

    def group_start(self, held: bool = False) -> None:
        self._check("ncclGroupStart", (self._group_start_kept if held else self._group_start)())

    def group_end(self, held: bool = False) -> None:
        self._check("ncclGroupEnd", (self._group_end_kept if held else self._group_end)())


_lock = threading.Lock()
_loaded: NcclLib | None = None
_error: str | None = None


def load() -> NcclLib | None:
    """The process's `NcclLib`, loaded once; None if no usable libnccl was found."""
    global _loaded, _error
    with _lock:
        if _loaded is not None or _error is not None:
            return _loaded
        errors = []
        for path in _candidates():
            try:
                _loaded = NcclLib(path)
                return _loaded
            except (OSError, AttributeError, NcclError) as exc:
                errors.append(f"{path}: {exc}")
        _error = "no usable libnccl: " + ("; ".join(errors) or "nothing found")
        return None


def load_error() -> str | None:
    """Why `load()` returned None (None if it has not failed)."""
    return _error
