"""Bytes <-> messages: a 2-byte header (magic, version), then msgpack of one `Message`.

Decoding is strict: every failure is one `RemoteProtocolError` subclass naming the
problem, so a receive loop catches one type, answers `Error(code=...)` and goes on.
"""

from __future__ import annotations

import msgspec

from .errors import (
    InvalidMessage,
    LocalProtocolError,
    OversizedMessage,
    TruncatedMessage,
    UnknownMessageType,
    VersionMismatch,
)
from .messages import PROTOCOL_VERSION, Message

MAGIC = 0x6B  # "k"
HEADER = bytes([MAGIC, PROTOCOL_VERSION])
DEFAULT_MAX_FRAME = 1 << 20


class Codec:
    """Encodes and decodes messages under a frame-size limit (bytes, header included)."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if max_frame < len(HEADER) + 1:
            raise ValueError(f"max_frame must be at least {len(HEADER) + 1} bytes, got {max_frame}")
        self.max_frame = max_frame
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        body = self._encoder.encode(msg)
        if len(body) + len(HEADER) > self.max_frame:
            raise LocalProtocolError(
                f"{type(msg).__name__} encodes to {len(body) + len(HEADER)} bytes, over the "
                f"{self.max_frame}-byte frame limit; raise max_frame on both sides or send less"
            )
        return HEADER + body

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        n = len(frame)
        if n > self.max_frame:
            raise OversizedMessage(f"frame of {n} bytes is over the {self.max_frame}-byte limit")
        if n < len(HEADER) + 1:
            raise TruncatedMessage(f"frame of {n} bytes is shorter than a header and a body")
        view = memoryview(frame)
        if view[0] != MAGIC:
            raise InvalidMessage(f"frame does not start with the kvbroker magic byte 0x{MAGIC:02x}")
        if view[1] != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"peer speaks protocol version {view[1]}, this side speaks {PROTOCOL_VERSION}; "
                "run the same kvbroker release on the broker and every worker"
            )
        try:
            return self._decoder.decode(view[len(HEADER):])
        except msgspec.ValidationError as exc:
            text = str(exc)
            if text.endswith("`$.type`") or "missing required field `type`" in text:
                raise UnknownMessageType(f"unknown or missing message type: {text}") from None
            raise InvalidMessage(f"malformed message: {text}") from None
        except msgspec.DecodeError as exc:
            text = str(exc)
            if "truncated" in text:
                raise TruncatedMessage(f"truncated message: {text}") from None
            raise InvalidMessage(f"undecodable message: {text}") from None
        except RecursionError:
            # Deep nesting, even inside an ignored field, hits msgspec's recursion guard.
            raise InvalidMessage("message is nested too deeply") from None


_default = Codec()
encode = _default.encode
decode = _default.decode
