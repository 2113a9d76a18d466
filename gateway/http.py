"""HTTP/1.1 for the gateway, parsed by httptools (llhttp, in C) on both sides: its
clients' requests (`HttpConn`, one request answered at a time on a connection, pipelined
ones kept in order) and its upstreams' responses (`UpstreamPool`, over the kept-alive
connections of gateway.pool that every request shares). The gateway frames what it
writes itself: a whole answer's head and body leave in one write.

An upstream request that is cancelled (the client left, the deadline passed, P's or D's
request is no longer needed) closes its connection instead of handing it back to the
pool, so the vLLM server sees the disconnect and aborts the request.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus

import anyio
import httptools
import msgspec

from .pool import Broke, Connection, StackPool, Unreachable
from .routes import Upstream
from .sockets import Stream

READ_CHUNK = 64 << 10
MAX_HEAD_BYTES = 16 << 10  # a request's line and headers together
HEAD_TOO_LONG = f"the request's line and headers are over {MAX_HEAD_BYTES} bytes; send shorter ones."


class HttpError(Exception):
    """An answer the gateway gives itself: status, one sentence for the client, and any
    headers beside it (a 503's Retry-After)."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class UpstreamFailed(Exception):
    """An upstream could not be reached or broke off; `reached` says whether it got the request."""

    def __init__(self, upstream: Upstream, reason: str, *, reached: bool) -> None:
        super().__init__(f"{upstream.role} instance {upstream.instance_id} at {upstream.url}: {reason}")
        self.upstream = upstream
        self.reached = reached


@functools.lru_cache(maxsize=64)
def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def _head(status: int, headers: list[tuple[str, str]], last: bytes) -> bytes:
    lines = [_status_line(status)]
    lines += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
    lines.append(last)
    return b"".join(lines)


def error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})


# --- the clients' side ------------------------------------------------------------------


class Request:
    """A client's request, whole."""

    __slots__ = ("method", "target", "headers", "body", "keep_alive", "chunked_ok")

    def __init__(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes,
                 keep_alive: bool, chunked_ok: bool) -> None:
        self.method, self.target, self.headers, self.body = method, target, headers, body
        self.keep_alive = keep_alive  # the connection serves on after this answer
        self.chunked_ok = chunked_ok  # HTTP/1.1: a stream can go chunked (else until the close)


