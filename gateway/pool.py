"""The gateway's upstream connections: HTTP/1.1 client connections whose responses
httptools (llhttp, the parser in C that uvicorn uses) parses, kept alive per upstream in
a stack of idle ones, the last used first.

A request takes the top of its upstream's stack and checks that one connection only
(whether anything came on it while idle: one the server closed, or wrote to, is
dropped); a connection whose response was not read to its end (a cancelled request, a
body left unread), or whose server said `Connection: close`, is closed, never handed out
again.

A request's head and body leave in one write. At most `max_connections` requests are in
flight at once (a request over it waits for one to end, under the caller's deadline); at
most `max_connections` idle connections are kept, each for `keepalive_s`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator

import anyio
import httptools

from .sockets import SocketClosed, Stream, connect

Key = tuple[str, int]
READ_CHUNK = 64 << 10


class Unreachable(Exception):
    """No connection could be opened: the request cannot have reached the server."""


class Broke(Exception):
    """The connection broke, or the server's answer was not HTTP, after the request was sent."""


class Connection:
    """One HTTP/1.1 connection to an upstream; one request at a time. `request` sends and
    reads the response's head; `body` yields the body as it comes."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = time.monotonic()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._parts: list[bytes] = []
        self._head_done = False
        self.done = False  # the whole response has been read
        self.keep_alive = False

    # --- httptools' callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._parts.append(body)

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()

    # --- the request ---

    async def request(self, data: bytes) -> None:
        """Send one request (head and body, whole) and read its response's head."""
        self.status, self.headers, self._head_done, self.done = 0, [], False, False
        try:
            await self.stream.send(data)
        except SocketClosed as exc:
            raise Broke(f"the connection broke while sending ({exc})") from None
        while not self._head_done:
            await self._read("before answering")

    async def _read(self, when: str) -> None:
        try:
            data = await self.stream.receive(READ_CHUNK)
        except SocketClosed as exc:
            raise Broke(f"the connection broke {when} ({exc})") from None
        if not data:
            if self._head_done and self._until_eof():
                self.done, self.keep_alive = True, False
                return
            raise Broke(f"the server closed the connection {when}")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise Broke(f"the answer is not HTTP/1.1 ({exc})") from None

    def _until_eof(self) -> bool:
        """Whether the body has no length, and ends with the connection."""
        framed = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in self.headers)
        return not framed and self.status >= 200 and self.status not in (204, 304)

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            if self._parts:
                parts = self._parts
                self._parts = []
                yield parts[0] if len(parts) == 1 else b"".join(parts)
            if self.done:
                return
            await self._read("mid-answer")

    async def read_all(self) -> bytes:
        """The whole body (without `body`'s generator: most bodies came with the head)."""
        while not self.done:
            await self._read("mid-answer")
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def reusable(self) -> bool:
        return self.done and self.keep_alive and not self._parts and not self.stream.closed

    def close(self) -> None:
        self.stream.close()


class Slots:
    """At most `limit` holders at once; the others wait, first come first served. A count,
    not anyio's Semaphore: a free slot is taken with no call into the event loop's
    machinery (the Semaphore checks for cancellation first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.busy = 0
        self.waiting: deque[anyio.Event] = deque()

    async def take(self) -> None:
        if self.busy < self.limit and not self.waiting:
            self.busy += 1
            return
        turn = anyio.Event()
        self.waiting.append(turn)
        try:
            await turn.wait()  # `give_back` hands it a slot, counted
        except BaseException:
            if turn.is_set():
                self.give_back()  # the slot it was given goes to the next one
            else:
                self.waiting.remove(turn)
            raise

    def give_back(self) -> None:
        self.busy -= 1
        if self.waiting and self.busy < self.limit:
            self.busy += 1
            self.waiting.popleft().set()


class StackPool:
    def __init__(self, connect_timeout_s: float, max_connections: int, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: dict[Key, list[Connection]] = {}
        self.slots = Slots(max_connections)  # requests in flight, and those waiting for one to end

    async def take(self, key: Key) -> Connection:
        """A connection to `key` (host, port) for one request; `give_back` ends its use.
        Raises `Unreachable`."""
        await self.slots.take()
        try:
            return self._idle_connection(key) or await self._connect(key)
        except BaseException:
            self.slots.give_back()
            raise

    def _idle_connection(self, key: Key) -> Connection | None:
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            # Expired, or closed by the server meanwhile (readable while idle: at its end).
            if now - conn.idle_since < self.keepalive_s and not conn.stream.readable():
                return conn
            conn.close()
        return None

    async def _connect(self, key: Key) -> Connection:
        try:
            with anyio.fail_after(self.connect_timeout_s):
                stream = await connect(*key)
        except TimeoutError:
            raise Unreachable(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise Unreachable(exc.strerror or str(exc) or type(exc).__name__) from None
        return Connection(stream)

    def give_back(self, key: Key, conn: Connection) -> None:
        """A request ended: its connection is kept if its response was read whole."""
        self.slots.give_back()
        stack = self._idle.setdefault(key, [])
        if conn.reusable() and len(stack) < self.max_connections:
            conn.idle_since = time.monotonic()
            stack.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for stack in self._idle.values():
            while stack:
                stack.pop().close()
