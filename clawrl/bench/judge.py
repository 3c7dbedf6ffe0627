"""`clawrl bench judge`: judge throughput/latency on the engine, and the claim query's cost.

    clawrl bench judge [--engine-url URL] [--turns 48] [--concurrency 1,4,16]
                       [--claim-rows 1000000] [--skip-engine] [--skip-claim]

Runs in a scratch database created next to the configured one (CLAWRL_DATABASE__URL, or the
embedded Postgres) and dropped afterwards. The engine is the one at CLAWRL_ENGINE__URL (start
it first, e.g. `clawrl engine --model DIR`); the judge backend is that policy engine.

1. Throughput: a burst of N continued turns with judge jobs; one worker at concurrency c
   judges them all (3 PRM votes + 3 hint votes each); turns/s = N / wall time. Latency =
   judgments.created_at − turns.next_state_at per turn (p50/p95; in a burst it includes
   queueing), and a trickle latency: one turn at a time, next state → judgment, which is
   what a single user sees (NOTIFY wake-up included).
2. Claim cost: `--claim-rows` queued jobs made with generate_series, ANALYZE, then
   EXPLAIN (ANALYZE, BUFFERS) of the claim statement inside a rolled-back transaction, and
   the median of 50 rolled-back claims.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from typing import Any

import httpx
from sqlalchemy import Engine, func, insert, text
from sqlalchemy.engine import make_url

from clawrl.base.db import Turn, User, create_async, create_engine, libpq_url
from clawrl.base.jobs import claim_stmt, enqueue_stmt, notify_stmt
from clawrl.bench.proxy import pct
from judge.config import JudgeProcessSettings, load_judge_settings
from judge.worker import Worker

QUESTIONS = ["What does Ada like?", "Where does Bob live?", "What is Cleo's job?",
             "How old is Dan?"]
NEXT = ["thanks! and what about her brother?", "too long. answer in lowercase please",
        "no, that is wrong, try again", "great, that helps"]


def scratch_database(url: str) -> tuple[str, str]:
    """Create an empty database beside `url`'s; returns (its URL, its name)."""
    import psycopg

    name = f"clawrl_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return make_url(url).set(database=name).render_as_string(hide_password=False), name


