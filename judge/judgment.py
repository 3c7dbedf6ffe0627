"""Judging one turn and storing the verdict: the body of a judge job.

`judge_job` reads the turn, decides whether it is judged at all, runs the PRM votes and the
hint votes concurrently, computes teacher logprobs for an accepted hint, and writes — in ONE
transaction together with marking the job done — the `judgments` row and, for a trainable
turn, the `samples` row. If the job's lease was taken over meanwhile, nothing is written.

Never judged (job done, no judgment): user opted out of training, side turns.
Judged as skipped (judgment with reason, no votes, no sample): turn status not ok, empty
response, judge prompt over the judge's context. A reply cut off by the length limit is
judged and trained like any other: its tokens are what the model said, and a reply too long
is exactly the one a person complains about.

Outcome only: a session's final turn has no next state, so only its session's outcome says
how it went; the proxy enqueues its job with the `OUTCOME_ONLY` payload marker when the
outcome arrives (proxy/sessions.py). No judge model is asked: the judgment has reward NULL
and no votes, the sample carries no reward and no teacher, and the trainer trains it with
the session outcome alone. If the turn was continued after all, the job its continuation
enqueued judges it (superseding an untrained outcome-only sample); this one then ends
unjudged, or judges it normally when there is no such job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from clawrl.base.db import ChatSession, Feedback, Job, Judgment, Sample, Turn, User
from clawrl.base.jobs import OUTCOME_ONLY, ClaimedJob, complete_stmt
from judge.backends import ChatBackend
from judge.config import JudgeSettings
from judge.errors import JobInvalid, PromptTooLong, first_error
from judge.hints import HintResult, extract_hint, hint_from
from judge.prm import (
    PrmResult,
    greedy_with_alternatives,
    prm_from_distribution,
    prm_from_samples,
    sample_votes,
    score_turn,
)
from judge.prompts import (
    FeedbackItem,
    check_version,
    is_combined,
    render_fields,
    render_hint,
    render_judge,
    render_prm,
    score_first,
)
from judge.teacher import TeacherEngine, TeacherResult, compute_teacher_logprobs

log = logging.getLogger("clawrl.judge")


@dataclass(frozen=True)
class Outcome:
    """What a job ended as, for logs and tests."""

    action: str  # judged | outcome_only | skipped | not_judged | lease_lost
    judgment_id: int | None = None
    sample_id: int | None = None
    reward: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Verdict:
    prm: PrmResult | None
    hints: HintResult | None
    teacher: TeacherResult | None
    reason: str | None
    outcome_only: bool = False  # no judge asked: the session outcome is the only signal


OUTCOME_ONLY_REASON = "outcome only: the session's final turn has no next state"


def skip_reason(turn: Turn) -> str | None:
    """Why a continued main turn is judged as skipped, or None to judge it."""
    if turn.status != "ok":
        return f"skipped: turn status {turn.status}"
    if not turn.response_ids:
        return "skipped: empty response"
    return None


def sample_blocker(turn: Turn, reward: int | None, teacher: list[float] | None, *,
                   outcome_only: bool = False) -> str | None:
    """Why a judged turn gets no sample, or None when it is trainable. An outcome-only
    turn needs neither a reward nor a teacher: its session's outcome is the signal."""
    if reward is None and teacher is None and not outcome_only:
        return "no sample: no reward and no teacher logprobs"
    if not turn.prompt_ids or not turn.response_ids:
        return "no sample: token ids missing"
    if turn.response_logprobs is None or len(turn.response_logprobs) != len(turn.response_ids):
        return "no sample: rollout logprobs missing or misaligned"
    return None


async def load_turn(conn: AsyncConnection,
                    turn_id: int) -> tuple[Turn, bool, list[FeedbackItem]]:
    """The turn, whether its user opted out of training, and its explicit feedback."""
    table = Turn.__table__
    row = (await conn.execute(
        select(table, User.train_opt_out).join(User, User.id == table.c.user_id)
        .where(table.c.id == turn_id))).first()
    if row is None:
        raise JobInvalid(f"turn {turn_id} does not exist")
    feedback = (await conn.execute(
        select(Feedback.rating, Feedback.text).where(Feedback.turn_id == turn_id)
        .order_by(Feedback.created_at, Feedback.id))).all()
    turn = Turn(**{c.key: row._mapping[c] for c in table.columns})
    items = [FeedbackItem(rating=f.rating, text=f.text) for f in feedback]
    return turn, bool(row.train_opt_out), items


