"""The console's pages under `/console` (mounted by proxy/app.py; never on the chat path).

    GET  /console                      overview: traffic, judge backlog, trainer, reward by
                                       version (live through GET /console/events, SSE)
    GET  /console/turns[?user=&session=&version=&reward=&hint=&since=&until=&before=]
    GET  /console/turns/{id}           one turn: conversation, tokens, judgments, advantage
    GET  /console/login, POST /console/login, POST /console/logout
    GET  /console/static/{name}        the stylesheet, the script and the vendored uPlot

Versions, users and keys, and the SQL box are in proxy/console/actions.py. Sign in with the
admin key (`CLAWRL_PROXY__ADMIN_KEY`); without one the console is disabled (403).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from clawrl.base.errors import BadRequest, Forbidden, NotFound
from proxy.console import queries
from proxy.console.actions import actions, serving_version
from proxy.console.render import (
    HERE,
    SECURITY_HEADERS,
    ConsoleRoute,
    CsrfFailed,
    admin_key,
    check_origin,
    console_state,
    current_session,
    read_form,
    render,
    require_post,
    require_session,
)
from proxy.console.signin import (
    COOKIE,
    COOKIE_PATH,
    LOGIN_COOKIE,
    SESSION_TTL_S,
    check_admin_key,
    new_login_token,
    same_token,
)

EVENT_INTERVAL_S = 2.0
# An event stream ends after this long; the browser's EventSource reconnects by itself, and
# a proxy shutting down never waits long for an open console.
EVENT_STREAM_MAX_S = 300.0
STATIC = {
    "console.css": "text/css", "console.js": "text/javascript",
    "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
}

console_router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)


# --- sign-in ----------------------------------------------------------------------------

def _safe_next(target: str | None) -> str:
    """Only a path inside the console (never another site) is a place to return to."""
    if target and target.startswith("/console") and not target.startswith("//"):
        return target
    return "/console"


@console_router.get("/login")
async def login_page(request: Request, next: str | None = None) -> Response:
    if admin_key(request) is None:
        return render(request, "login.html", status=403, disabled=True, token="", next="",
                      error=None)
    if await current_session(request) is not None:
        return RedirectResponse(_safe_next(next), 303, headers=SECURITY_HEADERS)
    token = new_login_token()
    response = render(request, "login.html", disabled=False, token=token,
                      next=_safe_next(next), error=None)
    response.set_cookie(LOGIN_COOKIE, token, max_age=600, path=COOKIE_PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@console_router.post("/login")
async def login(request: Request) -> Response:
    key = admin_key(request)
    if key is None:
        raise Forbidden("The console is disabled: set CLAWRL_PROXY__ADMIN_KEY to enable it.",
                        code="console_disabled")
    check_origin(request)
    form = await read_form(request)
    if not same_token(form.get("token"), request.cookies.get(LOGIN_COOKIE)):
        raise CsrfFailed("The sign-in form expired; reload the page and try again.")
    state = console_state(request)
    address = request.client.host if request.client else "?"
    wait = state.throttle.retry_after(address)
    if wait is None and not check_admin_key(key, form.get("admin_key", "")):
        state.throttle.failed(address)
        return _login_again(request, form, 401, "Incorrect admin key.")
    if wait is not None:  # refused unchecked: a right key counts no more than a wrong one
        return _login_again(request, form, 429, f"Too many failed sign-ins from this address; "
                            f"try again in {wait} s.", {"Retry-After": str(wait)})
    state.throttle.succeeded(address)
    cookie, _ = await state.sessions.issue(key)
    response: Response = RedirectResponse(_safe_next(form.get("next")), 303, headers=SECURITY_HEADERS)
    response.set_cookie(COOKIE, cookie, max_age=SESSION_TTL_S, path=COOKIE_PATH,
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    response.delete_cookie(LOGIN_COOKIE, path=COOKIE_PATH)
    return response


def _login_again(request: Request, form: dict[str, str], status: int, error: str,
                 headers: dict[str, str] | None = None) -> Response:
    """The sign-in form again, with why, and a fresh form token."""
    token = new_login_token()
    page = render(request, "login.html", status=status, disabled=False, token=token,
                  next=_safe_next(form.get("next")), error=error, headers=headers)
    page.set_cookie(LOGIN_COOKIE, token, max_age=600, path=COOKIE_PATH, httponly=True,
                    samesite="strict", secure=request.url.scheme == "https")
    return page


@console_router.post("/logout")
async def logout(request: Request) -> Response:
    session, _ = await require_post(request)
    await console_state(request).sessions.sign_out(session)
    response = RedirectResponse("/console/login", 303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response


@console_router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        raise NotFound(f"No static file {name!r}.")
    folder = HERE / "static" / ("uplot" if name.startswith("uPlot") else "")
    return Response((folder / name).read_bytes(), media_type=STATIC[name],
                    headers={"Cache-Control": "public, max-age=3600",
                             "X-Content-Type-Options": "nosniff"})


# --- overview ---------------------------------------------------------------------------

def _chat_requests(request: Request) -> float:
    """Chat requests this proxy process has answered (from its Prometheus counter)."""
    total = 0.0
    for metric in request.app.state.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") \
                    and sample.labels.get("route") == "/v1/chat/completions":
                total += sample.value
    return total


def _clean(value: Any) -> Any:
    """JSON-safe: datetimes as ISO text, NaN as null."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


