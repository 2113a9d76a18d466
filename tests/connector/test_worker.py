"""The connector's worker half against a real broker process, with real CPU KV tensors.

No vLLM here: the worker half takes plain `EngineInfo` and per-step metadata, so these
tests drive the same hooks vLLM calls (bind, save_kv_layer, wait_for_save,
start_load_kv, get_finished) in the order vLLM calls them, in one process, with a P and
a D side that talk only through the broker and TCP.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.config import ConfigError, EngineInfo, parse_config
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker, compat_hash
from protocols.errors import BrokerUnavailable, Refused
from protocols.messages import Abort, Layout, Prepare, Register
from tests.faults import refuse_sends
from tests.support import BrokerProcess, engine_step_pause, wait_until
from workers.client import BrokerClient, ClientConfig, SyncBrokerClient

pytestmark = pytest.mark.slow

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@dataclass(frozen=True)
class FakeSpec:
    block_size: int = 32
    num_kv_heads: int = 2
    head_size: int = 64
    use_mla: bool = False


def make_caches(
    num_blocks: int = 64, dtype: torch.dtype = torch.bfloat16, spec: FakeSpec = FakeSpec(), seed: int = 0
) -> dict[str, torch.Tensor]:
    """Layers as views of one allocation, like vLLM's CPU backend: [blocks, heads, bs, 2*head]."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
    whole = torch.randn((len(LAYERS), *shape), generator=g).to(dtype)
    return {name: whole[i] for i, name in enumerate(LAYERS)}


def make_worker(
    broker: str,
    role: str,
    instance: str,
    caches: dict[str, torch.Tensor],
    spec: FakeSpec = FakeSpec(),
    **extra: object,
) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": instance, "pool_bytes": 1 << 22, "staging_bytes": 1 << 22, **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer",
        engine_id=None,
    )
    info = EngineInfo(model="tiny", spec=spec, block_size=spec.block_size, backend="CPU_ATTN/test")
    worker = ConnectorWorker(config, info)
    worker.register_kv_caches(caches)
    return worker


def through_pool(d: ConnectorWorker, prefix: str) -> None:
    """D receives the loads whose transfer id starts with `prefix` into a pool lease and
    scatters them, as it does where its cache declines the tcp wire's writes (a hybrid
    model, a GPU cache), instead of straight into their blocks."""
    consumer = d.consumer
    assert consumer is not None
    places = consumer._places

    def routed(load: Any, nbytes: int) -> Any:
        return None if load.transfer_id.startswith(prefix) else places(load, nbytes)

    consumer._places = routed  # type: ignore[method-assign]


def stage(
    p: ConnectorWorker, caches: dict[str, torch.Tensor], tid: str, blocks: list[int], decode: str = "", tokens: str = ""
) -> None:
    """One producer step, as vLLM runs it."""
    spec = SaveSpec(
        req_id=f"req-{tid}", block_ids=blocks, num_tokens=len(blocks) * 32 - 5, decode=decode, tokens=tokens
    )
    p.bind(KvBrokerMetadata(saves={tid: spec}))
    for name in LAYERS:
        p.save_kv_layer(name, caches[name])
    p.wait_for_save()
    p.clear()


def load(d: ConnectorWorker, tid: str, blocks: list[int], cached: int, tokens: str = "", prefill: str = "") -> None:
    d.bind(
        KvBrokerMetadata(
            loads={
                tid: LoadSpec(
                    req_id=f"req-{tid}", block_ids=blocks, num_cached_blocks=cached, num_tokens=len(blocks) * 32 - 5,
                    tokens=tokens, prefill=prefill,
                )
            }
        )
    )
    d.start_load_kv()
    d.clear()


@contextmanager
def own_broker_pair(
    tmp_path: Path, peer_lease_s: float, seed: int
) -> Iterator[tuple[BrokerProcess, ConnectorWorker, ConnectorWorker, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """A broker of its own (heartbeat 0.5 s, the given peer lease), producer p0 and
    consumer d0 (20 s load deadline) on it, and their caches; all stopped after."""
    b = BrokerProcess(tmp_path, "--heartbeat", "0.5", "--peer-lease", str(peer_lease_s))
    b.start()
    pc, dc = make_caches(seed=seed), make_caches(seed=seed + 1)
    p = make_worker(b.endpoint, "p", "p0", pc)
    d = make_worker(b.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    try:
        yield b, p, d, pc, dc
    finally:
        d.close()
        p.close()
        b.kill()


def wait_for_transfer(broker: BrokerProcess, tid: str) -> None:
    """Until the broker holds `tid` (its Offer or Expect has arrived)."""
    wait_until(lambda: any(t["transfer_id"] == tid for t in broker.status()["transfers"]), 10, f"{tid} at the broker")


def run_steps(d: ConnectorWorker, want: set[str], timeout: float) -> tuple[set[str], set[int], float]:
    """Empty decode steps until every request in `want` is reported; (finished, error blocks, seconds)."""
    t0 = time.monotonic()
    finished: set[str] = set()
    errors: set[int] = set()
    while not want <= finished:
        assert time.monotonic() - t0 < timeout, f"no report for {want - finished} within {timeout} s"
        _, recving = d.get_finished(set())
        finished |= recving or set()
        errors |= d.get_block_ids_with_load_errors()
        engine_step_pause()
    return finished, errors, time.monotonic() - t0


def test_go_during_the_forward_pass_waits_for_the_copy(broker: BrokerProcess) -> None:
    """P offers once the first layer is saved, so the broker's Go can come while P's
    forward pass still runs: the send waits until wait_for_save has every layer, then
    moves exactly those bytes."""
    pc, dc = make_caches(seed=31), make_caches(seed=32)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        src, dst = [3, 4, 5], [20, 21, 22]
        load(d, "t-early", dst, cached=0)
        spec = SaveSpec(req_id="req-t-early", block_ids=src, num_tokens=len(src) * 32 - 5, decode="d0")
        saved = {n: t[src].clone() for n, t in pc.items()}
        p.bind(KvBrokerMetadata(saves={"t-early": spec}))  # the step starts
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])  # its Offer leaves now
        wait_until(lambda: [t["state"] for t in broker.status()["transfers"]] == ["sending"], 10,
                   "the broker's Go, before the forward pass ends")
        assert p.statistics()["sent"] == 0  # nothing may leave before the copy is complete
        for name in LAYERS[1:]:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        p.clear()
        for t in pc.values():  # the blocks are reused right after the step
            t[src] = 0
        _, errors, _ = run_steps(d, {"req-t-early"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][dst], saved[n])
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, "the Release")
        assert p.statistics()["sent"] == 1
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("twin", ["shipped", "unsafe"])
def test_a_go_during_the_forward_pass_streams_each_layer_once_copied(broker: BrokerProcess, twin: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp the send posted at a Go during the forward pass streams the save layer by
    layer: D holds layer 0's bytes of every block before layer 1 is computed, and the
    blocks P writes right after each save never reach D. Its unsafe twin, injected here,
    counts every layer copied at the first save, so the send reads staging not yet
    written and D's blocks differ: the test can fail."""
    from connector import producer

    if twin == "unsafe":
        real = producer._Layers.copied
        monkeypatch.setattr(producer._Layers, "copied",
                            lambda self, layer: [real(self, i) for i in range(len(LAYERS))])
    pc, dc = make_caches(seed=41), make_caches(seed=42)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        mismatched = 0
        for round_ in range(3):
            tid, src, dst = f"s{round_}", [3 + round_, 9, 12 + round_, 30], [40, 41 + round_, 50, 60 - round_]
            for t in pc.values():
                t[src] = torch.randn_like(t[src])
            saved = {n: t[src].clone() for n, t in pc.items()}
            load(d, tid, dst, cached=0)
            sent = p.statistics()["sent"]
            p.bind(KvBrokerMetadata(saves={tid: SaveSpec(req_id=f"req-{tid}", block_ids=src,
                                                         num_tokens=len(src) * 32 - 5, decode="d0")}))
            p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])
            pc[LAYERS[0]][src] = -7.0  # the next layer's compute reuses the blocks at once
            if twin == "shipped":  # streamed, straight into D's blocks: layer 0 is there before layer 1 is saved
                wait_until(lambda: [t["state"] for t in broker.status()["transfers"]] == ["sending"], 10,
                           "the broker's Go, before the forward pass ends")
                wait_until(lambda: torch.equal(dc[LAYERS[0]][dst], saved[LAYERS[0]]), 10,
                           "layer 0's bytes in D's blocks before layer 1 is saved")
                assert p.statistics()["sent"] == sent
            else:  # every layer counted copied: the send, on the Go, has nothing to wait for
                wait_until(lambda: p.statistics()["sent"] == sent + 1, 10,
                           "the unsafe twin's whole send, before the forward pass ends")
            for name in LAYERS[1:]:
                p.save_kv_layer(name, pc[name])
                pc[name][src] = -7.0
            p.wait_for_save()
            p.clear()
            _, errors, _ = run_steps(d, {f"req-{tid}"}, 10)
            assert errors == set()
            mismatched += any(not torch.equal(dc[n][dst], saved[n]) for n in LAYERS)
        if twin == "shipped":
            assert mismatched == 0
        else:
            assert mismatched == 3, "the send read staging before its layers were copied: the test can fail"
    finally:
        p.close()
        d.close()


