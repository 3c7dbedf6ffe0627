"""A lean HTTP/1.1 client for the proxy's chat calls to the engine.

The chat relay is the proxy's hot path, and on a small machine httpx costs more CPU per
request (and per streamed chunk) than everything else the proxy does for it. This client
does only what that path needs: POST a JSON body over a pool of keep-alive connections
(asyncio protocols, parsed by httptools — the C parser uvicorn already uses), then read a
`Content-Length`, chunked or read-until-close body, whole or piece by piece.

Failures raise httpx's exception types, so `proxy.upstream.translate` maps them to the
same client errors as before: cannot connect -> `ConnectError` (502), connect or read
silence beyond the timeouts -> `ConnectTimeout`/`ReadTimeout` (504), a connection that
breaks or speaks bad HTTP -> `ReadError`/`RemoteProtocolError` (502). A response closed
before its end (a client that went away) closes its connection, so the engine sees the
request end and stops generating; only fully read responses go back to the pool.
A request on a reused connection that the engine had already closed (an idle keep-alive
timing out) is sent again once on a fresh connection, as nothing of it was processed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

# Above this many unread body bytes the connection stops reading (the client is slow).
_HIGH_WATER = 256 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.lost = asyncio.get_running_loop().create_future()  # done at connection_lost
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.received = False  # any byte of the current response arrived
        self.sized = False  # Content-Length or chunked: the end is in the stream
        self.error: Exception | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"bad HTTP from the engine: {exc}")
            self.close()
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        if self.headers_done and not self.sized and not self.complete:
            self.complete = True  # a read-until-close body ends here
        elif not self.complete and self.error is None:
            self.error = httpx.ReadError("The engine closed the connection.")
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding"
                                            and b"chunked" in value.lower()):
            self.sized = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # used by the pool and the response
    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(request)

    async def wait(self, timeout_s: float) -> None:
        """Until more of the response (or its end, or a failure) arrives."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("The engine did not answer in time."))


class EngineResponse:
    """An engine response whose headers have arrived; read its body once, whole or in
    pieces, then `aclose()` (a no-op after a complete read)."""

    def __init__(self, pool: EnginePool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status_code = conn.status

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None, "the response was already read or closed"
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._pool.read_timeout_s)
        self._release()

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_bytes()])

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)

    async def aclose(self) -> None:
        """Give the connection back if the body was read to its end, else close it (the
        engine sees the request end)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.complete and not conn.chunks:
                self._pool.release(conn)
            else:
                self._pool.discard(conn)


class EnginePool:
    """Keep-alive connections to one engine base URL (`http://host:port[/prefix]`)."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 300.0,
                 max_connections: int = 1024) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        host = self.host if parts.port is None else f"{self.host}:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host}\r\nContent-Type: application/json\r\n{extra}".encode()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def post(self, path: str, body: bytes) -> EngineResponse:
        """Send the request and wait for the response headers."""
        request = (b"POST " + (self.prefix + path).encode() + b" HTTP/1.1\r\n" + self._head
                   + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:
            await asyncio.wait_for(self._slots.acquire(), self.read_timeout_s)
        except TimeoutError:
            raise httpx.PoolTimeout("No free connection to the engine in time.") from None
        try:
            while True:
                conn, reused = self._take_idle(), True
                if conn is None:
                    conn, reused = await self._connect(), False
                try:
                    return await self._exchange(conn, request)
                except httpx.ReadError:
                    # Closed by the engine while idle: nothing of the request was handled.
                    if not reused or conn.received:
                        raise
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, request: bytes) -> EngineResponse:
        try:
            conn.send(request)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_timeout_s)
        except BaseException:
            conn.close()
            raise
        return EngineResponse(self, conn)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s)
        except TimeoutError:
            raise httpx.ConnectTimeout("Connecting to the engine timed out.") from None
        except OSError as exc:
            raise httpx.ConnectError(f"Cannot connect to the engine: {exc}") from exc
        self._open.add(conn)
        conn.lost.add_done_callback(lambda _: self._open.discard(conn))
        return conn

    def release(self, conn: _Connection) -> None:
        """A connection whose response was read to its end: keep it for the next request."""
        self._slots.release()
        if conn.closed or self._closed or conn.chunks:
            conn.close()
        else:
            self._idle.append(conn)

    def discard(self, conn: _Connection) -> None:
        self._slots.release()
        conn.close()

    async def aclose(self) -> None:
        """Close every connection, idle or busy, and wait until their sockets are shut."""
        self._closed = True
        self._idle.clear()
        lost = [conn.lost for conn in self._open]
        for conn in list(self._open):
            conn.close()
        if lost:
            await asyncio.wait(lost, timeout=5.0)
