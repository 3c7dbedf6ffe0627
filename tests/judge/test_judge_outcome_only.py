"""Outcome-only judgments: a session's final turn has no next state, so its session's outcome
(`POST /v1/sessions/{id}/outcome` or the `X-Session-Outcome` header) enqueues its judge job,
and the worker stores a judgment without a reward and a sample without asking a judge model.
Through the real proxy app, the real embedded engine and Postgres; the judge endpoint is an
httpx.MockTransport that refuses every request (so a call to it fails the job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from judgedb import rows, wait_for
from proxyharness import create_user, running_proxy
from sqlalchemy import Engine
from test_judge_worker import ScriptedJudge, run_until, settings_for

from judge.judgment import OUTCOME_ONLY_REASON
from proxy.auth import VERIFIER

# The random test model rarely ends a reply by itself; common stop strings end it early so
# the final turn is not skipped as cut off by the length limit.
STOP = [" ", "e", "a", "o"]
ASK = [{"role": "user", "content": "Write hello into a.txt, then tell me you did."}]


class NoJudge:
    """A judge endpoint that must not be called: counts calls and refuses them (400 fails
    the job at once instead of retrying it)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        return httpx.Response(400, json={"error": {"message": "no judge model here"}})


async def ask(http: httpx.AsyncClient, messages: list[Any], **headers: str) -> dict[str, Any]:
    """One chat request; the reply message (finished by a stop string, not the length)."""
    response = await http.post("/v1/chat/completions", headers=headers, json={
        "model": "default", "messages": messages, "max_tokens": 48, "stop": STOP})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return dict(choice["message"])


def client(proxy_url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=proxy_url, timeout=120,
                             headers={"Authorization": f"Bearer {key}"})


async def stored(db: Engine, n: int) -> None:
    await wait_for(lambda: rows(db, "SELECT count(*) AS n FROM turns")[0].n == n)


def judge_jobs(db: Engine) -> list[Any]:
    return rows(db, "SELECT j.id, j.turn_id, t.index_in_session, s.external_id, j.payload, j.status, "
                    "j.last_error FROM jobs j JOIN turns t ON t.id = j.turn_id "
                    "JOIN sessions s ON s.id = t.session_id WHERE j.kind = 'judge' ORDER BY j.id")


def finished(db: Engine) -> bool:
    return not rows(db, "SELECT 1 FROM jobs WHERE status IN ('queued', 'running')")


async def test_api_outcome_trains_the_final_turn_without_a_judge_model(
        db: Engine, db_url: str, engine_url: str, tmp_path: Path) -> None:
    """An agent that answers at once: its episode is one turn, the final one. The outcome
    gives it exactly one judge job (posting it again adds none); the worker stores a
    judgment with reward NULL and a sample, never calling the judge model. A session
    without an outcome gets no job."""
    key = create_user(db_url, "agent", scopes=[VERIFIER])[1]
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            client(proxy_url, key) as http:
        await ask(http, ASK, **{"X-Session-Id": "solved"})
        await ask(http, ASK, **{"X-Session-Id": "unverified"})
        # Right after the reply (its turn may still be queued in the proxy).
        posted = await http.post("/v1/sessions/solved/outcome", json={"outcome": -1})
        assert posted.status_code == 200, posted.text
        await stored(db, 2)
        [job] = judge_jobs(db)
        assert (job.index_in_session, job.external_id, job.payload, job.status) == (
            0, "solved", {"outcome_only": True}, "queued")

        no_judge = NoJudge()
        await run_until(db_url, settings_for(db_url), no_judge, lambda: finished(db))
        assert no_judge.calls == 0
        assert [j.status for j in judge_jobs(db)] == ["done"]
        [judgment] = rows(db, "SELECT * FROM judgments")
        assert judgment.turn_id == job.turn_id
        assert (judgment.reward, judgment.votes, judgment.hint, judgment.hint_votes,
                judgment.judge_model, judgment.teacher_logprobs) == (None, [], None, [], None,
                                                                     None)
        assert judgment.reason == OUTCOME_ONLY_REASON
        [turn] = rows(db, "SELECT * FROM turns WHERE id = :id", id=job.turn_id)
        [sample] = rows(db, "SELECT * FROM samples")
        assert (sample.turn_id, sample.judgment_id, sample.reward, sample.teacher_logprobs,
                sample.trained_step, sample.skipped_reason) == (turn.id, judgment.id, None,
                                                                None, None, None)
        assert (sample.prompt_ids, sample.response_ids, sample.rollout_logprobs) == (
            turn.prompt_ids, turn.response_ids, turn.response_logprobs)
        assert turn.next_state is None and len(turn.response_ids) > 0

        # The verifier posts again (by the proxy's UUID this time): no second job.
        session_id = rows(db, "SELECT session_id FROM turns WHERE id = :id", id=turn.id)[0][0]
        again = await http.post(f"/v1/sessions/{session_id}/outcome", json={"outcome": 1})
        assert again.status_code == 200, again.text
    assert len(judge_jobs(db)) == 1
    assert rows(db, "SELECT count(*) AS n FROM samples")[0].n == 1


