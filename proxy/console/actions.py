"""The console's pages that change things, each behind a confirmation where it cannot be
undone, and the SQL box.

    GET  /console/versions                       history, serving version, turns per version
    GET  /console/versions/{n}/rollback          confirm; POST does it (by running `clawrl versions
                                                 rollback N`, which asks the engine to
                                                 load the folder)
    GET  /console/users                          users, their keys, opt-outs
    POST /console/users                          create (and a first key, shown once)
    POST /console/users/{name}/opt-out           set the training / logging opt-outs
    GET  /console/users/{name}/delete            confirm (says what goes); POST deletes
    POST /console/keys                           issue a key (shown once)
    POST /console/keys/{prefix}/revoke
    GET  /console/sql, POST /console/sql         one read-only statement as `clawrl sql`
                                                 runs it (proxy/admin_cli.py: role clawrl_sql)

Every POST needs the session's CSRF token (proxy/console/render.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse
from sqlalchemy import func, select, text

from clawrl.base.db import Judgment, Sample, Turn
from clawrl.base.errors import BadRequest, ClawrlError
from clawrl.base.settings import EngineSettings
from proxy import admin
from proxy.admin_cli import SqlError, first_line, run_readonly_sql_rows
from proxy.auth import SCOPES
from proxy.console import queries
from proxy.console.render import (
    SECURITY_HEADERS,
    ConsoleRoute,
    console_state,
    render,
    require_post,
    require_session,
)

SQL_TIMEOUT_S = 30.0
# What the SQL box renders at most: rows, characters of one cell, characters in all (a large
# result is cut, and the page says so, rather than sent as megabytes of HTML).
SQL_MAX_ROWS = 1000
SQL_MAX_CELL = 2000
SQL_MAX_CHARS = 1_000_000

actions = APIRouter(route_class=ConsoleRoute)


def _db_url(request: Request) -> str:
    return str(request.app.state.db.url.render_as_string(hide_password=False))


def _back(path: str, note: str | None = None) -> RedirectResponse:
    from urllib.parse import quote

    return RedirectResponse(path + (f"?note={quote(note, safe='')}" if note else ""), 303,
                            headers=SECURITY_HEADERS)


# --- versions ---------------------------------------------------------------------------

async def _turns_by_version(request: Request) -> dict[str, dict[str, Any]]:
    tally = console_state(request).tally
    await tally.refresh()
    return {str(r["version"]): r for r in tally.rows()}


async def serving_version(request: Request) -> str | None:
    """The version users are served: the shared model's adapter version when it learns as
    one, else the engine's weight_version."""
    async with request.app.state.db.connect() as conn:
        adapter = await queries.served_adapter_version(conn)
    upstream = getattr(request.app.state, "upstream", None)
    return adapter or (upstream.weight_version if upstream else None)


@actions.get("/versions")
async def versions_page(request: Request) -> Response:
    session = await require_session(request)
    async with request.app.state.db.connect() as conn:
        versions = await queries.list_versions(conn)
    return render(request, "versions.html", session=session, versions=versions,
                  by_version=await _turns_by_version(request),
                  serving=await serving_version(request),
                  note=request.query_params.get("note"))


@actions.get("/versions/{version}/rollback")
async def rollback_confirm(request: Request, version: int) -> Response:
    session = await require_session(request)
    if not 0 <= version <= admin.MAX_LIMIT:  # policy_versions.version is an integer
        raise BadRequest(f"No version {version}.", code="version_not_found")
    async with request.app.state.db.connect() as conn:
        newer = (await conn.execute(text(
            "SELECT count(*) FROM policy_versions WHERE version > :v "
            "AND status NOT IN ('retired', 'rejected')"),
            {"v": version})).scalar_one()
        exists = version == 0 or (await conn.execute(text(
            "SELECT 1 FROM policy_versions WHERE version = :v"), {"v": version})).first()
    if not exists:
        raise BadRequest(f"No version {version}.", code="version_not_found")
    return render(request, "rollback.html", session=session, version=version, newer=newer,
                  serving=await serving_version(request))


class RollbackRefused(Exception):
    """`clawrl versions rollback N` refused (the message is its one line)."""


