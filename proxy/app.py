"""The proxy application: `create_app(settings)` and the `clawrl proxy` entry point.

    clawrl proxy [--host 127.0.0.1] [--port 8000]

Settings come from the environment (`CLAWRL_ENGINE__URL`, `CLAWRL_DATABASE__URL`, ...;
see clawrl/base/settings.py); with no database URL an embedded Postgres is started. The database
must be migrated (`clawrl db upgrade`; `clawrl up` does it).

Shared resources live in the lifespan: the engine connections (a lean keep-alive pool for
chat, proxy/engine_http.py, and one `httpx.AsyncClient` for the rest), one async SQLAlchemy
engine, and the background tasks — the turn writer, the session-timeout sweep and the
weight-version poll (which also follows the served model's tokenizer, proxy/prompt_size.py).
`POST /v1/chat/completions`, `POST /v1/responses` and `POST /v1/completions` (the same path,
proxy/responses.py and proxy/completions.py) skip FastAPI's layers (`ProxyApp`).

Nothing grows before authentication (`ProxyApp.__call__`, and the chat endpoint for its
own routes): a declared body over the limit is 413 and a missing or wrong key 401 from the
headers alone, before a byte of the body is read, and the connection is then closed; every
body must arrive within `body_timeout_s` (408, closed); routes that take no key (the
console's sign-in, health) buffer small bodies only, and at most `max_unauth_buffered_bytes`
of them at once in total (`UnauthBudget`; 503 past it, `clawrl_unauth_body_bytes`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import importlib
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import Gauge
from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clawrl.base.db import create_async
from clawrl.base.errors import ClawrlError, Forbidden, NotFound, Unauthorized, Unavailable
from clawrl.base.logs import setup_logging
from clawrl.base.settings import Settings, load_settings
from proxy.auth import Authenticator, bearer_token, hash_secret
from proxy.chat import (
    ChatEndpoint,
    ClientGone,
    check_declared,
    early_answer_headers,
    read_body,
    send_json,
)
from proxy.completions import COMPLETIONS_PATH, CompletionsEndpoint
from proxy.endpoints import router
from proxy.journal import Journal
from proxy.metrics import TRAINED_SHARES_REFRESH_S, MetricsMiddleware, ProxyMetrics
from proxy.models import ModelNames
from proxy.prompt_size import PromptSizer
from proxy.responses import RESPONSES_PATH, ResponsesEndpoint
from proxy.sessions import close_stale_turns
from proxy.store import TurnWriter
from proxy.upstream import CHAT_PATH, Upstream, create_client, create_pool

log = logging.getLogger("clawrl.proxy")

WEIGHT_VERSION_POLL_S = 5.0


async def _every(seconds: float, action: Callable[[], Awaitable[Any]], name: str, *,
                 now: bool = False) -> None:
    """Run `action` periodically (first at once when `now`) until cancelled; a failure is
    logged, never fatal."""
    if not now:
        await asyncio.sleep(seconds)
    while True:
        try:
            await action()
        except (SQLAlchemyError, OSError, httpx.HTTPError, ClawrlError, ValueError) as exc:
            log.debug("%s failed: %s", name, exc, extra={"action": name})
        await asyncio.sleep(seconds)


def _error_response(exc: ClawrlError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def _on_clawrl_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ClawrlError)
    return _error_response(exc)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return _error_response(NotFound(f"Unknown path: {request.url.path}"))
    error = ClawrlError(str(exc.detail), code="http_error")
    error.status = exc.status_code
    error.type = "invalid_request_error" if exc.status_code < 500 else "api_error"
    return _error_response(error)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, extra={"action": "crash"})
    return _error_response(ClawrlError("The proxy failed unexpectedly."))


class UnauthBudget:
    """Bytes of request bodies buffered for routes that take no key, all requests together:
    a request reserves its body (the declared length at once, else chunk by chunk) and
    gives it back when it ends; past `limit` it is answered 503 and reads nothing more."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def holder(self) -> BudgetHold:
        return BudgetHold(self)


class BudgetHold:
    """One request's share of the `UnauthBudget` (`release` gives it all back)."""

    def __init__(self, budget: UnauthBudget) -> None:
        self.budget = budget
        self.held = 0

    def __call__(self, nbytes: int) -> None:
        budget = self.budget
        if budget.held + nbytes > budget.limit:
            raise Unavailable("Too many unauthenticated request bodies are being received at "
                              "once; retry shortly.", code="server_busy",
                              headers={"Retry-After": "1"})
        budget.held += nbytes
        self.held += nbytes

    def release(self) -> None:
        self.budget.held -= self.held
        self.held = 0


