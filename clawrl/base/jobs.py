"""The Postgres job queue (judge jobs today).

Jobs are enqueued in the same transaction as the write that caused them: callers execute
`enqueue_stmt(...)` and `notify_stmt(...)` on their own connection/session, sync or async.
Workers claim with one statement (CTE + FOR UPDATE SKIP LOCKED + lease) and finish a job
with `complete_stmt` / `retry_stmt` / `fail_stmt`, see judge/worker.py.

The claim is fair across users (`jobs.user_id`, the job's turn's user): a user's next job
waits behind the jobs the other users have fewer of in flight, so one user's burst of
conversations cannot hold back another user's judgment (see `_CLAIM_SQL`).

Job states: 'queued' → 'running' (leased until `available_at`) → 'done' | 'failed', or back
to 'queued' with a later `available_at` (retry with backoff). A running job whose lease
expired is claimable again, so a killed worker's jobs are never lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Insert, TextClause, insert, select, text

from clawrl.base.db import Job, Turn

# LISTEN/NOTIFY channel; the payload is the job kind.
JOB_CHANNEL = "clawrl_jobs"
# Payload key of a judge job enqueued because the turn's session got an outcome: the turn
# is the session's final one and had no next state (proxy/sessions.py, judge/judgment.py).
OUTCOME_ONLY = "outcome_only"


def enqueue_stmt(kind: str, turn_id: int | None = None,
                 payload: dict[str, Any] | None = None, user_id: int | None = None) -> Insert:
    """Insert one job. Its owner (`jobs.user_id`, what the fair claim shares by) is `user_id`,
    else the turn's user, else none (a job of no user is claimed as one more user)."""
    owner: Any = user_id
    if owner is None and turn_id is not None:
        owner = select(Turn.user_id).where(Turn.id == turn_id).scalar_subquery()
    return insert(Job).values(kind=kind, turn_id=turn_id, payload=payload or {}, user_id=owner)


def notify_stmt(kind: str) -> TextClause:
    # Delivered at commit, so a worker never wakes for a job it cannot see yet.
    return text("SELECT pg_notify(:channel, :kind)").bindparams(channel=JOB_CHANNEL, kind=kind)


@dataclass(frozen=True)
class ClaimedJob:
    id: int
    kind: str
    turn_id: int | None
    payload: dict[str, Any]
    attempts: int  # including this one
    max_attempts: int


# One statement: lock up to :limit claimable rows nobody else holds (SKIP LOCKED), lease
# them. `available_at` is the backoff time of a queued job and the lease deadline of a running
# one, hence one predicate (`available_at <= now()`) covers both.
#
# Fair across users (NULL owner: one more user, 0). Each user's claimable jobs are numbered
# oldest first, starting after the jobs the user already has in flight (running under a live
# lease); the claim takes the lowest numbers first, then the oldest. A user with 60 jobs
# queued and 8 running waits behind another user's first job, whenever it arrived.
#   owners: the users with claimable jobs, one index probe each (a loose index scan of
#     ix_jobs_claimable_owner), so the claim does not read every queued job;
#   heads:  each owner's oldest :limit claimable jobs, numbered (same index), the first
#     2 × :limit of them in fair order;
#   busy:   jobs in flight per user (ix_jobs_claimable: `available_at > now()`);
#   fair:   the heads in fair order, locked (SKIP LOCKED);
#   rest:   when another worker holds heads this claim wanted, the oldest other claimable
#     jobs (ix_jobs_claimable) fill the claim, so a worker never comes back empty while
#     unlocked jobs are claimable.
# The locking scans re-check status and available_at, so a job another worker claimed and
# committed meanwhile is not taken twice. The UPDATE finds the locked rows by primary key.
_CLAIM_SQL = """
WITH RECURSIVE owners(owner) AS (
    (SELECT coalesce(user_id, 0) FROM jobs
     WHERE kind = :kind AND status IN ('queued', 'running') AND available_at <= now()
     ORDER BY coalesce(user_id, 0) LIMIT 1)
    UNION ALL
    SELECT (SELECT coalesce(j.user_id, 0) FROM jobs j
            WHERE j.kind = :kind AND j.status IN ('queued', 'running')
              AND j.available_at <= now() AND coalesce(j.user_id, 0) > o.owner
            ORDER BY coalesce(j.user_id, 0) LIMIT 1)
    FROM owners o WHERE o.owner IS NOT NULL
),
busy AS (
    SELECT coalesce(user_id, 0) AS owner, count(*) AS n FROM jobs
    WHERE kind = :kind AND status IN ('queued', 'running') AND available_at > now()
      AND status = 'running'
    GROUP BY 1
),
heads AS (
    SELECT h.id, h.available_at,
           coalesce(b.n, 0) + row_number() OVER (
               PARTITION BY o.owner ORDER BY h.available_at, h.id) AS turn
    FROM owners o
    CROSS JOIN LATERAL (
        SELECT id, available_at FROM jobs
        WHERE kind = :kind AND status IN ('queued', 'running') AND available_at <= now()
          AND coalesce(user_id, 0) = o.owner
        ORDER BY available_at, id
        LIMIT :limit
    ) h
    LEFT JOIN busy b ON b.owner = o.owner
    WHERE o.owner IS NOT NULL
    ORDER BY turn, h.available_at, h.id
    LIMIT 2 * :limit
),
fair AS MATERIALIZED (
    SELECT j.id FROM jobs j JOIN heads h ON h.id = j.id
    WHERE j.status IN ('queued', 'running') AND j.available_at <= now()
    ORDER BY h.turn, h.available_at, h.id
    LIMIT :limit
    FOR UPDATE OF j SKIP LOCKED
),
rest AS MATERIALIZED (
    SELECT id FROM jobs
    WHERE kind = :kind AND status IN ('queued', 'running') AND available_at <= now()
      AND id NOT IN (SELECT id FROM fair)
    ORDER BY available_at, id
    LIMIT greatest(:limit - (SELECT count(*) FROM fair), 0)
    FOR UPDATE SKIP LOCKED
),
claimable AS (SELECT id FROM fair UNION ALL SELECT id FROM rest)
UPDATE jobs AS j
SET status = 'running', attempts = j.attempts + 1,
    available_at = now() + make_interval(secs => :lease_s), locked_by = :worker
WHERE j.id = ANY(ARRAY(SELECT id FROM claimable))
RETURNING j.id, j.kind, j.turn_id, j.payload, j.attempts, j.max_attempts
"""