def _rollback(url: str, engine: EngineSettings, state_dir: Path, version: int) -> str:
    """`clawrl versions rollback N`, run as the command itself in a child process: it
    publishes the folder to the engine and retires newer versions. The console never imports
    the trainer (tests/test_boundaries.py); it shares the command's code path and its
    one-line refusals instead. Returns the command's answer."""
    env = {**os.environ, "CLAWRL_DATABASE__URL": url, "CLAWRL_STATE_DIR": str(state_dir),
           "CLAWRL_ENGINE__URL": engine.url}
    if engine.api_key is not None:
        env["CLAWRL_ENGINE__API_KEY"] = engine.api_key.get_secret_value()
    done = subprocess.run([sys.executable, "-m", "clawrl.cli", "versions", "rollback",
                           str(version)], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=ROLLBACK_TIMEOUT_S)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise RollbackRefused(lines[-1].removeprefix("clawrl versions: "))
    return done.stdout.strip()


# The command's own publish waits on the engine's reload (three attempts at most).
ROLLBACK_TIMEOUT_S = 600


@actions.post("/versions/{version}/rollback")
async def rollback(request: Request, version: int) -> Response:
    await require_post(request)
    if not 0 <= version <= admin.MAX_LIMIT:
        raise BadRequest(f"No version {version} (versions count up from 0).")
    settings = request.app.state.settings
    try:
        await asyncio.to_thread(_rollback, _db_url(request), settings.engine,
                                settings.state_dir, version)
    except RollbackRefused as exc:
        return _back("/console/versions", f"Rollback refused: {exc}")
    upstream = getattr(request.app.state, "upstream", None)
    if upstream is not None:
        await upstream.model_info()  # the serving version, at once rather than at next poll
    serving = await serving_version(request)
    return _back("/console/versions",
                 f"The engine now serves v{version if serving is None else serving}.")


# --- users and keys ---------------------------------------------------------------------

def _invalidate(request: Request) -> None:
    authenticator = getattr(request.app.state, "authenticator", None)
    if authenticator is not None:
        authenticator.invalidate()


async def _users_page(request: Request, *, status: int = 200, created: Any = None,
                      error: str | None = None) -> Response:
    session = await require_session(request)
    db = request.app.state.db
    users, keys = await admin.list_users(db), await admin.list_keys(db)
    async with db.connect() as conn:
        last = await queries.last_turn_by_user(conn)
    return render(request, "users.html", status=status, session=session, users=users,
                  keys=keys, last=last, created=created, error=error, scopes=SCOPES,
                  note=request.query_params.get("note"))


@actions.get("/users")
async def users_page(request: Request) -> Response:
    return await _users_page(request)


def _rpm(value: str | None) -> int | None:
    """Requests per minute from a form: blank (the proxy's default), or a whole number
    within the column's range (admin.check_rpm)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 10:
        raise BadRequest("Requests per minute must be a whole number from 0 (unlimited) to "
                         f"{admin.MAX_LIMIT}.", param="rpm")
    return admin.check_rpm(int(text))


def _key_params(form: dict[str, str], label: str) -> admin.KeyParams:
    """A new key's label, limit and scope from a form (one `scope` select: none or a name)."""
    scope = form.get("scope", "").strip()
    return admin.KeyParams(name=form.get(label) or None, rate_limit_rpm=_rpm(form.get("rpm")),
                           scopes=[scope] if scope else []).checked()


@actions.post("/users")
async def create_user(request: Request) -> Response:
    """A user and (unless `key=off`) its first key, in one transaction: a refused limit,
    scope or name creates nothing, and the page says why."""
    _, form = await require_post(request)
    try:
        params = None if form.get("key", "on") != "on" else _key_params(form, "key_name")
        _, key = await admin.create_user_with_key(request.app.state.db, form.get("name", ""),
                                                  key=params)
    except ClawrlError as exc:
        return await _users_page(request, status=exc.status, error=exc.message)
    # The key is on this page and nowhere else: it is never stored, only its hash.
    return await _users_page(request, status=201, created=key)


@actions.post("/keys")
async def create_key(request: Request) -> Response:
    _, form = await require_post(request)
    try:
        p = _key_params(form, "name")
        key = await admin.create_key(request.app.state.db, form.get("user", ""), name=p.name,
                                     rate_limit_rpm=p.rate_limit_rpm, scopes=p.scopes)
    except ClawrlError as exc:
        return await _users_page(request, status=exc.status, error=exc.message)
    return await _users_page(request, status=201, created=key)