async def cast_votes(backend: ChatBackend, fields: Mapping[str, str], settings: JudgeSettings,
                     prompt_version: str) -> tuple[PrmResult, HintResult]:
    """The PRM and hint votes on one turn's rendered fields, all at once. A combined prompt
    version asks once: in `logprob` mode one greedy answer gives the drawn PRM votes and the
    one hint vote; in `sample` mode each of `votes` samples is a PRM and a hint vote."""
    if is_combined(prompt_version):
        prompt = render_judge(fields, prompt_version)
        leading = score_first(prompt_version)
        if settings.prm_mode == "logprob":
            answer = await greedy_with_alternatives(backend, prompt,
                                                    max_tokens=settings.max_tokens)
            return (prm_from_distribution(answer, prompt, votes=settings.votes,
                                          temperature=settings.temperature, leading=leading),
                    hint_from([answer], settings.min_hint_chars))
        answers = await sample_votes(backend, prompt, settings.votes,
                                     temperature=settings.temperature,
                                     max_tokens=settings.max_tokens)
        return (prm_from_samples(answers, leading=leading),
                hint_from(answers, settings.min_hint_chars))
    hint_temperature = (settings.temperature if settings.hint_temperature is None
                        else settings.hint_temperature)
    try:
        async with asyncio.TaskGroup() as tg:
            prm_task = tg.create_task(score_turn(
                backend, render_prm(fields, prompt_version), votes=settings.votes,
                temperature=settings.temperature, max_tokens=settings.max_tokens,
                mode=settings.prm_mode))
            hint_task = tg.create_task(extract_hint(
                backend, render_hint(fields, prompt_version), votes=settings.hint_votes,
                min_chars=settings.min_hint_chars, temperature=hint_temperature,
                max_tokens=settings.max_tokens))
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return prm_task.result(), hint_task.result()


async def run_judges(turn: Turn, feedback: list[FeedbackItem], *, settings: JudgeSettings,
                     backend: ChatBackend, teacher: TeacherEngine | None,
                     prompt_version: str) -> Verdict:
    fields = render_fields(turn.request_messages or [], turn.response_message, turn.next_state,
                           feedback)
    prm, hints = await cast_votes(backend, fields, settings, prompt_version)
    teacher_result: TeacherResult | None = None
    if hints.hint is not None and teacher is not None:
        teacher_result = await compute_teacher_logprobs(
            teacher, request_messages=turn.request_messages or [], tools=turn.tools,
            hint=hints.hint, response_ids=turn.response_ids or [], prompt_version=prompt_version)
    elif hints.hint is not None:
        teacher_result = TeacherResult(None, "teacher: disabled")
    return Verdict(prm=prm, hints=hints, teacher=teacher_result,
                   reason=teacher_result.reason if teacher_result else None)


async def store_verdict(conn: AsyncConnection, job: ClaimedJob, worker: str, turn: Turn,
                        verdict: Verdict, prompt_version: str) -> Outcome:
    """Judgment (+ sample) + job done, in the caller's transaction. Returns lease_lost
    (and the caller rolls back) when the job is no longer ours."""
    opted_out = (await conn.execute(
        select(User.train_opt_out).where(User.id == turn.user_id).with_for_update(read=True)
    )).scalar_one_or_none()
    if opted_out is None or opted_out:
        return await finish_unjudged(conn, job, worker, "not judged: user opted out of training")
    prm, hints, teacher = verdict.prm, verdict.hints, verdict.teacher
    reward = prm.reward if prm else None
    teacher_lp = teacher.logprobs if teacher else None
    # A skipped turn gets no sample for the skip reason; a judged one may lack a signal.
    if prm is None and not verdict.outcome_only:
        blocker = verdict.reason
    else:
        blocker = sample_blocker(turn, reward, teacher_lp, outcome_only=verdict.outcome_only)
    reason = "; ".join(r for r in dict.fromkeys((verdict.reason, blocker)) if r) or None
    judgment_id = (await conn.execute(insert(Judgment).values(
        turn_id=turn.id, prompt_version=prompt_version,
        judge_model=prm.judge_model if prm else None, reward=reward,
        votes=[v.as_json() for v in prm.votes] if prm else [],
        hint=hints.hint if hints else None,
        hint_votes=[v.as_json() for v in hints.votes] if hints else [],
        teacher_logprobs=teacher_lp,
        reason=reason,
    ).returning(Judgment.id))).scalar_one()
    # A newer judgment replaces an older one that the trainer has not used yet (rejudge).
    await conn.execute(update(Sample).where(
        Sample.turn_id == turn.id, Sample.trained_step.is_(None),
        Sample.skipped_reason.is_(None)).values(skipped_reason="superseded"))
    sample_id = None
    if blocker is None:
        sample_id = (await conn.execute(insert(Sample).values(
            turn_id=turn.id, judgment_id=judgment_id, user_id=turn.user_id,
            prompt_ids=turn.prompt_ids, response_ids=turn.response_ids,
            rollout_logprobs=turn.response_logprobs, weight_version=turn.weight_version,
            reward=reward, teacher_logprobs=teacher_lp,
        ).returning(Sample.id))).scalar_one()
    if (await conn.execute(complete_stmt(job.id, worker))).first() is None:
        return Outcome("lease_lost")
    action = ("outcome_only" if verdict.outcome_only
              else "skipped" if verdict.prm is None else "judged")
    return Outcome(action, judgment_id=judgment_id, sample_id=sample_id, reward=reward,
                   reason=blocker or verdict.reason)


