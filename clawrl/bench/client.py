"""A minimal HTTP/1.1 keep-alive client for `clawrl bench proxy`.

One connection, one request at a time, `Content-Length` or chunked bodies. It costs far
less CPU per request and per streamed chunk than httpx, so on a small machine the load
generator takes less CPU away from the processes it measures (both paths, direct and
through the proxy, use it alike). Benchmarks only: no TLS, redirects or proxies.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class Reply:
    status: int
    body: bytes  # the whole body, or its last `keep` bytes when streaming
    first_chunk_at: float | None  # perf_counter() when the first body bytes arrived
    turn_id: str | None = None  # the proxy's X-Clawrl-Turn-Id header


class Connection:
    """A keep-alive connection to `url`'s host; reopened when the server closes it."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path or "/"
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
            self._reader = self._writer = None

    async def post(self, body: bytes, *, keep: int = 0) -> Reply:
        """POST `body` (JSON); `keep` > 0 keeps only the body's last `keep` bytes."""
        try:
            return await self._post(body, keep)
        except BaseException:
            await self.close()  # a half-read response poisons the connection
            raise

    async def _post(self, body: bytes, keep: int) -> Reply:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"{self.headers}\r\n".encode() + body)
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        length, chunked, close, turn_id = None, False, False, None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection":
                close = value == "close"
            elif name == "x-clawrl-turn-id":
                turn_id = value
        first: float | None = None
        data = b""
        if chunked:
            while size := int((await reader.readline()).split(b";")[0], 16):
                chunk = (await reader.readexactly(size + 2))[:-2]
                if first is None:
                    first = time.perf_counter()
                data = (data + chunk)[-keep:] if keep else data + chunk
            while await reader.readline() not in (b"\r\n", b""):
                pass  # trailers
        elif length is not None:
            data = await reader.readexactly(length)
            first = time.perf_counter()
        else:
            data, close = await reader.read(), True
            first = time.perf_counter()
        if close:
            await self.close()
        return Reply(status, data, first, turn_id)