@actions.post("/keys/{prefix}/revoke")
async def revoke_key(request: Request, prefix: str) -> Response:
    await require_post(request)
    key = await admin.revoke_key(request.app.state.db, prefix)
    _invalidate(request)
    return _back("/console/users", f"Revoked key {key.prefix} of {key.user}.")


@actions.post("/users/{name:path}/opt-out")
async def opt_out(request: Request, name: str) -> Response:
    _, form = await require_post(request)
    user = await admin.set_opt_out(request.app.state.db, name,
                                   training=form.get("training") == "on",
                                   logging=form.get("logging") == "on")
    _invalidate(request)
    return _back("/console/users", f"{user.name}: training opt-out {user.train_opt_out}, "
                                   f"logging opt-out {user.log_opt_out}.")


@actions.get("/users/{name:path}/delete")
async def delete_confirm(request: Request, name: str) -> Response:
    session = await require_session(request)
    db = request.app.state.db
    user = await admin.get_user(db, name)
    async with db.connect() as conn:
        turns = select(Turn.id).where(Turn.user_id == user.id).scalar_subquery()
        counts = {
            "turns": (await conn.execute(select(func.count()).where(
                Turn.user_id == user.id))).scalar_one(),
            "judgments": (await conn.execute(select(func.count()).where(
                Judgment.turn_id.in_(turns)))).scalar_one(),
            "samples": (await conn.execute(select(func.count()).where(
                Sample.user_id == user.id))).scalar_one(),
            "keys": len(await admin.list_keys(db, name)),
        }
    return render(request, "delete_user.html", session=session, user=user, counts=counts)


@actions.post("/users/{name:path}/delete")
async def delete_user(request: Request, name: str) -> Response:
    _, form = await require_post(request)
    if form.get("confirm_name") != name:
        raise BadRequest("Type the user's name to confirm the deletion.",
                         code="confirmation_mismatch")
    writer = getattr(request.app.state, "writer", None)
    counts = await admin.delete_user(request.app.state.db, name,
                                     writer.journal if writer is not None else None)
    _invalidate(request)
    await console_state(request).tally.reset()  # deleted turns leave the reward counts
    return _back("/console/users", f"Deleted {name}: " + ", ".join(
        f"{v} {k.replace('_', ' ')}" for k, v in counts.items()) + ".")


# --- SQL --------------------------------------------------------------------------------

def sql_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, indent=2, default=str)
    return str(value)


def sql_cells(rows: list[tuple[Any, ...]]) -> tuple[list[list[str]], bool]:
    """The rows as the page shows them: each cell at most SQL_MAX_CELL characters, and rows
    only while the page holds under SQL_MAX_CHARS in all. Returns them and whether a cell
    was cut."""
    shown: list[list[str]] = []
    used, cut = 0, False
    for row in rows:
        cells = []
        for value in row:
            text = sql_cell(value)
            if len(text) > SQL_MAX_CELL:
                text, cut = text[:SQL_MAX_CELL] + "…", True
            cells.append(text)
        used += sum(len(c) for c in cells)
        if shown and used > SQL_MAX_CHARS:
            break
        shown.append(cells)
    return shown, cut


@actions.get("/sql")
async def sql_page(request: Request) -> Response:
    session = await require_session(request)
    return render(request, "sql.html", timeout=int(SQL_TIMEOUT_S), session=session, query="", result=None, error=None)


@actions.post("/sql")
async def sql_run(request: Request) -> Response:
    session, form = await require_post(request)
    query = form.get("query", "")
    started = time.perf_counter()
    try:
        columns, rows, total = await asyncio.to_thread(
            run_readonly_sql_rows, _db_url(request), query, timeout_s=SQL_TIMEOUT_S,
            max_rows=SQL_MAX_ROWS)
    except SqlError as exc:
        return render(request, "sql.html", timeout=int(SQL_TIMEOUT_S), status=400, session=session, query=query,
                      result=None, error=exc.message)
    except psycopg.Error as exc:  # the role cannot log in, the server is down, ...
        return render(request, "sql.html", timeout=int(SQL_TIMEOUT_S), status=503, session=session, query=query,
                      result=None, error=f"database error: {first_line(exc)}")
    shown, cells_cut = sql_cells(rows)
    result = {"columns": columns, "rows": shown, "total": total, "cells_cut": cells_cut,
              "max_cell": SQL_MAX_CELL, "ms": (time.perf_counter() - started) * 1000}
    return render(request, "sql.html", timeout=int(SQL_TIMEOUT_S), session=session, query=query, result=result,
                  error=None)