def check_admin_key(admin_key: str | None, authorization: str | None) -> None:
    """The admin API's key from the headers (proxy/admin.py's guard, answered before the
    body): 403 when the admin API is off, 401 for a missing or wrong key."""
    if admin_key is None:
        raise Forbidden("The admin API is disabled: set CLAWRL_PROXY__ADMIN_KEY to enable it.",
                        code="admin_api_disabled")
    token = bearer_token(authorization)
    if not hmac.compare_digest(hash_secret(token), hash_secret(admin_key)):
        raise Unauthorized("Incorrect admin key.", code="invalid_admin_key")


class ProxyApp(FastAPI):
    """FastAPI, except that `POST /v1/chat/completions` (and `POST /v1/responses`) go
    straight to their endpoints (through the metrics middleware only): FastAPI's middleware
    stack costs more CPU per request than the whole relay, and these routes need none of
    it."""

    fast_routes: Mapping[str, ASGIApp] = MappingProxyType({})
    unauth_budget: UnauthBudget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        fast = self.fast_routes.get(scope["path"]) if scope["method"] == "POST" else None
        if fast is not None:
            await fast(scope, receive, send)  # checks the key and reads the body itself
            return
        # Every other route: the declared size, then the key when the route takes one (all
        # of /v1 an API key, /admin the admin key), then the whole body, within the limit
        # and the read timeout, before any parsing.
        cfg = self.state.settings.proxy
        deadline = asyncio.get_running_loop().time() + cfg.body_timeout_s
        declared = authorization = None
        for name, value in scope["headers"]:
            if name == b"content-length" and declared is None:
                declared = value.decode("latin-1")
            elif name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
        hold = None
        try:
            check_declared(declared, cfg.max_body_bytes)
            keyed = await self._check_key(scope["path"], authorization)
            if keyed:
                body = await read_body(receive, declared, cfg.max_body_bytes, deadline=deadline)
            else:
                hold = self.unauth_budget.holder()
                body = await read_body(receive, declared,
                                       min(cfg.max_body_bytes, cfg.max_unauth_body_bytes),
                                       deadline=deadline, reserve=hold)
        except ClawrlError as exc:
            if hold is not None:
                hold.release()
            # Answered before the body was read (proxy/chat.py, DISCARD_BYTES).
            await send_json(send, exc.status, orjson.dumps(exc.body()),
                            early_answer_headers(exc, declared, False))
            return
        except ClientGone:
            if hold is not None:
                hold.release()
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await super().__call__(scope, replay, send)
        finally:
            if hold is not None:
                hold.release()

    async def _check_key(self, path: str, authorization: str | None) -> bool:
        """Whether `path` takes a key, after checking it from the headers (raises 401/403/
        503 as the route would; the route's own check, and its rate limit, still run, from
        the cache)."""
        if path.startswith("/v1/"):
            authenticator = getattr(self.state, "authenticator", None)
            if authenticator is not None:
                await authenticator.principal(bearer_token(authorization))
            return True
        if path.startswith("/admin/") or path == "/admin":
            admin_key = self.state.settings.proxy.admin_key
            check_admin_key(None if admin_key is None else admin_key.get_secret_value(),
                            authorization)
            return True
        return False


