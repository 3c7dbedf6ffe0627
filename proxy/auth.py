"""Per-user API keys: generation, hashing, lookup and constant-time verification.

A key looks like `ck-<prefix>-<secret>`. The prefix (public, unique) finds the row; only
sha256(secret) is stored, so a database leak reveals no usable key. Keys are random
(256 bits), so a fast hash is enough (no password stretching needed); the comparison is
constant-time (`hmac.compare_digest`).

The serving path uses `Authenticator.authenticate(headers)`: a short-lived in-process
cache of principals (so most requests cost no database round trip) and a per-key
`RateLimiter`; `Authenticator.limits` holds the per-key fair-share limits (proxy/limits.py).

Scopes (`api_keys.scopes`) say what a key may do beyond chatting and giving feedback on its
own turns. `verifier` lets a key set session outcomes (`POST /v1/sessions/{id}/outcome`, the
`X-Session-Outcome` header), which the trainer trains with as rewards: environments, graders
and admins hold it, an ordinary user's key does not (`require_scope`, 403 `missing_scope`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy import func, select, true, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import ApiKey, PolicyVersion, User, UserAdapter
from clawrl.base.errors import BadRequest, Forbidden, RateLimited, Unauthorized, Unavailable
from clawrl.base.settings import ProxySettings
from proxy.limits import KeyLimits

KEY_PREFIX = "ck"

# Sets session outcomes, which become rewards: environments, graders, admins.
VERIFIER = "verifier"
# Every scope a key may hold, with what it allows (for help texts and errors).
SCOPES: dict[str, str] = {VERIFIER: "set session outcomes (rewards the trainer trains with)"}


@dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from a valid, unrevoked API key."""

    user_id: int
    user_name: str
    key_id: int
    rate_limit_rpm: int | None
    train_opt_out: bool
    log_opt_out: bool
    # Fair share (proxy/limits.py); None: the proxy's default, 0: unlimited.
    max_concurrent: int | None = None
    rate_limit_tpm: int | None = None
    # The user's LoRA adapter while one is loaded in the engine (`user_adapters`), else None:
    # requests are sent with `lora_path: adapter` (docs/proxy.md, "Personal adapters").
    adapter: str | None = None
    adapter_version: int | None = None
    # The shared model's newest published version when it is a LoRA adapter
    # (`policy_versions.adapter`, trainer/policy_adapter.py): served to a user without an
    # adapter of their own, and the turn's policy version is that version.
    policy_adapter: str | None = None
    policy_version: int | None = None
    # What the key may do beyond chatting (SCOPES); refreshed with the rest within the TTL.
    scopes: frozenset[str] = frozenset()

    @property
    def serving_adapter(self) -> str | None:
        """The adapter a request is sent with: the user's own, else the shared model's
        newest version when it is an adapter, else none (the base model)."""
        return self.adapter or self.policy_adapter

    def policy_label(self, served_by: str | None) -> str | None:
        """The turn's policy version (`turns.weight_version`) when the shared model's adapter
        served it (`served_by`): that version, since the engine's own label names the base.
        None otherwise, also when the engine lacked the adapter and the base served it."""
        if self.adapter is None and served_by is not None and served_by == self.policy_adapter:
            return str(self.policy_version)
        return None


def check_scopes(scopes: object) -> list[str]:
    """Scopes as given to the admin API, CLI or console: known names only, each once,
    sorted; a clear 400 otherwise."""
    if isinstance(scopes, str) or not isinstance(scopes, (list, tuple, set, frozenset)):
        raise BadRequest("scopes must be a list of scope names.", code="invalid_scope",
                         param="scopes")
    unknown = sorted({str(s) for s in scopes} - SCOPES.keys())
    if unknown:
        raise BadRequest(f"Unknown scope {unknown[0]!r}; known scopes: "
                         f"{', '.join(sorted(SCOPES))}.", code="invalid_scope", param="scopes")
    return sorted({str(s) for s in scopes})


def require_scope(principal: Principal, scope: str, what: str) -> None:
    """403 `missing_scope` unless the key holds `scope`; `what` names the refused act."""
    if scope not in principal.scopes:
        raise Forbidden(f"This API key may not {what}: that needs a key with the {scope!r} "
                        f"scope (`clawrl keys create --user NAME --scope {scope}`).",
                        code="missing_scope")


@dataclass(frozen=True)
class NewKey:
    prefix: str
    secret: str  # the full key, shown once

    @property
    def hash(self) -> str:
        return hash_secret(self.secret)


def hash_secret(full_key: str) -> str:
    return hashlib.sha256(full_key.encode()).hexdigest()


def generate_key() -> NewKey:
    prefix = secrets.token_hex(6)
    return NewKey(prefix=prefix, secret=f"{KEY_PREFIX}-{prefix}-{secrets.token_urlsafe(32)}")