def test_over_tcp_the_kv_lands_straight_in_the_blocks_and_nothing_is_scattered(
        broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """D's receiving thread writes each block of each layer where it belongs as the bytes
    come (`CachePlaces`), with and without a prefix hit: the engine's get_finished
    scatters nothing, the blocks hold what P saved, the blocks around them and the
    prefix-hit head are untouched, and the receive pool's leases all come back."""
    from connector import consumer

    scattered: list[int] = []
    real = consumer.scatter_layers_from_staging
    monkeypatch.setattr(consumer, "scatter_layers_from_staging",
                        lambda *args: (scattered.append(1), real(*args))[1])
    pc, dc = make_caches(seed=51), make_caches(seed=52)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        for i, cached in enumerate([0, 1, 2, 0]):
            src, dst = [5 + i, 17, 40 - i, 9], [50 - i, 2, 33, 21 + i]
            for t in pc.values():
                t[src] = torch.randn_like(t[src])
            before = {n: t.clone() for n, t in dc.items()}
            load(d, f"in{i}", dst, cached=cached)
            stage(p, pc, f"in{i}", src, decode="d0")
            finished, errors, _ = run_steps(d, {f"req-in{i}"}, 10)
            assert errors == set()
            for n, t in dc.items():
                assert torch.equal(t[dst[cached:]], pc[n][src[cached:]]), (i, n)
                rest = [b for b in range(t.shape[0]) if b not in dst[cached:]]
                assert torch.equal(t[rest], before[n][rest]), f"{n}: blocks outside the load's tail changed"
        assert scattered == []
        assert d.pool is not None and d.pool.statistics().leases == 0  # given back by the step that reported each
    finally:
        p.close()
        d.close()


def test_a_load_into_its_blocks_is_done_at_the_broker_before_the_engine_reports_it(broker: BrokerProcess) -> None:
    """Over tcp into its blocks, D's receiving task sends the Done as the bytes land: the
    broker has completed the transfer and P has released its staging while D's engine has
    not called get_finished yet. The get_finished that then reports it sends no second
    Done, which the broker would refuse and count as an error: a later transfer through
    the same D, whose messages follow on the same socket, completes with none counted."""
    pc, dc = make_caches(seed=55), make_caches(seed=56)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        counters = broker.status()["counters"]
        completed, errors = counters.get("completed", 0), counters.get("errors", 0)
        src, dst = [4, 11, 19, 26], [30, 8, 44, 15]
        load(d, "early", dst, cached=1)
        stage(p, pc, "early", src, decode="d0")
        wait_until(lambda: broker.status()["counters"].get("completed", 0) == completed + 1
                   and p.statistics()["released"] == 1, 10, "the broker's completion before D's engine reports it")
        assert d.statistics()["loaded"] == 0 and d.statistics()["done_at_landing"] == 1
        for n, t in dc.items():
            assert torch.equal(t[dst[1:]], pc[n][src[1:]]), n
        assert run_steps(d, {"req-early"}, 10)[1] == set()
        assert d.statistics()["loaded"] == 1
        load(d, "later", dst, cached=0)
        stage(p, pc, "later", src, decode="d0")
        assert run_steps(d, {"req-later"}, 10)[1] == set()
        wait_until(lambda: p.statistics()["released"] == 2, 10, "the later transfer's release")
        counters = broker.status()["counters"]
        assert counters.get("completed", 0) == completed + 2 and counters.get("errors", 0) == errors, counters
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("then", ["next_step", "close", "no_step"])
def test_a_load_landing_while_an_idle_step_waits_is_reported_by_it_and_done_by_the_next(
        broker: BrokerProcess, then: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle step's get_finished is waiting for the load when it lands: that step reports
    it, and the receiving task sends no Done (it would hold the GIL from the step that is
    about to report the load). Nor does the reporting step: the engine goes from it to
    scheduling the request, so its Done waits for the next step's get_finished, and the
    broker holds the transfer until then; where the engine shuts down instead, until
    `close`; and where no step comes (the request's client went away and nothing else
    runs), until the client's loop sends it (`HELD_DONES_S`, raised here but in that
    case, so that the check of the hold cannot race it). P's forward pass is held after
    its first layer until the step waits, so the load can only land during that wait."""
    from tests.connector.test_consumer_idle import _SaysWaiting

    if then != "no_step":
        monkeypatch.setattr("connector.consumer.HELD_DONES_S", 60.0)

    pc, dc = make_caches(seed=57), make_caches(seed=58)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    assert d.consumer is not None
    d.consumer.landed = waits = _SaysWaiting(d.lock)
    d.consumer.idle_wait_s = 30.0  # a slow machine cannot turn the landing into the wait's end
    reported: list[set[str] | None] = []
    try:
        src, dst = [6, 13, 21, 28], [31, 9, 45, 16]
        load(d, "waited", dst, cached=0)
        p.bind(KvBrokerMetadata(saves={"waited": SaveSpec(req_id="req-waited", block_ids=src,
                                                          num_tokens=len(src) * 32 - 5, decode="d0")}))
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])
        wait_until(lambda: [t["state"] for t in broker.status()["transfers"]] == ["sending"], 10,
                   "the Go, with P's forward pass held after its first layer")

        def idle_step() -> None:
            d.bind(KvBrokerMetadata(idle=True))
            reported.append(d.get_finished(set())[1])
            d.clear()

        step = threading.Thread(target=idle_step, daemon=True)
        step.start()
        assert waits.waiting.wait(10), "the idle step never waited for the load"
        for name in LAYERS[1:]:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        p.clear()
        step.join(20)
        assert reported == [{"req-waited"}]
        assert d.statistics()["loaded"] == 1 and d.statistics()["done_at_landing"] == 0
        assert d.statistics()["seen_waiting"] == 1
        if then != "no_step":
            assert [t["state"] for t in broker.status()["transfers"]] == ["sending"]  # no Done yet
            assert p.statistics()["released"] == 0
        if then == "next_step":
            d.bind(KvBrokerMetadata())
            assert d.get_finished(set()) == (None, None)
            d.clear()
        elif then == "close":
            d.close()
        wait_until(lambda: p.statistics()["released"] == 1, 10, f"the release on the Done sent at {then}")
        assert broker.status()["transfers"] == []
        for n, t in dc.items():
            assert torch.equal(t[dst], pc[n][src]), n
    finally:
        p.close()
        d.close()


def test_over_tcp_a_load_into_its_blocks_takes_no_pool_room_whatever_its_size(broker: BrokerProcess) -> None:
    """D's receive pool holds less than one transfer: the loads that go straight into
    their blocks need none of it (their Expect says so, and the broker reserves nothing),
    so they all land. A load whose bytes must go through the pool is refused by the
    broker, naming the sizes."""
    pc, dc = make_caches(seed=61), make_caches(seed=62)
    src, dst = [3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25]
    p = make_worker(broker.endpoint, "p", "p0", pc)
    probe = make_worker(broker.endpoint, "d", "d-probe", make_caches(seed=0))
    nbytes = len(dst) * len(LAYERS) * probe.block_nbytes
    probe.close()
    d = make_worker(broker.endpoint, "d", "d0", dc, pool_bytes=nbytes // 2)
    through_pool(d, "pooled")
    try:
        assert d.pool is not None and d.pool.capacity < nbytes
        for i in range(3):
            load(d, f"small-pool{i}", dst, cached=0)
            stage(p, pc, f"small-pool{i}", src, decode="d0")
            _, errors, _ = run_steps(d, {f"req-small-pool{i}"}, 10)
            assert errors == set()
            for n, t in dc.items():
                assert torch.equal(t[dst], pc[n][src]), (i, n)
            assert d.pool.statistics().reserved == 0
        load(d, "pooled", dst, cached=0)
        stage(p, pc, "pooled", src, decode="d0")
        _, errors, _ = run_steps(d, {"req-pooled"}, 10)
        assert errors == set(dst)
    finally:
        p.close()
        d.close()


def test_a_step_that_misses_a_layer_ends_its_transfer_at_once(broker: BrokerProcess) -> None:
    """Offered at its first layer, a copy that then misses a layer is not sent half-written: P aborts
    it at the broker, and D's load fails at once rather than at its 30 s deadline."""
    pc, dc = make_caches(seed=33), make_caches(seed=34)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    try:
        load(d, "t-half", [30, 31], cached=0)
        spec = SaveSpec(req_id="req-t-half", block_ids=[1, 2], num_tokens=2 * 32 - 5, decode="d0")
        p.bind(KvBrokerMetadata(saves={"t-half": spec}))
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])  # the step ends after one layer
        p.wait_for_save()
        p.clear()
        _, errors, took = run_steps(d, {"req-t-half"}, 20)
        assert errors == {30, 31} and took < 5
        assert p.statistics()["staged_now"] == 0 and p.statistics()["sent"] == 0
    finally:
        p.close()
        d.close()


def test_transfer_skips_prefix_hit_and_never_writes_it(broker: BrokerProcess) -> None:
    pc, dc = make_caches(seed=1), make_caches(seed=2)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        src, dst = [5, 9, 2, 40], [7, 8, 30, 31]
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-1", dst, cached=1)  # D's request first (Expect), as usual
        stage(p, pc, "t-1", src, decode="d0")
        # vLLM frees and reuses P's blocks right after the step: the staged copy is what moves.
        saved = {n: t[src].clone() for n, t in pc.items()}
        for t in pc.values():
            t[src] = 0
        _, errors, _ = run_steps(d, {"req-t-1"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][dst[1:]], saved[n][1:])  # the tail arrived intact
            assert torch.equal(dc[n][dst[0]], before[n][dst[0]])  # the prefix-cached block was not written
            others = [b for b in range(dc[n].shape[0]) if b not in dst[1:]]
            assert torch.equal(dc[n][others], before[n][others])
        assert d.statistics()["loaded"] == 1
        wait_until(lambda: not p.statistics()["staged_now"], 5, "P to release its staged copy")
        assert p.statistics()["released"] == 1 and p.pool is not None and p.pool.statistics().reserved == 0
        assert d.pool is not None and d.pool.statistics().reserved == 0
    finally:
        p.close()
        d.close()


