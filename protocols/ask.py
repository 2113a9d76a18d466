"""One question to a broker, without registering: its status, or a Cancel.

`kvbroker status`, `kvbroker cancel` and the gateway ask through here; it needs only the
wire (messages, codec, channel), so a client of the broker imports nothing of the broker.
"""

from __future__ import annotations

from typing import TypeVar

import anyio
import zmq

from .channel import ZmqChannel, curve_client_keys, dealer
from .codec import Codec
from .messages import Cancel, Cancelled, Error, Message, Status, StatusRequest

# A status reply lists up to 1,000 transfers: allow it a larger frame than requests get.
STATUS_MAX_FRAME = 64 << 20
A = TypeVar("A")


async def ask(
    broker: str, msg: Message, answer: type[A], timeout: float = 3.0, curve_server_key: str | None = None,
    curve_client_secret: bytes | None = None, *, ctx: zmq.Context | None = None,
) -> A:
    """One round trip, unregistered; raises TimeoutError if the broker is silent, and
    RuntimeError with the broker's sentence if it refuses `msg`. A caller that asks
    often passes its own `ctx`: making and ending a context takes milliseconds, during
    which the event loop waits."""
    codec = Codec(STATUS_MAX_FRAME)
    own = ctx is None
    ctx = zmq.Context() if ctx is None else ctx
    curve = curve_client_keys(curve_server_key, curve_client_secret)
    try:
        async with ZmqChannel(dealer(ctx, broker, curve=curve, max_frame=STATUS_MAX_FRAME)) as chan:
            with anyio.fail_after(timeout):
                await chan.send([codec.encode(msg)])
                while True:
                    frames = await chan.receive()
                    got = codec.decode(frames[-1])
                    if isinstance(got, answer):
                        return got
                    if isinstance(got, Error):
                        raise RuntimeError(f"the broker at {broker} refused {type(msg).__name__}: {got.detail}")
    finally:
        if own:
            ctx.destroy(linger=0)


async def fetch_status(
    broker: str, timeout: float = 3.0, curve_server_key: str | None = None, curve_client_secret: bytes | None = None,
    *, ctx: zmq.Context | None = None,
) -> Status:
    """One StatusRequest round trip; raises TimeoutError if the broker is silent."""
    return await ask(broker, StatusRequest(), Status, timeout, curve_server_key, curve_client_secret, ctx=ctx)


async def cancel_transfer(
    broker: str, transfer_id: str, reason: str = "", timeout: float = 3.0, curve_server_key: str | None = None,
    curve_client_secret: bytes | None = None, *, ctx: zmq.Context | None = None,
) -> Cancelled:
    """Tell the broker the request behind `transfer_id` was given up (`Cancel`)."""
    return await ask(broker, Cancel(transfer_id=transfer_id, reason=reason[:2000]), Cancelled, timeout,
                     curve_server_key, curve_client_secret, ctx=ctx)
