"""Building NCCL communicators: backend choice, NCCL init under a deadline, torch groups.

Split from `nccl_comm.py` (the communicators and their cache), which calls these.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import structlog
import torch

from protocols.errors import RendezvousError

from . import cuda_driver, nccl_lib

log = structlog.get_logger()

BACKENDS = ("direct", "torch", "ipc")
FALLBACKS = ("direct", "torch")  # what "ipc,<fallback>" may build with a peer that declines ipc
_DECLINED = " declined: "  # an acceptor's answer that refuses a build: "<nonce> declined: <reason>"

# Where the ipc backend's shared page lives while two workers set up (`cuda_ipc`).
SHM_DIR = "/dev/shm"
IPC_PAGE_PREFIX = "kvbroker-ipc-"
# The ipc build's version (its offer's "v"): both sides must lay the shared page and
# counters out alike. 4: an arrival word per op in flight (`cuda_ipc._Counters`); 5: a
# block receive's descriptor names its transfer (`ipc_mailbox.transfer_tag`); 6: each
# side names its bell in the page (`workers.transports.bell`).
IPC_VERSION = 6

# The CUDA stream priority of the streams NCCL ops run on (lower is higher; compute and
# copy streams keep the default 0). torch maps it into the device's range.
HIGH_PRIORITY = -1


def resolve_backend(backend: str | None = None) -> str:
    """The communicator backend to use: `backend`, else `KVBROKER_NCCL_BACKEND`, else
    "direct" when the NCCL library loads, else "torch".

    "ipc,direct" (or "ipc,torch") asks for ipc and names what to build instead with a
    peer that declines it: one on another host, or one that cannot map this host's
    shared page. Only ipc can be declined, so only ipc may name a fallback.

    Raises:
        ValueError: an unknown name, a fallback after anything but ipc, or a backend
            asked for whose library or driver is missing here.
    """
    name = backend or os.environ.get("KVBROKER_NCCL_BACKEND", "") or None
    if name is None:
        return "direct" if nccl_lib.load() is not None else "torch"
    first, _, fallback = name.replace(" ", "").partition(",")
    if fallback and (first != "ipc" or fallback not in FALLBACKS):
        raise ValueError(
            f"NCCL backend {name!r} names a fallback that cannot apply: only ipc may be declined by a peer, "
            "so use one backend, or 'ipc,direct' (or 'ipc,torch') for ipc within a host and NCCL between hosts."
        )
    for each in (first, fallback) if fallback else (first,):
        _check_backend(each)
    return f"{first},{fallback}" if fallback else first


def _check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown NCCL backend {name!r}; use one of {BACKENDS}.")
    if name == "direct" and nccl_lib.load() is None:
        raise ValueError(f"the direct NCCL backend needs the NCCL library: {nccl_lib.load_error()}")
    if name == "ipc" and cuda_driver.driver() is None:
        raise ValueError(f"the ipc backend needs the CUDA driver: {cuda_driver.driver_error()}")


class IpcDeclined(RendezvousError):
    """The peer cannot share an ipc communicator (another host, no shared page): the
    message says why; `fallback` names the backend the initiator builds instead ("" none)."""

    def __init__(self, reason: str, fallback: str) -> None:
        super().__init__(reason)
        self.fallback = fallback


def await_join(rendezvous: Any, peer: str, key: str, nonce: str, cancelled: threading.Event | None,
               deadline: float, what: str) -> str | None:
    """The initiator's wait for the acceptor's answer to build `nonce` under `key`: None
    once it joined, else the reason it declined (`decline`). Answers to older builds of
    the pair (their acks come late) are skipped until `deadline`.

    Raises:
        RendezvousError: no answer to this build by `deadline`, or the wait was cancelled.
    """
    declined = f"{nonce}{_DECLINED}"
    while True:
        answer = rendezvous.receive(peer, f"{key}/joined", cancelled).decode(errors="replace")
        if answer == nonce:
            return None
        if answer.startswith(declined):
            return answer[len(declined):]
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{peer} did not join {what} rendezvous {nonce} in time.")


def join(rendezvous: Any, peer: str, key: str, nonce: str) -> None:
    """The acceptor's answer to build `nonce`: it joins."""
    rendezvous.publish(peer, f"{key}/joined", nonce.encode())