def save_many(p: ConnectorWorker, caches: dict[str, torch.Tensor], saves: dict[str, tuple[list[int], str]]) -> None:
    """One producer step saving several transfers: id -> (blocks, the decode instance named, or "")."""
    p.bind(KvBrokerMetadata(saves={
        tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=2 * 32 - 5, decode=decode)
        for tid, (src, decode) in saves.items()}))
    for name in LAYERS:
        p.save_kv_layer(name, caches[name])
    p.wait_for_save()
    p.clear()


def run_steps_on(ds: dict[str, ConnectorWorker], want: dict[str, set[str]], timeout: float) -> set[tuple[str, int]]:
    """Empty steps on every decode instance until each reported the requests it must;
    returns (instance, block) for every load error seen."""
    t0 = time.monotonic()
    done: dict[str, set[str]] = {h: set() for h in want}
    errors: set[tuple[str, int]] = set()
    while any(not want[h] <= done[h] for h in want):
        assert time.monotonic() - t0 < timeout, f"no report for {({h: want[h] - done[h] for h in want})}"
        for h in want:
            _, recving = ds[h].get_finished(set())
            done[h] |= recving or set()
            errors |= {(h, blk) for blk in ds[h].get_block_ids_with_load_errors()}
        engine_step_pause()
    return errors


def test_offer_before_request_is_parked(broker: BrokerProcess) -> None:
    pc, dc = make_caches(seed=3), make_caches(seed=4)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        stage(p, pc, "t-2", [1, 2, 3], decode="d0")
        # The Prepare reaches D before its request does, and waits parked.
        assert d.consumer is not None
        wait_until(lambda: "t-2" in d.consumer._parked, 10, "D to park the early Prepare")
        load(d, "t-2", [10, 11, 12], cached=0)
        _, errors, _ = run_steps(d, {"req-t-2"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[10, 11, 12]], pc[n][[1, 2, 3]])
    finally:
        p.close()
        d.close()


def test_a_claim_reserves_its_room_at_the_broker_before_the_prefill_offers(broker: BrokerProcess) -> None:
    """D's Expect says the bytes P will offer (the staged size of every block of the
    prompt, a prefix hit included): the broker holds that room in D's pool from the claim,
    the Offer finds it held, and the room comes back once the KV is in. (A load through
    the pool, as a GPU cache's or a hybrid model's is; one straight into a CPU cache's
    blocks takes no room.)"""
    pc, dc = make_caches(seed=5), make_caches(seed=6)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    through_pool(d, "t-room")
    try:
        load(d, "t-room", [20, 21, 22, 23], cached=1)

        def claim() -> dict | None:
            status = broker.status()
            held = [t for t in status["transfers"] if t["transfer_id"] == "t-room" and t["state"] == "expected"]
            pool = next(x for x in status["pools"] if x["peer_id"] == "d0:0")
            return {"nbytes": held[0]["nbytes"], "reserved": pool["reserved"]} if held and pool["reserved"] else None

        held = wait_until(claim, 10, "the claim's room reserved at the broker")
        assert held["nbytes"] == 4 * len(LAYERS) * p.block_nbytes  # what P stages for 4 blocks
        assert held["reserved"] >= held["nbytes"]
        stage(p, pc, "t-room", [1, 2, 3, 4], decode="d0")
        _, errors, _ = run_steps(d, {"req-t-room"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[21, 22, 23]], pc[n][[2, 3, 4]])
        wait_until(lambda: next(x for x in broker.status()["pools"] if x["peer_id"] == "d0:0")["reserved"] == 0,
                   10, "the room back once the KV is in")
    finally:
        p.close()
        d.close()


