"""Building NCCL communicators, the parts that run without a GPU: backend choice,
rendezvous payloads, and the torch debugging switches the transport turns off."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from protocols.errors import RendezvousError
from workers.transports import nccl_lib
from tests.support import wait_until
from workers.transports.nccl_setup import (
    IPC_VERSION,
    TORCH_NCCL_QUIET,
    await_join,
    decline,
    join,
    parse_payload,
    quiet_torch_nccl,
    resolve_backend,
)


def test_payloads_of_both_backends_parse() -> None:
    uid = bytes(range(128))
    direct = parse_payload(json.dumps({"v": 2, "backend": "direct", "id": uid.hex(), "nonce": "n1"}).encode())
    assert direct == {"backend": "direct", "id": uid, "nonce": "n1", "for": ""}
    torch_store = parse_payload(json.dumps({"v": 1, "host": "10.0.0.2", "port": 29500, "nonce": "n2"}).encode())
    assert torch_store == {"backend": "torch", "host": "10.0.0.2", "port": 29500, "nonce": "n2", "for": ""}
    built = parse_payload(json.dumps({"v": 2, "backend": "direct", "id": uid.hex(), "nonce": "n3", "for": "t7"}).encode())
    assert built["for"] == "t7"
    assert parse_payload(ipc_payload("n4", "t8", fallback="direct")) == {
        "backend": "ipc", "page": "/dev/shm/kvbroker-ipc-n4", "boot": "another-boot", "nonce": "n4", "for": "t8",
        "fallback": "direct"}
    assert parse_payload(ipc_payload("n5", "t8"))["fallback"] == "", "an initiator that names no fallback"


def ipc_payload(nonce: str, purpose: str, fallback: str | None = None, boot: str = "another-boot") -> bytes:
    info = {"v": IPC_VERSION, "backend": "ipc", "page": f"/dev/shm/kvbroker-ipc-{nonce}", "boot": boot, "nonce": nonce,
            "for": purpose}
    if fallback is not None:
        info["fallback"] = fallback
    return json.dumps(info).encode()


def direct_payload(nonce: str, purpose: str | None) -> bytes:
    info = {"v": 2, "backend": "direct", "id": bytes(128).hex(), "nonce": nonce}
    if purpose is not None:
        info["for"] = purpose
    return json.dumps(info).encode()


def test_an_acceptor_joins_only_a_build_for_its_own_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """D gave up t0 after its Ready, and P's send for t0 built a communicator: D's receive
    for t2 must not join that build (P's send for t0 would pair with it), only P's build
    for t2. A build that names no transfer (an older peer) is joined as before."""
    import multiprocessing as mp

    from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous

    ctx = mp.get_context("spawn")
    to_d = ctx.Queue()
    rendezvous = QueueRendezvous(ctx.Queue(), to_d, timeout_s=1)
    cache = CommunicatorCache("d:0", "cpu", rendezvous, backend="torch")  # the payloads name their backend
    joined: list[str] = []
    monkeypatch.setattr(cache, "_connect_direct",  # the NCCL init itself needs GPUs
                        lambda peer, info, cancelled=None, purpose="": joined.append(info["nonce"]) or info["nonce"])
    seen: list[str] = []
    receive = rendezvous.receive

    def receive_seen(*args: object, **kwargs: object) -> bytes:
        payload = receive(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(parse_payload(payload)["nonce"])
        return payload

    monkeypatch.setattr(rendezvous, "receive", receive_seen)
    key = CommunicatorCache.key("p:0", "d:0")
    to_d.put((key, direct_payload("for-t0", "t0")))
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(cache._connect("p:0", False, None, None, "t2")))
    waiter.start()
    wait_until(lambda: seen == ["for-t0"], 5, "the build for t0 seen")
    to_d.put((key, direct_payload("for-t2", "t2")))
    waiter.join(5)
    assert got == ["for-t2"] and seen == ["for-t0", "for-t2"]
    to_d.put((key, direct_payload("untagged", None)))
    assert cache._connect("p:0", False, None, None, "t3") == "untagged"
    assert joined == ["for-t2", "untagged"]
    to_d.put((key, direct_payload("for-t4", "t4")))
    with pytest.raises(RendezvousError, match="in 1 s"):
        cache._connect("p:0", False, None, None, "t5")  # only another transfer's build came


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        json.dumps({"v": 2, "backend": "direct", "id": "00" * 16, "nonce": "n"}).encode(),  # a short id
        json.dumps({"v": 2, "backend": "direct", "id": "zz" * 128, "nonce": "n"}).encode(),  # not hex
        json.dumps({"v": 1, "host": "h", "port": "29500", "nonce": "n"}).encode(),  # a port as text
        json.dumps({"v": 1, "host": "h", "port": 1}).encode(),  # no nonce
        json.dumps({"v": 3, "nonce": "n"}).encode(),
        ipc_payload("n", "", fallback="mpi"),  # a fallback no backend is
    ],
)
def test_bad_payloads_are_refused_with_what_was_sent(payload: bytes) -> None:
    with pytest.raises(RendezvousError, match="unusable NCCL rendezvous payload") as info:
        parse_payload(payload)
    assert repr(payload[:20])[2:-1] in str(info.value)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVBROKER_NCCL_BACKEND", raising=False)
    with pytest.raises(ValueError, match=r"unknown NCCL backend 'mpi'; use one of \('direct', 'torch', 'ipc'\)"):
        resolve_backend("mpi")
    assert resolve_backend("torch") == "torch"
    monkeypatch.setenv("KVBROKER_NCCL_BACKEND", "torch")
    assert resolve_backend() == "torch"
    monkeypatch.delenv("KVBROKER_NCCL_BACKEND")
    if nccl_lib.load() is None:  # no NCCL library on this host (a CPU machine)
        assert resolve_backend() == "torch"
        with pytest.raises(ValueError, match="the direct NCCL backend needs the NCCL library"):
            resolve_backend("direct")
    else:
        assert resolve_backend() == "direct"
    for choice in ("direct,ipc", "torch,direct", "ipc,ipc", "ipc,mpi"):
        with pytest.raises(ValueError, match=r"names a fallback that cannot apply: only ipc may be declined.*'ipc,direct'"):
            resolve_backend(choice)
    monkeypatch.setenv("KVBROKER_NCCL_BACKEND", "ipc,torch")
    from workers.transports import cuda_ipc

    if cuda_ipc.driver() is None:  # each backend of the choice must be usable here
        with pytest.raises(ValueError, match="the ipc backend needs the CUDA driver"):
            resolve_backend()
    else:
        assert resolve_backend() == "ipc,torch"


def test_an_acceptor_on_another_host_declines_ipc_and_joins_the_fallback_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """P asks for ipc with direct as its fallback; D runs on another host: D answers with
    the reason (so P need not wait out its connect deadline) and then joins P's direct
    build for the same transfer. Without a fallback, D's build fails with that reason."""
    import multiprocessing as mp

    from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous
    from workers.transports.nccl_setup import IpcDeclined

    ctx = mp.get_context("spawn")
    to_d, to_p = ctx.Queue(), ctx.Queue()
    cache = CommunicatorCache("d:0", "cpu", QueueRendezvous(to_p, to_d, timeout_s=5), backend="torch")
    joined: list[str] = []
    monkeypatch.setattr(cache, "_connect_direct",  # the NCCL init itself needs GPUs
                        lambda peer, info, cancelled=None, purpose="": joined.append(info["nonce"]) or info["nonce"])
    key = CommunicatorCache.key("p:0", "d:0")
    to_d.put((key, ipc_payload("ipc-1", "t1", fallback="direct")))
    got: list[str] = []
    acceptor = threading.Thread(target=lambda: got.append(cache._connect("p:0", False, None, None, "t1")))
    acceptor.start()
    answer_key, answer = to_p.get(timeout=10)
    assert answer_key == f"{key}/joined"
    assert answer.decode().startswith("ipc-1 declined: d:0 and p:0 run on different hosts: ")
    assert "KVBROKER_NCCL_BACKEND=ipc,direct" in answer.decode()
    to_d.put((key, direct_payload("direct-1", "t1")))
    acceptor.join(10)
    assert got == ["direct-1"] and joined == ["direct-1"]
    to_d.put((key, ipc_payload("ipc-2", "t2")))  # no fallback named
    with pytest.raises(IpcDeclined, match="run on different hosts") as info:
        cache._connect("p:0", False, None, None, "t2")
    assert isinstance(info.value, RendezvousError) and info.value.fallback == ""
    assert to_p.get(timeout=10)[1].startswith(b"ipc-2 declined: ")
    assert joined == ["direct-1"]


def test_an_initiator_reads_a_join_or_a_decline_of_its_own_build() -> None:
    """Answers to older builds of the pair are skipped; a decline carries its reason."""
    import multiprocessing as mp

    from workers.transports.nccl_comm import QueueRendezvous

    ctx = mp.get_context("spawn")
    to_p, to_d = ctx.Queue(), ctx.Queue()
    p_side, d_side = QueueRendezvous(to_d, to_p, timeout_s=0.5), QueueRendezvous(to_p, to_d, timeout_s=5)
    key = "nccl/p:0>d:0"
    far = time.monotonic() + 30
    join(d_side, "p:0", key, "old")
    join(d_side, "p:0", key, "n1")
    assert await_join(p_side, "d:0", key, "n1", None, far, "IPC") is None
    decline(d_side, "p:0", key, "old", "an older build")
    decline(d_side, "p:0", key, "n2", "d:0 and p:0 run on different hosts.")
    assert await_join(p_side, "d:0", key, "n2", None, far, "IPC") == "d:0 and p:0 run on different hosts."
    join(d_side, "p:0", key, "old")
    with pytest.raises(RendezvousError, match="d:0 did not join IPC rendezvous n3 in time"):
        await_join(p_side, "d:0", key, "n3", None, time.monotonic(), "IPC")


def test_torch_debugging_is_switched_off_unless_the_operator_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (*TORCH_NCCL_QUIET, "KVBROKER_NCCL_TORCH_DEBUG"):
        monkeypatch.delenv(key, raising=False)
    operator_key = next(iter(TORCH_NCCL_QUIET))
    monkeypatch.setenv(operator_key, "4000")  # an operator's value wins
    applied = quiet_torch_nccl()
    assert applied[operator_key] == "4000"
    assert all(applied[k] == v for k, v in TORCH_NCCL_QUIET.items() if k != operator_key)


def test_debug_switch_leaves_torch_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCH_NCCL_QUIET:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("KVBROKER_NCCL_TORCH_DEBUG", "1")
    assert quiet_torch_nccl() == {}
    assert not any(key in os.environ for key in TORCH_NCCL_QUIET)


class _Built:
    """Stands in for a built communicator (building one needs GPUs)."""

    def __init__(self, peer: str, nonce: str) -> None:
        self.peer, self.nonce = peer, nonce
        self.closed = self.broken = False

    def idle(self) -> bool:
        return True

    def abort(self) -> None:
        self.closed = True


def test_a_communicator_is_usable_without_a_build_only_while_the_acceptor_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`usable` hands out the cached communicator a ticket names, building and aborting
    nothing. Once the acceptor said it dropped that one, `usable` declines, and the
    notice is kept for `get`, which aborts it and builds a new one."""
    import multiprocessing as mp

    from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous

    ctx = mp.get_context("spawn")
    to_p = ctx.Queue()
    cache = CommunicatorCache("p:0", "cpu", QueueRendezvous(ctx.Queue(), to_p, timeout_s=1), backend="torch")
    nonces = iter(["n1", "n2"])
    monkeypatch.setattr(cache, "_connect", lambda peer, *args, **kwargs: _Built(peer, next(nonces)))
    first = cache.get("d:0", initiator=True, purpose="t0")
    assert cache.usable("d:0", "n1", initiator=True) is first
    assert cache.usable("d:0", "n0", initiator=True) is None, "a ticket naming another communicator"
    assert cache.usable("x:0", "n1", initiator=True) is None, "no communicator with that peer"
    to_p.put((f"{CommunicatorCache.key('p:0', 'd:0')}/stale", b"n1"))
    wait_until(lambda: not to_p.empty(), 5, "the stale notice queued")
    assert cache.usable("d:0", "n1", initiator=True) is None
    assert not first.closed, "usable aborted a communicator"
    second = cache.get("d:0", initiator=True, purpose="t1")
    assert first.closed and second.nonce == "n2", "get did not act on the notice usable read"
    assert cache.usable("d:0", "n2", initiator=True) is second
    first.broken = True
    assert cache.usable("d:0", "n1", initiator=True) is None


def test_an_ipc_build_of_another_version_is_refused_naming_what_to_change() -> None:
    """The page and the counters are laid out per version: an older worker's build is
    refused at once, with what to change, not left to fail its first transfer."""
    older = json.loads(ipc_payload("n", ""))
    older["v"] = IPC_VERSION - 1
    with pytest.raises(RendezvousError, match=f"version {IPC_VERSION - 1}, this worker version {IPC_VERSION}: "
                                              "run the same kvbroker release"):
        parse_payload(json.dumps(older).encode())
