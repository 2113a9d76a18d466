"""The codec: every message round-trips, and bad bytes raise only RemoteProtocolError.

Strategies are derived from each Struct's msgspec type info, so they respect the `Meta`
limits and cover any message type added later without edits here.
"""

from __future__ import annotations

import math
from typing import cast

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.codec import HEADER, MAGIC, Codec, decode, encode
from protocols.errors import (
    InvalidMessage,
    LocalProtocolError,
    OversizedMessage,
    RemoteProtocolError,
    TruncatedMessage,
    UnknownMessageType,
    VersionMismatch,
)
from protocols.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Done,
    Go,
    Heartbeat,
    Layout,
    Message,
    Offer,
    Register,
)

# Collections are capped so examples stay small; limits below the cap are respected.
MAX_ITEMS = 4
INT64 = (-(1 << 63), (1 << 63) - 1)


def strategy_for(t: mi.Type) -> st.SearchStrategy:
    """A strategy for values that a msgspec type accepts, `Meta` limits included."""
    if isinstance(t, mi.StructType):
        fields = {f.name: strategy_for(f.type) for f in t.fields}
        required = {name: s for name, s in fields.items() if _field(t, name).required}
        optional = {name: s for name, s in fields.items() if not _field(t, name).required}
        return st.fixed_dictionaries(required, optional=optional).map(lambda kw: t.cls(**kw))
    if isinstance(t, mi.StrType):
        return st.text(min_size=t.min_length or 0, max_size=t.max_length)
    if isinstance(t, mi.BytesType):
        return st.binary(min_size=t.min_length or 0, max_size=t.max_length)
    if isinstance(t, mi.IntType):
        low = t.ge if t.gt is None else t.gt + 1
        high = t.le if t.lt is None else t.lt - 1
        return st.integers(
            min_value=INT64[0] if low is None else low,
            max_value=INT64[1] if high is None else high,
        )
    if isinstance(t, mi.FloatType):
        return st.floats(
            min_value=t.gt if t.ge is None else t.ge,
            max_value=t.lt if t.le is None else t.le,
            exclude_min=t.gt is not None,
            exclude_max=t.lt is not None,
            allow_nan=False,  # NaN != NaN would fail the equality check, not the codec
        )
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.ListType):
        return st.lists(strategy_for(t.item_type), min_size=t.min_length or 0, max_size=_cap(t.max_length))
    if isinstance(t, mi.DictType):
        return st.dictionaries(
            strategy_for(t.key_type),
            strategy_for(t.value_type),
            min_size=t.min_length or 0,
            max_size=_cap(t.max_length),
        )
    raise NotImplementedError(f"no strategy for {t!r}; extend strategy_for")


def _field(t: mi.StructType, name: str) -> mi.Field:
    return next(f for f in t.fields if f.name == name)


def _cap(max_length: int | None) -> int:
    return MAX_ITEMS if max_length is None else min(max_length, MAX_ITEMS)


messages = st.one_of([strategy_for(mi.type_info(cls)) for cls in MESSAGE_TYPES])
# Room for the largest examples (2048-char strings in full dicts); the limit has its own tests.
roomy = Codec(max_frame=16 << 20)


def frame(obj: object) -> bytes:
    """A frame with a valid header around arbitrary msgpack, to reach the decoder's checks."""
    return HEADER + msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_message_type_round_trips(cls: type, data: st.DataObject) -> None:
    msg = data.draw(strategy_for(mi.type_info(cls)))
    assert roomy.decode(roomy.encode(msg)) == msg


@given(msg=messages)
def test_round_trip_through_a_default_codec(msg: Message) -> None:
    try:
        wire = encode(msg)
    except LocalProtocolError:
        return  # a few examples are over 1 MiB; refusing them is the right answer
    assert wire[:2] == HEADER
    assert decode(wire) == msg


def assert_rejected_cleanly(data: bytes, codec: Codec = roomy) -> None:
    """Decoding either yields a message or raises RemoteProtocolError, nothing else."""
    try:
        msg = codec.decode(data)
    except RemoteProtocolError as exc:
        assert str(exc)
        assert exc.code != "protocol"
    else:
        assert isinstance(msg, MESSAGE_TYPES)


@given(data=st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    assert_rejected_cleanly(data)


@given(body=st.binary(max_size=512))
def test_random_bodies_behind_a_valid_header(body: bytes) -> None:
    assert_rejected_cleanly(HEADER + body)


STRUCTS = [cast(mi.StructType, mi.type_info(cls)) for cls in MESSAGE_TYPES]
TAGS = [info.tag for info in STRUCTS]
FIELD_NAMES = sorted({f.name for info in STRUCTS for f in info.fields})
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(*INT64) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=16,
)


@given(
    tag=st.sampled_from(TAGS) | st.text(max_size=8),
    fields=st.dictionaries(st.sampled_from(FIELD_NAMES), msgpack_values),
)
def test_well_formed_msgpack_with_wrong_contents(tag: str, fields: dict) -> None:
    """Valid msgpack, plausible tags and field names, arbitrary values."""
    assert_rejected_cleanly(frame({"type": tag, **fields}))


@pytest.mark.parametrize("depth", [100, 10_000, 200_000])
def test_deep_nesting(depth: int) -> None:
    """Nesting inside an ignored field must not escape as RecursionError."""
    nested_maps = HEADER + b"\x82\xa4type\xa9heartbeat\xa1x" + b"\x81\xa1a" * depth + b"\xc0"
    assert_rejected_cleanly(nested_maps)
    nested_lists = HEADER + b"\x82\xa4type\xa9heartbeat\xa1x" + b"\x91" * depth + b"\xc0"
    assert_rejected_cleanly(nested_lists)