def test_an_offer_naming_no_decode_instance_reaches_the_one_of_two_that_holds_the_request(
    broker: BrokerProcess,
) -> None:
    """Two decode instances, and a proxy that names none: P offers before either has the
    request. The broker must not guess (a wrong guess failed the request on the instance
    that held it): the transfer waits for d1's Expect and arrives there whole."""
    pc = make_caches(seed=38)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    caches = {name: make_caches(seed=39 + k) for k, name in enumerate(("d0", "d1"))}
    ds = {name: make_worker(broker.endpoint, "d", name, caches[name]) for name in caches}
    try:
        stage(p, pc, "t-unnamed", [1, 2, 3])
        wait_for_transfer(broker, "t-unnamed")
        load(ds["d1"], "t-unnamed", [10, 11, 12], cached=0)
        _, errors, _ = run_steps(ds["d1"], {"req-t-unnamed"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(caches["d1"][n][[10, 11, 12]], pc[n][[1, 2, 3]])
        assert ds["d0"].consumer is not None and not ds["d0"].consumer._parked
    finally:
        p.close()
        for d in ds.values():
            d.close()


def test_a_request_the_proxy_sent_to_another_decode_instance_than_it_named_still_loads(
    broker: BrokerProcess,
) -> None:
    """P's Offer names d1, but the request went to d0 (a proxy that retried it there).
    d1 parks the Prepare for a request it does not hold; d0's Expect takes the transfer
    from it, and d0 loads the KV whole (before, d0's Expect was refused and its load
    failed, while d1 held P's copy until its own deadline)."""
    pc = make_caches(seed=43)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    caches = {name: make_caches(seed=44 + k) for k, name in enumerate(("d0", "d1"))}
    ds = {name: make_worker(broker.endpoint, "d", name, caches[name]) for name in caches}
    try:
        stage(p, pc, "t-moved", [4, 5], decode="d1")
        consumer = ds["d1"].consumer
        assert consumer is not None
        wait_until(lambda: "t-moved" in consumer._parked, 10, "d1 to park the Prepare")
        load(ds["d0"], "t-moved", [20, 21], cached=0)
        _, errors, _ = run_steps(ds["d0"], {"req-t-moved"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(caches["d0"][n][[20, 21]], pc[n][[4, 5]])
        wait_until(lambda: "t-moved" not in consumer._parked, 5, "d1 to drop the parked Prepare")
        wait_until(lambda: not p.statistics()["staged_now"], 5, "P to release its copy")
    finally:
        p.close()
        for d in ds.values():
            d.close()


def test_a_request_sent_again_after_its_decode_instance_died_gets_the_staged_kv(tmp_path: Path) -> None:
    """d1 holds the request and dies; the proxy sends the request again to d0 at once,
    before the broker's lease on d1 has run out. d0's claim waits behind d1, and when d1
    is evicted d0 gets P's staged copy, whole: no second prefill, no recompute (before,
    d0's claim was refused and its load failed)."""
    with own_broker_pair(tmp_path, 2, seed=46) as (b, p, d0, pc, dc0):
        dc1 = make_caches(seed=48)
        d1 = make_worker(b.endpoint, "d", "d1", dc1, load_timeout_s=20.0)
        try:
            load(d1, "t-again", [7, 8], cached=0)
            wait_for_transfer(b, "t-again")
            assert d1.client is not None
            d1.client._future.cancel()  # d1 dies without a goodbye
            stage(p, pc, "t-again", [3, 4], decode="d1")
            wait_until(lambda: any(t["transfer_id"] == "t-again" and t["state"] == "preparing"
                                   for t in b.status()["transfers"]), 10, "the Prepare to the dead d1")
            load(d0, "t-again", [20, 21], cached=0)
            _, errors, took = run_steps(d0, {"req-t-again"}, 15)
            assert errors == set(), took
            for n in LAYERS:
                assert torch.equal(dc0[n][[20, 21]], pc[n][[3, 4]])
            wait_until(lambda: not p.statistics()["staged_now"], 5, "P to release its copy")
            assert (p.statistics()["staged"], p.statistics()["released"], p.statistics()["aborted"]) == (1, 1, 0)
        finally:
            d1.close()


def test_a_copy_for_a_decode_instance_that_is_down_is_freed_after_one_lease(tmp_path: Path) -> None:
    """P's Offer names d1, which is down; d0 is up. The KV is useless to d0 (the request
    is on d1), so d0 gets nothing, and P frees its copy one peer lease (2 s) later. Before,
    d0 was sent it, and held it, and P's staging, until d0's 20 s load deadline."""
    with own_broker_pair(tmp_path, 2, seed=41) as (_, p, d, pc, _):
        t0 = time.monotonic()
        stage(p, pc, "t-down", [1, 2], decode="d1")
        wait_until(lambda: not p.statistics()["staged_now"], 10, "P to free the copy for d1")
        assert time.monotonic() - t0 < 10 and p.statistics()["aborted"] == 1
        assert d.consumer is not None and not d.consumer._parked
        assert d.pool is not None and d.pool.statistics().reserved == 0


def test_missing_producer_fails_within_deadline(broker: BrokerProcess) -> None:
    dc = make_caches(seed=5)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=1.0)
    try:
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-3", [4, 5, 6], cached=1)
        _, errors, took = run_steps(d, {"req-t-3"}, 5)
        assert errors == {5, 6}  # the blocks that were to be loaded; not D's prefix hit
        assert 0.9 < took < 3
        for n in LAYERS:
            assert torch.equal(dc[n], before[n])
        assert d.statistics()["failed"] == 1 and d.statistics()["loading_now"] == 0
    finally:
        d.close()


def test_dead_producer_fails_load_after_its_lease(broker: BrokerProcess) -> None:
    pc, dc = make_caches(seed=6), make_caches(seed=7)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    try:
        stage(p, pc, "t-4", [1, 2], decode="d0")
        # P vanishes without a goodbye: stop its heartbeats and its sends.
        assert p.client is not None and p.producer is not None and p.producer.sender is not None
        p.client._future.cancel()
        p.producer.sender.close()
        load(d, "t-4", [3, 4], cached=0)
        _, errors, took = run_steps(d, {"req-t-4"}, 10)
        assert errors == {3, 4} and took < 5  # the broker's 1 s peer lease, not D's 30 s deadline
    finally:
        d.close()


def test_a_request_behind_its_transfers_abort_fails_at_once(broker: BrokerProcess) -> None:
    """P offered to d1 and died; the broker aborted the transfer on d1 before d0, which
    holds the request, said anything. d0's load fails at once on the broker's answer
    to its Expect, not at its 30 s deadline; d1 stays clean."""
    pc, dc, d1c = make_caches(seed=25), make_caches(seed=26), make_caches(seed=27)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d0 = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    d1 = make_worker(broker.endpoint, "d", "d1", d1c, load_timeout_s=30.0)
    try:
        stage(p, pc, "t-late", [1, 2], decode="d1")
        assert p.client is not None and p.producer is not None and p.producer.sender is not None
        p.client._future.cancel()  # P vanishes without a goodbye
        p.producer.sender.close()
        wait_until(lambda: all(t["transfer_id"] != "t-late" for t in broker.status()["transfers"]), 10,
                   "the broker to abort t-late when p0's lease ends")
        load(d0, "t-late", [3, 4], cached=0)
        _, errors, took = run_steps(d0, {"req-t-late"}, 10)
        assert errors == {3, 4} and took < 5
        assert d1.statistics()["loading_now"] == 0
    finally:
        d0.close()
        d1.close()


@pytest.mark.parametrize("producer", ["alive", "dead"])
def test_a_load_the_broker_lost_track_of_while_stopped_fails_at_once(broker: BrokerProcess, producer: str) -> None:
    """The broker stalls past every lease while D receives (stopped, starved): the peers
    take it for lost and register again; it evicts them and ends the transfer, and the
    Abort meant for D goes to D's old socket. D's load still ends at once, not at its
    20 s deadline: on the Abort answering the Expect D re-announces (P dead), or on the
    second Prepare of the Offer P re-sends (P alive)."""
    pc, dc = make_caches(seed=28), make_caches(seed=29)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    try:
        assert p.client is not None and p.producer is not None and p.producer.sender is not None
        assert d.client is not None and d.consumer is not None
        p.producer.sender.close()  # P's bytes never come: the receive stays open
        stage(p, pc, "t-stall", [1, 2], decode="d0")
        wait_until(lambda: "t-stall" in d.consumer._parked, 10, "D to park the Prepare")  # as in a cluster
        load(d, "t-stall", [3, 4], cached=0)
        wait_until(lambda: d.consumer._loads["t-stall"].state == "receiving", 10, "D to be receiving")
        if producer == "dead":
            p.client._future.cancel()
        with broker.paused():
            wait_until(lambda: not d.client.client.connected, 10, "D to take the stopped broker for lost")
        _, errors, took = run_steps(d, {"req-t-stall"}, 30)
        assert errors == {3, 4} and took < 10
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(
    ("p_dtype", "p_spec", "differs"),
    [
        (torch.float16, FakeSpec(), "dtype: float16 vs bfloat16"),
        (torch.bfloat16, FakeSpec(block_size=64), "block_size: 64 vs 32"),
    ],
)
def test_incompatible_peers_are_refused_naming_the_difference(
    broker: BrokerProcess, p_dtype: torch.dtype, p_spec: FakeSpec, differs: str
) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        with pytest.raises(Refused) as info:
            make_worker(broker.endpoint, "p", "p0", make_caches(dtype=p_dtype, spec=p_spec), spec=p_spec)
        assert differs in str(info.value)
        assert "prefill instance p0 is incompatible with decode instance d0" in str(info.value)
    finally:
        d.close()


def test_a_peer_on_another_transport_or_chunk_plan_is_refused_naming_it(broker: BrokerProcess) -> None:
    """P and D on different transports, over nccl cutting transfers into different chunks
    (an NCCL send and the receive it pairs with must be the same size), or over tcp
    reading a transfer's bytes in another order (a release that sent them block by
    block), are refused at registration, naming the difference, not at their first
    transfer."""
    from connector.nccl_link import plan

    p = make_worker(broker.endpoint, "p", "p0", make_caches())
    assert p.compat["transport"] == "tcp, layer by layer"
    try:
        for other in ("nccl, " + plan(), "nccl, chunks v1 of 64..1024 MiB, last 16 MiB, growth 4/4", "tcp"):
            with pytest.raises(Refused) as info:
                _Peer(broker.endpoint, "decode", {**p.compat, "transport": other}, {})  # registers, or raises
            assert f"transport: {other} vs tcp, layer by layer" in str(info.value)
    finally:
        p.close()


def test_unreachable_broker_names_address_and_what_to_run(tmp_path: Path) -> None:
    address = "tcp://127.0.0.1:9"  # discard port: nothing answers ZMQ there
    with pytest.raises(BrokerUnavailable) as info:
        make_worker(address, "p", "p0", make_caches(), register_timeout_s=0.5)
    text = str(info.value)
    assert address in text and "kvbroker serve" in text


def test_abort_from_decode_frees_producer_staging(broker: BrokerProcess) -> None:
    """A layout mismatch found on D aborts the transfer: D reports load errors, P frees its lease."""
    pc, dc = make_caches(seed=10), make_caches(seed=11)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        load(d, "t-5", [30, 31, 32], cached=0)  # D's request spans 3 blocks...
        stage(p, pc, "t-5", [1, 2], decode="d0")  # ...but P staged 2
        _, errors, took = run_steps(d, {"req-t-5"}, 10)
        assert errors == {30, 31, 32} and took < 5
        wait_until(lambda: not p.statistics()["staged_now"], 5, "P to release its staged copy")
        assert p.statistics()["aborted"] == 1
        assert p.pool is not None and p.pool.statistics().reserved == 0
        assert d.pool is not None and d.pool.statistics().reserved == 0
    finally:
        p.close()
        d.close()


def test_named_prefill_lost_before_offering_fails_the_load_at_once(broker: BrokerProcess) -> None:
    """D's request names its prefill instance; that instance leaves before offering: the
    load fails now (the policy applies), not at D's 30 s load deadline."""
    pc, dc = make_caches(seed=23), make_caches(seed=24)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    try:
        load(d, "t-orphan", [30, 31], cached=0, prefill="p0")
        wait_for_transfer(broker, "t-orphan")
        p.close()  # says goodbye: p0 will offer nothing more
        _, errors, took = run_steps(d, {"req-t-orphan"}, 10)
        assert errors == {30, 31} and took < 10
    finally:
        p.close()
        d.close()


def test_a_prefill_instance_restarted_under_its_id_fails_the_loads_that_named_it(tmp_path: Path) -> None:
    """D's request names its prefill instance, which dies before offering and comes back
    (a new process, same instance id) well within its 10 s lease. The new process will
    never offer what the old one was computing: D's load fails at once, not at its 20 s
    deadline. (The same process registering again, a reconnect, keeps the wait: its
    Offers follow.)"""
    with own_broker_pair(tmp_path, 10, seed=34) as (b, p, d, pc, _):
        load(d, "t-lost", [30, 31], cached=0, prefill="p0")
        wait_for_transfer(b, "t-lost")
        assert p.client is not None
        p.client._future.cancel()  # the process dies without a goodbye
        t0 = time.monotonic()
        p2 = make_worker(b.endpoint, "p", "p0", pc)  # and comes back under its id
        try:
            _, errors, took = run_steps(d, {"req-t-lost"}, 30)
            assert errors == {30, 31} and time.monotonic() - t0 < 5, took
        finally:
            p2.close()


def test_a_load_naming_a_prefill_instance_down_across_a_broker_restart_fails_after_one_lease(tmp_path: Path) -> None:
    """D's request names its prefill instance; that instance dies (no goodbye), and the
    broker restarts before its lease ends. The new broker never hears of it: D registers
    again and re-announces the load, and the Expect ends one peer lease (2 s) later, not
    at D's 20 s load deadline."""
    with own_broker_pair(tmp_path, 2, seed=36) as (b, p, d, _, _):
        load(d, "t-absent", [30, 31], cached=0, prefill="p0")
        wait_for_transfer(b, "t-absent")
        assert p.client is not None
        p.client._future.cancel()  # p0 dies without a goodbye
        b.kill()
        b.start()  # same address, no memory of p0
        t0 = time.monotonic()
        _, errors, took = run_steps(d, {"req-t-absent"}, 30)
        assert errors == {30, 31} and time.monotonic() - t0 < 10, took


def test_kv_of_another_prompt_is_refused_by_the_decode_side(broker: BrokerProcess) -> None:
    """P and D got different prompts under one transfer_id (a proxy bug): D compares the
    prompt digest P sent with its own, fails the load instead of decoding from that KV,
    and P's staged copy is freed. The same digest, or an unknown one, loads."""
    pc, dc = make_caches(seed=17), make_caches(seed=18)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-x", [20, 21], cached=0, tokens="bbbb")
        stage(p, pc, "t-x", [1, 2], decode="d0", tokens="aaaa")
        _, errors, _ = run_steps(d, {"req-t-x"}, 10)
        assert errors == {20, 21}
        for n in LAYERS:
            assert torch.equal(dc[n], before[n])
        wait_until(lambda: not p.statistics()["staged_now"], 5, "P to free the refused transfer's staging")
        aborted = [json.loads(line) for line in broker.log_path.read_text().splitlines() if "transfer.aborted" in line]
        assert any("is for another prompt" in a.get("reason", "") for a in aborted), aborted
        load(d, "t-y", [22, 23], cached=0, tokens="cccc")
        stage(p, pc, "t-y", [3, 4], decode="d0", tokens="cccc")
        load(d, "t-z", [24, 25], cached=0)  # no digest on D's side: nothing to compare
        stage(p, pc, "t-z", [5, 6], decode="d0", tokens="dddd")
        _, errors, _ = run_steps(d, {"req-t-y", "req-t-z"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[22, 23, 24, 25]], pc[n][[3, 4, 5, 6]])
    finally:
        p.close()
        d.close()


def test_a_step_of_several_saves_is_staged_together_and_each_arrives_whole(broker: BrokerProcess) -> None:
    """A step's saves share one cut-up lease, so each layer is copied once for all of them;
    every request still reaches D intact, and its staging goes back on its own Release."""
    pc, dc = make_caches(seed=31), make_caches(seed=32)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        plan = {"t-g0": ([5, 9, 2], [40, 41, 42]), "t-g1": ([17], [43]), "t-g2": ([30, 31], [44, 45])}
        for tid, (_, dst) in plan.items():
            load(d, tid, dst, cached=0)
        saves = {tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=len(src) * 32 - 5, decode="d0")
                 for tid, (src, _) in plan.items()}
        p.bind(KvBrokerMetadata(saves=saves))
        assert p.producer is not None and p.producer._group is None  # staged at the first layer's save
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])
        assert p.producer._group is not None
        assert p.producer._group.members == [p.producer._staged[tid] for tid in plan]
        leases = [p.producer._staged[tid].lease for tid in plan]
        assert [lease.offset + lease.nbytes for lease in leases[:-1]] == [lease.offset for lease in leases[1:]]
        for name in LAYERS[1:]:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        p.clear()
        _, errors, _ = run_steps(d, {f"req-{tid}" for tid in plan}, 10)
        assert errors == set()
        for name in LAYERS:
            for src, dst in plan.values():
                assert torch.equal(dc[name][dst], pc[name][src]), (name, src, dst)
        wait_until(lambda: p.pool is not None and p.pool.statistics().reserved == 0, 10, "P's staging released")
    finally:
        p.close()
        d.close()