def create_app(settings: Settings, *, db_url: str | None = None,
               engine_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app. `db_url` defaults to `settings.database.url`; `engine_transport`
    replaces the engine connection (tests inject faults through it)."""
    if db_url is None:
        if settings.database.url is None:
            raise ValueError("create_app needs a database URL (settings.database.url)")
        db_url = settings.database.url.get_secret_value()
    cfg = settings.proxy
    from proxy.admin import admin_key_problem

    problem = admin_key_problem(cfg.admin_key)
    if problem:  # never a console or admin API behind an empty or guessable key
        raise ValueError(problem)
    # A journal left by an older proxy (one JSONL file) is adopted as its oldest segment.
    legacy = settings.state_dir / "journal.jsonl" if cfg.journal_path is None else None
    journal = Journal(settings.journal_file(), legacy=legacy)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = create_async(db_url, pool_size=settings.database.pool_size,
                          connect_args={"connect_timeout": 5})
        client = create_client(settings.engine, engine_transport)
        # An injected transport (tests' fault injection) serves chat requests too.
        pool = create_pool(settings.engine) if engine_transport is None else None
        writer = TurnWriter(db, journal, include_system=cfg.fingerprint_system,
                            backlog_max=cfg.turn_backlog_max, metrics=app.state.metrics,
                            early_next_state=cfg.judge_on_arrival)
        app.state.db, app.state.writer = db, writer
        app.state.upstream = upstream = Upstream(client, pool)
        app.state.models = ModelNames(cfg, upstream)
        app.state.authenticator = Authenticator(db, cfg)
        app.state.authenticator.limits.engine_slots = lambda: upstream.max_running_requests
        app.state.sizer = sizer = PromptSizer(max_token_bytes=cfg.max_token_bytes,
                                              tokenizer_path=cfg.tokenizer_path)
        writer.start()

        async def sweep() -> None:
            async with db.begin() as conn:
                await close_stale_turns(conn, cfg.session_timeout_s)

        async def poll_engine() -> None:
            # The weight version, the context, the running requests and the tokenizer.
            await sizer.follow(await upstream.model_info())

        tasks = [asyncio.create_task(_every(min(60.0, cfg.session_timeout_s / 4), sweep,
                                            "close_stale_turns")),
                 asyncio.create_task(_every(WEIGHT_VERSION_POLL_S, poll_engine,
                                            "poll_weight_version", now=True)),
                 asyncio.create_task(_every(TRAINED_SHARES_REFRESH_S,
                                            lambda: app.state.metrics.trained_shares.refresh(db),
                                            "trained_shares", now=True))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await writer.stop()
            await app.state.upstream.aclose()
            sizer.close()
            await db.dispose()

    # FastAPI's own OpenTelemetry hooks are off: /metrics covers this, per request for less.
    app = ProxyApp(title="clawrl proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, telemetry={"tracing": False, "metrics": False,
                                               "logs": False, "operation_spans": False})
    app.state.settings = settings
    app.unauth_budget = budget = UnauthBudget(cfg.max_unauth_buffered_bytes)
    # Read through the app state, so the gauges follow the writer of the running lifespan.
    app.state.metrics = ProxyMetrics(
        backlog=lambda: float(app.state.writer.backlog) if hasattr(app.state, "writer") else 0,
        journal=lambda: float(journal.pending),
        writer_up=lambda: float(app.state.writer.alive) if hasattr(app.state, "writer") else 0)
    Gauge("clawrl_unauth_body_bytes", "Request body bytes buffered for routes that take no "
          "key, all requests together", registry=app.state.metrics.registry
          ).set_function(lambda: float(budget.held))
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_exception_handler(ClawrlError, _on_clawrl_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    endpoints = ((CHAT_PATH, ChatEndpoint(app.state)),
                 (RESPONSES_PATH, ResponsesEndpoint(app.state)),
                 (COMPLETIONS_PATH, CompletionsEndpoint(app.state)))
    app.fast_routes = {path: MetricsMiddleware(endpoint, metrics=app.state.metrics)
                       for path, endpoint in endpoints}
    # Also regular routes: other methods get 405, and ASGI test transports reach them.
    for path, endpoint in endpoints:
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.include_router(router)
    try:  # H2b's admin API, when present
        admin = importlib.import_module("proxy.admin")
    except ImportError:
        admin = None
    if admin is not None and hasattr(admin, "admin_router"):
        app.include_router(admin.admin_router)
    from proxy.console.pages import console_router  # the admin console (/console)

    app.include_router(console_router)
    return app


def _check_url(url: str, what: str) -> str | None:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        return f"invalid {what} URL {url!r}: {exc}"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"invalid {what} URL {url!r}: expected http(s)://host:port"
    return None


def main(argv: list[str]) -> int:
    try:
        settings = load_settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        print(f"clawrl proxy: bad setting {where}: {first['msg']}", file=sys.stderr)
        return 2
    from proxy.admin import admin_key_problem

    problem = admin_key_problem(settings.proxy.admin_key)
    if problem:
        print(f"clawrl proxy: {problem}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="clawrl proxy",
                                     description="Run the OpenAI-compatible proxy.")
    parser.add_argument("--host", default=settings.proxy.host)
    parser.add_argument("--port", type=int, default=settings.proxy.port)
    parser.add_argument("--engine-url", default=settings.engine.url,
                        help="the serving engine (SGLang or `clawrl engine`)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    problem = _check_url(args.engine_url, "engine")
    if problem:
        print(f"clawrl proxy: {problem}", file=sys.stderr)
        return 2
    settings.engine.url = args.engine_url
    from clawrl.base import dbcli

    try:
        url = dbcli.resolve_url(settings)
        if make_url(url).get_backend_name() != "postgresql":
            raise ValueError(f"{make_url(url)!r} is not a postgresql:// URL")
    except (ArgumentError, ValueError, OSError) as exc:
        print(f"clawrl proxy: bad database URL: {exc}", file=sys.stderr)
        return 2
    from clawrl.base.engine_check import PROXY_NEEDS, check_at_start
    from clawrl.base.engine_client import EngineClient

    problem = check_at_start(EngineClient.from_settings(settings.engine), PROXY_NEEDS)
    if problem:  # e.g. an SGLang that returns no token ids: nothing it serves could train
        print(f"clawrl proxy: {problem}", file=sys.stderr)
        return 1
    setup_logging(args.log_level)
    app = create_app(settings, db_url=url)
    import uvicorn

    from proxy.drain import DrainingHttpTools

    # On SIGTERM in-flight requests get this long to finish before the lifespan stores the
    # remaining turns and exits; a keep-alive client's next request is not cut (proxy/drain.py).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.access_log, timeout_graceful_shutdown=30,
                http=DrainingHttpTools)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
