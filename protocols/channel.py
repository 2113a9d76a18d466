"""anyio channels over ZMQ sockets, for both the asyncio and the trio backend.

pyzmq's own async sockets exist only for asyncio, so a `ZmqChannel` drives a plain
`zmq.Socket` in non-blocking mode and sleeps on the socket's notification fd.

Theory of operation. `zmq.FD` is not the network socket: it is a signal that the
socket's command mailbox has something in it, and it is edge-triggered. Any libzmq call
on the socket (send, recv, reading `zmq.EVENTS`) may drain the mailbox and clear the
signal without anything becoming ready for *us*. Three rules follow:

1. Try the operation first (NOBLOCK). Only on `zmq.Again` read `zmq.EVENTS`, and wait on
   the fd only if the wanted flag is still clear. Every wake may be spurious, so the loop
   always goes back to rule 1.
2. Only one task may wait on an fd, so one task (the poller) waits on it and the others
   park on an `anyio.Event`. The poller wakes them whenever it returns, for any reason,
   cancellation included, so one of them takes over the fd.
3. Whoever drains the mailbox owns the edge it consumed: after every send or receive,
   and after every read of `zmq.EVENTS`, parked tasks whose flag is now set are woken.

A receive takes a message only in synchronous code, after its last cancellable await,
so a cancelled receive never loses a message. `close()` marks the channel closed, wakes
the poller with `anyio.notify_closing` and only then closes the socket, so no backend
is left watching a closed fd. All of this runs in the event loop's thread: never touch
the socket from another thread while the channel owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MethodType, TracebackType
from typing import TypeVar, cast

import anyio
import anyio.lowlevel
import zmq

from .codec import DEFAULT_MAX_FRAME, Codec
from .errors import ChannelClosed, InvalidMessage, KvBrokerError
from .messages import Message

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_LINGER_MS",
    "MessageChannel",
    "PeerUnreachable",
    "ZmqChannel",
    "curve_client_keys",
    "dealer",
    "router",
]

DEFAULT_HWM = 10_000
# Long enough for a last Goodbye to leave, short enough not to stall shutdown.
DEFAULT_LINGER_MS = 100

T = TypeVar("T")

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
# Backoff for a send that zmq refuses while reporting POLLOUT (see `_io`).
_BLIND_WAIT_MIN_S = 0.0005
_BLIND_WAIT_MAX_S = 0.05


class PeerUnreachable(KvBrokerError):
    """A ROUTER send named an identity that is not connected (now, or ever).

    Only that message is lost; the channel stays open, so a broker drops the peer and
    goes on.
    """

    def __init__(self, identity: bytes) -> None:
        super().__init__(f"no connected peer with identity {identity!r}")
        self.identity = identity


class ZmqChannel:
    """Sends and receives multipart messages on one zmq socket, which it owns.

    There are no timeout arguments: wrap calls in `anyio.fail_after`. Any number of tasks
    may send and receive at once; frames of one message are never interleaved.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        # The backend's own send and option read, bound to this socket: pyzmq's Python
        # layer over them handles arguments this channel never passes (a DRAFT socket's
        # routing id or group), and cost a send 0.28 us more than the send itself.
        self._raw_send = MethodType(zmq.backend.Socket.send, sock)
        self._raw_get = MethodType(zmq.backend.Socket.get, sock)
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        # A ROUTER's message is its sender's identity and at least one frame more: the
        # second is taken without asking whether one follows (each ask, 0.6 us, looks the
        # option up in pyzmq's enum; two a message were 4 us of a broker's handshake).
        self._router = sock.getsockopt(zmq.TYPE) == zmq.ROUTER
        self._closed = False
        self._poll_scope: anyio.CancelScope | None = None  # set while a task waits on the fd
        self._changed: anyio.Event | None = None  # where the other waiters park
        self._want_in = 0
        self._want_out = 0

    @property
    def socket(self) -> zmq.Socket:
        """The socket, for reading options; sending or receiving on it directly breaks rule 3."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message, waiting while the high-water mark is reached.

        Raises:
            ChannelClosed: the channel or its context is closed.
            PeerUnreachable: a ROUTER (with ROUTER_MANDATORY) has no peer named `frames[0]`.
        """
        _check_frames(frames)
        await anyio.lowlevel.checkpoint_if_cancelled()
        await self._io(lambda: self._send_frames(frames), zmq.POLLOUT, frames[0])
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, frames: Sequence[bytes]) -> None:
        """Send one multipart message now, or raise `anyio.WouldBlock` and send nothing."""
        _check_frames(frames)
        self._check_open()
        try:
            self._send_frames(frames)
        except zmq.Again:
            self._after_op()
            raise anyio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise self._failed(exc, frames[0]) from exc
        self._after_op()

    def receive_nowait(self) -> list[bytes]:
        """Take the next multipart message if one is queued, else raise `anyio.WouldBlock`.

        Lets a busy loop drain a burst without a scheduler round trip per message.
        """
        self._check_open()
        try:
            frames = self._recv_frames()
        except zmq.Again:
            self._after_op()
            raise anyio.WouldBlock from None
        except zmq.ZMQError as exc:
            raise self._failed(exc) from exc
        self._after_op()
        return frames

    async def receive(self) -> list[bytes]:
        """Wait for the next multipart message.

        Raises:
            ChannelClosed: the channel or its context is closed, before or during the wait.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        frames = await self._io(self._recv_frames, zmq.POLLIN)
        # The message is ours now; a cancellation here must not drop it.
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return frames

    def _send_frames(self, frames: Sequence[bytes]) -> None:
        # pyzmq's send_multipart combines IntFlag enums per frame, which costs more than
        # the send itself for small messages; plain ints keep the hot path cheap. Frames
        # after the first are never refused: zmq delivers a multipart message whole.
        send = self._raw_send
        for frame in frames[:-1]:
            send(frame, _SNDMORE_NOBLOCK)
        send(frames[-1], _NOBLOCK)

    def _recv_frames(self) -> list[bytes]:
        recv, more = self._sock.recv, self._raw_get
        frames = [recv(_NOBLOCK)]
        if self._router:  # the rest of a message is there once its first frame is
            frames.append(recv(_NOBLOCK))
        while more(_RCVMORE):
            frames.append(recv(_NOBLOCK))
        return frames

    def close(self) -> None:
        """Close the socket; tasks waiting on the channel raise `ChannelClosed`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._poll_scope is not None:
            anyio.notify_closing(self._fd)
        self._wake()
        self._sock.close()

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> ZmqChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _io(self, op: Callable[[], T], flag: int, peer: bytes = b"") -> T:
        """Run `op` until it does not raise `zmq.Again`, sleeping on the fd in between."""
        retried = False
        blind = _BLIND_WAIT_MIN_S
        while True:
            self._check_open()
            try:
                result = op()
            except zmq.Again:
                if not self._events() & flag:
                    retried = False
                    await self._wait(flag)
                    continue
                # A ROUTER with ROUTER_MANDATORY shows POLLOUT while any peer has room, yet
                # one full peer gives Again: retry once, then sleep, never spin. Nothing
                # signals when that one peer drains (reading EVENTS may already have
                # spent the edge that said so), so the sleep also ends after a backoff.
                if not retried:
                    retried = True
                    continue
                retried = False
                with anyio.move_on_after(blind):
                    await self._wait(flag)
                blind = min(blind * 2, _BLIND_WAIT_MAX_S)
                continue
            except zmq.ZMQError as exc:
                raise self._failed(exc, peer) from exc
            self._after_op()
            return result

    async def _wait(self, flag: int) -> None:
        """Return once `zmq.EVENTS` may have changed, or the channel closed. May be spurious."""
        if flag & zmq.POLLIN:
            self._want_in += 1
        else:
            self._want_out += 1
        try:
            if self._poll_scope is None:
                await self._poll_fd()
            else:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
        finally:
            if flag & zmq.POLLIN:
                self._want_in -= 1
            else:
                self._want_out -= 1

    async def _poll_fd(self) -> None:
        with anyio.CancelScope() as scope:
            self._poll_scope = scope
            try:
                await anyio.wait_readable(self._fd)
            except anyio.ClosedResourceError:
                pass  # close() is under way; the caller sees _closed
            finally:
                self._poll_scope = None
                self._wake()  # rule 2: someone else takes over the fd

    def _wake(self) -> None:
        """Make every waiting task re-check `zmq.EVENTS`."""
        if self._poll_scope is not None:
            self._poll_scope.cancel()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _events(self) -> int:
        """Read `zmq.EVENTS`, handing any readiness on to parked tasks (rule 3)."""
        try:
            events = cast(int, self._sock.getsockopt(zmq.EVENTS))
        except zmq.ZMQError as exc:
            raise self._error(exc) from exc
        if (events & zmq.POLLIN and self._want_in) or (events & zmq.POLLOUT and self._want_out):
            self._wake()
        return events

    def _after_op(self) -> None:
        """After every call into the socket, failed ones too: libzmq may have processed its
        mailbox there, which spends the fd's edge that a parked task sleeps on."""
        if self._want_in or self._want_out:
            self._events()

    def _failed(self, exc: zmq.ZMQError, peer: bytes = b"") -> KvBrokerError:
        """The error for a failed call; a socket still usable hands readiness on first."""
        error = self._error(exc, peer)
        if isinstance(error, PeerUnreachable):
            self._after_op()
        return error

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosed("channel is closed")

    def _error(self, exc: zmq.ZMQError, peer: bytes = b"") -> KvBrokerError:
        if exc.errno == zmq.EHOSTUNREACH:
            return PeerUnreachable(peer)
        # ETERM (context terminated), ENOTSOCK (socket closed), or worse: either way the
        # socket is done for.
        return ChannelClosed(f"zmq socket unusable: {exc}")