def test_a_save_naming_a_block_outside_the_cache_fails_alone(broker: BrokerProcess) -> None:
    """One save's bad block id (a scheduler bug, a cache of another size) must not take
    its step's other saves, or the forward pass, with it: the step is staged one save at
    a time, the bad save is aborted naming the id, so its decode load fails at once, and
    the other save arrives whole."""
    pc, dc = make_caches(seed=33), make_caches(seed=34)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    try:
        load(d, "t-ok", [20, 21], cached=0)
        load(d, "t-bad", [22, 23], cached=0)
        saves = {"t-ok": SaveSpec(req_id="req-t-ok", block_ids=[1, 2], num_tokens=59, decode="d0"),
                 "t-bad": SaveSpec(req_id="req-t-bad", block_ids=[3, 999], num_tokens=59, decode="d0")}
        p.bind(KvBrokerMetadata(saves=saves))
        assert p.producer is not None and p.producer._group is None
        for name in LAYERS:
            p.save_kv_layer(name, pc[name])  # raises nothing into the forward pass
        p.wait_for_save()
        p.clear()
        _, errors, took = run_steps(d, {"req-t-ok", "req-t-bad"}, 10)
        assert errors == {22, 23} and took < 10
        for name in LAYERS:
            assert torch.equal(dc[name][[20, 21]], pc[name][[1, 2]])
        aborted = [json.loads(line) for line in broker.log_path.read_text().splitlines() if "transfer.aborted" in line]
        assert any("block id 999 is outside" in a.get("reason", "") for a in aborted), aborted
        wait_until(lambda: p.pool is not None and p.pool.statistics().reserved == 0, 10, "P's staging released")
    finally:
        p.close()
        d.close()


def test_a_layer_that_cannot_be_copied_fails_the_saves_of_its_group(broker: BrokerProcess) -> None:
    """A layer handed over as a tensor of another shape than the one registered cannot be
    copied for the step's grouped saves: they are all aborted (their loads fail at once),
    nothing is raised into the forward pass, and their staging goes back."""
    pc, dc = make_caches(seed=35), make_caches(seed=36)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=30.0)
    try:
        load(d, "t-a", [20], cached=0)
        load(d, "t-b", [21, 22], cached=0)
        saves = {"t-a": SaveSpec(req_id="req-t-a", block_ids=[1], num_tokens=27, decode="d0"),
                 "t-b": SaveSpec(req_id="req-t-b", block_ids=[2, 3], num_tokens=59, decode="d0")}
        p.bind(KvBrokerMetadata(saves=saves))
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])
        assert p.producer is not None and p.producer._group is not None
        p.save_kv_layer(LAYERS[1], pc[LAYERS[1]][:, :1])  # not the registered shape
        p.wait_for_save()
        p.clear()
        _, errors, took = run_steps(d, {"req-t-a", "req-t-b"}, 10)
        assert errors == {20, 21, 22} and took < 10
        wait_until(lambda: p.pool is not None and p.pool.statistics().reserved == 0, 10, "P's staging released")
        assert p.statistics()["aborted"] == 2
    finally:
        p.close()
        d.close()


def test_full_staging_pool_stalls_a_step_once_not_once_per_save(broker: BrokerProcess) -> None:
    """Backpressure on prefill is bounded per step: with the staging pool full (nothing
    is ever released: no decode peer), a step of three saves waits load_timeout_s in
    all, then drops them, instead of waiting that long for each one."""
    pc = make_caches(seed=16)
    block = len(LAYERS) * 2 * 32 * 128 * 2  # one block, every layer: heads x block x 2*head x bf16
    p = make_worker(broker.endpoint, "p", "p0", pc, staging_bytes=4 * block, load_timeout_s=1.0)
    try:
        stage(p, pc, "t-full", [1, 2, 3, 4])  # fills the pool; no D ever takes it
        assert p.pool is not None and p.pool.statistics().free == 0
        saves = {f"t-w{i}": SaveSpec(req_id=f"req-w{i}", block_ids=[10 + i], num_tokens=27) for i in range(3)}
        t0 = time.monotonic()
        p.bind(KvBrokerMetadata(saves=saves))
        for name in LAYERS:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        took = time.monotonic() - t0
        p.clear()
        assert 0.9 < took < 2.0, f"the step waited {took:.2f} s for 3 saves with a 1 s deadline"
        assert p.statistics()["staged_now"] == 1  # only the first transfer holds staging
    finally:
        p.close()


def test_a_save_without_staging_room_fails_its_decode_load_at_once(broker: BrokerProcess) -> None:
    """P cannot stage a save (its staging pool stays full): D's load of it fails within
    seconds, so vLLM recomputes, instead of waiting its whole load_timeout_s for an Offer
    that will never come."""
    pc, dc = make_caches(seed=22), make_caches(seed=23)
    block = len(LAYERS) * 2 * 32 * 128 * 2  # one block, every layer: heads x block x 2*head x bf16
    p = make_worker(broker.endpoint, "p", "p0", pc, staging_bytes=4 * block, load_timeout_s=1.0)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=60.0)
    try:
        stage(p, pc, "t-full", [1, 2, 3, 4])  # fills P's staging pool; no decode peer takes it
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-nostage", [30, 31], cached=0)
        stage(p, pc, "t-nostage", [5, 6], decode="d0")  # waits 1 s for room, then gives up
        _, errors, _ = run_steps(d, {"req-t-nostage"}, 15)  # D's own deadline is 60 s
        assert errors == {30, 31}
        for n in LAYERS:
            assert torch.equal(dc[n], before[n])
        assert d.statistics()["failed"] == 1 and d.statistics()["loaded"] == 0
    finally:
        p.close()
        d.close()


def test_a_step_whose_saves_do_not_fit_its_staging_together_fails_the_one_left_over_at_once(
        broker: BrokerProcess) -> None:
    """Two saves of one step that fit P's staging one at a time but not together: only the
    first one's Release could make room for the second, and it is offered after the
    step's saves are staged. The second fails at once instead of holding the forward
    pass for P's load_timeout_s; the first goes through."""
    pc, dc = make_caches(seed=24), make_caches(seed=25)
    block = len(LAYERS) * 2 * 32 * 128 * 2  # one block, every layer: heads x block x 2*head x bf16
    p = make_worker(broker.endpoint, "p", "p0", pc, staging_bytes=4 * block, load_timeout_s=30.0)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=60.0)
    try:
        load(d, "t-a", [30, 31, 32], cached=0)
        load(d, "t-b", [40, 41], cached=0)
        saves = {"t-a": SaveSpec(req_id="req-t-a", block_ids=[1, 2, 3], num_tokens=3 * 32 - 5, decode="d0"),
                 "t-b": SaveSpec(req_id="req-t-b", block_ids=[5, 6], num_tokens=2 * 32 - 5, decode="d0")}
        t0 = time.monotonic()
        p.bind(KvBrokerMetadata(saves=saves))
        for name in LAYERS:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        took = time.monotonic() - t0
        p.clear()
        assert took < 10, f"the step waited {took:.1f} s for room that only its own saves held"
        _, errors, _ = run_steps(d, {"req-t-a", "req-t-b"}, 20)
        assert errors == {40, 41}
        for n in LAYERS:
            assert torch.equal(dc[n][[30, 31, 32]], pc[n][[1, 2, 3]])
    finally:
        p.close()
        d.close()


