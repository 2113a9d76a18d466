"""kv_connector_extra_config parsing: good settings pass, each bad one is one sentence naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connector.config import ConfigError, ConnectorConfig, loopback_receiver, parse_config

BROKER = "tcp://127.0.0.1:7100"


def parse(
    extra: dict[str, Any] | None, role: str = "kv_consumer", engine_id: str | None = "engine-1", cuda: bool = False
) -> ConnectorConfig:
    return parse_config(extra, kv_role=role, engine_id=engine_id, cuda_available=lambda: cuda)


def refused(extra: dict[str, Any] | None, role: str = "kv_consumer", cuda: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        parse(extra, role=role, cuda=cuda)
    text = str(info.value)
    # One sentence: a single full stop, at the end (addresses and numbers contain dots).
    assert text.endswith("."), text
    assert "\n" not in text
    return text


def test_defaults() -> None:
    cfg = parse({"broker": BROKER})
    assert cfg == ConnectorConfig(broker=BROKER, role="consumer", instance_id="engine-1")
    assert cfg.transport == "tcp" and cfg.pool_bytes == cfg.staging_bytes == 1 << 30
    assert cfg.load_timeout_s == 30.0 and cfg.register_timeout_s == 10.0
    assert cfg.tcp_host == "127.0.0.1"
    assert parse({"broker": BROKER}, role="kv_producer").role == "producer"


def test_every_key() -> None:
    cfg = parse(
        {
            "broker": "tcp://broker.internal:7100",
            "transport": "tcp",
            "pool_bytes": 1 << 20,
            "staging_bytes": 2 << 20,
            "load_timeout_s": 2.5,
            "register_timeout_s": 1,
            "tcp_host": "10.0.0.7",
            "instance_id": "decode-a",
        }
    )
    assert (cfg.pool_bytes, cfg.staging_bytes, cfg.load_timeout_s, cfg.register_timeout_s) == (
        1 << 20,
        2 << 20,
        2.5,
        1.0,
    )
    assert (cfg.tcp_host, cfg.instance_id) == ("10.0.0.7", "decode-a")
    assert cfg.staging_ttl_s >= 120


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:7100", "tcp://localhost:1", "tcp://[::1]:7100", "tcp://my-broker.svc:65535"]
)
def test_good_addresses(address: str) -> None:
    assert parse({"broker": address}).broker == address


def test_missing_broker() -> None:
    for extra in (None, {}, {"broker": ""}):
        text = refused(extra)
        assert "kv_connector_extra_config.broker is required" in text and "tcp://127.0.0.1:7100" in text


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:7100",
        "http://127.0.0.1:7100",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000",
        "tcp://*:7100",
        "tcp://a b:1",
        7100,
    ],
)
def test_malformed_broker_address(address: Any) -> None:
    text = refused({"broker": address})
    assert "kv_connector_extra_config.broker" in text and repr(address) in text and "tcp://HOST:PORT" in text


def test_unknown_transport() -> None:
    text = refused({"broker": BROKER, "transport": "rdma"})
    assert "kv_connector_extra_config.transport" in text and "'rdma'" in text and '"tcp"' in text


def test_nccl_needs_a_cuda_device() -> None:
    assert "not supported on this host" in refused({"broker": BROKER, "transport": "nccl"}, cuda=False)
    assert parse({"broker": BROKER, "transport": "nccl"}, cuda=True).transport == "nccl"


@pytest.mark.parametrize("key", ["pool_bytes", "staging_bytes"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB", True, None])
def test_non_positive_sizes(key: str, value: Any) -> None:
    text = refused({"broker": BROKER, key: value})
    assert f"kv_connector_extra_config.{key}" in text and "positive" in text and repr(value) in text


@pytest.mark.parametrize("key", ["load_timeout_s", "register_timeout_s"])
@pytest.mark.parametrize("value", [0, -3, "10", False, 1e9])
def test_bad_timeouts(key: str, value: Any) -> None:
    text = refused({"broker": BROKER, key: value})
    assert f"kv_connector_extra_config.{key}" in text and "seconds" in text


def test_unknown_key_is_named() -> None:
    text = refused({"broker": BROKER, "pool_byte": 10})
    assert "'pool_byte'" in text and "pool_bytes" in text


@pytest.mark.parametrize("role", ["kv_both", None, "producer"])
def test_role_must_be_producer_or_consumer(role: Any) -> None:
    text = refused({"broker": BROKER}, role=role)
    assert "kv_role" in text and repr(role) in text


@pytest.mark.parametrize("instance", ["", "a:b", "x" * 101, 5])
def test_bad_instance_id(instance: Any) -> None:
    assert "kv_connector_extra_config.instance_id" in refused({"broker": BROKER, "instance_id": instance})


def test_bad_tcp_host() -> None:
    assert "kv_connector_extra_config.tcp_host" in refused({"broker": BROKER, "tcp_host": ""})


def test_curve_server_key() -> None:
    key = "B<6MgI-#$9bCh#+rPq}I-1ny[]t]{aC1.sJ=q-[G"
    assert parse_config({"broker": BROKER, "curve_server_key": key}, kv_role="kv_producer", engine_id="e").curve_server_key == key
    assert "kv_connector_extra_config.curve_server_key" in refused({"broker": BROKER, "curve_server_key": "short"})


def test_curve_client_secret_file(tmp_path: Path) -> None:
    server = "B<6MgI-#$9bCh#+rPq}I-1ny[]t]{aC1.sJ=q-[G"
    good, bad = tmp_path / "p0.key_secret", tmp_path / "bad.key_secret"
    good.write_text("D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs\n")
    bad.write_text("not a key\n")
    cfg = parse({"broker": BROKER, "curve_server_key": server, "curve_client_secret_file": str(good)})
    assert cfg.curve_client_secret_file == str(good)
    key = "kv_connector_extra_config.curve_client_secret_file"
    assert key in refused({"broker": BROKER, "curve_client_secret_file": str(good)})  # no server key
    missing = refused({"broker": BROKER, "curve_server_key": server, "curve_client_secret_file": str(tmp_path / "no")})
    assert key in missing and "cannot be read" in missing
    assert "40-character" in refused({"broker": BROKER, "curve_server_key": server, "curve_client_secret_file": str(bad)})


def test_grant_key_file_is_read_at_startup_and_kept_out_of_reprs(tmp_path: Path) -> None:
    key = tmp_path / "grant.key"
    key.write_text("s3cr3t-s3cr3t-s3cr3t-s3cr3t\n")
    cfg = parse({"broker": BROKER, "grant_key_file": str(key)})
    assert cfg.grant_key == b"s3cr3t-s3cr3t-s3cr3t-s3cr3t"
    assert "s3cr3t" not in repr(cfg)
    assert parse({"broker": BROKER}).grant_key is None
    short = tmp_path / "short.key"
    short.write_text("abc")
    assert refused({"broker": BROKER, "grant_key_file": str(short)}).startswith(
        f"kv_connector_extra_config.grant_key_file {str(short)!r} must hold a secret of 16 to 4096 bytes"
    )
    assert "cannot be read" in refused({"broker": BROKER, "grant_key_file": str(tmp_path / "absent")})
    assert "grant_key_file must be the path" in refused({"broker": BROKER, "grant_key_file": 5})


def test_the_nccl_backend_and_communicator_cap_are_settings_of_the_nccl_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVBROKER_NCCL_BACKEND", raising=False)
    nccl = {"broker": BROKER, "transport": "nccl"}
    assert (parse(nccl, cuda=True).nccl_backend, parse(nccl, cuda=True).nccl_communicators) == ("", 8)
    cfg = parse({**nccl, "nccl_backend": "ipc, direct", "nccl_communicators": 2}, role="kv_producer", cuda=True)
    assert (cfg.nccl_backend, cfg.nccl_communicators) == ("ipc,direct", 2)
    for bad in ("nccl", "direct,ipc", 3):
        assert "nccl_backend must be one of direct, torch, ipc, ipc,direct, ipc,torch" in refused(
            {**nccl, "nccl_backend": bad}, cuda=True)
    for bad in (0, 1025, "4", True):
        assert "nccl_communicators must be a whole number from 1 to 1024" in refused(
            {**nccl, "nccl_communicators": bad}, cuda=True)
    assert 'nccl_backend applies to transport "nccl" only' in refused({"broker": BROKER, "nccl_backend": "ipc"})


def test_the_environment_overrides_the_nccl_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    nccl = {"broker": BROKER, "transport": "nccl", "nccl_backend": "direct"}
    monkeypatch.setenv("KVBROKER_NCCL_BACKEND", "ipc")
    assert parse(nccl, cuda=True).nccl_backend == "ipc"
    monkeypatch.setenv("KVBROKER_NCCL_BACKEND", "nvlink")
    assert "KVBROKER_NCCL_BACKEND='nvlink' names no NCCL backend" in refused(nccl, cuda=True)


def test_thread_cpus_is_auto_inherit_or_a_cpu_list_of_a_cpu_worker() -> None:
    assert parse({"broker": BROKER}).thread_cpus == "auto"
    assert parse({"broker": BROKER, "thread_cpus": "inherit"}).thread_cpus == "inherit"
    assert parse({"broker": BROKER, "thread_cpus": "6-7,14"}).thread_cpus == {6, 7, 14}
    for bad in ("all", "7-6", 7, ""):
        assert 'thread_cpus must be "auto", "inherit" or a CPU list such as "6-7,14"' in refused(
            {"broker": BROKER, "thread_cpus": bad})
    assert 'remove it for transport \'nccl\'' in refused(
        {"broker": BROKER, "transport": "nccl", "thread_cpus": "7"}, cuda=True)


@pytest.mark.parametrize(
    ("broker", "tcp_host", "role", "warned"),
    [
        ("tcp://10.0.0.5:7100", "127.0.0.1", "kv_consumer", True),
        ("tcp://broker.internal:7100", "localhost", "kv_consumer", True),
        ("tcp://[fd00::5]:7100", "::1", "kv_consumer", True),
        ("tcp://127.0.0.1:7100", "127.0.0.1", "kv_consumer", False),  # all on one host
        ("tcp://localhost:7100", "127.0.0.1", "kv_consumer", False),
        ("tcp://10.0.0.5:7100", "10.0.0.7", "kv_consumer", False),  # a routable address
        ("tcp://10.0.0.5:7100", "127.0.0.1", "kv_producer", False),  # P listens on nothing
    ],
)
def test_a_decode_receiver_on_loopback_with_a_broker_elsewhere_is_named(
        broker: str, tcp_host: str, role: str, warned: bool) -> None:
    cfg = parse_config({"broker": broker, "tcp_host": tcp_host}, kv_role=role, engine_id="e")
    sentence = loopback_receiver(cfg)
    assert (sentence is not None) == warned
    if sentence is not None:
        assert "kv_connector_extra_config.tcp_host" in sentence and sentence.endswith(".") and "\n" not in sentence
