"""Console sign-in: the admin key buys a signed session cookie; every form carries a CSRF token.

The cookie is `<expiry>.<nonce>.<hmac>`, signed with a key derived from the admin key, so
changing the admin key signs everyone out and a forged cookie costs no database query. A
session is also a row of `console_sessions` holding only sha256 of the cookie: signing out
sets its `revoked_at`, so a signed-out cookie is refused by every proxy process and after a
restart. The cookie is HttpOnly, SameSite=Strict and Path=/console. The CSRF token of a
session is an HMAC of its nonce (a synchronizer token a cross-site form cannot know); the
sign-in form, before any session, uses a double-submit cookie instead. Every POST must also
come from the console's own origin when the browser says where it comes from.

Failed sign-ins are throttled per client address (`SignInThrottle`, in process): past
`MAX_FAILURES` in `FAILURE_WINDOW_S` the sign-in answers 429 with Retry-After until the
oldest failure ages out, so the admin key cannot be guessed at speed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import delete, insert, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import ConsoleSession as SessionRow
from clawrl.base.errors import Unavailable

COOKIE = "clawrl_console"
LOGIN_COOKIE = "clawrl_console_login"
COOKIE_PATH = "/console"
SESSION_TTL_S = 12 * 3600
# Failed sign-ins one client address may make in FAILURE_WINDOW_S before it must wait.
MAX_FAILURES = 5
FAILURE_WINDOW_S = 60.0
_THROTTLE_MAX_ADDRESSES = 10_000


@dataclass(frozen=True)
class ConsoleSession:
    nonce: str
    expires: int
    csrf: str
    token_hash: str  # sha256 of the cookie: its row in console_sessions


def _key(admin_key: str, purpose: bytes) -> bytes:
    return hashlib.sha256(b"clawrl-console\0" + purpose + b"\0" + admin_key.encode()).digest()


def _sign(admin_key: str, purpose: bytes, payload: str) -> str:
    return hmac.new(_key(admin_key, purpose), payload.encode(), hashlib.sha256).hexdigest()


def check_admin_key(admin_key: str, given: str) -> bool:
    """Constant-time comparison of two keys of any length (hashes are compared)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                               hashlib.sha256(admin_key.encode()).digest())


def csrf_for(admin_key: str, nonce: str) -> str:
    return _sign(admin_key, b"csrf", nonce)


def cookie_hash(cookie: str) -> str:
    return hashlib.sha256(cookie.encode()).hexdigest()


def _utc(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, dt.UTC)


_DB_DOWN = (OSError, DBAPIError, PoolTimeout, TimeoutError)


class SessionBook:
    """Issues, checks and ends session cookies; the sessions live in `console_sessions`."""

    def __init__(self, db: AsyncEngine) -> None:
        self._db = db

    async def issue(self, admin_key: str, now: float | None = None
                    ) -> tuple[str, ConsoleSession]:
        """A new session: its cookie and what it holds. Expired rows are swept here, so the
        table holds at most the sessions of the last SESSION_TTL_S."""
        at = now if now is not None else time.time()
        expires = int(at) + SESSION_TTL_S
        nonce = secrets.token_urlsafe(18)
        payload = f"{expires}.{nonce}"
        cookie = f"{payload}.{_sign(admin_key, b'session', payload)}"
        digest = cookie_hash(cookie)
        try:
            async with self._db.begin() as conn:
                await conn.execute(delete(SessionRow).where(SessionRow.expires_at < _utc(at)))
                await conn.execute(insert(SessionRow).values(token_hash=digest,
                                                             expires_at=_utc(expires)))
        except _DB_DOWN as exc:
            raise Unavailable("Cannot sign in: the database is unreachable.",
                              code="database_unavailable") from exc
        return cookie, ConsoleSession(nonce, expires, csrf_for(admin_key, nonce), digest)

    async def read(self, admin_key: str, cookie: str | None,
                   now: float | None = None) -> ConsoleSession | None:
        """The session a cookie holds, or None when it is absent, forged, expired or
        signed out (in any process, before any restart)."""
        if not cookie or cookie.count(".") != 2:
            return None
        expires_text, nonce, signature = cookie.split(".")
        payload = f"{expires_text}.{nonce}"
        if not hmac.compare_digest(signature, _sign(admin_key, b"session", payload)):
            return None
        at = now if now is not None else time.time()
        expires = int(expires_text) if expires_text.isascii() and expires_text.isdigit() else 0
        if expires < at:
            return None
        digest = cookie_hash(cookie)
        try:
            async with self._db.connect() as conn:
                live = (await conn.execute(select(SessionRow.token_hash).where(
                    SessionRow.token_hash == digest, SessionRow.revoked_at.is_(None),
                    SessionRow.expires_at > _utc(at)))).first()
        except _DB_DOWN as exc:
            raise Unavailable("Cannot check the console session: the database is "
                              "unreachable.", code="database_unavailable") from exc
        if live is None:
            return None
        return ConsoleSession(nonce, expires, csrf_for(admin_key, nonce), digest)

    async def sign_out(self, session: ConsoleSession) -> None:
        try:
            async with self._db.begin() as conn:
                await conn.execute(update(SessionRow).where(
                    SessionRow.token_hash == session.token_hash,
                    SessionRow.revoked_at.is_(None)).values(revoked_at=_utc(time.time())))
        except _DB_DOWN as exc:
            raise Unavailable("Cannot sign out: the database is unreachable; the session "
                              "is still valid.", code="database_unavailable") from exc


class SignInThrottle:
    """Failed sign-ins per client address: at most `limit` in `window_s` seconds."""

    def __init__(self, limit: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str) -> deque[float]:
        now = self._clock()
        failures = self._failures.get(address, deque())
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        return failures

    def retry_after(self, address: str) -> int | None:
        """Seconds until `address` may try again, or None when it may now."""
        failures = self._recent(address)
        if len(failures) < self.limit:
            return None
        return max(1, math.ceil(failures[0] + self.window_s - self._clock()))

    def failed(self, address: str) -> None:
        failures = self._recent(address)
        failures.append(self._clock())
        self._failures[address] = failures
        self._failures.move_to_end(address)
        while len(self._failures) > _THROTTLE_MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)


def new_login_token() -> str:
    return secrets.token_urlsafe(18)


def same_token(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(str(a), str(b))