async def overview_data(request: Request) -> dict[str, Any]:
    state = console_state(request)
    await state.tally.refresh()
    async with request.app.state.db.connect() as conn:
        data = await queries.overview(conn)
    now, count = time.monotonic(), _chat_requests(request)
    last = state.requests_sample
    state.requests_sample = (now, count)
    rate = (count - last[1]) / (now - last[0]) if last and now - last[0] >= 0.5 else None
    data.update(turns=state.tally.total_turns, requests_per_s=rate, requests_total=count,
                serving_version=await serving_version(request),
                reward_by_version=state.tally.rows())
    cleaned: dict[str, Any] = _clean(data)
    return cleaned


@console_router.get("")
async def overview_page(request: Request) -> Response:
    session = await require_session(request)
    data = await overview_data(request)
    return render(request, "overview.html", session=session, data=data,
                  data_json=json.dumps(data).replace("<", "\\u003c"))


@console_router.get("/api/overview")
async def overview_json(request: Request) -> Response:
    await require_session(request)
    return JSONResponse(await overview_data(request), headers=SECURITY_HEADERS)


@console_router.get("/events")
async def events(request: Request) -> Response:
    """Server-sent events: the overview's numbers every EVENT_INTERVAL_S seconds, while
    the session lasts (signed out in any process, the stream ends)."""
    await require_session(request)
    key, cookie = admin_key(request), request.cookies.get(COOKIE)
    sessions = console_state(request).sessions

    async def stream() -> AsyncIterator[bytes]:
        started = time.monotonic()
        yield b"retry: 2000\n\n"
        while time.monotonic() - started < EVENT_STREAM_MAX_S:
            if await request.is_disconnected() or key is None \
                    or await sessions.read(key, cookie) is None:
                return
            data = await overview_data(request)
            yield f"event: overview\ndata: {json.dumps(data)}\n\n".encode()
            await asyncio.sleep(EVENT_INTERVAL_S)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={**SECURITY_HEADERS, "X-Accel-Buffering": "no"})


# --- turns ------------------------------------------------------------------------------

def _time_arg(value: str | None, name: str) -> dt.datetime | None:
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise BadRequest(f"{name} must be a date and time like 2026-12-03T10:00, "
                         f"not {value!r}.") from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


MAX_ID = 2**63 - 1  # turns.id is a bigint


def parse_turn_id(text: str) -> int | None:
    """A turn id given as text: ASCII digits within a bigint (`²` is a digit to
    str.isdigit but no number to int), else None."""
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or int(text) > MAX_ID:
        return None
    return int(text)