def decline(rendezvous: Any, peer: str, key: str, nonce: str, reason: str) -> None:
    """The acceptor's answer to build `nonce`: it cannot, and `reason` says why in one
    sentence; the initiator then builds its fallback, or fails at once with `reason`
    instead of at its connect deadline."""
    rendezvous.publish(peer, f"{key}/joined", f"{nonce}{_DECLINED}{reason}".encode()[:2000])


def init_direct(lib: Any, uid: bytes, rank: int, device: torch.device, deadline: float, peer: str,
                 nonce: str) -> int:
    """ncclCommInitRank plus one small exchange each way, on a helper thread, by `deadline`.

    NCCL connects point-to-point channels inside the first group that uses them, and
    that blocks the posting thread until the peer posts too (see `new_torch_group`); the
    exchange does it now, while both sides are here. Past the deadline the communicator,
    if init got that far, is aborted (which also ends a stuck exchange); a thread still
    inside ncclCommInitRank, which has no deadline of its own, aborts what it gets once
    that returns.

    Raises:
        RendezvousError: the deadline passed or NCCL failed.
    """
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            handle = lib.init_rank(2, uid, rank)
            with lock:
                box["handle"] = handle
                if box.get("abandoned"):
                    box.pop("handle")
                    lib.abort(handle)
                    return
            stream = torch.cuda.Stream(device)
            buf = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=device)
            torch.cuda.current_stream(device).synchronize()
            lib.group_start()
            try:
                lib.send(buf[0].data_ptr(), buf[0].numel(), 1 - rank, handle, stream.cuda_stream)
                lib.recv(buf[1].data_ptr(), buf[1].numel(), 1 - rank, handle, stream.cuda_stream)
            finally:
                lib.group_end()
            stream.synchronize()
            err = lib.async_error(handle)
            if err not in (0, 7):
                raise RuntimeError(f"NCCL reported {lib.error_string(err)} after the warm-up exchange")
            box["ok"] = True
        except BaseException as exc:  # reported to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"nccl-init-{peer}", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        if box.get("ok"):
            return box["handle"]
        box["abandoned"] = True
        handle = box.pop("handle", None)
    if handle:
        try:
            lib.abort(handle)
        except Exception as exc:  # best effort: the handle is dropped anyway
            log.warning("nccl.abort_failed", peer=peer, backend="direct", error=repr(exc))
    if "error" in box:
        raise RendezvousError(f"NCCL init with {peer} (rendezvous {nonce}) failed: {box['error']}") from box["error"]
    raise RendezvousError(f"NCCL init with {peer} (rendezvous {nonce}) did not finish in time.")


