"""API keys on the serving path: hashing, lookup, the principal cache and rate limits."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import psycopg
import pytest
from sqlalchemy import event, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import ApiKey, create_async
from clawrl.base.errors import BadRequest, Forbidden, RateLimited, Unauthorized, Unavailable
from clawrl.base.settings import ProxySettings
from proxy import admin
from proxy.auth import (
    VERIFIER,
    Authenticator,
    RateLimiter,
    hash_secret,
    lookup_principal,
    require_scope,
)

ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


class Clock:
    """A settable monotonic clock, so TTLs and refills need no sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async(db_url)
    yield engine
    await engine.dispose()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_only_the_hash_is_stored_and_the_key_resolves(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    created = await admin.create_key(db, "alice", name="laptop", rate_limit_rpm=7)
    async with db.connect() as conn:
        stored = (await conn.execute(select(ApiKey.prefix, ApiKey.secret_hash))).one()
    assert stored.prefix == created.info.prefix
    assert stored.secret_hash == hash_secret(created.secret)
    assert created.secret not in stored.secret_hash
    # Listing keys never shows a secret again.
    listed = await admin.list_keys(db, "alice")
    assert created.secret not in repr(listed)
    principal = await lookup_principal(db, created.secret)
    assert (principal.user_name, principal.rate_limit_rpm) == ("alice", 7)


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"authorization": "Basic abc"}, "invalid_api_key"),
    (bearer("not-a-key"), "invalid_api_key"),
    (bearer("ck-000000000000-wrongsecret"), "invalid_api_key"),
])
async def test_missing_or_invalid_key_is_401(db: AsyncEngine, headers: dict[str, str],
                                             code: str) -> None:
    auth = Authenticator(db, ProxySettings())
    with pytest.raises(Unauthorized) as info:
        await auth.authenticate(headers)
    assert info.value.status == 401 and info.value.code == code


