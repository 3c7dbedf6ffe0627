"""The console's reads: each page's query, index-backed (tests/console/test_queries.py runs
EXPLAIN on them), on the async engine the proxy already holds.

Turns are listed newest first by id (the primary key) with keyset paging (`before` an id),
never OFFSET; a turn's latest judgment is one lookup on `judgments.turn_id`. Counts over the
whole log come from the reward tally (proxy/console/tally.py), never from count(*).
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

PAGE_SIZE = 50
REWARD_FILTERS = ("1", "0", "-1", "abstained", "unjudged")


async def served_adapter_version(conn: AsyncConnection) -> str | None:
    """The shared model's served version when it is a LoRA adapter (the newest published
    version names one, trainer/policy_adapter.py): the engine's own weight_version then
    names the base it serves. None: the engine's label is the served version."""
    row = (await conn.execute(text(
        "SELECT version, adapter FROM policy_versions WHERE status = 'published' "
        "ORDER BY version DESC LIMIT 1"))).first()
    return str(row.version) if row is not None and row.adapter is not None else None


@dataclass(frozen=True)
class TurnFilter:
    user: str | None = None
    session: uuid.UUID | None = None
    version: str | None = None
    reward: str | None = None  # one of REWARD_FILTERS
    has_hint: bool | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    before: int | None = None  # keyset paging: turns with a smaller id


# The overview's queries, by name (tests/console/test_console_queries.py EXPLAINs each).
OVERVIEW = {
    "turns_last_minute": text(
        "SELECT count(*) FROM turns WHERE created_at > now() - interval '60 seconds'"),
    "judge_backlog": text("SELECT count(*) FROM jobs WHERE status IN ('queued', 'running')"),
    # From the moment the next state arrived to the judgment, over the last 200 judgments.
    "reward_latency": text("""
        SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY s), count(*)
        FROM (SELECT extract(epoch FROM j.created_at - t.next_state_at) AS s
              FROM (SELECT turn_id, created_at FROM judgments ORDER BY id DESC LIMIT 200) j
              JOIN turns t ON t.id = j.turn_id WHERE t.next_state_at IS NOT NULL) x
    """),
    "trainer_step": text(
        "SELECT step, version, status, loss, reward_mean, num_samples, created_at "
        "FROM training_steps ORDER BY step DESC LIMIT 1"),
    "published": text(
        "SELECT version, published_at FROM policy_versions WHERE status = 'published' "
        "ORDER BY published_at DESC NULLS LAST LIMIT 1"),
    "latest_turn": text("SELECT max(id) FROM turns"),
}


async def overview(conn: AsyncConnection) -> dict[str, Any]:
    """The overview's numbers that come from the database."""
    q = OVERVIEW
    lat = (await conn.execute(q["reward_latency"])).one()
    step = (await conn.execute(q["trainer_step"])).mappings().first()
    published = (await conn.execute(q["published"])).mappings().first()
    return {"turns_last_minute": (await conn.execute(q["turns_last_minute"])).scalar_one(),
            "judge_backlog": (await conn.execute(q["judge_backlog"])).scalar_one(),
            "reward_latency_p50_s": lat[0], "reward_latency_p95_s": lat[1],
            "reward_latency_n": lat[2],
            "trainer_step": dict(step) if step else None,
            "published": dict(published) if published else None,
            "latest_turn_id": (await conn.execute(q["latest_turn"])).scalar()}


_TURN_COLUMNS = """
    t.id, t.created_at, u.name AS user_name, t.session_id, t.index_in_session, t.kind,
    t.status, t.state, t.weight_version, t.latency_ms,
    cardinality(t.response_ids) AS response_tokens,
    left(t.request_messages -> -1 ->> 'content', 160) AS last_message,
    left(t.response_message ->> 'content', 160) AS reply,
    j.id AS judgment_id, j.reward, j.hint IS NOT NULL AS has_hint
"""
_LATEST_JUDGMENT = """
    LEFT JOIN LATERAL (SELECT jj.id, jj.reward, jj.hint FROM judgments jj
                       WHERE jj.turn_id = t.id ORDER BY jj.id DESC LIMIT 1) j ON true
"""


