"""Signed grants: valid ones verify; tampered, expired, wrong-key and missing ones are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.grants import MAX_GRANT, GrantKeyError, mint, read_key, sign, verify

KEY = b"k" * 32
NOW = 1_800_000_000.0
DIGEST = "a3" * 12


def grant(**kw: object) -> str:
    args: dict[str, object] = {"transfer_id": "t-1", "prefill": "prefill-0", "prompt": DIGEST, "expires": NOW + 60}
    args.update(kw)
    return sign(KEY, **args)  # type: ignore[arg-type]


def check(g: object, *, key: bytes = KEY, transfer_id: str = "t-1", prefill: str = "prefill-0",
          prompt: str = DIGEST, now: float = NOW) -> str | None:
    return verify(key, g, transfer_id=transfer_id, prefill=prefill, prompt=prompt, now=now)


def test_a_valid_grant_verifies_until_it_expires() -> None:
    g = grant()
    assert g.startswith(f"v1.{int(NOW) + 60}.{DIGEST}.") and len(g) < MAX_GRANT
    assert check(g) is None
    assert check(g, now=NOW + 60) is None  # the last second still counts
    assert check(g, now=NOW + 61) == "its grant expired 1 s ago"


def test_a_grant_binds_the_transfer_the_prefill_instance_and_the_prompt() -> None:
    g = grant()
    forged = "its grant does not verify (another key, another transfer_id or prefill instance, or altered)"
    assert check(g, transfer_id="t-2") == forged
    assert check(g, prefill="prefill-1") == forged
    assert check(g, key=b"x" * 32) == forged
    assert check(g, prompt="b4" * 12) == "its grant was made for another prompt"


def test_a_grant_without_a_prompt_serves_any_prompt() -> None:
    g = grant(prompt="")
    assert check(g, prompt=DIGEST) is None and check(g, prompt="") is None
    assert check(g, transfer_id="t-9") is not None


def test_every_altered_part_is_refused() -> None:
    version, until, prompt, mac = grant().split(".")
    flipped = ("0" if mac[0] != "0" else "1") + mac[1:]
    for altered in (
        f"{version}.{int(until) + 3600}.{prompt}.{mac}",  # a later expiry
        f"{version}.{until}.{'b4' * 12}.{mac}",  # another prompt
        f"{version}.{until}..{mac}",  # the prompt dropped, to serve any
        f"{version}.{until}.{prompt}.{flipped}",
    ):
        assert check(altered, prompt=altered.split(".")[2]) is not None, altered
    for malformed, why in (
        (f"v2.{until}.{prompt}.{mac}", "its grant is not a v1 grant"),
        (f"{version}.{until}.{prompt}", "its grant is not a v1 grant"),
        (f"{version}.-5.{prompt}.{mac}", "its grant is malformed"),
        (f"{version}.{until}.{prompt}.{mac.upper()}", "its grant is malformed"),
        (f"{version}.{until}.{prompt}.{mac[:-2]}", "its grant is malformed"),
        (f"{version}.{until}.{prompt}.{mac}" + "0" * MAX_GRANT, "its grant is not a grant string"),
    ):
        assert check(malformed) == why, malformed


def test_a_missing_grant_is_refused_with_its_reason() -> None:
    assert check(None) == "the request carries no grant, and this instance loads only granted transfers"
    for wrong in (5, [grant()], {"grant": grant()}, b"v1", True):
        assert check(wrong) == "its grant is not a grant string"


@given(st.one_of(st.text(max_size=400), st.binary(max_size=64), st.integers(), st.none(),
                 st.lists(st.text(max_size=8), max_size=4), st.floats()))
def test_any_client_value_gives_a_reason_and_never_raises(value: object) -> None:
    assert isinstance(check(value), str)


def test_minted_ids_are_fresh_and_their_grants_verify() -> None:
    ids = set()
    for _ in range(50):
        tid, g = mint(KEY, prefill="prefill-0", ttl_s=30, now=NOW, prefix="gw")
        assert tid.startswith("gw-") and len(tid) == 35
        assert verify(KEY, g, transfer_id=tid, prefill="prefill-0", prompt="any", now=NOW + 30) is None
        assert verify(KEY, g, transfer_id=tid, prefill="prefill-0", prompt="any", now=NOW + 32) is not None
        ids.add(tid)
    assert len(ids) == 50


def test_signing_refuses_fields_that_would_not_fit() -> None:
    with pytest.raises(ValueError):
        sign(KEY, transfer_id="x" * 129, prefill="p", expires=NOW)
    with pytest.raises(ValueError):
        sign(KEY, transfer_id="t", prefill="p", prompt="a.b", expires=NOW)


def test_the_key_file_must_hold_a_secret(tmp_path: Path) -> None:
    good = tmp_path / "grant.key"
    good.write_text("0123456789abcdef0123456789abcdef\n")
    assert read_key(good) == b"0123456789abcdef0123456789abcdef"
    short = tmp_path / "short.key"
    short.write_text("secret\n")
    with pytest.raises(GrantKeyError, match="must hold a secret of 16 to 4096 bytes.*it holds 6"):
        read_key(short)
    with pytest.raises(GrantKeyError, match="cannot be read"):
        read_key(tmp_path / "absent.key")
