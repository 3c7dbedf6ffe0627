"""The proxy's HTTP routes: chat completions, models, feedback, health and metrics.

The chat route does no database work of its own: the key lookup is cached (proxy/auth.py)
and the turn is handed to the background writer (proxy/store.py) after the reply is sent
or, for a stream, when it ends. Every error is a `proxy.errors` exception rendered as an
OpenAI-shaped body by the app's handler; anything rejected before the engine is called is
not stored at all.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import insert, select
from sqlalchemy.exc import SQLAlchemyError

from proxy.auth import Principal
from proxy.db import Feedback, Turn
from proxy.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.openai_types import parse_chat_request, parse_feedback
from proxy.records import TurnRecord
from proxy.sessions import explicit_session_id
from proxy.sse import RelayResponse, StreamCollector, relay
from proxy.upstream import client_view, engine_body, parse_reply

router = APIRouter()
T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_MAX_SESSION_ID = 256


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    too_large = PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _turn_kind(request: Request) -> str:
    value = request.headers.get("x-turn-type", "main").strip().lower() or "main"
    if value not in ("main", "side"):
        raise BadRequest("The X-Turn-Type header must be 'main' or 'side'.")
    return value


def _session_header(request: Request) -> str | None:
    value = request.headers.get("x-session-id", "").strip()
    if len(value) > _MAX_SESSION_ID:
        raise BadRequest(f"The X-Session-Id header is longer than {_MAX_SESSION_ID} chars.")
    return value or None


class ClientGone(Exception):
    """The client disconnected while the engine was still working on its request."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await the engine call `work`, but cancel it (closing the engine request, so the
    engine stops generating) as soon as the client disconnects, raising ClientGone.

    After the body is read, the ASGI `receive` only ever answers `http.disconnect`."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


async def _principal(request: Request) -> Principal:
    principal: Principal = await request.app.state.authenticator.authenticate(request.headers)
    return principal


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    started = time.perf_counter()
    state = request.app.state
    principal = await _principal(request)
    raw = await read_body(request, state.settings.proxy.max_body_bytes)
    body, chat = parse_chat_request(raw)
    kind, session_ext = _turn_kind(request), _session_header(request)
    if not body.get("model"):
        body["model"] = state.settings.proxy.served_model_name or "default"

    uid = str(uuid.uuid4())
    # Users opted out of logging get no turn id: there is no stored turn to refer to.
    headers = {} if principal.log_opt_out else {"X-Clawrl-Turn-Id": uid}
    if session_ext is not None and not principal.log_opt_out:
        headers["X-Clawrl-Session-Id"] = str(explicit_session_id(principal.user_id,
                                                                 session_ext))
    record = None if principal.log_opt_out else TurnRecord(
        uid=uid, user_id=principal.user_id, api_key_id=principal.key_id,
        request_messages=body["messages"], tools=body.get("tools"),
        params={k: v for k, v in body.items() if k not in ("messages", "tools")},
        kind=kind, session_external_id=session_ext,
        session_done=request.headers.get("x-session-done", "").strip().lower() in _TRUE,
        train_opt_out=principal.train_opt_out)
    wants_logprobs = bool(chat.logprobs)

    def log_turn(status: str, error: str | None = None) -> None:
        if record is None:
            return
        record.status, record.error = status, error
        record.latency_ms = (time.perf_counter() - started) * 1000.0
        state.writer.submit(record)
        state.metrics.turns.labels(status).inc()

    try:
        if chat.stream:
            upstream = await until_disconnect(
                request, state.upstream.open_chat_stream(engine_body(body, stream=True)))
        else:
            data = await until_disconnect(
                request, state.upstream.chat(engine_body(body, stream=False)))
    except ClientGone:
        log_turn("client_disconnected", "The client left before the reply was ready.")
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    except (UpstreamError, UpstreamTimeout) as exc:
        # The engine was called: keep the failed turn (never trained), tell the client its id.
        log_turn("engine_error", exc.message)
        if record is not None:
            exc.headers.update(headers)
        raise

    if chat.stream:
        def finish(collector: StreamCollector, status: str, error: str | None) -> None:
            if record is not None:
                record.response_message = collector.message()
                record.finish_reason = collector.finish_reason
                record.prompt_ids = collector.prompt_ids
                record.response_ids = collector.response_ids
                record.response_logprobs = collector.logprobs or None
                record.weight_version = collector.weight_version or state.upstream.weight_version
            state.metrics.count_tokens(len(collector.prompt_ids or ()),
                                       len(collector.response_ids or ()))
            log_turn(status, error)

        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return RelayResponse(relay(upstream, wants_logprobs=wants_logprobs, finish=finish),
                             media_type="text/event-stream", headers=headers)

    reply = parse_reply(data)
    if record is not None:
        record.response_message = reply.message
        record.finish_reason = reply.finish_reason
        record.prompt_ids, record.response_ids = reply.prompt_ids, reply.response_ids
        record.response_logprobs = reply.logprobs
        record.weight_version = reply.weight_version or state.upstream.weight_version
    state.metrics.count_tokens(len(reply.prompt_ids or ()), len(reply.response_ids or ()))
    log_turn("ok")
    content = orjson.dumps(client_view(data, wants_logprobs=wants_logprobs))
    return Response(content, media_type="application/json", headers=headers)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    await _principal(request)
    name = request.app.state.settings.proxy.served_model_name
    if name:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "clawrl"}]}
    models: dict[str, Any] = await request.app.state.upstream.models()
    return models


@router.post("/v1/feedback")
async def post_feedback(request: Request) -> dict[str, Any]:
    """Thumbs up/down (+1/-1) and/or text on a turn, by the turn's owner only."""
    state = request.app.state
    principal = await _principal(request)
    fb = parse_feedback(await read_body(request, state.settings.proxy.max_body_bytes))
    not_found = NotFound(f"No turn {fb.turn_id} for this API key's user.",
                         code="turn_not_found")
    if principal.log_opt_out:
        raise not_found
    await state.writer.wait_stored(str(fb.turn_id))
    try:
        async with state.db.begin() as conn:
            turn = (await conn.execute(select(Turn.id, Turn.user_id)
                                       .where(Turn.uid == fb.turn_id))).first()
            if turn is None or turn.user_id != principal.user_id:
                raise not_found
            feedback_id = (await conn.execute(
                insert(Feedback).values(turn_id=turn.id, user_id=principal.user_id,
                                        rating=fb.rating, text=fb.text)
                .returning(Feedback.id))).scalar_one()
    except (SQLAlchemyError, OSError) as exc:
        raise Unavailable("Cannot store feedback: the database is unreachable.",
                          code="database_unavailable") from exc
    return {"id": feedback_id, "object": "feedback", "turn_id": str(fb.turn_id),
            "rating": fb.rating, "text": fb.text}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready while the engine answers; its 503 during a weight update means busy, not down."""
    state = request.app.state
    engine = await state.upstream.health()
    ready = engine != "down"
    body = {"status": "ready" if ready else "not_ready", "engine": engine,
            "turn_log_backlog": state.writer.backlog,
            "journal_turns": state.writer.journal.pending}
    return Response(orjson.dumps(body), status_code=200 if ready else 503,
                    media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)