class HttpConn:
    """A client's connection: `pump` reads and parses (a task beside the one that
    answers), `next_request` waits for a whole request, `send_whole` or `start_stream`,
    `send_chunk`, `end_stream` answer it."""

    def __init__(self, stream: Stream, max_body_bytes: Callable[[], int]) -> None:
        self.stream = stream
        self.max_body_bytes = max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        self.ready: deque[Request | HttpError | None] = deque()  # None: the client's end
        self._arrived = anyio.Event()
        self._taken = anyio.Event()  # set when `next_request` takes one from `ready`
        # Bytes fed while a head was incomplete (`pump`), and whether a head or a message
        # ended in the bytes fed last.
        self._head_fed = 0
        self._head_ended = False
        self._in_body = False
        # The scope of the request being answered, if any: `pump` cancels it when the
        # client hangs up before its whole answer went out, and sets `gone`.
        self.request_scope: anyio.CancelScope | None = None
        self.gone = False
        self.head_sent = False  # the answer to the current request has begun
        self.answered = True  # the answer to the current request went out whole
        self.keep_alive = True
        self._chunked = True
        self._head_only = False
        self._new_message()

    def _new_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._continue = False  # it waits for 100 Continue before it sends its body

    # --- httptools' callbacks (an exception raised here ends the connection's parsing) ---

    def on_message_begin(self) -> None:
        self._new_message()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._size += len(url)
        if self._size > MAX_HEAD_BYTES:
            raise HttpError(431, HEAD_TOO_LONG)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        if len(name) == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            self._continue = True
        self._size += len(name) + len(value)
        if self._size > MAX_HEAD_BYTES:
            raise HttpError(431, HEAD_TOO_LONG)

    def on_headers_complete(self) -> None:
        self._size = 0  # from here, the body's bytes
        self._head_ended = self._in_body = True
        self._keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        limit = self.max_body_bytes()
        if self._size > limit:
            raise HttpError(413, f"the request body is over {limit} bytes; send a smaller one or raise --max-body-bytes.")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._continue = False
        self._head_ended, self._in_body = True, False
        if self.parser.should_upgrade():
            return  # answered with a 400 (`pump`): llhttp hands what follows the head over unparsed
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        p = self.parser
        self.ready.append(Request(p.get_method().decode("latin-1"), self._url.decode("latin-1"), self._headers, body,
                                  self._keep_alive, p.get_http_version() != "1.0"))
        self._new_message()

    # --- reading ---

    async def pump(self) -> None:
        """Parse every byte the client sends, until it closes: run as a task beside the
        one that answers. Requests that come while one is answered are pipelined; they
        wait their turn in `ready`. After what is not HTTP, the rest is read and dropped
        (see `linger`)."""
        broken = False
        while True:
            while self.ready and not broken:
                # A whole request waits its turn: read no further until it is taken, so what
                # the client pipelines behind it waits in the socket's buffers (TCP pushes the
                # client back), not in the gateway's memory. A hang-up meanwhile is seen then.
                self._taken = anyio.Event()
                await self._taken.wait()
            data = await self.stream.receive(READ_CHUNK)
            if broken and data:
                continue
            if not data:
                self._arrive(None)
                scope = self.request_scope
                if scope is not None and not self.answered:
                    self.gone = True  # it had not its whole answer; P's request may still end on its own
                    scope.cancel()
                return
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._arrive(HttpError(400, "the gateway does not switch protocols; send the request without an Upgrade header."))
                broken = True
                continue
            except httptools.HttpParserError as exc:
                cause = exc.__context__
                self._arrive(cause if isinstance(cause, HttpError) else HttpError(400, f"malformed HTTP request ({exc})."))
                broken = True
                continue
            if self._head_ended:
                self._head_fed, self._head_ended = 0, False  # the next head's first bytes go uncounted: a chunk at most
            elif not self._in_body:
                # All of `data` was head. httptools keeps a header's name and value until they
                # end, unseen by the callbacks' limit: one that never ends would grow, and be
                # copied, without bound.
                self._head_fed += len(data)
                if self._head_fed > MAX_HEAD_BYTES:
                    self._arrive(HttpError(431, HEAD_TOO_LONG))
                    broken = True
                    continue
            if self._continue and self.answered and not self.ready:
                # The client waits for a word before it sends the body (not sent amid
                # another request's answer: the client then sends it after its own wait).
                self._continue = False  # once: the body may come in many reads
                await self.stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self.ready:
                self._arrived.set()

    def _arrive(self, item: Request | HttpError | None) -> None:
        self.ready.append(item)
        self._arrived.set()

    async def next_request(self) -> Request | HttpError | None:
        """The next request, whole; an HttpError for what was not one (then the connection
        ends once it is answered); None when the client closed."""
        while not self.ready:
            await self._arrived.wait()
            self._arrived = anyio.Event()
        got = self.ready.popleft()
        self._taken.set()  # `pump` reads on
        self.head_sent, self.answered = False, False
        if isinstance(got, Request):
            self.keep_alive, self._chunked, self._head_only = got.keep_alive, got.chunked_ok, got.method == "HEAD"
        else:
            self.keep_alive, self._head_only = False, False
        return got

    async def linger(self, timeout_s: float) -> None:
        """End the connection after an answer to what was not a request: no more writes,
        and the client's bytes still coming read (for up to `timeout_s`) until it closes.
        Closed at once, with bytes unread, the connection would be reset, and the client
        could lose the answer before reading it."""
        self.stream.shutdown_write()
        with anyio.move_on_after(timeout_s):
            while await self.next_request() is not None:
                pass

    # --- answering ---

    def _closing(self) -> bytes:
        return b"\r\n" if self.keep_alive else b"Connection: close\r\n\r\n"

    async def send_whole(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """The whole answer, head and body, in one write."""
        self.head_sent = True
        head = _head(status, headers, b"Content-Length: %d\r\n%s" % (len(body), self._closing()))
        await self.stream.send(head if self._head_only else head + body)
        self.answered = True

    async def start_stream(self, status: int, headers: list[tuple[str, str]]) -> None:
        """An answer whose body follows as it comes: chunked (an HTTP/1.0 client's ends
        with the connection)."""
        self.head_sent = True
        if not self._chunked:
            self.keep_alive = False
        frame = b"Transfer-Encoding: chunked\r\n" if self._chunked else b""
        await self.stream.send(_head(status, headers, frame + self._closing()))

    async def send_chunk(self, data: bytes) -> None:
        if data and not self._head_only:
            await self.stream.send(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def end_stream(self) -> None:
        if self._chunked and not self._head_only:
            await self.stream.send(b"0\r\n\r\n")
        self.answered = True


# --- the upstreams' side ----------------------------------------------------------------


class UpstreamReply:
    """An upstream's response head; its body is read through `chunks` or `body`."""

    __slots__ = ("status", "headers", "_conn")

    def __init__(self, conn: Connection) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self._conn = conn

    def header(self, name: str) -> str | None:
        want = name.encode().lower()
        for key, value in self.headers:
            if key.lower() == want:
                return value.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        return self.header("content-type") or "application/json"

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes, as sent (dechunked, not decoded: the client gets the same bytes)."""
        return self._conn.body()

    async def body(self) -> bytes:
        return await self._conn.read_all()


class UpstreamPool:
    """Kept-alive connections to the upstreams, shared by every request (gateway.pool).

    `keepalive_s` stays under uvicorn's (vLLM's server's) 5 s keep-alive, so an idle
    connection is dropped here before the server closes it under a request.
    """

    def __init__(self, connect_timeout_s: float, max_connections: int, keepalive_s: float = 4.0) -> None:
        self.pool = StackPool(connect_timeout_s, max_connections, keepalive_s)
        self._heads: dict[tuple[Upstream, str, str], bytes] = {}

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.pool.close()

    def _start(self, up: Upstream, method: str, target: str) -> bytes:
        """The request line and the headers every request to `up` carries."""
        got = self._heads.get((up, method, target))
        if got is None:
            host = up.host.encode("idna")
            host = b"[%s]" % host if b":" in host else host
            got = self._heads[(up, method, target)] = (
                b"%s %s HTTP/1.1\r\nHost: %s:%d\r\nAccept-Encoding: identity\r\n"
                % (method.encode(), target.encode(), host, up.port))
        return got

    def request(self, up: Upstream, method: str, target: str, body: bytes, headers: list[tuple[str, str]]) -> UpstreamCall:
        """`async with pool.request(...) as reply`: send one request on a pooled connection
        and get the response head; the body is read through the reply. Raises
        `UpstreamFailed`."""
        # The body passes through as sent (identity), on a kept-alive connection.
        data = b"".join([self._start(up, method, target), *[f"{k}: {v}\r\n".encode("latin-1") for k, v in headers],
                         b"Content-Length: %d\r\n\r\n" % len(body), body])
        return UpstreamCall(self.pool, up, data)


class UpstreamCall:
    __slots__ = ("pool", "up", "data", "conn")

    def __init__(self, pool: StackPool, up: Upstream, data: bytes) -> None:
        self.pool, self.up, self.data = pool, up, data
        self.conn: Connection | None = None

    async def __aenter__(self) -> UpstreamReply:
        up = self.up
        try:
            self.conn = await self.pool.take((up.host, up.port))
        except Unreachable as exc:
            raise UpstreamFailed(up, f"cannot connect ({exc})", reached=False) from None
        try:
            await self.conn.request(self.data)
        except Broke as exc:
            self._end()
            raise UpstreamFailed(up, f"broke off before answering ({exc})", reached=True) from None
        except BaseException:
            self._end()
            raise
        return UpstreamReply(self.conn)

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._end()  # a body not read to its end closes the connection
        if isinstance(exc, Broke):
            raise UpstreamFailed(self.up, f"broke off mid-answer ({exc})", reached=True) from None

    def _end(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.pool.give_back((self.up.host, self.up.port), conn)
