"""The proxy's FastAPI routes besides chat: models (proxy/models.py), feedback, session
outcomes, health and metrics.

`POST /v1/chat/completions` is a bare ASGI endpoint (proxy/chat.py), the hot path, and so is
`POST /v1/responses` (proxy/responses.py). Every
error here is a `clawrl.base.errors` exception rendered as an OpenAI-shaped body by the app's
handler.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sqlalchemy import insert, select
from sqlalchemy.exc import SQLAlchemyError

from clawrl.base.db import Feedback, Turn
from clawrl.base.errors import NotFound, PayloadTooLarge, Unavailable
from proxy.auth import VERIFIER, Principal, require_scope
from proxy.completions import COMPLETIONS_PATH, CompletionRequest
from proxy.models import ModelNames
from proxy.openai_types import (
    ChatCompletionRequest,
    FeedbackRequest,
    OutcomeRequest,
    parse_feedback,
    parse_outcome,
)
from proxy.responses import RESPONSES_PATH, ResponsesRequest
from proxy.sessions import MAX_SESSION_ID, set_outcome
from proxy.upstream import CHAT_PATH

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
    names: ModelNames = request.app.state.models
    if names.configured is None and names.upstream.model_name is None:
        await names.upstream.model_info()  # the poll has not read the engine's name yet
    return names.listing()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """One model by any name a request may use (proxy/models.py), or 404 `model_not_found`."""
    await _principal(request)
    names: ModelNames = request.app.state.models
    return await names.card(model_id)


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


@router.post("/v1/sessions/{session_id}/outcome")
async def post_outcome(request: Request, session_id: str) -> dict[str, Any]:
    """A verifier's outcome in [-1, 1] for one of the caller's sessions, named by its
    `X-Session-Id` or by the proxy's session UUID (docs/proxy.md, "Session outcomes").
    Only a key with the `verifier` scope may: an outcome is a reward the model trains with."""
    state = request.app.state
    principal = await _principal(request)
    require_scope(principal, VERIFIER, "set a session outcome")
    body = parse_outcome(await read_body(request, state.settings.proxy.max_body_bytes))
    # Another user's session is answered like a missing one: nothing says it exists.
    not_found = NotFound(f"No session {session_id!r} for this API key's user.",
                         code="session_not_found")
    if principal.log_opt_out or len(session_id) > MAX_SESSION_ID:
        raise not_found
    await state.writer.wait_queued()  # the session's last turn may still be queued
    try:
        async with state.db.begin() as conn:
            found = await set_outcome(conn, user_id=principal.user_id, ref=session_id,
                                      outcome=body.outcome, key_id=principal.key_id)
    except (SQLAlchemyError, OSError) as exc:
        raise Unavailable("Cannot store the outcome: the database is unreachable.",
                          code="database_unavailable") from exc
    if found is None:
        raise not_found
    return {"object": "session.outcome", "session_id": str(found), "outcome": body.outcome,
            "source": "api"}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The proxy's OpenAPI document: FastAPI's routes, plus the request bodies of the bare
    chat, responses and completions routes, of feedback and of session outcomes (read raw, so FastAPI
    cannot describe them)."""
    doc = get_openapi(title="clawrl proxy", version="1", routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    models: tuple[tuple[str, type[BaseModel]], ...] = (
        (CHAT_PATH, ChatCompletionRequest), (RESPONSES_PATH, ResponsesRequest),
        (COMPLETIONS_PATH, CompletionRequest),
        ("/v1/feedback", FeedbackRequest), ("/v1/sessions/{session_id}/outcome", OutcomeRequest))
    for path, model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        # Update, not replace: FastAPI's entry holds the path parameters (outcome's id).
        doc["paths"].setdefault(path, {}).setdefault("post", {}).update({
            "operationId": model.__name__,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": {"200": {"description": "OK"}}})
    return doc


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request) -> dict[str, Any]:
    return openapi_document(request.app)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    """Ready while the engine answers (its 503 during a weight update means busy, not
    down), the turn writer runs and its backlog is under `turn_backlog_max`."""
    state = request.app.state
    engine = await state.upstream.health()
    writer = state.writer
    ready = engine != "down" and writer.ready
    body = {"status": "ready" if ready else "not_ready", "engine": engine,
            "turn_writer": "up" if writer.alive else "down",
            "turn_log_backlog": writer.backlog, "turn_log_backlog_max": writer.backlog_max,
            "journal_turns": writer.journal.pending}
    return Response(orjson.dumps(body), status_code=200 if ready else 503,
                    media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)

