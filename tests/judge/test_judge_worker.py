"""The worker end to end against real Postgres, with the judge endpoint as a remote
OpenAI-compatible API faked by httpx.MockTransport (scripted votes and injected faults)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from judgedb import add_turn, add_user, jobs, rows, wait_for
from sqlalchemy import Engine, insert, text

from clawrl.base.db import Feedback, create_async
from clawrl.base.jobs import claim_stmt
from judge.config import JudgeProcessSettings, load_judge_settings
from judge.rejudge import enqueue_rejudge, parse_time
from judge.worker import Worker

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def settings_for(db_url: str, **judge: Any) -> JudgeProcessSettings:
    base: dict[str, Any] = {
        "backend": "openai", "poll_interval_s": 0.1, "backoff_base_s": 0.05,
        "teacher_enabled": False, "max_attempts": 3,
        "openai": {"base_url": "http://judge.test/v1", "model": "judge-test",
                   "api_key": "sk-judge"},
    }
    base.update(judge)
    return load_judge_settings(database={"url": db_url}, judge=base)


def reply(text_: str) -> httpx.Response:
    body = {"id": "c", "object": "chat.completion", "model": "judge-test",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text_}}]}
    # ASCII JSON, so even a lone surrogate travels as the escape a real server would send.
    return httpx.Response(200, content=json.dumps(body).encode(),
                          headers={"content-type": "application/json"})


class ScriptedJudge:
    """Answers PRM prompts and hint prompts from two lists (cycled); records requests."""

    def __init__(self, prm: list[str], hint: list[str]) -> None:
        self.prm, self.hint = prm, hint
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append({"body": body, "auth": request.headers.get("authorization")})
        prompt = body["messages"][0]["content"]
        pool = self.prm if prompt.startswith("Rate the assistant reply") else self.hint
        n = sum(1 for r in self.requests
                if r["body"]["messages"][0]["content"].startswith(prompt[:20]))
        return reply(pool[(n - 1) % len(pool)])


async def run_until(db_url: str, settings: JudgeProcessSettings, handler: Handler,
                    done: Callable[[], bool], *, name: str = "w") -> None:
    db = create_async(db_url)
    stop = asyncio.Event()
    worker = Worker(settings, db, db_url, name=name, transport=httpx.MockTransport(handler))
    task = asyncio.create_task(worker.run(stop))
    try:
        await wait_for(done)
    finally:
        stop.set()
        await task
        await db.dispose()


def job_status(db: Engine) -> list[str]:
    return [j.status for j in jobs(db)]


async def test_majority_reward_votes_hint_and_sample_in_one_go(db: Engine, db_url: str) -> None:
    user = add_user(db)
    turn = add_turn(db, user)
    with db.begin() as conn:
        conn.execute(insert(Feedback).values(turn_id=turn, user_id=user, rating=-1,
                                             text="too formal"))
    judge = ScriptedJudge(
        prm=["The user asks for lowercase. \\boxed{-1}", "\\boxed{-1}", "I think \\boxed{1"],
        hint=["[HINT] Answer in lowercase. [/HINT]", "[NO_HINT]", "lowercase"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"])
    [j] = rows(db, "SELECT * FROM judgments")
    assert (j.turn_id, j.reward, j.prompt_version, j.judge_model) == (turn, -1, "v1",
                                                                      "judge-test")
    assert [v["score"] for v in j.votes] == [-1, -1, None]
    assert j.votes[2]["text"] == "I think \\boxed{1"  # raw text kept
    assert j.hint == "Answer in lowercase."
    assert [v["accepted"] for v in j.hint_votes] == [True, False, False]
    assert j.teacher_logprobs is None and j.reason == "teacher: disabled"
    [s] = rows(db, "SELECT * FROM samples")
    assert (s.turn_id, s.judgment_id, s.reward, s.teacher_logprobs) == (turn, j.id, -1, None)
    assert (s.prompt_ids, s.response_ids) == ([1, 5, 6, 7, 2, 1, 8], [10, 11, 12, 2])
    assert s.rollout_logprobs == [-0.5, -1.0, -0.25, -0.1] and s.weight_version == "default"
    assert len(judge.requests) == 6
    first = judge.requests[0]
    assert first["auth"] == "Bearer sk-judge"
    assert (first["body"]["model"], first["body"]["temperature"]) == ("judge-test", 0.6)
    assert len(first["body"]["messages"]) == 1
    assert "[FEEDBACK]\nthumbs down: too formal\n" in first["body"]["messages"][0]["content"]


async def test_tie_or_garbage_is_an_abstention_never_zero(db: Engine, db_url: str) -> None:
    user = add_user(db)
    tie = add_turn(db, user)
    judge = ScriptedJudge(prm=["\\boxed{1}", "\\boxed{-1}", "no idea"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"])
    garbage = add_turn(db, user)
    judge = ScriptedJudge(prm=["ttt\x00 ll5x \ud83d", "\\boxed{7}", ""], hint=["junk"])
    await run_until(db_url, settings_for(db_url), judge,
                    lambda: job_status(db) == ["done", "done"])
    judged = {r.turn_id: r for r in rows(db, "SELECT * FROM judgments")}
    assert judged[tie].reward is None and judged[garbage].reward is None
    assert judged[garbage].hint is None and len(judged[garbage].hint_votes) == 3
    assert judged[garbage].votes[0]["text"] == "ttt\ufffd ll5x ?"  # NUL etc. cannot be stored
    assert judged[tie].reason == "no sample: no reward and no teacher logprobs"
    assert rows(db, "SELECT * FROM samples") == []


async def test_skipped_and_never_judged_turns(db: Engine, db_url: str) -> None:
    user, opted_out = add_user(db), add_user(db, opt_out=True)
    empty = add_turn(db, user, response_ids=[], response_logprobs=[],
                     response_message={"role": "assistant", "content": ""})
    broken = add_turn(db, user, status="engine_error")
    add_turn(db, opted_out)
    add_turn(db, user, kind="side")
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: set(job_status(db)) == {"done"})
    assert judge.requests == []  # none of these needed the judge
    reasons = {r.turn_id: r.reason for r in rows(db, "SELECT * FROM judgments")}
    assert reasons == {empty: "skipped: empty response",
                       broken: "skipped: turn status engine_error"}
    assert rows(db, "SELECT * FROM samples") == []
    notes = sorted(j.last_error for j in jobs(db) if j.last_error)
    assert notes == ["not judged: side turn", "not judged: user opted out of training"]


async def test_a_reply_cut_off_by_the_length_limit_is_judged_and_trained(
        db: Engine, db_url: str) -> None:
    """A reply too long is what people complain about: cut off at max_tokens, it is judged
    like any other and becomes a sample."""
    cut = add_turn(db, add_user(db), finish_reason="length")
    judge = ScriptedJudge(prm=["\\boxed{-1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"])
    assert judge.requests  # the judge was asked
    [judgment] = rows(db, "SELECT * FROM judgments")
    assert judgment.turn_id == cut and judgment.reward == -1 and judgment.reason is None
    [sample] = rows(db, "SELECT * FROM samples")
    assert sample.turn_id == cut and sample.reward == -1


async def test_endpoint_down_is_retried_then_recorded_never_lost(db: Engine,
                                                                 db_url: str) -> None:
    add_turn(db, add_user(db))
    calls = 0

    async def down(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503, json={"error": {"message": "overloaded", "type": "x"}})

    await run_until(db_url, settings_for(db_url, hint_votes=0), down,
                    lambda: job_status(db) == ["failed"])
    [job] = jobs(db)
    assert job.attempts == 3 and "HTTP 503: overloaded" in job.last_error
    assert calls >= 3
    assert rows(db, "SELECT * FROM judgments") == []


async def test_unreachable_or_slow_endpoint_is_retried_until_it_answers(
        db: Engine, db_url: str) -> None:
    add_turn(db, add_user(db))
    faults = [httpx.ConnectError("connection refused"), httpx.ReadTimeout("slow")]

    async def flaky(request: httpx.Request) -> httpx.Response:
        if faults:
            raise faults.pop(0)
        return reply("Thanks, moving on. \\boxed{1}")

    await run_until(db_url, settings_for(db_url, votes=1, hint_votes=0), flaky,
                    lambda: job_status(db) == ["done"])
    # The refused connection was an outage and gave its attempt back; the timeout counted.
    assert jobs(db)[0].attempts == 2
    assert [r.reward for r in rows(db, "SELECT reward FROM judgments")] == [1]
    assert len(rows(db, "SELECT * FROM samples")) == 1


async def test_an_engine_down_longer_than_the_attempts_loses_no_job(db: Engine,
                                                                    db_url: str) -> None:
    """The judge engine refuses connections for more tries than the jobs have attempts (3 here;
    a restart of a few minutes in production): every queued turn is judged once it is back,
    none failed, no attempt spent, and the worker waited longer between tries as it stayed
    down instead of bouncing every queued job."""
    user = add_user(db)
    for _ in range(2):
        add_turn(db, user)
    refusals = 7  # more than both jobs' 3 attempts together
    tried: list[float] = []

    async def restarting(request: httpx.Request) -> httpx.Response:
        nonlocal refusals
        if refusals > 0:
            refusals -= 1
            tried.append(time.monotonic())
            raise httpx.ConnectError("connection refused")
        return reply("Thanks, moving on. \\boxed{1}")

    await run_until(db_url, settings_for(db_url, votes=1, hint_votes=0, concurrency=1),
                    restarting, lambda: job_status(db) == ["done"] * 2)
    assert [j.attempts for j in jobs(db)] == [1, 1]
    assert len(rows(db, "SELECT * FROM samples")) == 2
    # Paused 0.05, 0.1, 0.2, … s (backoff_base_s doubling) between the refused tries.
    gaps = [b - a for a, b in zip(tried, tried[1:], strict=False)]
    assert gaps[-1] >= 0.05 * 2 ** 5 * 0.9, gaps


async def test_rejected_request_fails_at_once(db: Engine, db_url: str) -> None:
    add_turn(db, add_user(db))

    async def bad_key(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid api key"}})

    await run_until(db_url, settings_for(db_url), bad_key, lambda: job_status(db) == ["failed"])
    [job] = jobs(db)
    assert job.attempts == 1 and "BackendRejected" in job.last_error


async def test_a_killed_workers_job_is_picked_up_after_its_lease(db: Engine,
                                                                 db_url: str) -> None:
    add_turn(db, add_user(db))
    with db.begin() as conn:  # a worker claims it, then dies without a word
        assert conn.execute(claim_stmt("judge", "dead", 1, 0.5)).all()
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"],
                    name="alive")
    [job] = jobs(db)
    assert job.attempts == 2
    assert len(rows(db, "SELECT * FROM judgments")) == 1


async def test_stop_finishes_jobs_in_flight_and_claims_no_more(db: Engine,
                                                               db_url: str) -> None:
    user = add_user(db)
    add_turn(db, user)
    started, release = asyncio.Event(), asyncio.Event()

    async def gated(request: httpx.Request) -> httpx.Response:
        started.set()
        await release.wait()
        return reply("\\boxed{1}")

    db_async = create_async(db_url)
    stop = asyncio.Event()
    worker = Worker(settings_for(db_url, votes=1, hint_votes=0), db_async, db_url,
                    transport=httpx.MockTransport(gated))
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.wait_for(started.wait(), 30)
        stop.set()  # what SIGTERM does
        add_turn(db, user)  # arrives after the stop: must stay queued
        await asyncio.sleep(0.3)
        assert not task.done()  # still finishing the job in flight
        release.set()
        await asyncio.wait_for(task, 30)
    finally:
        release.set()
        stop.set()
        await task
        await db_async.dispose()
    assert job_status(db) == ["done", "queued"]


async def test_rejudge_supersedes_untrained_samples_and_skips_opted_out(
        db: Engine, db_url: str) -> None:
    user, opted_out = add_user(db), add_user(db, opt_out=True)
    turn = add_turn(db, user)
    trained = add_turn(db, user)
    add_turn(db, opted_out, job=False)
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"] * 2)
    with db.begin() as conn:
        conn.execute(text("UPDATE samples SET trained_step = 1 WHERE turn_id = :t"),
                     {"t": trained})
    with pytest.raises(FileNotFoundError):
        enqueue_rejudge(db, parse_time("2000-01-01T00:00:00Z"), "v999")
    assert enqueue_rejudge(db, parse_time("2000-01-01T00:00:00Z"), "v1") == 2
    assert enqueue_rejudge(db, parse_time("2000-01-01T00:00:00Z"), "v1") == 0  # queued already
    assert [j.payload for j in jobs(db)][2:] == [{"prompt_version": "v1", "rejudge": True}] * 2
    judge = ScriptedJudge(prm=["\\boxed{-1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: job_status(db) == ["done"] * 4)
    samples = rows(db, "SELECT turn_id, reward, trained_step, skipped_reason FROM samples")
    assert sorted((s.turn_id, s.reward, s.trained_step or 0, s.skipped_reason or "")
                  for s in samples) == sorted([
                      (turn, 1, 0, "superseded"), (trained, 1, 1, ""),
                      (turn, -1, 0, ""), (trained, -1, 0, "")])
    assert len(rows(db, "SELECT * FROM judgments")) == 4  # old judgments stay for audit


async def test_a_live_worker_keeps_its_lease_on_a_slow_job(db: Engine, db_url: str) -> None:
    add_turn(db, add_user(db))

    started = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        started.set()
        await asyncio.sleep(1.5)  # longer than the lease: the heartbeat must extend it
        return reply("\\boxed{1}")

    stolen: list[Any] = []

    async def thief() -> None:
        await started.wait()  # the worker holds the job now
        while True:
            with db.begin() as conn:
                stolen.extend(conn.execute(claim_stmt("judge", "thief", 1, 60.0)).all())
            await asyncio.sleep(0.1)

    stealing = asyncio.create_task(thief())
    try:
        await run_until(db_url, settings_for(db_url, votes=1, hint_votes=0, lease_s=0.6),
                        slow, lambda: job_status(db) == ["done"] or bool(stolen))
    finally:
        stealing.cancel()
    assert stolen == [] and jobs(db)[0].attempts == 1, (stolen, jobs(db))


async def test_a_job_whose_lease_was_taken_over_writes_nothing(db: Engine,
                                                               db_url: str) -> None:
    add_turn(db, add_user(db))
    started, release = asyncio.Event(), asyncio.Event()

    async def gated(request: httpx.Request) -> httpx.Response:
        started.set()
        await release.wait()
        return reply("\\boxed{1}")

    db_async = create_async(db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(settings_for(db_url, votes=1, hint_votes=0), db_async,
                                      db_url, transport=httpx.MockTransport(gated)).run(stop))
    try:
        await asyncio.wait_for(started.wait(), 30)
        with db.begin() as conn:  # as if the lease expired and another worker took it
            conn.execute(text("UPDATE jobs SET locked_by = 'other'"))
        release.set()
        await asyncio.sleep(0.5)
    finally:
        release.set()
        stop.set()
        await task
        await db_async.dispose()
    assert rows(db, "SELECT * FROM judgments") == [] and rows(db, "SELECT * FROM samples") == []
    [job] = jobs(db)
    assert (job.status, job.locked_by) == ("running", "other")


async def test_judge_prompt_over_the_context_is_a_skip_not_a_failure(db: Engine,
                                                                     db_url: str) -> None:
    turn = add_turn(db, add_user(db))

    async def refuses(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"object": "error", "message": (
            "The input (900 tokens) is longer than the model's context length (512 tokens).")})

    await run_until(db_url, settings_for(db_url), refuses, lambda: job_status(db) == ["done"])
    [j] = rows(db, "SELECT * FROM judgments")
    assert j.turn_id == turn and j.reward is None and j.votes == []
    assert j.reason.startswith("skipped: judge prompt too long")
    assert rows(db, "SELECT * FROM samples") == []


async def test_unknown_prompt_version_or_missing_next_state_fail_at_once(
        db: Engine, db_url: str) -> None:
    user = add_user(db)
    add_turn(db, user, job=False)
    add_turn(db, user, next_state=None)
    with db.begin() as conn:
        conn.execute(text("INSERT INTO jobs (kind, turn_id, payload) SELECT 'judge', min(id), "
                          "'{\"prompt_version\": \"v404\"}' FROM turns"))
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge,
                    lambda: job_status(db) == ["failed", "failed"])
    errors = sorted(j.last_error for j in jobs(db))
    assert "'v404'" in errors[0] and "has no next state" in errors[1]
    assert all(j.attempts == 1 for j in jobs(db)) and judge.requests == []


async def test_two_workers_judge_every_turn_exactly_once(db: Engine, db_url: str) -> None:
    user = add_user(db)
    turns = [add_turn(db, user) for _ in range(12)]
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    settings = settings_for(db_url, concurrency=3)
    dbs = [create_async(db_url), create_async(db_url)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(Worker(settings, d, db_url, name=f"w{i}",
                                        transport=httpx.MockTransport(judge)).run(stop))
             for i, d in enumerate(dbs)]
    try:
        await wait_for(lambda: job_status(db) == ["done"] * 12)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for d in dbs:
            await d.dispose()
    judged = sorted(r.turn_id for r in rows(db, "SELECT turn_id FROM judgments"))
    assert judged == turns
    assert {j.attempts for j in jobs(db)} == {1}
