"""The Postgres job queue (judge jobs today).

Jobs are enqueued in the same transaction as the write that caused them: callers execute
`enqueue_stmt(...)` and `notify_stmt(...)` on their own connection/session, sync or async.
Workers claim with one statement (CTE + FOR UPDATE SKIP LOCKED + lease), see judge/worker.py.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Insert, TextClause, insert, text

from proxy.db import Job

# LISTEN/NOTIFY channel; the payload is the job kind.
JOB_CHANNEL = "clawrl_jobs"


def enqueue_stmt(kind: str, turn_id: int | None = None,
                 payload: dict[str, Any] | None = None) -> Insert:
    return insert(Job).values(kind=kind, turn_id=turn_id, payload=payload or {})


def notify_stmt(kind: str) -> TextClause:
    # Delivered at commit, so a worker never wakes for a job it cannot see yet.
    return text("SELECT pg_notify(:channel, :kind)").bindparams(channel=JOB_CHANNEL, kind=kind)
