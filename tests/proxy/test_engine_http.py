"""The lean engine client (proxy/engine_http.py) against scripted raw-socket servers:
body framings, keep-alive reuse, a stale idle connection, failures as httpx errors, an
early close reaching the engine — and, through the proxy, a client disconnect doing so."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from proxyharness import ProxyFactory, chunk, closed_port_url, create_user, query

from proxy.engine_http import EnginePool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server running `handler` per connection; yields its URL and a list that
    gets one entry per accepted connection."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()
        await srv.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)


def reply(body: bytes, status: int = 200) -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


async def test_sized_bodies_reuse_one_connection() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            writer.write(reply(b"got " + await read_request(reader)))

    async with server(echo) as (url, accepted):
        pool = EnginePool(url)
        for n in range(3):
            response = await pool.post("/x", b"%d" % n)
            assert response.status_code == 200
            assert await response.aread() == b"got %d" % n
        assert len(accepted) == 1
        await pool.aclose()


async def test_error_status_and_read_until_close() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\noverloaded")
        await writer.drain()

    async with server(answer) as (url, _):
        pool = EnginePool(url)
        response = await pool.post("/x", b"{}")
        assert response.status_code == 503
        assert await response.aread() == b"overloaded"
        await pool.aclose()


async def test_chunked_stream_arrives_piece_by_piece() -> None:
    go_on = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go_on.wait()  # the second piece only after the client has the first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(stream) as (url, _):
        pool = EnginePool(url)
        response = await pool.post("/x", b"{}")
        pieces = []
        async for piece in response.aiter_bytes():
            pieces.append(piece)
            go_on.set()
        assert pieces == [b"first", b"second"]
        await pool.aclose()


async def test_stale_idle_connection_is_replaced_once() -> None:
    async def one_per_connection(reader: asyncio.StreamReader,
                                 writer: asyncio.StreamWriter) -> None:
        writer.write(reply(await read_request(reader)))  # keep-alive, then hang up
        await writer.drain()

    async with server(one_per_connection) as (url, accepted):
        pool = EnginePool(url)
        assert await (await pool.post("/x", b"a")).aread() == b"a"
        for _ in range(100):  # until the client side has seen the hang-up
            if pool._idle and pool._idle[0].closed:
                break
            await asyncio.sleep(0.01)
        assert await (await pool.post("/x", b"b")).aread() == b"b"
        assert len(accepted) == 2
        await pool.aclose()


async def test_connection_lost_mid_body_is_a_read_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async with server(cut) as (url, _):
        pool = EnginePool(url)
        response = await pool.post("/x", b"{}")
        with pytest.raises(httpx.ReadError):
            await response.aread()
        await pool.aclose()


async def test_connect_error_and_read_timeout() -> None:
    with pytest.raises(httpx.ConnectError):
        await EnginePool(closed_port_url()).post("/x", b"{}")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with server(silent) as (url, _):
        pool = EnginePool(url, read_timeout_s=0.2)
        with pytest.raises(httpx.ReadTimeout):
            await pool.post("/x", b"{}")
        await pool.aclose()


async def test_closing_a_response_early_closes_the_engine_connection() -> None:
    engine_saw_eof = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client closed the connection
        engine_saw_eof.set()

    async with server(endless) as (url, accepted):
        pool = EnginePool(url)
        response = await pool.post("/x", b"{}")
        async for piece in response.aiter_bytes():
            assert piece == b"abc"
            break
        await response.aclose()
        await asyncio.wait_for(engine_saw_eof.wait(), 10)
        assert not pool._idle  # never reused
        await pool.aclose()


async def test_a_timed_out_body_frees_its_connection_slot() -> None:
    async def stall_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if len(accepted) == 1:  # the first connection: headers, part of the body, silence
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            await reader.read()
        else:
            writer.write(reply(b"ok"))
            await writer.drain()

    async with server(stall_first) as (url, accepted):
        pool = EnginePool(url, read_timeout_s=0.2, max_connections=1)
        response = await pool.post("/x", b"{}")
        with pytest.raises(httpx.ReadTimeout):
            await response.aread()
        await response.aclose()
        assert await (await pool.post("/x", b"{}")).aread() == b"ok"  # the one slot is free
        await pool.aclose()


async def test_proxy_client_disconnect_closes_the_pooled_engine_connection(
        proxy_factory: ProxyFactory, db_url: str) -> None:
    """The same guarantee as test_faults' disconnect test, over the lean pool (a real
    socket engine, no injected transport)."""
    engine_saw_eof = asyncio.Event()

    async def hanging_stream(reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for event in (chunk(), chunk("Hel", logprob=-0.5)):
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        await reader.read()  # hangs until the proxy closes the connection
        engine_saw_eof.set()

    async with server(hanging_stream) as (url, _):
        proxy = await proxy_factory(url)
        _, key = create_user(db_url, "u")
        async with proxy.client(key) as client:
            response = await client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], stream=True)
            async for part in response:
                if part.choices and part.choices[0].delta.content:
                    break  # the user pressed stop
            await response.close()
        await asyncio.wait_for(engine_saw_eof.wait(), 10)
        await proxy.settle()
    [(status, message)] = query(db_url, "SELECT status, response_message FROM turns")
    assert status == "client_disconnected" and message["content"] == "Hel"