def _check_frames(frames: Sequence[bytes]) -> None:
    """Refuse a message before any frame goes out: once the first went with SNDMORE, a
    refused later frame would leave it open, and the next message would be glued onto it."""
    if not frames:
        raise ValueError("a message needs at least one frame")
    for frame in frames:
        if type(frame) is not bytes:  # this runs for every message: test the usual type only
            _check_buffers(frames)
            return


def _check_buffers(frames: Sequence[bytes]) -> None:
    for i, frame in enumerate(frames):
        try:
            memoryview(frame)  # what zmq sends: any bytes-like object (bytearray, memoryview, zmq.Frame...)
        except TypeError:
            raise TypeError(
                f"frame {i} of the message is of type {type(frame).__name__}, not bytes-like; encode it to bytes first"
            ) from None


class MessageChannel:
    """A `ZmqChannel` that encodes and decodes `Message`s with a `Codec`; nothing more.

    DEALER side: `send` / `receive`, one frame per message. ROUTER side: `send_to` /
    `receive_from`, which leaves decoding to the caller so it can answer bad frames.
    """

    def __init__(self, channel: ZmqChannel, codec: Codec | None = None) -> None:
        self._channel = channel
        self._codec = codec if codec is not None else Codec()

    @property
    def channel(self) -> ZmqChannel:
        return self._channel

    @property
    def codec(self) -> Codec:
        return self._codec

    async def send(self, msg: Message) -> None:
        """Raises: LocalProtocolError (too large, before any IO), ChannelClosed."""
        await self._channel.send([self._codec.encode(msg)])

    async def receive(self) -> Message:
        """Raises: a RemoteProtocolError subclass for a bad message, ChannelClosed."""
        frames = await self._channel.receive()
        if len(frames) != 1:
            raise InvalidMessage(f"expected a message of 1 frame, got {len(frames)} frames")
        return self._codec.decode(frames[0])

    async def send_to(self, identity: bytes, msg: Message) -> None:
        """Raises: LocalProtocolError, PeerUnreachable, ChannelClosed."""
        await self._channel.send([identity, self._codec.encode(msg)])

    async def receive_from(self) -> tuple[bytes, list[bytes]]:
        """Return the sender's identity and its raw frames (normally one)."""
        identity, *frames = await self._channel.receive()
        return identity, frames

    def close(self) -> None:
        self._channel.close()

    async def aclose(self) -> None:
        await self._channel.aclose()

    async def __aenter__(self) -> MessageChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _configure(sock: zmq.Socket, max_frame: int | None, hwm: int, linger_ms: int) -> None:
    # Options apply to connections made afterwards, so set them before bind/connect.
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # zmq itself drops the connection of a peer that sends a larger frame.
    sock.setsockopt(zmq.MAXMSGSIZE, -1 if max_frame is None else max_frame)