async def test_wrong_secret_with_a_real_prefix_is_401(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    forged = f"ck-{key.info.prefix}-{'x' * 43}"
    with pytest.raises(Unauthorized):
        await Authenticator(db, ProxySettings()).authenticate(bearer(forged))


async def test_revocation_takes_effect_within_the_cache_ttl(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    clock = Clock()
    auth = Authenticator(db, ProxySettings(), ttl_s=2.0, clock=clock)
    assert (await auth.authenticate(bearer(key.secret))).user_name == "alice"
    await admin.revoke_key(db, key.info.prefix)  # as another process would
    assert (await auth.authenticate(bearer(key.secret))).user_name == "alice"  # cached
    clock.now += 2.5
    with pytest.raises(Unauthorized) as info:
        await auth.authenticate(bearer(key.secret))
    assert info.value.code == "revoked_api_key"


async def test_a_scope_change_takes_effect_within_the_cache_ttl(db: AsyncEngine) -> None:
    """Scopes are carried on the principal and refreshed with it: a verifier scope granted
    or taken away by another process holds within the TTL, like a revocation."""
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    clock = Clock()
    auth = Authenticator(db, ProxySettings(), ttl_s=2.0, clock=clock)
    principal = await auth.authenticate(bearer(key.secret))
    assert principal.scopes == frozenset()
    with pytest.raises(Forbidden) as info:
        require_scope(principal, VERIFIER, "set a session outcome")
    assert info.value.status == 403 and info.value.code == "missing_scope"
    async with db.begin() as conn:  # as another process would
        await conn.execute(update(ApiKey).where(ApiKey.prefix == key.info.prefix)
                           .values(scopes=[VERIFIER]))
    assert (await auth.authenticate(bearer(key.secret))).scopes == frozenset()  # cached
    clock.now += 2.5
    granted = await auth.authenticate(bearer(key.secret))
    assert granted.scopes == frozenset({VERIFIER})
    require_scope(granted, VERIFIER, "set a session outcome")
    async with db.begin() as conn:
        await conn.execute(update(ApiKey).where(ApiKey.prefix == key.info.prefix)
                           .values(scopes=[]))
    clock.now += 2.5
    assert (await auth.authenticate(bearer(key.secret))).scopes == frozenset()


async def test_key_scopes_are_checked_when_issued(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice", scopes=[VERIFIER, VERIFIER])
    assert key.info.scopes == [VERIFIER]
    assert (await lookup_principal(db, key.secret)).scopes == frozenset({VERIFIER})
    for bad in (["admin"], "verifier", [VERIFIER, "root"]):
        with pytest.raises(BadRequest) as info:
            await admin.create_key(db, "alice", scopes=bad)  # type: ignore[arg-type]
        assert info.value.code == "invalid_scope"
    assert len(await admin.list_keys(db, "alice")) == 1


async def test_keys_in_use_are_refreshed_ahead_in_the_background(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    clock = Clock()
    auth = Authenticator(db, ProxySettings(), ttl_s=2.0, clock=clock)
    await auth.authenticate(bearer(key.secret))
    await admin.revoke_key(db, key.info.prefix)
    clock.now += 1.5  # past half the TTL, still fresh: answered from the cache at once...
    assert (await auth.authenticate(bearer(key.secret))).user_name == "alice"
    # ...while a refresh runs in the background, which sees the revocation.
    await asyncio.gather(*auth._lookups.values(), return_exceptions=True)
    with pytest.raises(Unauthorized) as info:
        await auth.authenticate(bearer(key.secret))
    assert info.value.code == "revoked_api_key"


async def test_invalidate_applies_revocation_at_once(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    auth = Authenticator(db, ProxySettings(), clock=Clock())
    await auth.authenticate(bearer(key.secret))
    await admin.revoke_key(db, key.secret)  # the full key works as well as the prefix
    auth.invalidate()
    with pytest.raises(Unauthorized):
        await auth.authenticate(bearer(key.secret))


async def test_rate_limit_is_429_with_retry_after(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    limited = await admin.create_key(db, "alice", rate_limit_rpm=2)
    unlimited = await admin.create_key(db, "alice", rate_limit_rpm=0)
    clock = Clock()
    auth = Authenticator(db, ProxySettings(rate_limit_rpm=1), clock=clock)
    for _ in range(2):
        await auth.authenticate(bearer(limited.secret))
    with pytest.raises(RateLimited) as info:
        await auth.authenticate(bearer(limited.secret))
    assert info.value.status == 429
    assert info.value.headers["Retry-After"] == "30"  # 2 per minute: one every 30 s
    assert info.value.body()["error"]["type"] == "rate_limit_error"
    clock.now += 30
    await auth.authenticate(bearer(limited.secret))
    for _ in range(50):  # rpm 0 on the key overrides the default: unlimited
        await auth.authenticate(bearer(unlimited.secret))


def test_default_limit_applies_when_the_key_has_none() -> None:
    from proxy.auth import Principal

    clock = Clock()
    limiter = RateLimiter(3, clock=clock)
    p = Principal(user_id=1, user_name="a", key_id=1, rate_limit_rpm=None,
                  train_opt_out=False, log_opt_out=False)
    for _ in range(3):
        limiter.check(p)
    with pytest.raises(RateLimited) as info:
        limiter.check(p)
    assert info.value.retry_after_s == 20
    assert RateLimiter(0).limit_for(p) == 0


async def test_database_down_serves_known_keys_and_503s_unknown(db_url: str,
                                                                db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    known = await admin.create_key(db, "alice")
    other = await admin.create_key(db, "alice")
    clock = Clock()
    auth = Authenticator(db, ProxySettings(), clock=clock)
    await auth.authenticate(bearer(known.secret))
    await db.dispose()
    # Injected fault: the database disappears.
    name = db_url.rsplit("/", 1)[1]
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    clock.now += 10  # past the TTL: a lookup is attempted and fails
    assert (await auth.authenticate(bearer(known.secret))).user_name == "alice"
    with pytest.raises(Unavailable) as info:
        await auth.authenticate(bearer(other.secret))
    assert info.value.status == 503


async def test_concurrent_misses_share_one_lookup(db: AsyncEngine) -> None:
    await admin.create_user(db, "alice")
    key = await admin.create_key(db, "alice")
    lookups: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "FROM api_keys" in statement:
            lookups.append(statement)

    event.listen(db.sync_engine, "before_cursor_execute", count)
    auth = Authenticator(db, ProxySettings(), clock=Clock())
    principals = await asyncio.gather(*(auth.authenticate(bearer(key.secret))
                                        for _ in range(20)))
    assert {p.key_id for p in principals} == {key.info.id}
    assert len(lookups) == 1