def turns_query(f: TurnFilter, limit: int = PAGE_SIZE) -> tuple[str, dict[str, Any]]:
    """The list's SQL and parameters for a filter."""
    where: list[str] = ["true"]
    params: dict[str, Any] = {"limit": limit}
    if f.user is not None:
        where.append("t.user_id = (SELECT id FROM users WHERE name = :user)")
        params["user"] = f.user
    if f.session is not None:
        where.append("t.session_id = :session")
        params["session"] = f.session
    if f.version is not None:
        # Bounded by the version's first and last turn (ix_turns_version_id), like time below.
        where.append("t.weight_version = :version AND t.id BETWEEN (SELECT min(id) FROM turns "
                     "WHERE weight_version = :version) AND (SELECT max(id) FROM turns "
                     "WHERE weight_version = :version)")
        params["version"] = f.version
    # A version or a time range also bounds the ids (found on its index), so the newest-
    # first walk of the primary key starts and stops at the range's ends instead of
    # filtering every newer row (the planner assumes matching rows are spread evenly over
    # the table; in a log they are bunched in time). A time bound is the extreme id among
    # the 100 turns nearest it in time: ids and times agree but for transactions in flight
    # together, which the 100 cover.
    if f.since is not None:
        where.append("t.created_at >= :since AND t.id >= (SELECT min(id) FROM (SELECT id "
                     "FROM turns WHERE created_at >= :since ORDER BY created_at LIMIT 100) b)")
        params["since"] = f.since
    if f.until is not None:
        where.append("t.created_at < :until AND t.id <= (SELECT max(id) FROM (SELECT id "
                     "FROM turns WHERE created_at < :until ORDER BY created_at DESC LIMIT 100) b)")
        params["until"] = f.until
    if f.before is not None:
        where.append("t.id < :before")
        params["before"] = f.before
    if f.reward in ("1", "0", "-1"):
        where.append("j.reward = :reward")
        params["reward"] = int(f.reward)
    elif f.reward == "abstained":
        where.append("j.id IS NOT NULL AND j.reward IS NULL")
    elif f.reward == "unjudged":
        where.append("j.id IS NULL")
    if f.has_hint is not None:
        where.append("j.hint IS NOT NULL" if f.has_hint else "j.hint IS NULL")
    sql = (f"SELECT {_TURN_COLUMNS} FROM turns t JOIN users u ON u.id = t.user_id "
           f"{_LATEST_JUDGMENT} WHERE {' AND '.join(where)} ORDER BY t.id DESC LIMIT :limit")
    return sql, params


async def list_turns(conn: AsyncConnection, f: TurnFilter,
                     limit: int = PAGE_SIZE) -> list[dict[str, Any]]:
    sql, params = turns_query(f, limit)
    return [dict(r) for r in (await conn.execute(text(sql), params)).mappings()]


# A turn's page: the turn, its judgments, feedback and training samples, each by turn id.
TURN = {
    "turn": text("""
        SELECT t.*, u.name AS user_name, s.external_id AS session_external_id
        FROM turns t JOIN users u ON u.id = t.user_id
        LEFT JOIN sessions s ON s.id = t.session_id WHERE t.id = :id
    """),
    "judgments": text("SELECT * FROM judgments WHERE turn_id = :id ORDER BY id DESC"),
    "feedback": text(
        "SELECT rating, text, created_at FROM feedback WHERE turn_id = :id ORDER BY id"),
    "samples": text(
        "SELECT s.id, s.judgment_id, s.reward, s.rollout_logprobs, s.teacher_logprobs, "
        "s.trained_step, s.skipped_reason, s.created_at, ts.version AS trained_version "
        "FROM samples s LEFT JOIN training_steps ts ON ts.step = s.trained_step "
        "WHERE s.turn_id = :id ORDER BY s.id DESC"),
}


async def get_turn(conn: AsyncConnection, turn_id: int) -> dict[str, Any] | None:
    """A turn in full, its judgments (newest first), feedback and training samples."""
    turn = (await conn.execute(TURN["turn"], {"id": turn_id})).mappings().first()
    if turn is None:
        return None
    found: dict[str, Any] = {"turn": dict(turn)}
    for part in ("judgments", "feedback", "samples"):
        rows = (await conn.execute(TURN[part], {"id": turn_id})).mappings().all()
        found[part] = [dict(r) for r in rows]
    return found


async def list_versions(conn: AsyncConnection) -> list[dict[str, Any]]:
    rows = (await conn.execute(text(
        "SELECT version, step, status, num_samples, loss, reward_mean, created_at, "
        "published_at, stats -> 'gate' AS gate FROM policy_versions "
        "ORDER BY version DESC"))).mappings().all()
    return [dict(r) for r in rows]


LAST_TURN_BY_USER = text("""
    SELECT u.id, t.created_at FROM users u
    LEFT JOIN LATERAL (SELECT created_at FROM turns WHERE user_id = u.id
                       ORDER BY created_at DESC LIMIT 1) t ON true
""")


async def last_turn_by_user(conn: AsyncConnection) -> dict[int, dt.datetime]:
    """Each user's latest turn time: one backward step on (user_id, created_at) per user."""
    rows = (await conn.execute(LAST_TURN_BY_USER)).all()
    return {r[0]: r[1] for r in rows if r[1] is not None}