async def test_outcome_header_on_the_last_request_judges_its_turn(
        db: Engine, db_url: str, engine_url: str, tmp_path: Path) -> None:
    """The header path: the request that carries `X-Session-Outcome` (and
    `X-Session-Done`) records the final turn and its outcome-only job together; an earlier
    turn it continues gets its usual job. A later outcome by the API adds no job."""
    key = create_user(db_url, "header-agent", scopes=[VERIFIER])[1]
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            client(proxy_url, key) as http:
        first = await ask(http, ASK, **{"X-Session-Id": "ep"})
        follow = [*ASK, first, {"role": "user", "content": "Did it work?"}]
        await ask(http, follow, **{"X-Session-Id": "ep", "X-Session-Outcome": "1",
                                   "X-Session-Done": "1"})
        await stored(db, 2)
        assert [(j.index_in_session, j.payload) for j in judge_jobs(db)] == [
            (0, {}), (1, {"outcome_only": True})]
        posted = await http.post("/v1/sessions/ep/outcome", json={"outcome": 0.5})
        assert posted.status_code == 200, posted.text
    assert len(judge_jobs(db)) == 2
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: finished(db))
    assert [j.status for j in judge_jobs(db)] == ["done", "done"]
    assert len(judge.requests) == 6  # 3 PRM + 3 hint votes, all on the first turn
    judged = rows(db, "SELECT t.index_in_session, j.reward, j.votes = '[]'::jsonb AS no_votes, "
                      "j.reason, s.reward AS sample_reward FROM judgments j "
                      "JOIN turns t ON t.id = j.turn_id JOIN samples s ON s.judgment_id = j.id "
                      "ORDER BY t.index_in_session")
    assert [tuple(j) for j in judged] == [(0, 1, False, None, 1),
                                          (1, None, True, OUTCOME_ONLY_REASON, None)]


async def test_opted_out_users_final_turns_are_never_judged(
        db: Engine, db_url: str, engine_url: str, tmp_path: Path) -> None:
    """No job for an opted-out user's final turn by either path; a user who opts out after
    the job was enqueued gets no judgment and no sample (the judge checks again)."""
    out_key = create_user(db_url, "private", train_opt_out=True,
                          scopes=[VERIFIER])[1]
    later_id, later_key = create_user(db_url, "changes-mind", scopes=[VERIFIER])
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url:
        async with client(proxy_url, out_key) as http:
            await ask(http, ASK, **{"X-Session-Id": "by-api"})
            assert (await http.post("/v1/sessions/by-api/outcome",
                                    json={"outcome": 1})).status_code == 200
            await ask(http, ASK, **{"X-Session-Id": "by-header", "X-Session-Outcome": "1"})
        async with client(proxy_url, later_key) as http:
            await ask(http, ASK, **{"X-Session-Id": "ep"})
            assert (await http.post("/v1/sessions/ep/outcome",
                                    json={"outcome": 1})).status_code == 200
        await stored(db, 3)
    assert [j.external_id for j in judge_jobs(db)] == ["ep"]
    with db.begin() as conn:
        conn.exec_driver_sql(f"UPDATE users SET train_opt_out = true WHERE id = {later_id}")
    no_judge = NoJudge()
    await run_until(db_url, settings_for(db_url), no_judge, lambda: finished(db))
    [job] = judge_jobs(db)
    assert (job.status, job.last_error) == ("done", "not judged: user opted out of training")
    assert no_judge.calls == 0
    assert rows(db, "SELECT count(*) AS n FROM judgments")[0].n == 0
    assert rows(db, "SELECT count(*) AS n FROM samples")[0].n == 0