def test_a_transfer_p_will_not_stage_fails_the_decode_load_that_claimed_it_at_once(broker: BrokerProcess) -> None:
    """The router named the transfer to both instances, and P's request ended before its
    prompt ran: the next step's metadata cancels it, and D's claimed load fails within
    seconds (its own deadline is 60 s), leaving its blocks as they were."""
    pc, dc = make_caches(seed=26), make_caches(seed=27)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=60.0)
    try:
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-gone", [30, 31], cached=0)
        wait_until(lambda: [t["state"] for t in broker.status()["transfers"]] == ["expected"], 10, "D's claim")
        p.bind(KvBrokerMetadata(cancels={"t-gone": "the prefill instance will not compute it"}))
        p.wait_for_save()
        p.clear()
        _, errors, _ = run_steps(d, {"req-t-gone"}, 15)
        assert errors == {30, 31}
        for n in LAYERS:
            assert torch.equal(dc[n], before[n])
        assert d.statistics()["failed"] == 1 and broker.status()["transfers"] == []
    finally:
        p.close()
        d.close()


def test_transfer_id_reused_for_another_prompt_is_aborted(broker: BrokerProcess) -> None:
    """A proxy retry (same prompt) keeps the staged copy; another prompt must never get it."""
    pc, dc = make_caches(seed=12), make_caches(seed=13)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        stage(p, pc, "t-6", [1, 2], decode="d0", tokens="aaa")
        stage(p, pc, "t-6", [5, 6], decode="d0", tokens="aaa")  # a retry: ignored
        assert p.statistics()["staged_now"] == 1 and p.statistics()["aborted"] == 0
        stage(p, pc, "t-6", [7, 8], decode="d0", tokens="bbb")  # another prompt: abort
        assert p.statistics()["staged_now"] == 0 and p.statistics()["aborted"] == 1
        assert p.pool is not None and p.pool.statistics().reserved == 0
        before = {n: t.clone() for n, t in dc.items()}
        load(d, "t-6", [40, 41], cached=0)
        _, errors, _ = run_steps(d, {"req-t-6"}, 10)
        assert errors == {40, 41}
        for n in LAYERS:
            assert torch.equal(dc[n], before[n])
    finally:
        p.close()
        d.close()


def test_broker_outage_never_stalls_a_step_and_restart_recovers(broker: BrokerProcess) -> None:
    pc, dc = make_caches(seed=14), make_caches(seed=15)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=15.0)
    try:
        broker.kill()
        # Past the 1 s lease both clients notice the broker is gone.
        wait_until(lambda: not (p.client.client.connected or d.client.client.connected), 10, "the clients to notice")
        t0 = time.monotonic()
        load(d, "t-7", [50, 51], cached=0)
        assert d.get_finished(set()) == (None, None)
        assert time.monotonic() - t0 < 0.5  # the Expect waits on the client's loop, not in the step
        t0 = time.monotonic()
        stage(p, pc, "t-7", [1, 2], decode="d0")
        assert time.monotonic() - t0 < 0.5  # the Offer, too, waits on the client's loop, not in the step
        broker.start()  # same address; both clients register again, P re-offers, D re-expects
        _, errors, _ = run_steps(d, {"req-t-7"}, 20)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[50, 51]], pc[n][[1, 2]])
    finally:
        p.close()
        d.close()


def test_a_load_under_way_when_the_broker_restarts_fails_at_once(broker: BrokerProcess) -> None:
    """The broker restarts while D receives: the new one knows nothing of the transfer.
    D re-announces its load and P re-offers; the second Prepare that pairing sends ends
    D's load at once (before, D aborted the new transfer and waited out the old one)."""
    pc, dc = make_caches(seed=30), make_caches(seed=31)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    try:
        assert p.producer is not None and p.producer.sender is not None and d.consumer is not None
        p.producer.sender.close()  # P's bytes never come: the receive stays open
        load(d, "t-restart", [5, 6], cached=0)
        stage(p, pc, "t-restart", [1, 2], decode="d0")
        wait_until(lambda: d.consumer._loads["t-restart"].state == "receiving", 10, "D to be receiving")
        broker.kill()
        broker.start()  # same address
        _, errors, took = run_steps(d, {"req-t-restart"}, 30)
        assert errors == {5, 6} and took < 10
    finally:
        d.close()
        p.close()


def test_a_prepare_for_a_load_that_already_ended_is_refused_at_once(broker: BrokerProcess) -> None:
    """The broker can lose track of a decode peer just as its bytes land: it takes the peer
    for lost, re-routes the transfer, and the peer, registered again, gets a new Prepare.
    A Prepare for a transfer this instance already loaded, or already gave up, is refused
    at once; parked until the load deadline, it held the broker's credit and P's staged
    copy that long."""
    pc, dc = make_caches(seed=32), make_caches(seed=33)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    try:
        assert d.client is not None and d.consumer is not None
        load(d, "t-loaded", [3, 4], cached=0)
        stage(p, pc, "t-loaded", [1, 2], decode="d0")
        assert run_steps(d, {"req-t-loaded"}, 10)[1] == set()
        load(d, "t-given-up", [5, 6], cached=0)
        d.client.call(d.consumer.on_abort, Abort(transfer_id="t-given-up", reason="P was lost"))
        assert run_steps(d, {"req-t-given-up"}, 10)[1] == {5, 6}
        for tid in ("t-loaded", "t-given-up"):
            t0 = time.monotonic()
            d.client.call(d.consumer.on_prepare, Prepare(transfer_id=tid, nbytes=1 << 16, source="p0:0", attempt=1))
            assert time.monotonic() - t0 < 2 and tid not in d.consumer._parked
        assert d.statistics()["loaded"] == 1 and d.statistics()["loading_now"] == 0
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_transfers_through_broker_stalls_and_restarts_end_whole_or_fail_at_once(
    broker: BrokerProcess, seed: int
) -> None:
    """Eight steps of two to five transfers each, either side first, with the broker
    stopped past every lease or restarted at a random point of some (before, between the
    two sides, or with the transfers under way). Each load ends within seconds, never at
    its 20 s deadline: whole, byte for byte, or failed for all its blocks; and after, P's
    staging and D's pool are empty, so no Release or Abort lost to an old socket leaves a
    copy, a lease or a phantom transfer behind."""
    rng = random.Random(seed)
    pc, dc = make_caches(seed=40), make_caches(seed=41)
    p = make_worker(broker.endpoint, "p", "p0", pc, load_timeout_s=20.0)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    assert d.client is not None and d.pool is not None
    client = d.client.client

    def upset(how: str) -> None:
        if how == "stop":
            with broker.paused():
                wait_until(lambda: not client.connected, 10, "D to take the stopped broker for lost")
        elif how == "restart":
            broker.kill()
            broker.start()

    def save_step(moves: dict[str, tuple[list[int], list[int]]]) -> None:
        p.bind(KvBrokerMetadata(saves={
            tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=2 * 32 - 5, decode="d0")
            for tid, (src, _) in moves.items()
        }))
        for name in LAYERS:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        p.clear()

    def load_step(moves: dict[str, tuple[list[int], list[int]]]) -> None:
        d.bind(KvBrokerMetadata(loads={
            tid: LoadSpec(req_id=f"req-{tid}", block_ids=dst, num_cached_blocks=0, num_tokens=2 * 32 - 5)
            for tid, (_, dst) in moves.items()
        }))
        d.start_load_kv()
        d.clear()

    outcomes: list[tuple[object, ...]] = []
    try:
        for step in range(8):
            n = rng.randint(2, 5)
            srcs, dsts = rng.sample(range(1, 32), 2 * n), rng.sample(range(32, 64), 2 * n)
            moves = {f"t{seed}-{step}-{k}": (srcs[2 * k : 2 * k + 2], dsts[2 * k : 2 * k + 2]) for k in range(n)}
            for src, _ in moves.values():  # these prompts' KV
                for t in pc.values():
                    t[src] = torch.randn_like(t[src])
            saved = {tid: {name: t[src].clone() for name, t in pc.items()} for tid, (src, _) in moves.items()}
            how, when, d_first = rng.choice(["", "stop", "restart"]), rng.randrange(3), rng.random() < 0.5
            sides = [partial(load_step, moves), partial(save_step, moves)]
            for k, side in enumerate(sides if d_first else sides[::-1]):
                if when == k:
                    upset(how)
                side()
            if when == 2:
                upset(how)
            _, errors, took = run_steps(d, {f"req-{tid}" for tid in moves}, 30)
            outcomes.append((step, n, how, when, d_first, len(errors), round(took, 2)))
            assert took < 10, outcomes
            for tid, (_, dst) in moves.items():
                if errors & set(dst):
                    assert set(dst) <= errors, (tid, outcomes)
                else:
                    for name in LAYERS:
                        assert torch.equal(dc[name][dst], saved[tid][name]), (tid, outcomes)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 15, f"P's staging to empty; {outcomes}")
        assert d.pool.statistics().leases == 0, outcomes
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_kv_follows_each_request_to_its_decode_instance_whatever_the_proxy_names(
    broker: BrokerProcess, seed: int
) -> None:
    """Three decode instances. Each request goes to one of them; P's copy names that one,
    none, or a wrong one (the proxy sent the request elsewhere after all); either side may
    come first. Every load lands whole on the instance that holds its request, within
    seconds; after, no instance holds a lease or a parked Prepare and P's staging is empty."""
    rng = random.Random(seed)
    pc = make_caches(seed=50)
    p = make_worker(broker.endpoint, "p", "p0", pc, load_timeout_s=20.0)
    names = ["d0", "d1", "d2"]
    caches = {name: make_caches(seed=51 + k) for k, name in enumerate(names)}
    ds = {name: make_worker(broker.endpoint, "d", name, caches[name], load_timeout_s=20.0) for name in names}
    outcomes: list[tuple[object, ...]] = []
    try:
        for step in range(8):
            n = rng.randint(2, 4)
            srcs, dsts = rng.sample(range(1, 32), 2 * n), rng.sample(range(32, 64), 2 * n)
            moves = {f"r{seed}-{step}-{k}": (srcs[2 * k: 2 * k + 2], dsts[2 * k: 2 * k + 2], rng.choice(names))
                     for k in range(n)}
            named = {tid: rng.choice(["", home, *[x for x in names if x != home]]) for tid, (_, _, home) in moves.items()}
            for src, _, _ in moves.values():
                for t in pc.values():
                    t[src] = torch.randn_like(t[src])
            saved = {tid: {name: t[src].clone() for name, t in pc.items()} for tid, (src, _, _) in moves.items()}

            def save_all(moves: dict[str, tuple[list[int], list[int], str]] = moves, named: dict[str, str] = named) -> None:
                save_many(p, pc, {tid: (src, named[tid]) for tid, (src, _, _) in moves.items()})

            def load_all(moves: dict[str, tuple[list[int], list[int], str]] = moves) -> None:
                for tid, (_, dst, home) in moves.items():
                    load(ds[home], tid, dst, cached=0)

            d_first = rng.random() < 0.5
            for side in ((load_all, save_all) if d_first else (save_all, load_all)):
                side()
            want = {home: {f"req-{tid}" for tid, (_, _, h) in moves.items() if h == home} for home in names}
            t0 = time.monotonic()
            errors = run_steps_on(ds, want, 10)
            outcomes.append((step, d_first, sorted(named.values()), round(time.monotonic() - t0, 2)))
            assert not errors, (errors, outcomes, named)
            for tid, (_, dst, home) in moves.items():
                for name in LAYERS:
                    assert torch.equal(caches[home][name][dst], saved[tid][name]), (tid, home, named[tid], outcomes)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, f"P's staging to empty; {outcomes}")
        for d in ds.values():
            assert d.pool is not None and d.pool.statistics().leases == 0, outcomes
            assert d.consumer is not None and not d.consumer._parked, outcomes
    finally:
        p.close()
        for d in ds.values():
            d.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_requests_sent_again_after_their_decode_instance_died_get_the_staged_kv(tmp_path: Path, seed: int) -> None:
    """Three decode instances; one dies (no goodbye) holding some of the requests, before
    P saves. The proxy sends those requests again, each to one of the other two, before
    or after P's save and long before the broker's 2 s lease on the dead one ends. Every
    request, sent again or not, loads whole from P's single staged copy."""
    rng = random.Random(seed)
    b = BrokerProcess(tmp_path, "--heartbeat", "0.5", "--peer-lease", "2")
    b.start()
    pc = make_caches(seed=60)
    p = make_worker(b.endpoint, "p", "p0", pc, load_timeout_s=20.0)
    names = ["d0", "d1", "d2"]
    caches = {name: make_caches(seed=61 + k) for k, name in enumerate(names)}
    ds = {name: make_worker(b.endpoint, "d", name, caches[name], load_timeout_s=20.0) for name in names}
    try:
        victim = rng.choice(names)
        n = rng.randint(3, 6)
        srcs, dsts = rng.sample(range(1, 32), 2 * n), rng.sample(range(32, 64), 2 * n)
        homes = [rng.choice(names) for _ in range(n)]
        homes[0] = victim  # at least one request is on the instance that dies
        moves = {f"v{seed}-{k}": (srcs[2 * k: 2 * k + 2], dsts[2 * k: 2 * k + 2], homes[k]) for k in range(n)}
        named = {tid: rng.choice(["", home]) for tid, (_, _, home) in moves.items()}
        for tid, (_, dst, home) in moves.items():
            load(ds[home], tid, dst, cached=0)
        for tid, (_, _, home) in moves.items():
            if home == victim:
                wait_for_transfer(b, tid)
        client = ds[victim].client
        assert client is not None
        client._future.cancel()  # the victim dies without a goodbye
        again = {tid: rng.choice([x for x in names if x != victim]) for tid, m in moves.items() if m[2] == victim}
        after_save = rng.random() < 0.5

        def send_again() -> None:
            for tid, home in again.items():
                load(ds[home], tid, moves[tid][1], cached=0)

        if not after_save:
            send_again()
        save_many(p, pc, {tid: (src, named[tid]) for tid, (src, _, _) in moves.items()})
        if after_save:
            send_again()
        final = {tid: again.get(tid, home) for tid, (_, _, home) in moves.items()}
        want = {h: {f"req-{tid}" for tid, fh in final.items() if fh == h} for h in names if h != victim}
        errors = run_steps_on(ds, want, 15)
        assert not errors, (errors, victim, again, named, after_save)
        for tid, (src, dst, _) in moves.items():
            for name in LAYERS:
                assert torch.equal(caches[final[tid]][name][dst], pc[name][src]), (tid, final[tid], named[tid])
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, "P's staging to empty")
        assert p.statistics()["staged"] == n and p.statistics()["aborted"] == 0
    finally:
        p.close()
        for d in ds.values():
            d.close()
        b.kill()


