"""The gateway's pure parts (`gateway.proxy`): what a client's body becomes for each side."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.http import HttpError
from gateway.proxy import decode_body, parse_request, prefill_body, route_grant
from protocols import grants
from gateway.routes import Route, Upstream


def up(name: str) -> Upstream:
    return Upstream(instance_id=name, role="prefill" if name.startswith("p") else "decode", host="127.0.0.1", port=1)


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                 ).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 200_000).map(lambda n: b"[" * n),
    st.integers(1, 100_000).map(lambda n: b'{"a":' * n),
))
def test_any_request_body_is_a_json_object_or_a_400_that_says_why(raw: bytes) -> None:
    try:
        body = parse_request(raw)
    except HttpError as exc:
        assert exc.status == 400 and exc.message.startswith("the request body")
    else:
        assert isinstance(body, dict) and "kv_transfer_params" not in body


def test_prefill_is_asked_for_one_token_and_neither_side_gets_the_clients_kv_params() -> None:
    route = Route("gw-1", up("p0"), up("d0"))
    request = {"prompt": [1], "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
               "stream_options": {"include_usage": True}, "min_tokens": 5, "n": 1}
    p = prefill_body(request, route)
    assert p == {"prompt": [1], "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 1,
                 "kv_transfer_params": {"transfer_id": "gw-1", "decode_instance_id": "d0"}}
    d = decode_body(request, route)
    assert d == {**request, "kv_transfer_params": {"transfer_id": "gw-1", "prefill_instance_id": "p0"}}
    assert "kv_transfer_params" not in request  # the client's request is left as it was


def test_with_a_grant_key_d_is_sent_a_grant_that_verifies_for_that_route_only() -> None:
    key, other = b"k" * 32, b"o" * 32
    route = Route("gw-1", up("p0"), up("d0"))
    assert "grant" not in decode_body({"prompt": [1]}, route, route_grant(None, route, 60, 1000.0))["kv_transfer_params"]
    params = decode_body({"prompt": [1]}, route, route_grant(key, route, 60, 1000.0))["kv_transfer_params"]
    grant = params[grants.GRANT_PARAM]
    ok = dict(transfer_id="gw-1", prefill="p0", prompt="", now=1030.0)
    assert grants.verify(key, grant, **ok) is None
    assert "does not verify" in grants.verify(other, grant, **ok)
    assert "does not verify" in grants.verify(key, grant, **{**ok, "transfer_id": "gw-2"})
    assert "does not verify" in grants.verify(key, grant, **{**ok, "prefill": "p1"})
    assert "expired" in grants.verify(key, grant, **{**ok, "now": 1061.0})
