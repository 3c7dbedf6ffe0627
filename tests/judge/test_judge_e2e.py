"""The whole path: an HTTP chat turn through the real proxy and engine, the follow-up
message that continues it, and the judge worker storing the judgment (and sample)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from judgedb import rows, wait_for
from proxyharness import create_user, running_proxy
from sqlalchemy import Engine
from test_judge_engine import HINT, direct_logprobs
from test_judge_worker import ScriptedJudge, settings_for

from clawrl.base.db import create_async
from judge.config import JudgeProcessSettings, load_judge_settings
from judge.prompts import teacher_messages
from judge.worker import Worker

# The random test model rarely ends a reply by itself; common stop strings end it early so
# the turn is not skipped as cut off by the length limit.
STOP = [" ", "e", "a", "o"]




@contextlib.asynccontextmanager
async def running_worker(settings: JudgeProcessSettings, db_url: str,
                         transport: httpx.AsyncBaseTransport | None = None
                         ) -> AsyncIterator[None]:
    db = create_async(db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(settings, db, db_url, transport=transport).run(stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await db.dispose()


async def chat_two_turns(proxy_url: str, key: str) -> dict[str, Any]:
    """Turn 1, thumbs-down feedback on it, then the user's follow-up (turn 2)."""
    first = [{"role": "user", "content": "What does Ada like?"}]
    async with httpx.AsyncClient(base_url=proxy_url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        r1 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": first, "max_tokens": 48, "stop": STOP})
        assert r1.status_code == 200, r1.text
        reply = r1.json()["choices"][0]["message"]
        turn_uid = r1.headers["X-Clawrl-Turn-Id"]
        fb = await client.post("/v1/feedback", json={"turn_id": turn_uid, "rating": -1,
                                                     "text": "too formal"})
        assert fb.status_code == 200, fb.text
        follow = [*first, {"role": "assistant", "content": reply["content"]},
                  {"role": "user", "content": "too long. answer in lowercase please"}]
        r2 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": follow, "max_tokens": 12})
        assert r1.json()["choices"][0]["finish_reason"] == "stop"
        assert r2.status_code == 200, r2.text
    return {"uid": turn_uid, "request": first}


def judged(db: Engine) -> bool:
    return bool(rows(db, "SELECT 1 FROM jobs WHERE status IN ('done', 'failed')"))


async def test_chat_turn_follow_up_and_policy_judgment(db: Engine, db_url: str,
                                                       engine_url: str, tmp_path: Path) -> None:
    key = create_user(db_url, "ada")[1]
    settings = load_judge_settings(database={"url": db_url}, engine={"url": engine_url},
                                   judge={"poll_interval_s": 0.1, "max_tokens": 16})
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            running_worker(settings, db_url):
        turn = await chat_two_turns(proxy_url, key)
        await wait_for(lambda: judged(db), timeout_s=300)
    [job] = rows(db, "SELECT * FROM jobs")
    assert job.status == "done", job.last_error
    [t1] = rows(db, "SELECT * FROM turns WHERE uid = :u", u=turn["uid"])
    assert t1.state == "continued" and job.turn_id == t1.id
    [j] = rows(db, "SELECT * FROM judgments")
    assert j.turn_id == t1.id and len(j.votes) == 3 and j.prompt_version == "v1"


async def test_chat_turn_to_reward_hint_teacher_logprobs_and_sample(
        db: Engine, db_url: str, engine_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    key = create_user(db_url, "ada")[1]
    judge = ScriptedJudge(prm=["The user asks for lowercase. \\boxed{-1}"],
                          hint=[f"[HINT] {HINT} [/HINT]"])
    settings = settings_for(db_url, teacher_enabled=True, teacher_url=engine_url)
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            running_worker(settings, db_url, httpx.MockTransport(judge)):
        turn = await chat_two_turns(proxy_url, key)
        await wait_for(lambda: judged(db), timeout_s=300)
    [t1] = rows(db, "SELECT * FROM turns WHERE uid = :u", u=turn["uid"])
    [j] = rows(db, "SELECT * FROM judgments")
    assert (j.turn_id, j.reward, j.hint) == (t1.id, -1, HINT)
    prompt = judge.requests[0]["body"]["messages"][0]["content"]
    assert "[NEXT]\nuser: too long. answer in lowercase please\n" in prompt
    assert "[FEEDBACK]\nthumbs down: too formal\n" in prompt
    [s] = rows(db, "SELECT * FROM samples")
    assert (s.prompt_ids, s.response_ids) == (t1.prompt_ids, t1.response_ids)
    assert s.rollout_logprobs == t1.response_logprobs and s.reward == -1
    _, expected = direct_logprobs(tiny_model_dir, teacher_messages(turn["request"], HINT),
                                  t1.response_ids)
    assert max(abs(a - b) for a, b in zip(s.teacher_logprobs, expected, strict=True)) < 1e-4
