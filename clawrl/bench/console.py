"""`clawrl bench console`: each console page's latency with a big log (target p95 <= 200 ms).

    clawrl bench console [--turns 1000000] [--requests 30] [--keep]
    python -m clawrl.bench.console ...                      (the same, without the dispatcher)

Fills a scratch database (on CLAWRL_DATABASE__URL's server, else an embedded Postgres under
/tmp) with synthetic rows generated inside Postgres in bulk (`INSERT … SELECT` over
generate_series: 100 users, sessions of 5 turns, 20 weight versions, 80% of turns judged,
a hint on each -1; then VACUUM ANALYZE, as autovacuum would), then serves the real proxy
app in this process and times every page, signed in, `--requests` times each after one
warm-up. The first overview after a start builds the reward tally from the whole log once
(proxy/console/tally.py, ~10 s per million turns); it is reported on its own line.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import re
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import uvicorn
from sqlalchemy.engine import make_url

from clawrl.base.db import libpq_url
from clawrl.base.dbcli import start_embedded, stop_embedded, upgrade
from clawrl.base.settings import load_settings

TARGET_P95_MS = 200.0
VERSIONS = 20
USERS = 100

FILL = [
    "INSERT INTO users (name) SELECT 'user' || i FROM generate_series(1, {users}) i",
    "INSERT INTO sessions (id, user_id, created_at, last_turn_at) "
    "SELECT md5('s' || s)::uuid, 1 + (s % {users}), now(), now() "
    "FROM generate_series(0, {turns} / 5) s",
    # Turn i: user 1 + (i / 5) % users (a session's turns share a user), session i / 5,
    # version grows with time, 100 ms apart, the newest now.
    "INSERT INTO turns (uid, user_id, session_id, index_in_session, kind, request_messages,"
    " response_message, response_ids, response_logprobs, weight_version, status, state,"
    " next_state, next_state_at, created_at, latency_ms, finish_reason) "
    "SELECT md5('t' || i)::uuid, 1 + ((i / 5) % {users}), md5('s' || (i / 5))::uuid, i % 5,"
    " CASE WHEN i % 100 = 0 THEN 'side' ELSE 'main' END,"
    " jsonb_build_array(jsonb_build_object('role', 'user', 'content',"
    "   'question number ' || i || ', please answer briefly and in full sentences')),"
    " jsonb_build_object('role', 'assistant', 'content', 'answer number ' || i),"
    " array_fill(i % 1000, ARRAY[32]), array_fill(-0.5::float8, ARRAY[32]),"
    " ((i::bigint * {versions}) / {turns})::text, 'ok', 'continued',"
    " jsonb_build_array(jsonb_build_object('role', 'user', 'content', 'thanks')),"
    " now() - ({turns} - i) * interval '100 ms' + interval '1 s',"
    " now() - ({turns} - i) * interval '100 ms', 80, 'stop' "
    "FROM generate_series(1, {turns}) i",
    "INSERT INTO judgments (turn_id, prompt_version, judge_model, reward, votes, hint,"
    " created_at) "
    "SELECT t.id, 'v2', 'bench', r.reward,"
    " jsonb_build_array(jsonb_build_object('text', 'Score: ' || coalesce(r.reward::text, '?'),"
    "   'score', r.reward)),"
    " CASE WHEN r.reward = -1 THEN 'Answer in French.' END,"
    " t.next_state_at + interval '3 s' "
    "FROM turns t CROSS JOIN LATERAL (SELECT CASE t.id % 7 WHEN 0 THEN NULL WHEN 1 THEN -1"
    " WHEN 2 THEN 0 ELSE 1 END AS reward) r WHERE t.id % 5 <> 0 AND t.kind = 'main'",
    "INSERT INTO jobs (kind, turn_id, user_id) SELECT 'judge', id, user_id FROM turns "
    "WHERE id > (SELECT max(id) - 500 FROM turns)",
    "INSERT INTO training_steps (step, version, status, num_samples, num_tokens, loss) "
    "SELECT v, v, 'ok', 16, 4096, 1.0 / v FROM generate_series(1, {versions}) v",
    "INSERT INTO policy_versions (version, step, path, status, num_samples, loss,"
    " published_at) SELECT v, v, '/nowhere/v' || v, 'published', 16, 1.0 / v,"
    " now() - ({versions} - v) * interval '1 h' FROM generate_series(1, {versions}) v",
    # As autovacuum does on a table that only grows (PostgreSQL >= 13 vacuums after inserts):
    # the visibility map lets the version and time bounds be read from their indexes alone.
    "VACUUM ANALYZE",
]


def fill(url: str, turns: int) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for sql in FILL:
            started = time.perf_counter()
            conn.execute(sql.format(turns=turns, users=USERS, versions=VERSIONS).encode())
            what = " ".join(sql.split()[:3])
            print(f"  {what:<32} {time.perf_counter() - started:6.1f} s", flush=True)


def pages(turns: int) -> list[tuple[str, str]]:
    """(name, path) of every page timed; filters pick old, rare and common cases."""
    session = uuid.UUID(hashlib.md5(f"s{turns // 10}".encode()).hexdigest())
    return [
        ("overview", "/console"),
        ("overview (json)", "/console/api/overview"),
        ("turns", "/console/turns"),
        ("turns: user", "/console/turns?user=user7"),
        ("turns: session", f"/console/turns?session={session}"),
        ("turns: old version", "/console/turns?version=1"),
        ("turns: reward -1", "/console/turns?reward=-1"),
        ("turns: has hint", "/console/turns?hint=yes"),
        ("turns: abstained", "/console/turns?reward=abstained"),
        ("turns: user + reward", "/console/turns?user=user7&reward=-1"),
        ("turns: until (old)", f"/console/turns?until={_old_time(turns)}"),
        ("turns: page deep", f"/console/turns?before={turns // 2}"),
        ("turn", f"/console/turns/{turns // 2}"),
        ("versions", "/console/versions"),
        ("users", "/console/users"),
    ]


def _old_time(turns: int) -> str:
    # The first tenth of the log (it spans turns * 100 ms up to now).
    when = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=turns * 0.1 * 0.9)
    return when.strftime("%Y-%m-%dT%H:%M:%S")


async def measure(url: str, turns: int, requests: int) -> list[tuple[str, list[float]]]:
    from proxy.app import create_app

    key = secrets.token_urlsafe(24)
    state_dir = Path(tempfile.mkdtemp(prefix="clawrl-bench-console-"))
    settings = load_settings(state_dir=state_dir, proxy={"admin_key": key,
                                                         "journal_path": state_dir / "j"},
                             engine={"url": "http://127.0.0.1:9", "connect_timeout_s": 1})
    app = create_app(settings, db_url=url)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    results: list[tuple[str, list[float]]] = []
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120, headers={"Origin": base}) as c:
            token = re.search(r'name="token" value="([^"]+)"',
                              (await c.get("/console/login")).text)
            assert token is not None
            await c.post("/console/login", data={"token": token.group(1), "admin_key": key})
            started = time.perf_counter()
            (await c.get("/console")).raise_for_status()
            results.append(("first overview (tally)", [(time.perf_counter() - started) * 1e3]))
            for name, path in pages(turns):
                (await c.get(path)).raise_for_status()  # warm-up
                times = []
                for _ in range(requests):
                    started = time.perf_counter()
                    (await c.get(path)).raise_for_status()
                    times.append((time.perf_counter() - started) * 1e3)
                results.append((name, times))
    finally:
        server.should_exit = True
        await task
    return results


def p95(times: list[float]) -> float:
    return sorted(times)[max(0, int(round(0.95 * len(times))) - 1)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl bench console", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=1_000_000)
    p.add_argument("--requests", type=int, default=30, help="timed requests per page")
    p.add_argument("--keep", action="store_true", help="keep the scratch database")
    p.add_argument("--reuse", metavar="DB", help="time a database kept by --keep (migrated to "
                   "head first) instead of filling a new one")
    args = p.parse_args(argv)
    if args.turns < 100 or args.requests < 1:
        p.error("--turns must be at least 100 and --requests at least 1")
    configured = load_settings().database.url
    embedded = None
    if configured is not None:
        server_url = configured.get_secret_value()
    else:
        embedded = Path(tempfile.mkdtemp(prefix="clawrl-bench-console-pg-"))
        server_url = start_embedded(embedded)
    name = args.reuse or f"clawrl_bench_console_{uuid.uuid4().hex[:8]}"
    url = make_url(server_url).set(database=name).render_as_string(hide_password=False)
    admin_url = libpq_url(server_url)
    try:
        if not args.reuse:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{name}"'.encode())
        upgrade(url)
        if not args.reuse:
            print(f"filling {name} with {args.turns:,} turns …", flush=True)
            fill(url, args.turns)
        results = asyncio.run(measure(url, args.turns, args.requests))
    except (psycopg.Error, OSError) as exc:
        print(f"clawrl bench console: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    finally:
        if not args.keep and not args.reuse:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
        if embedded is not None:
            stop_embedded(embedded)
    print(f"\n{'page':<26} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    slow = 0
    for page, times in results:
        over = len(times) > 1 and p95(times) > TARGET_P95_MS
        slow += over
        print(f"{page:<26} {statistics.median(times):8.1f} {p95(times):8.1f} {max(times):8.1f}"
              f"{'  > target' if over else ''}")
    print(f"\n{args.turns:,} turns; target p95 <= {TARGET_P95_MS:.0f} ms: "
          f"{'met on every page' if not slow else f'missed on {slow} page(s)'}")
    return 0 if not slow else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
