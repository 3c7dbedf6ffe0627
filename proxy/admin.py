"""Administration: users, API keys, opt-outs and read-only SQL, for the CLI and the admin API.

The operations are async functions on an `AsyncEngine`. `admin_router` serves them over
HTTP under `/admin` (guarded by `CLAWRL_PROXY__ADMIN_KEY`; 403 when none is set):
GET/POST /admin/users, PATCH/DELETE /admin/users/{name} (opt-outs / delete),
GET/POST /admin/keys, POST /admin/keys/{prefix}/revoke. The `clawrl users|keys|sql`
commands run them from a shell:

    clawrl users create alice [--rpm 60] [--no-key] [--scope verifier]
                                                       # also prints a first key (once)
    clawrl users list
    clawrl users opt-out alice --training [--logging]  # `opt-in` undoes it
    clawrl users delete alice                          # removes turns, judgments, samples
    clawrl keys create --user alice [--name laptop] [--rpm 60] [--scope verifier]
    clawrl keys list [--user alice]
    clawrl keys revoke PREFIX                          # or the full key
    clawrl sql "SELECT * FROM activity_by_user"

A key's scopes (proxy/auth.py, `SCOPES`) say what it may do beyond chatting: `verifier` sets
session outcomes (rewards), for environments, graders and admins only.

User names are 1-64 letters, digits and `._@+-`, starting with a letter or digit (`check_name`):
they appear in URLs, file names and logs. Limits are whole numbers from 0 to 2^31-1 (the
column type), 0 meaning unlimited.

The database comes from `CLAWRL_DATABASE__URL`, or the embedded Postgres under the state dir.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hmac
import logging
import shutil
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, SecretStr
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from clawrl.base.db import (
    AdapterVersion,
    ApiKey,
    DeadLetter,
    Judgment,
    Sample,
    Turn,
    User,
    UserAdapter,
    create_async,
)
from clawrl.base.engine_client import EngineClient, EngineClientError
from clawrl.base.errors import (
    BadRequest,
    ClawrlError,
    Forbidden,
    NotFound,
    Unauthorized,
    Unavailable,
)
from clawrl.base.settings import EngineSettings, load_settings
from proxy.admin_cli import print_csv, print_table, run_cli, run_readonly_sql_rows
from proxy.auth import (
    SCOPES,
    bearer_token,
    check_scopes,
    generate_key,
    hash_secret,
    parse_prefix,
)
from proxy.journal import Journal

log = logging.getLogger("clawrl.proxy.admin")


class Conflict(ClawrlError):
    status, type, code = 409, "invalid_request_error", "conflict"


@dataclass(frozen=True)
class UserInfo:
    id: int
    name: str
    created_at: dt.datetime
    train_opt_out: bool
    log_opt_out: bool


@dataclass(frozen=True)
class KeyInfo:
    id: int
    prefix: str
    user: str
    name: str | None
    rate_limit_rpm: int | None
    max_concurrent: int | None
    rate_limit_tpm: int | None
    scopes: list[str]
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


@dataclass(frozen=True)
class CreatedKey:
    info: KeyInfo
    secret: str  # the full key; shown once, never stored


_KEY_COLUMNS = (ApiKey.id, ApiKey.prefix, User.name, ApiKey.name, ApiKey.rate_limit_rpm,
                ApiKey.max_concurrent, ApiKey.rate_limit_tpm, ApiKey.scopes, ApiKey.created_at,
                ApiKey.revoked_at, ApiKey.last_used_at)
_USER_COLUMNS = (User.id, User.name, User.created_at, User.train_opt_out, User.log_opt_out)


MAX_NAME = 64
_NAME_PUNCT = frozenset("._@+-")


def check_name(name: str) -> str:
    """A new user's name: 1-64 letters, digits and `._@+-`, starting with a letter or digit.
    Names go into URLs (the console), file names and log lines: no `/`, spaces, controls."""
    name = name.strip()
    if (not name or len(name) > MAX_NAME or not name[0].isalnum()
            or not all(c.isalnum() or c in _NAME_PUNCT for c in name)):
        raise BadRequest(f"A user name must be 1-{MAX_NAME} letters, digits and . _ @ + -, "
                         f"starting with a letter or digit.", code="invalid_user_name",
                         param="name")
    return name


MAX_LIMIT = 2**31 - 1


def check_rpm(rpm: int | None) -> int | None:
    if rpm is not None and not 0 <= rpm <= MAX_LIMIT:
        raise BadRequest(f"rate_limit_rpm must be between 0 and {MAX_LIMIT} (0 = unlimited).",
                         code="invalid_rpm", param="rate_limit_rpm")
    return rpm


def check_limit(name: str, value: int | None) -> int | None:
    """A per-key limit: None (the proxy's default), 0 (unlimited) or a positive number."""
    if value is not None and not 0 <= value <= MAX_LIMIT:
        raise BadRequest(f"{name} must be between 0 and {MAX_LIMIT} (0 = unlimited).",
                         code="invalid_limit", param=name)
    return value


def _user(row: Sequence[Any]) -> UserInfo:
    return UserInfo(*row)  # the row matches _USER_COLUMNS


def _key(row: Sequence[Any]) -> KeyInfo:
    return KeyInfo(*row)  # the row matches _KEY_COLUMNS


async def create_user(db: AsyncEngine, name: str) -> UserInfo:
    return (await create_user_with_key(db, name, key=None))[0]


@dataclass(frozen=True)
class KeyParams:
    """What a new key is issued with; checked before anything is written (`checked`)."""

    name: str | None = None
    rate_limit_rpm: int | None = None
    max_concurrent: int | None = None
    rate_limit_tpm: int | None = None
    scopes: Sequence[str] = ()

    def checked(self) -> KeyParams:
        check_rpm(self.rate_limit_rpm)
        check_limit("max_concurrent", self.max_concurrent)
        check_limit("rate_limit_tpm", self.rate_limit_tpm)
        if self.name is not None and len(self.name) > 200:
            raise BadRequest("A key's name must be at most 200 characters.",
                             code="invalid_key_name", param="name")
        return KeyParams(self.name, self.rate_limit_rpm, self.max_concurrent,
                         self.rate_limit_tpm, check_scopes(list(self.scopes)))


async def create_user_with_key(db: AsyncEngine, name: str, *, key: KeyParams | None
                               ) -> tuple[UserInfo, CreatedKey | None]:
    """Create a user and, unless `key` is None, its first key, in one transaction: when
    anything is refused (a bad limit, a taken name) nothing is created."""
    name = check_name(name)
    params = key.checked() if key is not None else None
    try:
        async with db.begin() as conn:
            row = (await conn.execute(
                insert(User).values(name=name).returning(*_USER_COLUMNS))).one()
            created = None if params is None else await _insert_key(conn, row[0], params)
    except IntegrityError as exc:
        raise Conflict(f"User {name!r} already exists.", code="user_exists") from exc
    return _user(row), created


async def get_user(db: AsyncEngine, name: str) -> UserInfo:
    async with db.connect() as conn:
        row = (await conn.execute(select(*_USER_COLUMNS).where(User.name == name))).first()
    if row is None:
        raise NotFound(f"No user named {name!r}.", code="user_not_found")
    return _user(row)


async def ensure_user(db: AsyncEngine, name: str) -> UserInfo:
    """The user with this name, created if missing (idempotent, race-safe)."""
    try:
        return await create_user(db, name)
    except Conflict:
        return await get_user(db, name)


async def list_users(db: AsyncEngine) -> list[UserInfo]:
    async with db.connect() as conn:
        rows = (await conn.execute(select(*_USER_COLUMNS).order_by(User.id))).all()
    return [_user(r) for r in rows]


async def delete_user(db: AsyncEngine, name: str, journal: Journal | None = None,
                      engine: EngineSettings | None = None) -> dict[str, int]:
    """Delete a user and, by cascade, their keys, sessions, turns, judgments, samples,
    training steps and adapter versions; also their dead letters, when given their turns
    waiting in the local journal, and their personal adapters: unloaded from `engine` and
    their folders deleted (a trainer on another machine deletes the folders it holds for
    users that no longer exist: trainer/personal.py)."""
    async with db.begin() as conn:
        user_id = (await conn.execute(
            select(User.id).where(User.name == name).with_for_update())).scalar()
        if user_id is None:
            raise NotFound(f"No user named {name!r}.", code="user_not_found")
        adapter = (await conn.execute(
            select(UserAdapter.name).where(UserAdapter.user_id == user_id))).scalar()
        paths = (await conn.execute(
            select(AdapterVersion.path).where(AdapterVersion.user_id == user_id))).scalars().all()
        turns = select(Turn.id).where(Turn.user_id == user_id).scalar_subquery()
        counts = {
            "turns": (await conn.execute(
                select(func.count()).where(Turn.user_id == user_id))).scalar_one(),
            "judgments": (await conn.execute(
                select(func.count()).where(Judgment.turn_id.in_(turns)))).scalar_one(),
            "samples": (await conn.execute(
                select(func.count()).where(Sample.user_id == user_id))).scalar_one(),
            "adapter_versions": len(paths),
        }
        # A turn's dead letter is its record as JSON, which starts with uid and user_id
        # (proxy/store.py); matched as text, since a payload need not be valid jsonb.
        counts["dead_letters"] = (await conn.execute(
            delete(DeadLetter).where(DeadLetter.kind == "turn", DeadLetter.payload.regexp_match(
                f'^\\{{"uid": "[^"]*", "user_id": {int(user_id)},')))).rowcount or 0
        await conn.execute(delete(User).where(User.id == user_id))
    if journal is not None:
        # In a thread: it waits for a replay in progress, possibly this process's own.
        counts["journaled_turns"] = await asyncio.to_thread(journal.forget_user, user_id)
    if adapter is not None and engine is not None:
        counts["adapters_unloaded"] = await _unload(engine, adapter)
    counts["adapter_folders"] = await asyncio.to_thread(
        _remove_folders, {Path(p).parent for p in paths})
    return counts


async def _unload(engine: EngineSettings, name: str) -> int:
    """Unload a deleted user's adapter; 0 when the engine does not have it or is down (it
    forgets adapters on restart, and nobody can be served with it any more: the user and
    `user_adapters` row are gone)."""
    try:
        async with EngineClient.from_settings(engine) as client:
            return int(await client.unload_lora_adapter(name))
    except EngineClientError as exc:
        log.warning("deleted user's adapter %s not unloaded: %s", name, exc.message)
        return 0


def _remove_folders(folders: set[Path]) -> int:
    removed = 0
    for folder in folders:
        if folder.is_dir():
            shutil.rmtree(folder)
            removed += 1
    return removed


async def set_opt_out(db: AsyncEngine, name: str, *, training: bool | None = None,
                      logging: bool | None = None) -> UserInfo:
    """Set (True) or clear (False) a user's opt-outs; None leaves a flag as it is."""
    values: dict[str, bool] = {}
    if training is not None:
        values["train_opt_out"] = training
    if logging is not None:
        values["log_opt_out"] = logging
    if not values:
        raise BadRequest("Nothing to change: give train_opt_out and/or log_opt_out.")
    async with db.begin() as conn:
        row = (await conn.execute(update(User).where(User.name == name).values(**values)
                                  .returning(*_USER_COLUMNS))).first()
    if row is None:
        raise NotFound(f"No user named {name!r}.", code="user_not_found")
    return _user(row)


async def create_key(db: AsyncEngine, user: str, *, name: str | None = None,
                     rate_limit_rpm: int | None = None, max_concurrent: int | None = None,
                     rate_limit_tpm: int | None = None,
                     scopes: Sequence[str] = ()) -> CreatedKey:
    """Issue a key for `user`. Only its hash is stored: `secret` cannot be shown again.
    Limits left None follow the proxy's defaults; 0 is unlimited (proxy/limits.py).
    `scopes`: what it may do beyond chatting (proxy/auth.py, SCOPES), none by default."""
    params = KeyParams(name, rate_limit_rpm, max_concurrent, rate_limit_tpm, scopes).checked()
    async with db.begin() as conn:
        user_id = (await conn.execute(select(User.id).where(User.name == user))).scalar()
        if user_id is None:
            raise NotFound(f"No user named {user!r}.", code="user_not_found")
        return await _insert_key(conn, user_id, params)


async def _insert_key(conn: AsyncConnection, user_id: int, params: KeyParams) -> CreatedKey:
    new = generate_key()
    key_id = (await conn.execute(insert(ApiKey).values(
        user_id=user_id, prefix=new.prefix, secret_hash=new.hash, name=params.name,
        rate_limit_rpm=params.rate_limit_rpm, max_concurrent=params.max_concurrent,
        rate_limit_tpm=params.rate_limit_tpm, scopes=list(params.scopes))
        .returning(ApiKey.id))).scalar_one()
    row = (await conn.execute(select(*_KEY_COLUMNS).join(User, User.id == ApiKey.user_id)
                              .where(ApiKey.id == key_id))).one()
    return CreatedKey(info=_key(row), secret=new.secret)


async def list_keys(db: AsyncEngine, user: str | None = None) -> list[KeyInfo]:
    query = select(*_KEY_COLUMNS).join(User, User.id == ApiKey.user_id).order_by(ApiKey.id)
    if user is not None:
        await get_user(db, user)  # a clear 404 rather than an empty list
        query = query.where(User.name == user)
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [_key(r) for r in rows]


async def revoke_key(db: AsyncEngine, prefix_or_key: str) -> KeyInfo:
    """Revoke a key by its public prefix (or the full key). Revoking twice is a no-op."""
    prefix = parse_prefix(prefix_or_key) or prefix_or_key
    async with db.begin() as conn:
        await conn.execute(update(ApiKey).where(ApiKey.prefix == prefix,
                                                ApiKey.revoked_at.is_(None))
                           .values(revoked_at=func.now()))
        row = (await conn.execute(select(*_KEY_COLUMNS).join(User, User.id == ApiKey.user_id)
                                  .where(ApiKey.prefix == prefix))).first()
    if row is None:
        raise NotFound(f"No API key with prefix {prefix!r}.", code="key_not_found")
    return _key(row)


# --- HTTP: the same operations under /admin, guarded by the admin key ----------------------

class _AdminRoute(APIRoute):
    """Answers every failure of an admin route with an OpenAI-shaped error body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                # Postgres text cannot hold U+0000: such a name or prefix matches nothing.
                if any("\x00" in v for v in (*request.path_params.values(),
                                             *request.query_params.values())):
                    raise BadRequest("A path or query parameter contains a NUL character.",
                                     code="invalid_parameter")
                return await handler(request)
            except RequestValidationError as exc:
                err: ClawrlError = BadRequest(_validation_message(exc), code="invalid_body")
            except ClawrlError as exc:
                err = exc
            except (OSError, OperationalError, InterfaceError) as exc:
                log.warning("admin request failed, database unreachable: %s",
                            type(exc).__name__, extra={"action": "admin_db_unavailable"})
                err = Unavailable("The database is unreachable; try again later.",
                                  code="database_unavailable")
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

        return guarded


def _validation_message(exc: RequestValidationError) -> str:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"Invalid request body: {where or 'body'}: {first.get('msg', 'invalid')}."


# The admin key guards the admin API and the console; `clawrl up` generates 52 characters.
MIN_ADMIN_KEY = 16


def admin_key_problem(secret: SecretStr | None) -> str | None:
    """Why the configured admin key may not be used, or None (unset, the admin API and the
    console off, is fine). An empty or short key would open both to a guess."""
    if secret is None:
        return None
    key = secret.get_secret_value()
    if not key.strip():
        return ("CLAWRL_PROXY__ADMIN_KEY is set but empty: unset it to turn the admin API and "
                "console off, or set a random key of at least "
                f"{MIN_ADMIN_KEY} characters")
    if len(key.strip()) < MIN_ADMIN_KEY:
        return (f"CLAWRL_PROXY__ADMIN_KEY is {len(key.strip())} characters; it must be at least "
                f"{MIN_ADMIN_KEY} (e.g. python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))')")
    return None


def require_admin(request: Request) -> AsyncEngine:
    """The admin key guard; returns the database. 403 when the admin API is disabled."""
    admin_key = request.app.state.settings.proxy.admin_key
    if admin_key is None:
        raise Forbidden("The admin API is disabled: set CLAWRL_PROXY__ADMIN_KEY to enable it.",
                        code="admin_api_disabled")
    token = bearer_token(request.headers.get("authorization"))
    if not hmac.compare_digest(hash_secret(token), hash_secret(admin_key.get_secret_value())):
        raise Unauthorized("Incorrect admin key.", code="invalid_admin_key")
    db: AsyncEngine = request.app.state.db
    return db


def _invalidate(request: Request) -> None:
    """Revocations and opt-outs take effect at once in this process (others: cache TTL)."""
    authenticator = getattr(request.app.state, "authenticator", None)
    if authenticator is not None:
        authenticator.invalidate()


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class UserUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    train_opt_out: bool | None = None
    log_opt_out: bool | None = None


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str
    name: str | None = None
    rate_limit_rpm: int | None = None
    max_concurrent: int | None = None
    rate_limit_tpm: int | None = None
    scopes: list[str] = []


Admin = Annotated[AsyncEngine, Depends(require_admin)]
admin_router = APIRouter(prefix="/admin", route_class=_AdminRoute, tags=["admin"])


@admin_router.get("/users")
async def http_list_users(db: Admin) -> dict[str, Any]:
    return {"object": "list", "data": [asdict(u) for u in await list_users(db)]}


@admin_router.post("/users", status_code=201)
async def http_create_user(body: UserCreate, db: Admin) -> dict[str, Any]:
    return asdict(await create_user(db, body.name))


@admin_router.patch("/users/{name:path}")
async def http_update_user(name: str, body: UserUpdate, db: Admin,
                           request: Request) -> dict[str, Any]:
    user = await set_opt_out(db, name, training=body.train_opt_out, logging=body.log_opt_out)
    _invalidate(request)
    return asdict(user)


@admin_router.delete("/users/{name:path}")
async def http_delete_user(name: str, db: Admin, request: Request) -> dict[str, Any]:
    writer = getattr(request.app.state, "writer", None)
    counts = await delete_user(db, name, writer.journal if writer is not None else None,
                               request.app.state.settings.engine)
    _invalidate(request)
    return {"name": name, "deleted": True, **counts}


@admin_router.get("/keys")
async def http_list_keys(db: Admin, user: str | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [asdict(k) for k in await list_keys(db, user)]}


@admin_router.post("/keys", status_code=201)
async def http_create_key(body: KeyCreate, db: Admin) -> dict[str, Any]:
    key = await create_key(db, body.user, name=body.name, rate_limit_rpm=body.rate_limit_rpm,
                           max_concurrent=body.max_concurrent,
                           rate_limit_tpm=body.rate_limit_tpm, scopes=body.scopes)
    return {**asdict(key.info), "key": key.secret}


@admin_router.post("/keys/{prefix}/revoke")
async def http_revoke_key(prefix: str, db: Admin, request: Request) -> dict[str, Any]:
    key = await revoke_key(db, prefix)
    _invalidate(request)
    return asdict(key)


# --- CLI --------------------------------------------------------------------------------

def _run(prog: str, op: Callable[[AsyncEngine], Awaitable[int]]) -> int:
    async def go(url: str) -> int:
        db = create_async(url)
        try:
            return await op(db)
        finally:
            await db.dispose()

    return run_cli(prog, lambda url: asyncio.run(go(url)))


def _print_users(users: Sequence[UserInfo]) -> None:
    print_table(["id", "name", "created_at", "train_opt_out", "log_opt_out"],
                [tuple(asdict(u).values()) for u in users])


def _print_keys(keys: Sequence[KeyInfo]) -> None:
    print_table(["id", "prefix", "user", "name", "rate_limit_rpm", "max_concurrent",
                 "rate_limit_tpm", "scopes", "created_at", "revoked_at", "last_used_at"],
                [tuple(",".join(v) if isinstance(v, list) else v for v in asdict(k).values())
                 for k in keys])


def _print_new_key(key: CreatedKey) -> None:
    scopes = f", scopes: {', '.join(key.info.scopes)}" if key.info.scopes else ""
    print(f"API key for {key.info.user} (prefix {key.info.prefix}{scopes}); shown once, "
          f"store it now:")
    print(key.secret)


def _limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scope", action="append", default=[], choices=sorted(SCOPES),
                   dest="scopes", help="what the key may do beyond chatting (repeatable): "
                   + "; ".join(f"{k}: {v}" for k, v in SCOPES.items()))
    p.add_argument("--concurrent", type=int, metavar="N",
                   help="requests of the key in flight at once (0 = unlimited; default: the "
                        "proxy's, CLAWRL_PROXY__MAX_CONCURRENT)")
    p.add_argument("--tpm", type=int, metavar="N",
                   help="prompt + completion tokens per minute (0 = unlimited; default: the "
                        "proxy's, CLAWRL_PROXY__RATE_LIMIT_TPM)")


def users_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl users", description="Manage users.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a user and a first API key")
    c.add_argument("name")
    c.add_argument("--rpm", type=int, help="rate limit of the first key (requests/minute)")
    _limit_flags(c)
    c.add_argument("--no-key", action="store_true", help="do not create a first key")
    sub.add_parser("list", help="list users")
    d = sub.add_parser("delete", help="delete a user with all their turns and samples")
    d.add_argument("name")
    for verb in ("opt-out", "opt-in"):
        o = sub.add_parser(verb, help=f"{verb} of training and/or logging")
        o.add_argument("name")
        o.add_argument("--training", action="store_true")
        o.add_argument("--logging", action="store_true")
    args = p.parse_args(argv)
    if args.cmd in ("opt-out", "opt-in") and not (args.training or args.logging):
        p.error(f"{args.cmd}: give --training and/or --logging")

    async def op(db: AsyncEngine) -> int:
        if args.cmd == "create":
            user, key = await create_user_with_key(db, args.name, key=None if args.no_key else
                                                   KeyParams(None, args.rpm, args.concurrent,
                                                             args.tpm, args.scopes))
            print(f"created user {user.name} (id {user.id})")
            if key is not None:
                _print_new_key(key)
        elif args.cmd == "list":
            _print_users(await list_users(db))
        elif args.cmd == "delete":
            settings = load_settings()
            where = settings.journal_file()
            counts = await delete_user(db, args.name, Journal(where) if where.is_dir() else None,
                                       settings.engine)
            print(f"deleted user {args.name}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        else:
            flag = args.cmd == "opt-out"
            user = await set_opt_out(db, args.name, training=flag if args.training else None,
                                     logging=flag if args.logging else None)
            _print_users([user])
        return 0

    return _run("clawrl users", op)


def keys_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl keys", description="Manage API keys.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="issue a key (the secret is printed once)")
    c.add_argument("--user", required=True)
    c.add_argument("--name", help="a label, e.g. the app using it")
    c.add_argument("--rpm", type=int, help="requests per minute (0 = unlimited)")
    _limit_flags(c)
    ls = sub.add_parser("list", help="list keys (never their secrets)")
    ls.add_argument("--user")
    r = sub.add_parser("revoke", help="revoke a key by prefix or full key")
    r.add_argument("prefix")
    args = p.parse_args(argv)

    async def op(db: AsyncEngine) -> int:
        if args.cmd == "create":
            _print_new_key(await create_key(db, args.user, name=args.name,
                                            rate_limit_rpm=args.rpm,
                                            max_concurrent=args.concurrent,
                                            rate_limit_tpm=args.tpm, scopes=args.scopes))
        elif args.cmd == "list":
            _print_keys(await list_keys(db, args.user))
        else:
            key = await revoke_key(db, args.prefix)
            print(f"revoked key {key.prefix} of {key.user} at {key.revoked_at:%Y-%m-%d %H:%M:%S}")
        return 0

    return _run("clawrl keys", op)


# `clawrl sql` prints at most this many rows unless told otherwise (--limit).
SQL_CLI_ROWS = 10_000


def sql_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="clawrl sql", description="Run one read-only SQL statement and print a table.",
        epilog="Views: turns_with_rewards, reward_by_version, activity_by_user, session_turns, "
               "session_outcomes, training_shares.")
    p.add_argument("query")
    p.add_argument("--timeout", type=float, default=60.0, help="statement timeout, seconds")
    p.add_argument("--max-width", type=int, default=80, help="cut cells wider than this (0: no)")
    p.add_argument("--csv", action="store_true", help="print CSV (full cells) instead")
    p.add_argument("--limit", type=int, default=SQL_CLI_ROWS, metavar="N",
                   help=f"print at most N rows (default {SQL_CLI_ROWS}; 0: all)")
    args = p.parse_args(argv)
    if args.limit < 0 or args.max_width < 0:
        p.error("--limit and --max-width must be 0 or more")

    def op(url: str) -> int:
        columns, rows, total = run_readonly_sql_rows(url, args.query, timeout_s=args.timeout,
                                                     max_rows=args.limit or None)
        cut = (f"first {len(rows)} of {total} rows; --limit 0 prints all"
               if total > len(rows) else "")
        if args.csv:
            print_csv(columns, rows)
            if cut:
                print(f"clawrl sql: {cut}", file=sys.stderr)
            return 0
        print_table(columns, rows, max_width=args.max_width)
        print(f"({cut})" if cut else f"({total} row{'s' if total != 1 else ''})")
        return 0

    return run_cli("clawrl sql", op)


if __name__ == "__main__":
    sys.exit(users_main(sys.argv[1:]))
