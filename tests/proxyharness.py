"""Helpers for the proxy's chat-path tests: the real app under uvicorn, real Postgres.

`proxy_factory(engine_url, **proxy_settings)` starts `create_app(...)` under uvicorn on a
free port inside the test's event loop and returns a `RunningProxy`; clients are the
official `openai` SDK (`running.client(key)`). Users and keys are inserted as rows with
`proxy.auth.generate_key()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import psycopg
import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import make_url

from clawrl.bench.procs import TcpRelay  # noqa: F401  (re-exported for the tests)
from proxy.auth import generate_key

ProxyFactory = Callable[..., Awaitable["RunningProxy"]]


def closed_port_url() -> str:
    """An http URL where nothing listens (an engine that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def libpq(db_url: str) -> str:
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextlib.contextmanager
def turns_locked(db_url: str) -> Iterator[None]:
    """`turns` held ACCESS EXCLUSIVE by another connection for the block: every commit of a
    turn stalls (a stalled database) until it ends."""
    locker = psycopg.connect(libpq(db_url))
    locker.execute("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE")
    try:
        yield
    finally:
        locker.rollback()
        locker.close()


async def make_keys(db_url: str, **limits: dict[str, Any]) -> dict[str, str]:
    """One user and key per keyword, the key with that keyword's limits (`admin.create_key`
    arguments, e.g. max_concurrent=0); returns name -> full key."""
    from clawrl.base.db import create_async
    from proxy import admin

    db = create_async(db_url)
    try:
        keys = {}
        for name, own in limits.items():
            await admin.create_user(db, name)
            keys[name] = (await admin.create_key(db, name, **own)).secret
        return keys
    finally:
        await db.dispose()


def create_user(db_url: str, name: str, *, train_opt_out: bool = False,
                log_opt_out: bool = False, scopes: Sequence[str] = (),
                max_concurrent: int | None = None) -> tuple[int, str]:
    """Insert a user and one API key (with `scopes`, e.g. ["verifier"] to set session
    outcomes; `max_concurrent` its requests in flight, None: the proxy's default, 0: no
    limit); returns (user_id, full key)."""
    key = generate_key()
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        user_id = conn.execute(
            "INSERT INTO users (name, train_opt_out, log_opt_out) VALUES (%s, %s, %s) "
            "RETURNING id", (name, train_opt_out, log_opt_out)).fetchone()[0]  # type: ignore[index]
        conn.execute("INSERT INTO api_keys (user_id, prefix, secret_hash, scopes, "
                     "max_concurrent) VALUES (%s, %s, %s, %s, %s)",
                     (user_id, key.prefix, key.hash, list(scopes), max_concurrent))
    return user_id, key.secret


def query(db_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()


@dataclass
class RunningProxy:
    url: str
    app: FastAPI

    def client(self, key: str, **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    async def settle(self, timeout_s: float = 10.0, *, stored: bool = True) -> None:
        """Wait until the background writer has stored every served turn (`stored=False`:
        stored or journaled, e.g. while the database is cut off). A slow commit makes the
        writer journal turns to keep them durable (proxy/store.py), then replay them."""
        writer = self.app.state.writer
        for _ in range(int(timeout_s / 0.02)):
            if writer.backlog == 0 and (not stored or writer.journal.pending == 0):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"turn writer still has {writer.backlog} turns, "
                             f"{writer.journal.pending} journaled")


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[str]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="none",
                            lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped during startup")
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def running_proxy(engine_url: str, db_url: str, state_dir: Any) -> AsyncIterator[str]:
    """The real proxy app (default settings) on a free port; yields its base URL."""
    from clawrl.base.settings import load_settings
    from proxy.app import create_app

    settings = load_settings(state_dir=state_dir, engine={"url": engine_url},
                             proxy={"journal_path": state_dir / "journal.jsonl"})
    async with serve(create_app(settings, db_url=db_url)) as url:
        yield url


@dataclass
class SilentServer:
    url: str
    closed: asyncio.Event  # set when a client closes its connection


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[SilentServer]:
    """A real HTTP endpoint that accepts requests and never answers (an engine that hangs)."""
    closed = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):  # until the client gives up and closes
                pass
            closed.set()
        finally:
            writer.close()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    try:
        yield SilentServer(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", closed)
    finally:
        server.close()


class ScriptedStream(httpx.AsyncByteStream):
    """An engine SSE body that sends `events`, then fails as told: 'drop' (connection lost)
    or 'hang' (waits until the proxy closes it). Records whether it was closed."""

    def __init__(self, events: list[dict[str, Any]], then: str) -> None:
        self.events, self.then = events, then
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
        if self.then == "drop":
            raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                            "message body")
        if self.then == "hang":
            await asyncio.Event().wait()
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        self.closed.set()


def chunk(content: str | None = None, finish: str | None = None,
          logprob: float | None = None) -> dict[str, Any]:
    """An SGLang-shaped `chat.completion.chunk`."""
    delta: dict[str, Any] = {"role": "assistant"} if content is None and not finish else {}
    if content is not None:
        delta["content"] = content
    logprobs = None if logprob is None else {"content": [
        {"token": content, "logprob": logprob, "bytes": [], "top_logprobs": []}]}
    return {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0,
            "model": "default", "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish}]}


def scripted_engine(stream: ScriptedStream | None = None, *, status: int = 200,
                    error_body: dict[str, Any] | None = None) -> httpx.MockTransport:
    """An engine transport for fault injection: streams `stream`, or answers `status`."""
    def handle(request: httpx.Request) -> httpx.Response:
        if status != 200:
            return httpx.Response(status, json=error_body or {})
        assert stream is not None
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=stream)

    return httpx.MockTransport(handle)