def drop_database(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def sample_turn(client: httpx.AsyncClient, engine_url: str, i: int) -> dict[str, Any]:
    """A real turn from the engine (token ids and logprobs as the proxy would log them)."""
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    r = await client.post(f"{engine_url}/v1/chat/completions", json={
        "model": "default", "messages": messages, "max_tokens": 24, "temperature": 0.7,
        "logprobs": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lps = [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    return {"request_messages": messages, "response_message": choice["message"],
            "prompt_ids": choice["prompt_token_ids"], "response_ids": choice["response_token_ids"],
            "response_logprobs": lps, "finish_reason": "stop"}


def add_turns(db: Engine, user_id: int, templates: list[dict[str, Any]], n: int) -> list[int]:
    ids = []
    with db.begin() as conn:
        for i in range(n):
            t = templates[i % len(templates)]
            tid = conn.execute(insert(Turn).values(
                uid=uuid.uuid4(), user_id=user_id, status="ok", state="continued",
                next_state=[{"role": "user", "content": NEXT[i % len(NEXT)]}],
                next_state_at=func.clock_timestamp(), **t).returning(Turn.id)).scalar_one()
            conn.execute(enqueue_stmt("judge", tid))
            ids.append(tid)
        conn.execute(notify_stmt("judge"))
    return ids


def done_count(db: Engine, turn_ids: list[int]) -> int:
    with db.connect() as conn:
        return int(conn.execute(text(
            "SELECT count(*) FROM jobs WHERE turn_id = ANY(:ids) AND status IN "
            "('done', 'failed')"), {"ids": turn_ids}).scalar_one())


def latencies_ms(db: Engine, turn_ids: list[int]) -> list[float]:
    with db.connect() as conn:
        return [float(r[0]) for r in conn.execute(text(
            "SELECT extract(epoch FROM j.created_at - t.next_state_at) * 1000 FROM judgments j "
            "JOIN turns t ON t.id = j.turn_id WHERE t.id = ANY(:ids)"), {"ids": turn_ids})]


async def wait_done(db: Engine, ids: list[int], timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while done_count(db, ids) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError("judge jobs did not finish")
        await asyncio.sleep(0.02)


async def bench_engine(settings: JudgeProcessSettings, db_url: str, turns: int,
                       levels: list[int]) -> None:
    db = create_engine(db_url)
    engine_url = settings.engine.url.rstrip("/")
    async with httpx.AsyncClient(timeout=300) as client:
        templates = [await sample_turn(client, engine_url, i) for i in range(4)]
    with db.begin() as conn:
        user = conn.execute(insert(User).values(name="bench").returning(User.id)).scalar_one()
    print(f"judge throughput on {engine_url} ({settings.judge.votes} PRM + "
          f"{settings.judge.hint_votes} hint votes per turn, {turns} turns per level)")
    print(f"{'conc':>5} {'turns/s':>8} {'burst p50 ms':>13} {'burst p95 ms':>13} "
          f"{'trickle p50 ms':>15}")
    for c in levels:
        adb = create_async(db_url, pool_size=c + 4)
        stop = asyncio.Event()
        worker = Worker(settings, adb, db_url, name=f"bench-{c}", concurrency=c)
        task = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(0.5)  # listener connected
        start = time.perf_counter()
        ids = add_turns(db, user, templates, turns)
        await wait_done(db, ids)
        wall = time.perf_counter() - start
        burst = latencies_ms(db, ids)
        trickle: list[float] = []
        for _ in range(5):
            one = add_turns(db, user, templates, 1)
            await wait_done(db, one)
            trickle += latencies_ms(db, one)
        stop.set()
        await task
        await adb.dispose()
        print(f"{c:>5} {turns / wall:>8.2f} {pct(burst, 0.5):>13.0f} {pct(burst, 0.95):>13.0f} "
              f"{statistics.median(trickle):>15.0f}")
    db.dispose()


def bench_claim(db_url: str, rows: int) -> None:
    db = create_engine(db_url)
    start = time.perf_counter()
    with db.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (kind, payload, available_at) SELECT 'judge', '{}', "
            "now() - make_interval(secs => g % 3600) FROM generate_series(1, :n) g"), {"n": rows})
    with db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE jobs"))
    print(f"\nclaim query with {rows:,} queued jobs (made in {time.perf_counter() - start:.1f}s)")
    sql = str(claim_stmt("judge", "bench", 1, 60.0).compile(
        compile_kwargs={"literal_binds": True}))
    with db.connect() as conn:
        with conn.begin() as tx:
            plan = [r[0] for r in conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS) {sql}"))]
            tx.rollback()
        times = []
        for _ in range(50):
            with conn.begin() as tx:
                t0 = time.perf_counter()
                conn.execute(claim_stmt("judge", "bench", 1, 60.0)).all()
                times.append((time.perf_counter() - t0) * 1000)
                tx.rollback()
    print("\n".join("  " + line for line in plan))
    uses_index = any("ix_jobs_claimable" in line for line in plan)
    print(f"index scan on ix_jobs_claimable: {'yes' if uses_index else 'NO'}; "
          f"claim of 1 job, client-side median over 50: {statistics.median(times):.2f} ms")
    db.dispose()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl bench judge", description=__doc__.split("\n")[0])
    p.add_argument("--engine-url", help="default: CLAWRL_ENGINE__URL")
    p.add_argument("--turns", type=int, default=48)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--claim-rows", type=int, default=1_000_000)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-claim", action="store_true")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        print("clawrl bench judge: --concurrency takes e.g. 1,4,16", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    if args.engine_url:
        overrides["engine"] = {"url": args.engine_url}
    settings = load_judge_settings(**overrides)
    from clawrl.base.dbcli import resolve_url, upgrade

    if not args.skip_engine:
        try:
            httpx.get(settings.engine.url.rstrip("/") + "/model_info", timeout=5).raise_for_status()
        except httpx.HTTPError as exc:
            print(f"clawrl bench judge: no engine at {settings.engine.url} ({exc}); start one "
                  "with `clawrl engine --model DIR` or pass --skip-engine", file=sys.stderr)
            return 1
    server_url = resolve_url(settings)
    url, name = scratch_database(server_url)
    try:
        upgrade(url)
        if not args.skip_engine:
            asyncio.run(bench_engine(settings, url, args.turns, levels))
        if not args.skip_claim:
            bench_claim(url, args.claim_rows)
    finally:
        drop_database(server_url, name)
    return 0