def turn_filter(request: Request) -> queries.TurnFilter:
    q = {k: v.strip() for k, v in request.query_params.items() if v.strip()}
    try:
        session = uuid.UUID(q["session"]) if "session" in q else None
    except ValueError as exc:
        raise BadRequest(f"session must be a session id (a UUID), not {q['session']!r}.") \
            from exc
    reward = q.get("reward")
    if reward is not None and reward not in queries.REWARD_FILTERS:
        raise BadRequest(f"reward must be one of {', '.join(queries.REWARD_FILTERS)}.")
    hint = q.get("hint")
    if hint is not None and hint not in ("yes", "no"):
        raise BadRequest("hint must be yes or no.")
    before = q.get("before")
    if before is not None and parse_turn_id(before) is None:
        raise BadRequest("before must be a turn id.")
    return queries.TurnFilter(
        user=q.get("user"), session=session, version=q.get("version"), reward=reward,
        has_hint=None if hint is None else hint == "yes",
        since=_time_arg(q.get("since"), "since"), until=_time_arg(q.get("until"), "until"),
        before=parse_turn_id(before) if before else None)


async def _turn_rows(request: Request) -> tuple[queries.TurnFilter, list[dict[str, Any]]]:
    f = turn_filter(request)
    async with request.app.state.db.connect() as conn:
        rows = await queries.list_turns(conn, f)
    return f, rows


@console_router.get("/turns")
async def turns_page(request: Request) -> Response:
    session = await require_session(request)
    f, rows = await _turn_rows(request)
    params = {k: v for k, v in request.query_params.items() if k != "before" and v}
    older = None
    if len(rows) == queries.PAGE_SIZE:
        older = urlencode({**params, "before": rows[-1]["id"]})
    return render(request, "turns.html", session=session, rows=rows, f=f, q=params,
                  older=older, live=f.before is None)


@console_router.get("/turns/rows")
async def turn_rows(request: Request) -> Response:
    """The list's rows alone (the turns page swaps them in when new turns arrive)."""
    session = await require_session(request)
    _, rows = await _turn_rows(request)
    return render(request, "turn_rows.html", session=session, rows=rows)


def _shade_tokens(ids: list[int] | None, logprobs: list[float] | None) -> list[dict[str, Any]]:
    """Per token: id, logprob, probability (what the engine sampled it with)."""
    out = []
    for i, token in enumerate(ids or []):
        lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        out.append({"id": token, "lp": lp,
                    "p": math.exp(lp) if lp is not None and math.isfinite(lp) else None})
    return out


def _advantage(rollout: list[float] | None, teacher: list[float] | None
               ) -> list[float | None] | None:
    """Per token, teacher minus rollout logprob (what on-policy distillation pushes up)."""
    if not rollout or not teacher:
        return None
    return [t - r if t is not None and r is not None else None
            for t, r in zip(teacher, rollout, strict=False)]


@console_router.get("/turns/{turn_id}")
async def turn_page(request: Request, turn_id: int) -> Response:
    session = await require_session(request)
    found = None
    if 0 <= turn_id <= MAX_ID:
        async with request.app.state.db.connect() as conn:
            found = await queries.get_turn(conn, turn_id)
    if found is None:
        raise NotFound(f"No turn {turn_id}.", code="turn_not_found")
    turn = found["turn"]
    sample = next((s for s in found["samples"] if s["teacher_logprobs"]), None)
    judgment = next((j for j in found["judgments"] if j["teacher_logprobs"]), None)
    teacher = (sample or {}).get("teacher_logprobs") or (judgment or {}).get("teacher_logprobs")
    rollout = (sample or {}).get("rollout_logprobs") or turn["response_logprobs"]
    return render(request, "turn.html", session=session, t=turn,
                  judgments=found["judgments"], feedback=found["feedback"],
                  samples=found["samples"],
                  tokens=_shade_tokens(turn["response_ids"], turn["response_logprobs"]),
                  advantage=_advantage(rollout, teacher),
                  trained=any(s["trained_step"] is not None for s in found["samples"]))


console_router.include_router(actions)