def curve_client_keys(
    server_public: str | bytes | None, client_secret: str | bytes | None = None
) -> tuple[bytes, bytes, bytes] | None:
    """`dealer(curve=...)` keys for a client of a CURVE router with this Z85 public key.

    With `client_secret` (a Z85 secret key from `kvbroker keygen --name`) the client
    proves who it is, for a broker that admits only listed keys (`serve
    --curve-clients`); without, a fresh key pair per call: the router proves who it is
    and the traffic is encrypted. None when no server key is given.

    Raises:
        ValueError: a key that is not 40 Z85 characters.
    """
    if not server_public:
        return None
    key = _z85_key(server_public, "public")
    if client_secret:
        secret = _z85_key(client_secret, "secret")
        return zmq.curve_public(secret), secret, key
    public, secret = zmq.curve_keypair()
    return public, secret, key


def _z85_key(key: str | bytes, kind: str) -> bytes:
    raw = key.strip().encode() if isinstance(key, str) else key.strip()
    if len(raw) != 40:
        raise ValueError(f"a CURVE {kind} key is 40 Z85 characters, got {len(raw)}; copy it from `kvbroker keygen`")
    return raw


def dealer(
    ctx: zmq.Context,
    addr: str,
    identity: bytes | None = None,
    curve: tuple[bytes, bytes, bytes] | None = None,
    *,
    max_frame: int | None = None,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
) -> zmq.Socket:
    """A DEALER connected to `addr` (the connection completes in the background).

    Args:
        ctx: a plain (not `zmq.asyncio`) context.
        identity: the routing id the ROUTER sees; zmq picks one if None.
        curve: (public, secret, server_public) keys, z85 or raw, to talk to a CURVE router.
        max_frame: largest inbound frame for zmq to accept. None (the default) leaves the
            limit to the codec: a DEALER that gets a frame over MAXMSGSIZE drops the
            connection and never reconnects (libzmq counts it as a protocol error), after
            which its sends vanish silently. Set it only to at least the broker's limit.
    """
    sock = ctx.socket(zmq.DEALER)
    try:
        _configure(sock, max_frame, hwm, linger_ms)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        if curve is not None:
            public, secret, server_public = curve
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.connect(addr)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def router(
    ctx: zmq.Context,
    bind_addr: str,
    curve_secret: bytes | None = None,
    *,
    max_frame: int | None = DEFAULT_MAX_FRAME,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to `bind_addr`; returns it and the endpoint actually bound.

    Port 0 or `*` (`tcp://127.0.0.1:0`) picks a free port. A peer that sends a frame over
    `max_frame` is disconnected by zmq (the frame is never delivered); a DEALER peer
    reconnects after its RECONNECT_IVL, and frames it sent right behind the big one may
    be lost with the old connection. ROUTER_MANDATORY makes a send
    to an unknown identity fail (`PeerUnreachable`) instead of vanishing, and
    ROUTER_HANDOVER lets a restarted peer reclaim its identity while the old connection
    is still half-open. With `curve_secret`, clients must use CURVE and know the server's
    public key; which client keys are allowed is not checked (that needs a ZAP handler).
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        _configure(sock, max_frame, hwm, linger_ms)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve_secret is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve_secret)
        sock.bind(bind_addr)
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, endpoint