def claim_stmt(kind: str, worker: str, limit: int, lease_s: float) -> TextClause:
    """Claim and lease up to `limit` jobs of `kind` for `worker` (rows → `ClaimedJob`)."""
    return text(_CLAIM_SQL).bindparams(kind=kind, worker=worker, limit=limit,
                                       lease_s=float(lease_s))


def claimed_job(row: Any) -> ClaimedJob:
    return ClaimedJob(id=row.id, kind=row.kind, turn_id=row.turn_id, payload=row.payload or {},
                      attempts=row.attempts, max_attempts=row.max_attempts)


# The `locked_by = :worker AND status = 'running'` guard makes finishing a job whose lease
# was taken over by another worker a no-op (0 rows): the caller then rolls back its results.
def complete_stmt(job_id: int, worker: str, note: str | None = None) -> TextClause:
    """Done. `note` (kept in last_error) says why a job ended without a result."""
    return text(
        "UPDATE jobs SET status = 'done', finished_at = now(), locked_by = NULL, "
        "last_error = :note WHERE id = :id AND locked_by = :worker AND status = 'running' "
        "RETURNING id"
    ).bindparams(id=job_id, worker=worker, note=note)


def retry_stmt(job_id: int, worker: str, delay_s: float, error: str, *,
               counted: bool = True) -> TextClause:
    """Back to the queue, claimable again after `delay_s` (the backoff). `counted=False`: the
    attempt the claim counted is given back (an outage of the endpoint, not the job's fault)."""
    give_back = "" if counted else "attempts = greatest(attempts - 1, 0), "
    return text(
        "UPDATE jobs SET status = 'queued', available_at = now() + make_interval(secs => :d), "
        f"{give_back}locked_by = NULL, last_error = :err "
        "WHERE id = :id AND locked_by = :worker AND status = 'running' RETURNING id"
    ).bindparams(id=job_id, worker=worker, d=float(delay_s), err=error)


def fail_stmt(job_id: int, worker: str | None, error: str) -> TextClause:
    """Record a permanent failure (never silently dropped). worker=None: unconditional."""
    guard = "" if worker is None else " AND locked_by = :worker AND status = 'running'"
    stmt = text(
        "UPDATE jobs SET status = 'failed', finished_at = now(), locked_by = NULL, "
        f"last_error = :err WHERE id = :id{guard} RETURNING id"
    )
    params: dict[str, Any] = {"id": job_id, "err": error}
    if worker is not None:
        params["worker"] = worker
    return stmt.bindparams(**params)


def extend_lease_stmt(job_id: int, worker: str, lease_s: float) -> TextClause:
    """Heartbeat: push the lease deadline of a job this worker still holds."""
    return text(
        "UPDATE jobs SET available_at = now() + make_interval(secs => :lease_s) "
        "WHERE id = :id AND locked_by = :worker AND status = 'running' RETURNING id"
    ).bindparams(id=job_id, worker=worker, lease_s=float(lease_s))