async def finish_unjudged(conn: AsyncConnection, job: ClaimedJob, worker: str,
                          note: str) -> Outcome:
    if (await conn.execute(complete_stmt(job.id, worker, note=note))).first() is None:
        return Outcome("lease_lost")
    return Outcome("not_judged", reason=note)


async def session_outcome(conn: AsyncConnection, turn: Turn) -> float | None:
    if turn.session_id is None:
        return None
    outcome = (await conn.execute(select(ChatSession.outcome)
                                  .where(ChatSession.id == turn.session_id))).scalar()
    return None if outcome is None else float(outcome)


async def continuation_job(conn: AsyncConnection, job: ClaimedJob) -> int | None:
    """Another judge job of this outcome-only job's turn that is not outcome-only (the one
    the request continuing the turn enqueued), unless it failed."""
    found = (await conn.execute(
        select(Job.id).where(Job.turn_id == job.turn_id, Job.kind == "judge", Job.id != job.id,
                             Job.status.in_(("queued", "running", "done")),
                             Job.payload[OUTCOME_ONLY].astext.is_distinct_from("true"))
        .order_by(Job.id).limit(1))).scalar()
    return None if found is None else int(found)


async def judge_job(db: AsyncEngine, job: ClaimedJob, worker: str, *, settings: JudgeSettings,
                    backend: ChatBackend, teacher: TeacherEngine | None) -> Outcome:
    """Judge the job's turn and store the result. Raises JudgeError (or a DB error) on
    failure; the worker decides between retry and recorded failure."""
    if job.turn_id is None:
        raise JobInvalid("judge job without a turn_id")
    prompt_version = str(job.payload.get("prompt_version") or settings.prompt_version)
    try:
        check_version(prompt_version)
    except (FileNotFoundError, ValueError) as exc:
        raise JobInvalid(f"prompt version {prompt_version!r}: {exc}") from exc
    outcome_only = bool(job.payload.get(OUTCOME_ONLY))
    final_outcome: float | None = None
    async with db.connect() as conn:
        turn, opted_out, feedback = await load_turn(conn, job.turn_id)
        note = ("not judged: user opted out of training" if opted_out
                else f"not judged: {turn.kind} turn" if turn.kind != "main" else None)
        if note is None and outcome_only:
            if turn.next_state is None:
                final_outcome = await session_outcome(conn, turn)
            elif (other := await continuation_job(conn, job)) is not None:
                note = f"not judged: continued, judged by job {other}"
    if note is not None:
        async with db.begin() as conn:
            return await finish_unjudged(conn, job, worker, note)
    if turn.next_state is None and final_outcome is None:
        raise JobInvalid(f"turn {turn.id} has no next state"
                         + (" and its session no outcome" if outcome_only else ""))
    reason = skip_reason(turn)
    if reason is not None:
        verdict = Verdict(prm=None, hints=None, teacher=None, reason=reason)
    elif turn.next_state is None:  # the session's final turn: its outcome is the signal
        verdict = Verdict(prm=None, hints=None, teacher=None, reason=OUTCOME_ONLY_REASON,
                          outcome_only=True)
    else:
        try:
            verdict = await run_judges(turn, feedback, settings=settings, backend=backend,
                                       teacher=teacher if settings.teacher_enabled else None,
                                       prompt_version=prompt_version)
        except PromptTooLong as exc:  # a property of the turn: record it, do not retry
            verdict = Verdict(prm=None, hints=None, teacher=None,
                              reason=f"skipped: judge prompt too long ({exc})")
    async with db.connect() as conn:
        async with conn.begin() as tx:
            outcome = await store_verdict(conn, job, worker, turn, verdict, prompt_version)
            if outcome.action == "lease_lost":
                await tx.rollback()
    return outcome

