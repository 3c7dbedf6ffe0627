"""The Postgres job queue (judge jobs today).

Jobs are enqueued in the same transaction as the write that caused them: callers execute
`enqueue_stmt(...)` and `notify_stmt(...)` on their own connection/session, sync or async.
Workers claim with one statement (CTE + FOR UPDATE SKIP LOCKED + lease) and finish a job
with `complete_stmt` / `retry_stmt` / `fail_stmt`, see judge/worker.py.

Job states: 'queued' → 'running' (leased until `available_at`) → 'done' | 'failed', or back
to 'queued' with a later `available_at` (retry with backoff). A running job whose lease
expired is claimable again, so a killed worker's jobs are never lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Insert, TextClause, insert, text

from clawrl.base.db import Job

# LISTEN/NOTIFY channel; the payload is the job kind.
JOB_CHANNEL = "clawrl_jobs"
# Payload key of a judge job enqueued because the turn's session got an outcome: the turn
# is the session's final one and had no next state (proxy/sessions.py, judge/judgment.py).
OUTCOME_ONLY = "outcome_only"


def enqueue_stmt(kind: str, turn_id: int | None = None,
                 payload: dict[str, Any] | None = None) -> Insert:
    return insert(Job).values(kind=kind, turn_id=turn_id, payload=payload or {})


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
# them. The WHERE/ORDER BY match the partial index ix_jobs_claimable (kind, available_at, id)
# WHERE status IN ('queued', 'running'), so the claim stays an index scan with a million
# queued jobs. `available_at` is the backoff time of a queued job and the lease deadline of
# a running one, hence one predicate covers both.
_CLAIM_SQL = """
WITH claimable AS (
    SELECT id FROM jobs
    WHERE kind = :kind AND status IN ('queued', 'running') AND available_at <= now()
    ORDER BY available_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs AS j
SET status = 'running', attempts = j.attempts + 1,
    available_at = now() + make_interval(secs => :lease_s), locked_by = :worker
FROM claimable
WHERE j.id = claimable.id
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
