"""The claim statement: one SQL statement, SKIP LOCKED, leases, attempts, the index."""

from __future__ import annotations

import threading
import time

from judgedb import add_turn, add_user, jobs, rows
from sqlalchemy import Engine, text

from clawrl.base.jobs import claim_stmt, claimed_job, complete_stmt, fail_stmt, retry_stmt


def claim(db: Engine, worker: str, limit: int = 1, lease_s: float = 60.0) -> list[int]:
    with db.begin() as conn:
        return [claimed_job(r).id for r in conn.execute(
            claim_stmt("judge", worker, limit, lease_s)).all()]


def test_two_concurrent_workers_never_claim_the_same_job(db: Engine) -> None:
    user = add_user(db)
    for _ in range(60):
        add_turn(db, user)
    claimed: dict[str, list[int]] = {"a": [], "b": []}

    def work(name: str) -> None:
        while got := claim(db, name, limit=3):
            claimed[name] += got
            time.sleep(0.001)  # let the other worker interleave

    threads = [threading.Thread(target=work, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = claimed["a"] + claimed["b"]
    assert len(everything) == len(set(everything)) == 60
    assert claimed["a"] and claimed["b"]
    assert {j.status for j in jobs(db)} == {"running"}
    assert {j.attempts for j in jobs(db)} == {1}


def test_expired_lease_comes_back_and_the_old_holder_cannot_finish_it(db: Engine) -> None:
    add_turn(db, add_user(db))
    [job_id] = claim(db, "killed", lease_s=0.2)
    assert claim(db, "other") == []  # leased
    time.sleep(0.3)
    assert claim(db, "other") == [job_id]  # the lease expired: nothing is lost
    [job] = jobs(db)
    assert (job.attempts, job.locked_by) == (2, "other")
    with db.begin() as conn:  # the killed worker comes back to life: a no-op
        assert conn.execute(complete_stmt(job_id, "killed")).first() is None
        assert conn.execute(complete_stmt(job_id, "other")).first() is not None
    assert jobs(db)[0].status == "done"


def test_retry_waits_for_its_backoff_and_failure_is_recorded(db: Engine) -> None:
    user = add_user(db)
    add_turn(db, user)
    [job_id] = claim(db, "w")
    with db.begin() as conn:
        conn.execute(retry_stmt(job_id, "w", 0.3, "BackendUnavailable: down"))
    assert claim(db, "w") == []  # backing off
    time.sleep(0.4)
    assert claim(db, "w") == [job_id]
    with db.begin() as conn:
        conn.execute(fail_stmt(job_id, "w", "BackendRejected: 401"))
    [job] = jobs(db)
    assert (job.status, job.last_error, job.attempts) == ("failed", "BackendRejected: 401", 2)
    assert job.finished_at is not None
    assert claim(db, "w") == []


def test_claim_is_an_index_scan_on_ix_jobs_claimable(db: Engine) -> None:
    with db.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (kind, payload, status) SELECT 'judge', '{}', "
            "CASE WHEN g % 10 = 0 THEN 'queued' ELSE 'done' END "
            "FROM generate_series(1, 20000) g"))
        conn.execute(text("ANALYZE jobs"))
    stmt = claim_stmt("judge", "w", 4, 60.0).compile(
        compile_kwargs={"literal_binds": True})
    plan = "\n".join(r[0] for r in rows(db, f"EXPLAIN {stmt}"))
    assert "ix_jobs_claimable" in plan, plan
    assert "Seq Scan on jobs" not in plan, plan
