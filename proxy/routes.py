"""The proxy's FastAPI routes besides chat: models, feedback, health and metrics.

`POST /v1/chat/completions` is a bare ASGI endpoint (proxy/chat.py), the hot path. Every
error here is a `proxy.errors` exception rendered as an OpenAI-shaped body by the app's
handler.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import insert, select
from sqlalchemy.exc import SQLAlchemyError

from proxy.auth import Principal
from proxy.db import Feedback, Turn
from proxy.errors import NotFound, PayloadTooLarge, Unavailable
from proxy.openai_types import parse_feedback

router = APIRouter()


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


async def _principal(request: Request) -> Principal:
    principal: Principal = await request.app.state.authenticator.authenticate(request.headers)
    return principal


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