@settings(max_examples=300)
@given(msg=messages, data=st.data())
def test_mutated_frames(msg: Message, data: st.DataObject) -> None:
    wire = bytearray(roomy.encode(msg))
    how = data.draw(st.sampled_from(["flip", "truncate", "append", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(wire) - 1))
            wire[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del wire[data.draw(st.integers(0, len(wire) - 1)) :]
    elif how == "append":
        wire += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(wire)))
        wire[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    assert_rejected_cleanly(bytes(wire))


@given(data=st.binary(max_size=64))
def test_a_small_codec_rejects_what_is_over_its_limit(data: bytes) -> None:
    codec = Codec(max_frame=16)
    if len(data) > 16:
        with pytest.raises(OversizedMessage):
            codec.decode(data)
    else:
        assert_rejected_cleanly(data, codec)


def test_unknown_tag() -> None:
    with pytest.raises(UnknownMessageType):
        decode(frame({"type": "no_such_message", "transfer_id": "t"}))


@pytest.mark.parametrize("obj", [{"transfer_id": "t"}, {"type": 5, "transfer_id": "t"}, {"type": None}])
def test_missing_or_mistyped_tag(obj: dict) -> None:
    with pytest.raises(UnknownMessageType):
        decode(frame(obj))


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "done", "transfer_id": 5},
        {"type": "done", "transfer_id": "t", "nbytes": "many"},
        {"type": "done", "transfer_id": "t", "nbytes": -1},
        {"type": "done", "transfer_id": ""},
        {"type": "done", "transfer_id": "t" * 129},
        {"type": "done"},
        {"type": "register", "role": "observer", "instance_id": "i"},
        {"type": "registered", "peer_id": "p", "heartbeat_s": 0.0, "lease_s": 1.0},
        {"type": "offer", "transfer_id": "t", "nbytes": 1, "layout": {"num_layers": -1}},
        {"type": "relay", "to": "p", "key": "k", "payload": b"x" * 4097},
        {"type": "go", "transfer_id": "t", "decode": "d", "nbytes": 1, "endpoints": {str(i): "" for i in range(17)}},
        ["done", "t"],
        42,
    ],
)
def test_wrong_field_types_and_values(obj: object) -> None:
    with pytest.raises(InvalidMessage):
        decode(frame(obj))


def test_unknown_fields_are_ignored() -> None:
    """Newer peers may add fields; an older side skips them (forbid_unknown_fields=False)."""
    assert decode(frame({"type": "done", "transfer_id": "t", "later": [1, 2]})) == Done(transfer_id="t")


def test_wrong_version() -> None:
    wire = bytearray(encode(Done(transfer_id="t")))
    wire[1] = PROTOCOL_VERSION + 1
    with pytest.raises(VersionMismatch):
        decode(bytes(wire))


def test_wrong_magic() -> None:
    wire = bytearray(encode(Done(transfer_id="t")))
    wire[0] = MAGIC ^ 0xFF
    with pytest.raises(InvalidMessage):
        decode(bytes(wire))


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_shorter_than_header_and_body(cut: int) -> None:
    with pytest.raises(TruncatedMessage):
        decode(encode(Heartbeat())[:cut])


def test_truncated_body() -> None:
    wire = encode(Abort(transfer_id="t-1", reason="peer went away"))
    for cut in range(len(HEADER) + 1, len(wire)):
        with pytest.raises(TruncatedMessage):
            decode(wire[:cut])


def test_oversized_frame() -> None:
    codec = Codec(max_frame=64)
    with pytest.raises(OversizedMessage):
        codec.decode(HEADER + b"\x00" * 63)
    # Exactly at the limit is fine as far as size goes.
    with pytest.raises(InvalidMessage):
        codec.decode(HEADER + b"\xc1" * 62)


def test_encoding_a_message_over_the_limit_is_a_local_error() -> None:
    codec = Codec(max_frame=64)
    small = Done(transfer_id="t")
    assert codec.decode(codec.encode(small)) == small
    with pytest.raises(LocalProtocolError):
        codec.encode(Abort(transfer_id="t", reason="x" * 100))


def test_limits_at_the_boundary() -> None:
    longest = Go(
        transfer_id="t" * 128, decode="d", endpoints={f"{i:k>32}": "v" * 2048 for i in range(16)}, nbytes=1 << 50
    )
    assert decode(encode(longest)) == longest
    offer = Offer(transfer_id="t", nbytes=0, layout=Layout(num_layers=1 << 31))
    assert decode(encode(offer)) == offer
    big = Register(role="decode", instance_id="i", compat={str(i): "v" * 2048 for i in range(32)})
    assert decode(encode(big)) == big


def test_max_frame_must_fit_a_header_and_a_body() -> None:
    with pytest.raises(ValueError):
        Codec(max_frame=len(HEADER))


def test_memoryview_and_bytearray_frames() -> None:
    wire = encode(Heartbeat(seq=3))
    assert decode(bytearray(wire)) == decode(memoryview(wire)) == Heartbeat(seq=3)


def test_floats_keep_their_values() -> None:
    """msgpack keeps float64 exactly; nothing is rounded on the way."""
    msg = msgspec.convert({"type": "registered", "peer_id": "p", "heartbeat_s": math.pi, "lease_s": 1e-300}, Message)
    assert decode(encode(msg)) == msg
