"""What every console page shares: templates, the sign-in guard, CSRF on forms, the route
class that turns failures into pages, and the per-app console state.

Pages are Jinja2 templates (proxy/console/templates/) rendered on the server; the only script is
proxy/console/static/console.js with the vendored uPlot for charts, served from this package
(no CDN, no build step). Responses carry a Content-Security-Policy that allows scripts from
the console's own origin only, and `Cache-Control: no-store`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import jinja2
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.errors import BadRequest, ClawrlError, Forbidden
from proxy.console.signin import (
    COOKIE,
    ConsoleSession,
    SessionBook,
    SignInThrottle,
    same_token,
)
from proxy.console.tally import RewardTally

HERE = Path(__file__).resolve().parent
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; "
                               "base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class SignInNeeded(Exception):
    """A page was asked for without a valid session: go to the sign-in page."""


class CsrfFailed(Forbidden):
    code = "csrf_failed"


@dataclass
class ConsoleState:
    """Per app: the session book, the sign-in throttle, the reward tally and the last
    request count sample."""

    sessions: SessionBook
    tally: RewardTally
    throttle: SignInThrottle = field(default_factory=SignInThrottle)
    requests_sample: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def console_state(request: Request) -> ConsoleState:
    state = request.app.state
    existing: ConsoleState | None = getattr(state, "console", None)
    if existing is None:
        db: AsyncEngine = state.db
        existing = ConsoleState(SessionBook(db), RewardTally(db))
        state.console = existing
    return existing


def admin_key(request: Request) -> str | None:
    secret = request.app.state.settings.proxy.admin_key
    return None if secret is None else str(secret.get_secret_value())


_UNKNOWN = object()


async def current_session(request: Request) -> ConsoleSession | None:
    """The request's signed-in session, or None; looked up once per request."""
    key = admin_key(request)
    if key is None:
        return None
    found = getattr(request.state, "console_session", _UNKNOWN)
    if found is _UNKNOWN:
        found = await console_state(request).sessions.read(key, request.cookies.get(COOKIE))
        request.state.console_session = found
    return found if isinstance(found, ConsoleSession) else None


async def require_session(request: Request) -> ConsoleSession:
    session = await current_session(request)
    if session is None:
        raise SignInNeeded
    return session


def check_origin(request: Request) -> None:
    """A POST must come from the console's own pages when the browser tells (it always does
    for forms and fetches; a script outside a browser sends no Origin)."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise CsrfFailed("This form was sent from another site.")
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise CsrfFailed("This form was sent from another site.")


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form body (the only kind the console's forms send); a NUL in it is a
    400 (Postgres text cannot hold one)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    form = dict(parse_qsl(body, keep_blank_values=True))
    if any("\x00" in k or "\x00" in v for k, v in form.items()):
        raise BadRequest("A form field contains a NUL character.", code="invalid_parameter")
    return form


async def require_post(request: Request) -> tuple[ConsoleSession, dict[str, str]]:
    """A signed-in POST with the session's CSRF token and from the console's origin."""
    session = await require_session(request)
    check_origin(request)
    form = await read_form(request)
    if not same_token(form.get("csrf"), session.csrf):
        raise CsrfFailed("The form's security token is missing or stale; reload the page.")
    return session, form


def _fmt_time(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def _fmt_num(value: Any, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=2, default=str)


_env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                          autoescape=jinja2.select_autoescape(["html"]),
                          trim_blocks=True,
                          lstrip_blocks=True)
def urlq(value: Any) -> str:
    """A value as one URL path segment or query value: every reserved character escaped,
    `/` too, so a user named `x/../carol` stays one segment and never reaches `carol`."""
    return quote(str(value), safe="")


_env.filters.update(time=_fmt_time, num=_fmt_num, pretty=_to_json, urlq=urlq)


def render(request: Request, template: str, *, status: int = 200,
           session: ConsoleSession | None = None, headers: dict[str, str] | None = None,
           **context: Any) -> HTMLResponse:
    html = _env.get_template(template).render(
        request=request, session=session, csrf=session.csrf if session else "",
        path=request.url.path, **context)
    return HTMLResponse(html, status_code=status, headers={**SECURITY_HEADERS, **(headers or {})})


async def _session_or_none(request: Request) -> ConsoleSession | None:
    """For an error page's header: the session when it can be known (not when the database
    is what failed)."""
    try:
        return await current_session(request)
    except ClawrlError:
        return None


class ConsoleRoute(APIRoute):
    """Sends a visitor without a session to the sign-in page and answers failures with a
    page (not JSON): a bad filter is a 400 page, an unknown turn a 404 page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                # Postgres text cannot hold U+0000: refused here, for every page at once.
                if any("\x00" in v for v in (*request.path_params.values(),
                                             *request.query_params.keys(),
                                             *request.query_params.values())):
                    raise BadRequest("A path or query parameter contains a NUL character.",
                                     code="invalid_parameter")
                return await handler(request)
            except SignInNeeded:
                if request.method != "GET":
                    return render(request, "error.html", status=401, title="Signed out",
                                  message="Your session ended; sign in again.")
                target = request.url.path + (f"?{request.url.query}" if request.url.query
                                             else "")
                return RedirectResponse(f"/console/login?next={quote(target)}", 303,
                                        headers=SECURITY_HEADERS)
            except RequestValidationError:
                return render(request, "error.html", status=404, title="Not found",
                              session=await _session_or_none(request),
                              message=f"Nothing at {request.url.path}.")
            except ClawrlError as exc:
                return render(request, "error.html", status=exc.status,
                              session=await _session_or_none(request),
                              title=f"{exc.status}: {exc.code}", message=exc.message,
                              headers=exc.headers)

        return guarded
