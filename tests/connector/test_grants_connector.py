"""Signed grants through both halves of the connector on each side, with a real broker.

P's scheduler half signs the params it returns (the sequential protocol); D's scheduler
half checks the grant of each request, and its worker half fails a refused load at once:
the request is reported in that step's get_finished with its blocks as load errors (so
vLLM applies kv_load_failure_policy), nothing reaches the broker, and P's staged copy
stays for the request that holds the valid grant, which loads it.
"""

from __future__ import annotations

import pytest
import torch

from connector.config import ConnectorConfig
from connector.scheduler import ConnectorScheduler, refusal_key
from tests.connector.test_scheduler import NIXL_P, FakeBlocks, FakeRequest, FakeSchedulerOutput, NewReq
from tests.connector.test_worker import LAYERS, make_caches, make_worker, run_steps
from tests.support import BrokerProcess, wait_until

pytestmark = pytest.mark.slow

KEY = b"0123456789abcdef-shared"
BS = 32


def halves(broker: str, role: str, instance: str, key: bytes) -> ConnectorScheduler:
    config = ConnectorConfig(broker=broker, role=role, instance_id=instance, grant_key=key)  # type: ignore[arg-type]
    return ConnectorScheduler(config, BS)


def test_only_the_request_holding_a_valid_grant_loads_the_kv(broker: BrokerProcess, tmp_path: object) -> None:
    pc, dc = make_caches(seed=41), make_caches(seed=42)
    key_file = tmp_path / "grant.key"  # type: ignore[operator]
    key_file.write_bytes(KEY)
    p = make_worker(broker.endpoint, "p", "prefill-0", pc, grant_key_file=str(key_file))
    d = make_worker(broker.endpoint, "d", "decode-0", dc, grant_key_file=str(key_file), load_timeout_s=20.0)
    ps, ds = halves(broker.endpoint, "producer", "prefill-0", KEY), halves(broker.endpoint, "consumer", "decode-0", KEY)
    try:
        # P: the router's sequential request, one step that computes the whole prompt.
        rp = FakeRequest("p-1", 70, dict(NIXL_P))
        ps.update_state_after_alloc(rp, FakeBlocks([4, 5, 6]), 0)
        meta = ps.build_connector_meta(FakeSchedulerOutput(scheduled_new_reqs=[NewReq("p-1", ([4, 5, 6],), 0)],
                                                          num_scheduled_tokens={"p-1": 70}))
        p.bind(meta)
        for name in LAYERS:
            p.save_kv_layer(name, pc[name])
        p.wait_for_save()
        p.clear()
        params = ps.request_finished(rp, [4, 5, 6])[1]
        assert params is not None
        tid = params["transfer_id"]
        wait_until(lambda: any(t["transfer_id"] == tid for t in broker.status()["transfers"]), 10, "P's Offer")

        def decode(rid: str, sent: dict[str, object], blocks: list[int]) -> tuple[set[str], set[int]]:
            r = FakeRequest(rid, 70, sent)
            assert ds.get_num_new_matched_tokens(r, 0) == (70, True)
            ds.update_state_after_alloc(r, FakeBlocks(blocks), 70)
            d.bind(ds.build_connector_meta(FakeSchedulerOutput()))
            d.start_load_kv()
            d.clear()
            finished, errors, _ = run_steps(d, {rid}, 25)
            ds.request_finished(r, blocks)
            return finished, errors

        version, until, digest, mac = params["grant"].split(".")
        before = {n: t.clone() for n, t in dc.items()}
        for rid, sent in (
            ("d-tampered", {**params, "grant": f"{version}.{int(until) + 86400}.{digest}.{mac}"}),
            ("d-missing", {k: v for k, v in params.items() if k != "grant"}),
            ("d-other-prefill", {**params, "remote_engine_id": "prefill-9"}),
        ):
            finished, errors = decode(rid, sent, [10, 11, 12])
            assert finished == {rid} and errors == {10, 11, 12}, rid
        assert all(torch.equal(dc[n], before[n]) for n in LAYERS)  # nothing written
        assert d.statistics()["failed"] == 3 and d.statistics()["loaded"] == 0
        # The broker never heard of them (no Abort): the transfer waits for the granted request.
        assert [t["transfer_id"] for t in broker.status()["transfers"]] == [tid]
        assert p.statistics()["staged_now"] == 1
        assert ds.build_connector_meta(FakeSchedulerOutput()).loads == {}
        assert refusal_key("d-missing") not in ds._loads

        finished, errors = decode("d-granted", params, [20, 21, 22])
        assert finished == {"d-granted"} and errors == set()
        for n in LAYERS:
            assert torch.equal(dc[n][[20, 21, 22]], pc[n][[4, 5, 6]])
        assert d.statistics()["loaded"] == 1
    finally:
        p.close()
        d.close()