def parse_prefix(full_key: str) -> str | None:
    parts = full_key.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1]


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
    return token.strip()


async def lookup_principal(db: AsyncEngine, full_key: str) -> Principal:
    """Resolve a key to its principal or raise Unauthorized (unknown, wrong or revoked)."""
    prefix = parse_prefix(full_key)
    if prefix is None:
        raise Unauthorized("Incorrect API key provided.")
    # The newest published version of the shared model (its adapter, when it learns as one).
    newest = (select(PolicyVersion.version, PolicyVersion.adapter)
              .where(PolicyVersion.status == "published")
              .order_by(PolicyVersion.version.desc()).limit(1).subquery())
    async with db.connect() as conn:
        row = (await conn.execute(
            select(ApiKey.id, ApiKey.secret_hash, ApiKey.revoked_at, ApiKey.rate_limit_rpm,
                   User.id, User.name, User.train_opt_out, User.log_opt_out,
                   ApiKey.max_concurrent, ApiKey.rate_limit_tpm,
                   UserAdapter.name, UserAdapter.version, ApiKey.scopes,
                   newest.c.adapter, newest.c.version)
            .join(User, User.id == ApiKey.user_id)
            # A user who opted out of training has no adapter (the trainer also removes it).
            .outerjoin(UserAdapter, (UserAdapter.user_id == User.id) & UserAdapter.loaded
                       & ~User.train_opt_out)
            .outerjoin(newest, true())
            .where(ApiKey.prefix == prefix)
        )).first()
    # Compare even when the prefix is unknown, so timing does not reveal which prefixes exist.
    stored = row[1] if row is not None else hash_secret("")
    if not hmac.compare_digest(stored, hash_secret(full_key)) or row is None:
        raise Unauthorized("Incorrect API key provided.")
    if row[2] is not None:
        raise Unauthorized("This API key has been revoked.", code="revoked_api_key")
    return Principal(user_id=row[4], user_name=row[5], key_id=row[0], rate_limit_rpm=row[3],
                     train_opt_out=row[6], log_opt_out=row[7], max_concurrent=row[8],
                     rate_limit_tpm=row[9], adapter=row[10], adapter_version=row[11],
                     scopes=frozenset(row[12] or ()), policy_adapter=row[13],
                     policy_version=row[14] if row[13] is not None else None)


# --- Serving-path authentication: cached lookups and per-key rate limits -----------------

# Revocation or an opt-out made by another process (the CLI) takes effect within this long.
CACHE_TTL_S = 2.0
# While Postgres is unreachable (or too slow), a key verified this recently keeps working.
STALE_IF_ERROR_S = 60.0
# An unknown or revoked key is answered 401 from memory for this long (a made-up key costs
# one query per NEGATIVE_TTL_S, not one per request); a key just created works after it.
NEGATIVE_TTL_S = 2.0
# A key lookup slower than this counts as "database unreachable".
LOOKUP_TIMEOUT_S = 3.0
_CACHE_MAX = 100_000
# `api_keys.last_used_at` is written at most this often per key (it is informative only).
_TOUCH_EVERY_S = 60.0


@dataclass
class _Cached:
    principal: Principal
    fresh_until: float
    stale_until: float


_DB_DOWN = (OSError, DBAPIError, PoolTimeout, TimeoutError)


