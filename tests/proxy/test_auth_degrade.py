"""Auth that degrades well: unknown keys are remembered briefly (no query per request),
a slow or unreachable database leaves recently verified keys working (for at most
STALE_IF_ERROR_S) and answers unknown keys 503, never 500; a revoked key is refused by
every proxy within the cache TTL (2 s).

Outages are real: the proxy reaches Postgres through a TCP relay the test cuts; a slow
database is a real lock held on `api_keys`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import psycopg
import pytest
from proxyharness import ProxyFactory, TcpRelay, closed_port_url, create_user, libpq, query
from sqlalchemy.engine import make_url

from clawrl.base.db import create_async
from clawrl.base.errors import Unauthorized, Unavailable
from clawrl.base.settings import ProxySettings
from proxy import auth
from proxy.auth import Authenticator, generate_key

MODELS = "/v1/models"  # authenticated, and answered without the engine (served_model_name)


def relayed(db_url: str, relay: TcpRelay) -> str:
    return make_url(db_url).set(port=relay.port).render_as_string(hide_password=False)


async def start_relay(db_url: str) -> TcpRelay:
    url = make_url(db_url)
    relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432)
    await relay.start()
    return relay


async def test_database_down(proxy_factory: ProxyFactory, db_url: str) -> None:
    relay = await start_relay(db_url)
    proxy = await proxy_factory(closed_port_url(), db_url_override=relayed(db_url, relay),
                                served_model_name="tiny")
    _, key = create_user(db_url, "alice")
    unknown, other_unknown = generate_key().secret, generate_key().secret
    try:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
            async def get(k: str) -> httpx.Response:
                return await http.get(MODELS, headers={"Authorization": f"Bearer {k}"})

            assert (await get(key)).status_code == 200
            assert (await get(unknown)).status_code == 401
            await relay.stop()  # Postgres unreachable from here on
            # The unknown key seen a moment ago is refused from memory...
            assert (await get(unknown)).status_code == 401
            # ...a new one cannot be checked: 503, not 500.
            down = await get(other_unknown)
            assert down.status_code == 503
            assert down.json()["error"]["code"] == "database_unavailable"
            for _ in range(3):  # past the fresh TTL the known key is served stale
                assert (await get(key)).status_code == 200
                await asyncio.sleep(1.0)
    finally:
        await relay.stop()


async def test_database_slow(proxy_factory: ProxyFactory, db_url: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup stuck behind a lock counts as the database being down after
    LOOKUP_TIMEOUT_S: known keys keep working, unknown ones get 503."""
    monkeypatch.setattr(auth, "LOOKUP_TIMEOUT_S", 1.0)
    proxy = await proxy_factory(closed_port_url(), served_model_name="tiny")
    _, key = create_user(db_url, "alice")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        assert (await http.get(MODELS, headers={"Authorization": f"Bearer {key}"})
                ).status_code == 200
        await asyncio.sleep(2.1)  # the entry is stale: the next use looks the key up
        locker = psycopg.connect(libpq(db_url))
        locker.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        try:
            started = time.monotonic()
            ok = await http.get(MODELS, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200 and time.monotonic() - started < 3
            slow = await http.get(MODELS, headers={
                "Authorization": f"Bearer {generate_key().secret}"})
            assert slow.status_code == 503, slow.text
        finally:
            locker.rollback()
            locker.close()


async def test_stale_if_error_is_bounded(db_url: str) -> None:
    """Past STALE_IF_ERROR_S (60 s) without reaching the database, a known key gets 503."""
    relay = await start_relay(db_url)
    db = create_async(relayed(db_url, relay), connect_args={"connect_timeout": 2})
    now = [1000.0]
    authenticator = Authenticator(db, ProxySettings(rate_limit_rpm=0), clock=lambda: now[0])
    _, key = create_user(db_url, "alice")
    header = {"authorization": f"Bearer {key}"}
    try:
        await authenticator.authenticate(header)
        await relay.stop()
        now[0] += auth.STALE_IF_ERROR_S - 1
        await authenticator.authenticate(header)  # stale, still served
        now[0] += 2
        with pytest.raises(Unavailable):
            await authenticator.authenticate(header)
    finally:
        await relay.stop()
        await db.dispose()
    assert auth.STALE_IF_ERROR_S <= 60


async def test_unknown_key_is_remembered(db_url: str) -> None:
    """Within NEGATIVE_TTL_S a refused key costs no lookup (its refusal is remembered), and
    after it the key is looked up again (so a key created meanwhile would work)."""
    db = create_async(db_url)
    now = [1000.0]
    authenticator = Authenticator(db, ProxySettings(rate_limit_rpm=0), clock=lambda: now[0])
    key = generate_key()
    header = {"authorization": f"Bearer {key.secret}"}
    try:
        with pytest.raises(Unauthorized):
            await authenticator.authenticate(header)
        user_id, _ = create_user(db_url, "late")
        query(db_url, "INSERT INTO api_keys (user_id, prefix, secret_hash) VALUES (%s, %s, %s) "
                      "RETURNING id", user_id, key.prefix, key.hash)
        with pytest.raises(Unauthorized):  # remembered: not looked up again yet
            await authenticator.authenticate(header)
        now[0] += auth.NEGATIVE_TTL_S + 0.1
        assert (await authenticator.authenticate(header)).user_id == user_id
    finally:
        await db.dispose()


async def test_revoked_everywhere_within_two_seconds(proxy_factory: ProxyFactory,
                                                     db_url: str) -> None:
    """Two proxies (separate caches, as separate processes have) both serving a key; the
    key is revoked in the database, as `clawrl keys revoke` from a third process does."""
    proxies = [await proxy_factory(closed_port_url(), served_model_name="tiny")
               for _ in range(2)]
    _, key = create_user(db_url, "alice")
    headers = {"Authorization": f"Bearer {key}"}
    clients = [httpx.AsyncClient(base_url=p.url, headers=headers, timeout=30) for p in proxies]
    try:
        for client in clients:
            assert (await client.get(MODELS)).status_code == 200
        await asyncio.sleep(0.7)  # somewhere inside the cache entry's life
        query(db_url, "UPDATE api_keys SET revoked_at = now() RETURNING id")
        revoked_at = time.monotonic()
        refused_after: list[float] = []
        for client in clients:
            while (await client.get(MODELS)).status_code == 200:
                assert time.monotonic() - revoked_at < 5, "revoked key still served"
                await asyncio.sleep(0.05)
            refused_after.append(time.monotonic() - revoked_at)
    finally:
        for client in clients:
            await client.aclose()
    assert max(refused_after) <= auth.CACHE_TTL_S + 0.3, refused_after


def test_revoked_key_is_refused_by_two_proxy_processes_within_two_seconds(
        db_url: str, tmp_path: Path) -> None:
    """Two `clawrl proxy` OS processes serve a key; `clawrl keys revoke` (a third process)
    revokes it; both refuse it within the 2 s cache TTL."""
    import os
    import subprocess
    import sys

    from clawrl.bench.procs import BenchProcs

    _, key = create_user(db_url, "alice")
    headers = {"Authorization": f"Bearer {key}"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with BenchProcs(db_url, tmp_path / "a") as one, BenchProcs(db_url, tmp_path / "b") as two:
        urls = [one.proxy_url, two.proxy_url]
        for url in urls:
            assert httpx.get(f"{url}{MODELS}", headers=headers, timeout=30).status_code == 200
        done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "keys", "revoke", key],
                              env={**os.environ, "CLAWRL_DATABASE__URL": db_url},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        revoked_at = time.monotonic()
        refused_after: list[float] = []
        for url in urls:
            while True:
                status = httpx.get(f"{url}{MODELS}", headers=headers, timeout=30).status_code
                if status == 401:
                    break
                assert status == 200, status
                assert time.monotonic() - revoked_at < 5, "revoked key still served"
                time.sleep(0.05)
            refused_after.append(time.monotonic() - revoked_at)
    assert max(refused_after) <= auth.CACHE_TTL_S + 0.3, refused_after
