"""CLAWRL_JUDGE__URL: PRM and hint votes go to a judge engine of its own (the frozen judge
model that `clawrl up` serves), not to the policy engine; both engines are real."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from judgedb import add_turn, add_user, jobs, rows, wait_for
from sqlalchemy import Engine
from test_judge_engine import served_turn

from clawrl.base.db import create_async
from judge.backends import ChatBackend, http_client
from judge.config import load_judge_settings
from judge.prompts import judge_messages
from judge.worker import Worker


async def run_worker(db: Engine, db_url: str, engine_url: str, judge_url: str,
                     engine_key: str | None = None, **judge: object) -> None:
    settings = load_judge_settings(database={"url": db_url},
                                   engine={"url": engine_url, "api_key": engine_key},
                                   judge={"poll_interval_s": 0.1, "max_tokens": 16,
                                          "url": judge_url, "backoff_base_s": 60,
                                          "teacher_enabled": False, **judge})
    db_async = create_async(db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(settings, db_async, db_url).run(stop))
    try:
        await wait_for(lambda: jobs(db)[0].status in ("done", "failed")
                       or jobs(db)[0].last_error is not None, timeout_s=300)
    finally:
        stop.set()
        await task
        await db_async.dispose()


async def test_votes_go_to_the_judge_engine(db: Engine, db_url: str, engine_url: str,
                                            tiny_model_dir: Path,
                                            engine_factory: Callable[..., str]) -> None:
    """The judge engine takes the engine key (as under `clawrl up`, which gives both engines
    one key); the worker sends it there by default."""
    judge_url = engine_factory(tiny_model_dir, "--served-model-name", "judge",
                               "--api-key", "both-engines")
    async with httpx.AsyncClient() as client:  # the key is really asked for
        assert (await client.post(judge_url + "/v1/chat/completions", json={})).status_code == 401
    add_turn(db, add_user(db), **served_turn(engine_url))
    await run_worker(db, db_url, engine_url, judge_url, engine_key="both-engines")
    assert jobs(db)[0].status == "done", jobs(db)[0].last_error
    [j] = rows(db, "SELECT * FROM judgments")
    assert j.judge_model == "judge" and len(j.votes) == 3


async def test_an_unreachable_judge_engine_is_retried_not_replaced(
        db: Engine, db_url: str, engine_url: str) -> None:
    """With the judge engine down, the worker does not fall back to the policy engine: the
    job waits for a retry and says which URL it could not reach."""
    dead = "http://127.0.0.1:9"
    add_turn(db, add_user(db), **served_turn(engine_url))
    await run_worker(db, db_url, engine_url, dead)
    job = jobs(db)[0]
    assert job.status == "queued" and dead in (job.last_error or "")
    assert rows(db, "SELECT * FROM judgments") == []


@pytest.mark.parametrize("version", ["v3", "v4"])
async def test_a_combined_version_asks_once_with_alternatives(
        db: Engine, db_url: str, engine_url: str, tiny_model_dir: Path,
        engine_factory: Callable[..., str], version: str) -> None:
    """With a combined prompt version (v3; v4, score first) and the PRM in `logprob` mode a
    turn costs one request: one greedy answer, its top alternatives per token, the votes
    drawn from them (or one vote without a score when the answer holds none)."""
    judge_url = engine_factory(tiny_model_dir, "--served-model-name", "judge")
    async with http_client(30, 5, max_connections=2) as client:
        backend = ChatBackend(client, judge_url + "/v1", model="judge", api_key=None,
                              concurrency=1)
        answer = await backend.complete(judge_messages("[NEXT]\nuser: thanks"),
                                        temperature=0.0, max_tokens=6, top_logprobs=5)
    assert answer.tokens and len(answer.tokens) <= 6
    for token in answer.tokens:  # greedy: the chosen token is the most likely alternative
        best = max(token["top_logprobs"], key=lambda t: t["logprob"])
        assert len(token["top_logprobs"]) == 5 and best["token"] == token["token"]

    add_turn(db, add_user(db), **served_turn(engine_url))
    await run_worker(db, db_url, engine_url, judge_url, prompt_version=version,
                     prm_mode="logprob")
    assert jobs(db)[0].status == "done", jobs(db)[0].last_error
    [j] = rows(db, "SELECT * FROM judgments")
    assert j.prompt_version == version and len(j.hint_votes) == 1
    if j.reward is None and len(j.votes) == 1:
        assert j.votes[0]["score"] is None
    else:
        assert len(j.votes) == 3 and all(set(v["p"]) <= {"1", "-1", "0"} for v in j.votes)