async def test_a_final_turn_continued_after_all_is_judged_by_its_own_job(
        db: Engine, db_url: str, engine_url: str, tmp_path: Path) -> None:
    """Session `early`: the outcome-only sample is written, then the session goes on; the
    continuation's job judges the turn and supersedes that untrained sample. Session `late`:
    continued before the worker ran; the outcome-only job leaves the turn to the
    continuation's job, so the judge model judges it once."""
    key = create_user(db_url, "goes-on", scopes=[VERIFIER])[1]
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            client(proxy_url, key) as http:
        early = await ask(http, ASK, **{"X-Session-Id": "early"})
        late = await ask(http, ASK, **{"X-Session-Id": "late"})
        for session in ("early", "late"):
            posted = await http.post(f"/v1/sessions/{session}/outcome", json={"outcome": -1})
            assert posted.status_code == 200, posted.text
        await stored(db, 2)
        # Only early's job runs now: late's (the newer one) is held back.
        with db.begin() as conn:
            conn.exec_driver_sql("UPDATE jobs SET available_at = now() + interval '1 hour' "
                                 "WHERE id = (SELECT max(id) FROM jobs)")
        no_judge = NoJudge()
        await run_until(db_url, settings_for(db_url), no_judge,
                        lambda: [j.status for j in judge_jobs(db)] == ["done", "queued"])
        assert no_judge.calls == 0
        [outcome_only] = rows(db, "SELECT id, turn_id FROM samples")
        for session, reply in (("early", early), ("late", late)):
            await ask(http, [*ASK, reply, {"role": "user", "content": "Check again."}],
                      **{"X-Session-Id": session})
        await stored(db, 4)
    with db.begin() as conn:
        conn.exec_driver_sql("UPDATE jobs SET available_at = now()")
    judge = ScriptedJudge(prm=["\\boxed{1}"], hint=["[NO_HINT]"])
    await run_until(db_url, settings_for(db_url), judge, lambda: finished(db))
    jobs = judge_jobs(db)
    assert [(j.external_id, j.index_in_session, j.payload, j.status) for j in jobs] == [
        ("early", 0, {"outcome_only": True}, "done"), ("late", 0, {"outcome_only": True}, "done"),
        ("early", 0, {}, "done"), ("late", 0, {}, "done")]
    assert jobs[1].last_error == f"not judged: continued, judged by job {jobs[3].id}"
    late_turn = jobs[1].turn_id
    judgments = rows(db, "SELECT turn_id, reward FROM judgments ORDER BY id")
    assert judgments[0] == (outcome_only.turn_id, None)
    assert sorted(judgments[1:]) == sorted([(outcome_only.turn_id, 1), (late_turn, 1)])
    assert len(judge.requests) == 12  # two judged turns, 3 PRM + 3 hint votes each
    samples = rows(db, "SELECT turn_id, reward, skipped_reason FROM samples ORDER BY id")
    assert samples[0] == (outcome_only.turn_id, None, "superseded")
    assert sorted(samples[1:]) == sorted([(outcome_only.turn_id, 1, None), (late_turn, 1, None)])