def test_pending_expect_routes_after_broker_restart(broker: BrokerProcess) -> None:
    """D's Expect carries the route when P names no decode peer. The broker restarts
    while D waits: D's client sends the Expect again on registering, so the KV still goes
    to the decode peer holding the request, not the emptier one least-loaded routing
    would pick."""
    pc, d0c, d1c = make_caches(seed=20), make_caches(seed=21), make_caches(seed=22)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d0 = make_worker(broker.endpoint, "d", "d0", d0c, load_timeout_s=10.0)
    d1 = make_worker(broker.endpoint, "d", "d1", d1c, pool_bytes=1 << 23)  # more free room: preferred
    try:
        def expected() -> bool:
            return any(t["transfer_id"] == "t-9" and t["state"] == "expected" for t in broker.status()["transfers"])

        load(d0, "t-9", [60, 61], cached=0)
        wait_until(expected, 10, "d0's Expect to reach the broker")
        broker.kill()
        broker.start()  # same address, no state
        wait_until(expected, 20, "d0's Expect to reach the restarted broker")
        stage(p, pc, "t-9", [3, 4])  # no decode hint: only the Expect routes it
        _, errors, _ = run_steps(d0, {"req-t-9"}, 15)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(d0c[n][[60, 61]], pc[n][[3, 4]])
    finally:
        p.close()
        d0.close()
        d1.close()


# -- regressions: nothing escapes into vLLM's step, nothing leaks ------------------------


class _Peer:
    """A bare broker client standing in for the other role, recording what the broker sends it."""

    def __init__(self, broker: str, role: str, compat: dict[str, str], endpoints: dict[str, str]) -> None:
        self.prepares: list[Prepare] = []
        self.aborts: list[Abort] = []
        self.ready = True
        reg = Register(
            role=role,
            instance_id=f"fake-{role}",
            rank=0,
            world_size=1,
            endpoints=endpoints,
            pool_capacity=0 if role == "prefill" else 1 << 24,
            compat_hash=compat_hash(compat),
            compat=compat,
        )
        self.client = BrokerClient(ClientConfig(broker=broker), reg, handler=self)
        self.sync = SyncBrokerClient(self.client)

    async def on_prepare(self, msg: Prepare) -> None:
        self.prepares.append(msg)
        if self.ready:
            await self.client.ready(msg.transfer_id, msg.nbytes, 0)

    async def on_go(self, msg: object) -> None:
        pass  # never sends: the decode side stays "receiving"

    async def on_release(self, msg: object) -> None:
        pass

    async def on_abort(self, msg: Abort) -> None:
        self.aborts.append(msg)

    async def on_relay(self, msg: object) -> None:
        pass


@pytest.mark.parametrize(("endpoints", "named"), [({"tcp": "http://x:1"}, "http://x:1"), ({}, "no tcp endpoint")])
def test_a_decode_endpoint_p_cannot_use_aborts_the_transfer(
    broker: BrokerProcess, endpoints: dict[str, str], named: str
) -> None:
    """P cannot send (a malformed endpoint, or none for its transport): it aborts the
    transfer at the broker, so D hears at once instead of at its load deadline."""
    pc = make_caches(seed=20)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = _Peer(broker.endpoint, "decode", p.compat, endpoints)
    try:
        d.sync.expect("t-bad")
        stage(p, pc, "t-bad", [1, 2])
        abort = wait_until(lambda: next(iter(d.aborts), None), 10, "the broker to abort the transfer")
        assert named in abort.reason
        wait_until(lambda: not p.statistics()["staged_now"], 5, "P to free its staged copy on the Abort")
        assert p.client is not None and p.client.client.connected
    finally:
        d.sync.close()
        p.close()


def test_a_send_p_cannot_make_ends_the_transfer_at_once(broker: BrokerProcess) -> None:
    """P's payload of a send fails on the sending thread (as a layer never copied would):
    P aborts the transfer at the broker and frees its copy, so D's load fails at once
    instead of at its 20 s deadline, and the next transfer between them goes through."""
    pc, dc = make_caches(seed=40), make_caches(seed=41)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=20.0)
    assert p.producer is not None
    refuse_sends(p.producer, "lost-")
    try:
        load(d, "lost-1", [30, 31], cached=0)
        stage(p, pc, "lost-1", [1, 2], decode="d0")
        _, errors, seconds = run_steps(d, {"req-lost-1"}, 30)
        assert errors == {30, 31} and seconds < 4, (errors, seconds)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 5, "P to free the copy it could not send")
        assert p.statistics()["sent"] == 0 and p.statistics()["aborted"] == 1

        load(d, "ok-1", [40, 41], cached=0)
        stage(p, pc, "ok-1", [3, 4], decode="d0")
        assert run_steps(d, {"req-ok-1"}, 10)[1] == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[40, 41]], pc[n][[3, 4]])
    finally:
        p.close()
        d.close()