def master_store(host: str, timeout: timedelta) -> Any:
    """A TCPStore server on a free port (port 0 where torch supports it)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        if store.port:
            return store
    except (RuntimeError, ValueError):
        pass
    with socket.socket() as s:  # older stores: pick a port, accepting a small race
        s.bind((host, 0))
        port = s.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def parse_payload(payload: bytes) -> dict[str, Any]:
    """A rendezvous payload: v1 a torch store address, v2 a direct NCCL unique id, v3 an
    ipc page (its path, the host's boot id, and the backend the initiator builds instead
    if the acceptor declines: "fallback", "" none). Each may name the transfer it was
    built for ("for"; "" any, as older peers send)."""
    try:
        info = json.loads(payload)
        if not isinstance(info.get("nonce"), str) or not isinstance(info.get("for", ""), str):
            raise ValueError("bad fields")
        purpose = info.get("for", "")
        if info.get("v") == 2 and info.get("backend") == "direct":
            uid = bytes.fromhex(info["id"])
            if len(uid) != 128:
                raise ValueError(f"an NCCL unique id is 128 bytes, not {len(uid)}")
            return {"backend": "direct", "id": uid, "nonce": info["nonce"], "for": purpose}
        if info.get("v") == IPC_VERSION and info.get("backend") == "ipc":
            page, boot = info["page"], info["boot"]
            if not isinstance(page, str) or not isinstance(boot, str):
                raise ValueError("bad ipc fields")
            if os.path.dirname(page) != SHM_DIR or not os.path.basename(page).startswith(IPC_PAGE_PREFIX):
                raise ValueError(f"an ipc page lies in {SHM_DIR} and is named {IPC_PAGE_PREFIX}*, not {page!r}")
            fallback = info.get("fallback", "")
            if fallback not in ("", *FALLBACKS):
                raise ValueError(f"an ipc build falls back to one of {FALLBACKS}, not {fallback!r}")
            return {"backend": "ipc", "page": page, "boot": boot, "nonce": info["nonce"], "for": purpose,
                    "fallback": fallback}
        if info.get("backend") == "ipc":
            raise RendezvousError(f"the peer builds ipc communicators of version {info.get('v')!r}, this worker "
                                  f"version {IPC_VERSION}: run the same kvbroker release on every prefill and "
                                  "decode worker.")
        if info.get("v") != 1 or not isinstance(info["port"], int):
            raise ValueError("bad fields")
        return {"backend": "torch", "host": str(info["host"]), "port": info["port"], "nonce": info["nonce"],
                "for": purpose}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousError(f"unusable NCCL rendezvous payload ({exc}): {payload[:120]!r}") from exc


# torch's ProcessGroupNCCL debugging and monitoring, which this transport does not use:
# its own deadlines and `Completion.wait` catch stuck ops, and it never reads the
# flight recorder. The flight recorder (TORCH_FR_BUFFER_SIZE) records every op,
# with a captured stack, on the posting thread, i.e. on a transfer's critical path; the
# dumps on timeout need it; the heartbeat monitor is one more thread per group, whose
# reaction is to kill the process. Set with `os.environ.setdefault` before the first
# group of the process (torch reads some once per process), so an operator's value
# wins; KVBROKER_NCCL_TORCH_DEBUG=1 leaves torch's defaults alone. They are process-wide
# but only switch debugging off. Knobs that change how ops run (record streams, event
# caching) and NCCL_* variables, which would also change the host application's own
# communicators, are left alone. Measured on an H200 pair (torch 2.11, NCCL 2.28): the
# posting cost stayed within run-to-run noise (0.1-0.25 ms an op either way), so this
# is hygiene, not the fix for host time.
def _flight_recorder_names() -> tuple[str, str]:
    """The flight recorder's buffer-size and stack variables: torch 2.10 and later read
    TORCH_FR_* and warn that the TORCH_NCCL_TRACE_* names they replace are deprecated."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 10):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_CPP_STACK"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_TRACE_CPP_STACK"


_FR_BUFFER, _FR_STACK = _flight_recorder_names()
TORCH_NCCL_QUIET = {
    _FR_BUFFER: "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_DESYNC_DEBUG": "0",
    "TORCH_NCCL_ENABLE_TIMING": "0",
    _FR_STACK: "0",
    "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN": "0",
}


def quiet_torch_nccl() -> dict[str, str]:
    """Apply `TORCH_NCCL_QUIET` (unless opted out); returns the values in effect."""
    if os.environ.get("KVBROKER_NCCL_TORCH_DEBUG", "") not in ("", "0"):
        return {}
    for key, value in TORCH_NCCL_QUIET.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in TORCH_NCCL_QUIET}


def new_torch_group(store: Any, rank: int, device: torch.device, watchdog_timeout_s: float) -> Any:
    """A 2-rank ProcessGroupNCCL on `store`, connected now rather than at the first op."""
    from torch.distributed import ProcessGroupNCCL

    quiet_torch_nccl()
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=watchdog_timeout_s)
    opts.is_high_priority_stream = True  # as the direct backend's stream (see HIGH_PRIORITY)
    pg = ProcessGroupNCCL(store, rank, 2, opts)
    try:
        pg.bound_device_id = device
    except (AttributeError, RuntimeError):  # older torch: eager connect alone suffices
        pass
    with torch.cuda.device(device):
        pg.eager_connect_single_device(device)
        # NCCL connects point-to-point channels lazily, inside the first group that uses
        # them, and that blocks until the peer posts its side. A receive posted long
        # before its send (normal for D) would then block its thread, deadline or not.
        # One small exchange each way, while both sides are here, connects them now.
        buf = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=device)
        pg._start_coalescing()
        pg.send([buf[0]], 1 - rank, 0)
        pg.recv([buf[1]], 1 - rank, 0)
        pg._end_coalescing().wait()
        torch.cuda.current_stream(device).synchronize()
    return pg
