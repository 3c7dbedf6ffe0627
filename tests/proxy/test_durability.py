"""Durability under faults: `clawrl bench faults` end to end in a CI-sized run, and the
writer's guard on its own (a stalled database: a served turn is journaled within 100 ms;
with durability "sync" the reply waits for it).

The bench runs the real proxy as its own process, kills it with SIGKILL (and SIGTERM),
restarts it and looks the served turn ids up in Postgres; the outage is a TCP relay in
front of Postgres that it cuts and restores.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from proxyharness import ProxyFactory, create_user, query, turns_locked

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
CHAT = "/v1/chat/completions"


def test_bench_faults_short(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env["CLAWRL_DATABASE__URL"] = ADMIN_URL  # the bench makes (and drops) a scratch database
    done = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "bench", "faults", "--clients", "16",
         "--run-s", "1.5", "--outage-s", "3", "--reply-s", "0.25", "--json", str(out),
         "--scenarios", "kill,sigterm,outage"],  # the stack ones: tests/proxy/test_faults.py
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    by = {(r["scenario"].split()[0], r["durability"], r["mode"]): r for r in rows}
    assert len(by) == len(rows) == 8, done.stdout
    for mode in ("nonstream", "stream"):
        assert all(r["served"] > 0 for r in rows), done.stdout
        assert by[("kill", "sync", mode)]["lost"] == 0, done.stdout
        group = by[("kill", "group", mode)]
        # Lost only from the last moments before the kill (100 ms, plus slack for a noisy
        # shared machine), never older turns.
        assert group["lost"] == 0 or group["oldest_lost_ms"] < 400, done.stdout
        assert by[("SIGTERM", "group", mode)]["lost"] == 0, done.stdout
        outage = by[("Postgres", "group", mode)]
        assert (outage["lost"], outage["failed"]) == (0, 0), done.stdout
        assert outage["drain_s"] < 60, done.stdout


async def test_stalled_database_journals_at_once(proxy_factory: ProxyFactory,
                                                 db_url: str, engine_url: str) -> None:
    """With `turns` locked (every commit stalls), a served turn is in the fsynced journal
    soon after its reply (the guard's bound is 50 ms plus an fsync; asserted loosely here, as
    the machine is shared), never only when the lock goes; stored, in order, once it goes."""
    proxy = await proxy_factory(engine_url)
    writer = proxy.app.state.writer
    _, key = create_user(db_url, "alice")
    served, ages = [], []
    with turns_locked(db_url):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            for i in range(3):
                reply = await http.post(CHAT, json={"model": "default", "max_tokens": 4,
                                                    "messages": [{"role": "user",
                                                                  "content": f"turn {i}"}]})
                assert reply.status_code == 200
                at = time.monotonic()
                served.append(reply.headers["x-clawrl-turn-id"])
                while writer.journal.pending < i + 1 and time.monotonic() - at < 5:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                ages.append(time.monotonic() - at)
        assert writer.journal.pending == 3 and writer.rescued == 3
        assert max(ages) < 1.0, ages
    await proxy.settle()
    rows = query(db_url, "SELECT uid::text FROM turns ORDER BY id")
    assert [r[0] for r in rows] == served


async def test_sync_reply_waits_for_the_journal(proxy_factory: ProxyFactory, db_url: str,
                                                engine_url: str) -> None:
    """durability = "sync": when the reply (or a stream's [DONE]) arrives, its turn is
    already durable — here, with the database stalled, in the journal."""
    proxy = await proxy_factory(engine_url, durability="sync")
    writer = proxy.app.state.writer
    _, key = create_user(db_url, "bob")
    with turns_locked(db_url):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            ask = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
            reply = await http.post(CHAT, json=ask)
            assert reply.status_code == 200 and writer.journal.pending == 1
            async with http.stream("POST", CHAT, json={**ask, "stream": True}) as stream:
                async for line in stream.aiter_lines():
                    if line == "data: [DONE]":
                        assert writer.journal.pending == 2
                        break
                else:
                    raise AssertionError("no [DONE]")
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(2,)]