def _unreachable_decode(monkeypatch: pytest.MonkeyPatch, broker: str, instance: str, caches: dict[str, torch.Tensor],
                        **extra: object) -> ConnectorWorker:
    """A decode worker that advertises a port nothing listens on, as a wrong tcp_host
    would: its receiver runs, but no producer reaches it."""
    from connector import consumer

    with socket.socket() as closed:  # a port that was free a moment ago, and is closed now
        closed.bind(("127.0.0.1", 0))
        unreachable = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    with monkeypatch.context() as m:
        real_start = consumer.TcpReceiver.start
        m.setattr(consumer.TcpReceiver, "start", lambda self: (real_start(self), unreachable)[1])
        return make_worker(broker, "d", instance, caches, **extra)


def test_a_broken_link_to_d_leaves_the_transfer_to_the_broker_which_reroutes_it(
        broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """P cannot reach D's receiver: that is not P's failure, so P keeps its copy and
    leaves the transfer to the broker. Once that D is gone, the broker gives the transfer
    to the decode peer that claimed it after, and P sends the same copy there: no second
    prefill."""
    pc, d1c, d2c = make_caches(seed=42), make_caches(seed=43), make_caches(seed=44)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d1 = _unreachable_decode(monkeypatch, broker.endpoint, "d1", d1c)
    d2 = make_worker(broker.endpoint, "d", "d2", d2c)
    try:
        assert p.producer is not None and p.producer.sender is not None
        load(d1, "link-1", [30, 31], cached=0)
        stage(p, pc, "link-1", [1, 2], decode="d1")
        sender = p.producer.sender
        wait_until(lambda: sender.statistics().failed == 1, 10, "P's send to the closed port to fail")
        assert p.statistics()["staged_now"] == 1 and p.statistics().get("aborted", 0) == 0

        load(d2, "link-1", [40, 41], cached=0)  # the request, sent again, to d2
        d1.close()
        assert run_steps(d2, {"req-link-1"}, 20)[1] == set()
        for n in LAYERS:
            assert torch.equal(d2c[n][[40, 41]], pc[n][[1, 2]])
        assert p.statistics()["sent"] == 1 and p.statistics()["staged"] == 1
    finally:
        p.close()
        d1.close()
        d2.close()


def test_a_live_d_that_p_cannot_reach_fails_its_load_at_its_deadline_and_p_frees_the_copy(
        broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other way a broken link ends: D stays, so its load fails at its own deadline
    (the failure policy applies), and the Abort that follows frees the copy P kept."""
    pc, dc = make_caches(seed=45), make_caches(seed=46)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = _unreachable_decode(monkeypatch, broker.endpoint, "d1", dc, load_timeout_s=1.5)
    try:
        load(d, "link-2", [30, 31], cached=0)
        stage(p, pc, "link-2", [1, 2], decode="d1")
        _, errors, seconds = run_steps(d, {"req-link-2"}, 20)
        assert errors == {30, 31} and seconds >= 1.0, (errors, seconds)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, "P to free the copy once D gave the load up")
        assert p.statistics()["sent"] == 0 and p.statistics()["aborted"] == 1
    finally:
        p.close()
        d.close()


def test_a_save_staged_on_its_own_is_copied_from_the_caches_worked_out_once(
        broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that is not staged with the rest of its step (here: the step also repeats a
    transfer still staged, so each is leased on its own) is copied one `index_select` a
    layer from the registered caches too (`CacheRows`), and D gets its blocks; a layer
    handed over as another tensor than the registered one is copied the long way."""
    from connector import producer

    per_layer: list[str] = []
    real = producer.gather_layer_into_staging
    monkeypatch.setattr(producer, "gather_layer_into_staging",
                        lambda staging, idx, *rest: (per_layer.append(str(idx)), real(staging, idx, *rest))[1])
    pc, dc = make_caches(seed=71), make_caches(seed=72)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        stage(p, pc, "first", [1, 2], decode="d0")  # still staged: no D has it yet
        assert p.producer is not None and per_layer == []
        first = SaveSpec(req_id="req-first", block_ids=[1, 2], num_tokens=2 * 32 - 5, decode="d0")
        alone = SaveSpec(req_id="req-alone", block_ids=[9, 3, 22], num_tokens=3 * 32 - 5, decode="d0")
        p.bind(KvBrokerMetadata(saves={"first": first, "alone": alone}))
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])
        p.save_kv_layer(LAYERS[1], pc[LAYERS[1]].clone())  # not the registered tensor
        p.wait_for_save()
        p.clear()
        assert not p.producer._staged["alone"].grouped and p.producer._staged["alone"].gather is not None
        assert per_layer == ["1"], "only the layer handed over as another tensor goes one call a layer"
        load(d, "alone", [40, 41, 42], cached=0)
        _, errors, _ = run_steps(d, {"req-alone"}, 10)
        assert errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[40, 41, 42]], pc[n][[9, 3, 22]])
    finally:
        p.close()
        d.close()


def test_a_stopped_client_never_raises_into_the_step(broker: BrokerProcess) -> None:
    pc = make_caches(seed=21)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    try:
        assert p.client is not None and p.pool is not None
        p.client.close()  # the client's loop is gone
        stage(p, pc, "t-offline", [1, 2])  # wait_for_save's offer: must not raise
        assert p.statistics()["staged_now"] == 1  # kept until its TTL
        hog = p.pool.acquire_nowait(p.pool.statistics().largest_free)
        stage(p, pc, "t-full", [3])  # waiting for room goes through the loop: must not raise
        hog.release()
        assert p.statistics()["staged_now"] == 1
    finally:
        p.close()


def test_client_torn_down_mid_receive_fails_the_load_and_frees_its_lease(broker: BrokerProcess) -> None:
    dc = make_caches(seed=22)
    # through the pool: a load into its blocks leases nothing
    d = make_worker(broker.endpoint, "d", "d0", dc, load_timeout_s=60)
    through_pool(d, "t-cut")
    fake_p = _Peer(broker.endpoint, "prefill", d.compat, {})
    try:
        assert d.pool is not None and d.client is not None
        load(d, "t-cut", [4, 5], cached=0)
        layout = Layout(num_layers=len(LAYERS), block_nbytes=d.block_nbytes, num_blocks=2)
        fake_p.sync.offer("t-cut", 2 * len(LAYERS) * d.block_nbytes, layout)
        wait_until(lambda: d.pool.statistics().reserved, 10, "D to lease room and send Ready")  # type: ignore[union-attr]
        d.client.close()  # cancels the handler running on_prepare
        _, errors, _took = run_steps(d, {"req-t-cut"}, 10)
        assert errors == {4, 5}
        assert d.pool.statistics().reserved == 0
    finally:
        fake_p.sync.close()
        d.close()


def test_expired_staging_is_aborted_at_the_broker(broker: BrokerProcess) -> None:
    pc = make_caches(seed=23)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    try:
        assert p.producer is not None and p.client is not None
        stage(p, pc, "t-old", [1])
        # The Offer leaves from the client's loop; it is re-sent after a reconnect until settled.
        wait_until(lambda: "t-old" in p.client.client._offers, 5, "the Offer to be recorded")  # type: ignore[union-attr]
        p.producer._staged["t-old"].created -= 10 * p.config.staging_ttl_s  # it outlived its TTL
        p.wait_for_save()  # the next step expires it
        assert p.statistics()["staged_now"] == 0
        wait_until(lambda: "t-old" not in p.client.client._offers, 5, "the Abort to reach the client")  # type: ignore[union-attr]
    finally:
        p.close()


def test_a_cache_the_transport_cannot_move_is_refused_before_registering() -> None:
    """tcp moves CPU caches and nccl the caches of one GPU; the other kind is refused with
    a sentence naming the transport to set, before anything reaches the broker."""
    info = EngineInfo(model="tiny", spec=FakeSpec(), block_size=32, backend="test")
    meta = {name: torch.empty(64, 2, 32, 128, device="meta") for name in LAYERS}
    tcp = ConnectorWorker(parse_config({"broker": "tcp://127.0.0.1:9"}, kv_role="kv_consumer", engine_id="d"), info)
    with pytest.raises(ConfigError, match='the "tcp" transport moves CPU KV caches only: set transport "nccl"'):
        tcp.register_kv_caches(meta)
    config = parse_config({"broker": "tcp://127.0.0.1:9", "transport": "nccl"}, kv_role="kv_consumer", engine_id="d",
                          cuda_available=lambda: True)
    with pytest.raises(ConfigError, match='the "nccl" transport moves GPU KV caches: set transport "tcp"'):
        ConnectorWorker(config, info).register_kv_caches(make_caches())
    assert tcp.client is None


_AMX_PROBE = """
import ctypes, json, sys
from connector.worker import allow_amx_tiles

def tiles_allowed():
    state = ctypes.c_ulong(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(state))  # arch_prctl(ARCH_GET_XCOMP_PERM)
    return bool(state.value & (1 << 18))  # XTILEDATA

steps = [tiles_allowed(), allow_amx_tiles("CPU_ATTN/vec"), tiles_allowed(), allow_amx_tiles("CPU_ATTN/amx"),
         tiles_allowed()]
print(json.dumps(steps))
"""


def test_a_cpu_worker_asks_for_amx_tile_state_when_vllm_attends_with_amx() -> None:
    """vLLM's CPU attention runs AMX tiles when the CPU has them, without asking Linux for
    their state; a decode worker whose first steps are loaded prompts' one-token queries
    was killed by SIGILL (the end-to-end tests, on such a CPU). The worker asks, in a
    fresh process, only for the AMX kernel."""
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64" or not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _AMX_PROBE], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, vec, after_vec, amx, after_amx = json.loads(out.stdout.strip().splitlines()[-1])
    assert not before and not vec and not after_vec, "tile state asked for without the AMX kernel"
    assert amx and after_amx