class RateLimiter:
    """Per-key requests per minute: a token bucket holding one minute's worth of requests.

    A key may burst its whole per-minute allowance, then gets `rpm / 60` requests per
    second. The limit is per proxy process: with N workers the fleet allows N times it.
    """

    def __init__(self, default_rpm: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_rpm = default_rpm
        self._clock = clock
        self._buckets: dict[int, tuple[float, float]] = {}  # key_id -> (tokens, at)

    def limit_for(self, principal: Principal) -> int:
        rpm = principal.rate_limit_rpm
        return self.default_rpm if rpm is None else rpm

    def check(self, principal: Principal) -> None:
        """Take one request from the key's bucket or raise RateLimited with Retry-After."""
        rpm = self.limit_for(principal)
        if rpm <= 0:
            return
        now = self._clock()
        rate = rpm / 60.0  # tokens per second
        tokens, at = self._buckets.get(principal.key_id, (float(rpm), now))
        tokens = min(float(rpm), tokens + (now - at) * rate)
        if tokens < 1.0:
            self._buckets[principal.key_id] = (tokens, now)
            retry_after = math.ceil((1.0 - tokens) / rate)
            raise RateLimited(f"Rate limit reached for this API key: {rpm} requests per "
                              f"minute. Retry after {retry_after} s.", retry_after_s=retry_after)
        self._buckets[principal.key_id] = (tokens - 1.0, now)


class Authenticator:
    """Resolves `Authorization` headers to principals and applies the per-key rate limit.

    Lookups are cached in process for `ttl_s` (keyed by the key's hash, never the key), so
    the hot path costs no database round trip; `invalidate()` drops the cache at once
    (the admin API calls it after revoking a key or changing a user). When Postgres is
    unreachable a recently seen key keeps working (stale-if-error); an unknown one gets 503.
    """

    def __init__(self, db: AsyncEngine, settings: ProxySettings, *, ttl_s: float = CACHE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._db = db
        self._ttl_s = ttl_s
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._refused: dict[str, tuple[float, Unauthorized]] = {}  # digest -> (until, error)
        self._lookups: dict[str, asyncio.Future[Principal]] = {}
        self._generation = 0  # bumped by invalidate(): lookups begun before it are not cached
        self._touched: dict[int, float] = {}
        self.limiter = RateLimiter(settings.rate_limit_rpm, clock=clock)
        # Requests in flight and tokens per minute, checked by the chat endpoint once it
        # knows the request's size (proxy/limits.py).
        self.limits = KeyLimits(settings.max_concurrent, settings.rate_limit_tpm, clock=clock)

    def invalidate(self) -> None:
        self._cache.clear()
        self._refused.clear()
        self._lookups.clear()
        self._generation += 1

    async def principal(self, full_key: str) -> Principal:
        """The key's principal, from the cache when fresh, else from Postgres.

        Concurrent misses for one key share a single lookup (no stampede at TTL expiry).
        A key in use is refreshed ahead, in the background, once its entry is past half
        its TTL, so an active key's requests never wait for the database (a revocation
        still takes effect within the TTL).
        """
        digest = hash_secret(full_key)
        refused = self._refused.get(digest)
        if refused is not None:
            if self._clock() < refused[0]:
                raise refused[1]
            del self._refused[digest]
        hit = self._cache.get(digest)
        if hit is not None:
            now = self._clock()
            if now < hit.fresh_until:
                if now >= hit.fresh_until - self._ttl_s / 2 and digest not in self._lookups:
                    self._lookup(digest, full_key, hit)
                return hit.principal
        pending = self._lookups.get(digest) or self._lookup(digest, full_key, hit)
        # Shielded: a waiter that is cancelled (client gone) does not cancel the others' lookup.
        return await asyncio.shield(pending)

    def _lookup(self, digest: str, full_key: str,
                hit: _Cached | None) -> asyncio.Future[Principal]:
        pending = asyncio.ensure_future(self._refresh(digest, full_key, hit))
        self._lookups[digest] = pending
        pending.add_done_callback(lambda done: self._lookup_done(digest, done))
        return pending

    def _lookup_done(self, digest: str, done: asyncio.Future[Principal]) -> None:
        if self._lookups.get(digest) is done:
            del self._lookups[digest]
        if not done.cancelled():
            done.exception()  # retrieved here, so an unawaited failure is not logged

    async def _refresh(self, digest: str, full_key: str, hit: _Cached | None) -> Principal:
        now, generation = self._clock(), self._generation
        try:
            found = await asyncio.wait_for(lookup_principal(self._db, full_key),
                                           LOOKUP_TIMEOUT_S)
        except Unauthorized as exc:
            self._cache.pop(digest, None)
            if generation == self._generation:
                if len(self._refused) >= _CACHE_MAX:
                    self._refused.clear()
                self._refused[digest] = (now + NEGATIVE_TTL_S, exc)
            raise
        except _DB_DOWN as exc:
            if hit is not None and now < hit.stale_until:
                return hit.principal
            raise Unavailable("Cannot verify the API key: the database is unreachable.",
                              code="database_unavailable") from exc
        if generation != self._generation:
            return found  # invalidated meanwhile: answer this request, cache nothing
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[digest] = _Cached(found, now + self._ttl_s, now + STALE_IF_ERROR_S)
        await self._touch(found.key_id, now)
        return found

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """Bearer key -> principal, then one request off its rate limit.

        Raises Unauthorized (401), RateLimited (429, `Retry-After`) or Unavailable (503).
        """
        header = headers.get("authorization") or headers.get("Authorization")
        principal = await self.principal(bearer_token(header))
        self.limiter.check(principal)
        return principal

    async def _touch(self, key_id: int, now: float) -> None:
        if now - self._touched.get(key_id, -_TOUCH_EVERY_S) < _TOUCH_EVERY_S:
            return
        self._touched[key_id] = now
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S), self._db.begin() as conn:
                await conn.execute(update(ApiKey).where(ApiKey.id == key_id)
                                   .values(last_used_at=func.now()))
        except _DB_DOWN:
            pass  # informative column only; never fail a request over it
