"""The claim statement: one SQL statement, SKIP LOCKED, leases, attempts, the index, fair
across users."""

from __future__ import annotations

import threading
import time

from judgedb import add_turn, add_user, jobs, rows
from sqlalchemy import Engine, text

from clawrl.base.jobs import (
    claim_stmt,
    claimed_job,
    complete_stmt,
    enqueue_stmt,
    fail_stmt,
    retry_stmt,
)


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
    users = [add_user(db) for _ in range(50)]
    with db.begin() as conn:
        # A tenth queued, spread over 50 users and jobs of no user; the rest done.
        conn.execute(text(
            "INSERT INTO jobs (kind, payload, status, user_id) SELECT 'judge', '{}', "
            "CASE WHEN g % 10 = 0 THEN 'queued' ELSE 'done' END, "
            "CASE WHEN g % 7 = 0 THEN NULL ELSE (:users)[1 + (g / 10) % 50] END "
            "FROM generate_series(1, 20000) g"), {"users": users})
        conn.execute(text("ANALYZE jobs"))
    stmt = claim_stmt("judge", "w", 4, 60.0).compile(
        compile_kwargs={"literal_binds": True})
    plan = "\n".join(r[0] for r in rows(db, f"EXPLAIN {stmt}"))
    assert "ix_jobs_claimable " in plan, plan  # in flight per user; the fallback
    assert "ix_jobs_claimable_owner" in plan, plan  # the users, each one's oldest
    assert "Seq Scan on jobs" not in plan, plan
    claimed = claim(db, "w", limit=8)
    assert len(claimed) == 8
    owners = rows(db, "SELECT coalesce(user_id, 0) AS owner FROM jobs WHERE id = ANY(:ids)",
                  ids=claimed)
    assert len({r.owner for r in owners}) == 8  # eight users' oldest, not one user's eight


def test_enqueued_jobs_carry_their_turns_user(db: Engine) -> None:
    user = add_user(db)
    add_turn(db, user)
    with db.begin() as conn:
        conn.execute(enqueue_stmt("judge"))  # no turn: no user
    assert [j.user_id for j in jobs(db)] == [user, None]


def test_one_users_burst_does_not_hold_back_another_users_job(db: Engine) -> None:
    """60 jobs of one user queued, then one of another: it is among the first claims, and
    again when the first user already has jobs in flight."""
    loud, quiet = add_user(db), add_user(db)
    for _ in range(60):
        add_turn(db, loud)
    first = add_turn(db, quiet)
    [quiet_job] = [j.id for j in jobs(db) if j.turn_id == first]
    assert quiet_job in claim(db, "w", limit=4)

    # The loud user has 4 jobs in flight now; a later job of the quiet user still goes first,
    # ahead of the loud user's older ones, even one job at a time.
    second = add_turn(db, quiet)
    [quiet_job] = [j.id for j in jobs(db) if j.turn_id == second]
    assert claim(db, "w", limit=1) == [quiet_job]
    # With no other user waiting, the loud user's jobs are claimed (oldest first).
    loud_jobs = [j.id for j in jobs(db) if j.status == "queued"]
    assert sorted(claim(db, "w", limit=3)) == loud_jobs[:3]


def test_users_take_turns_and_a_finished_job_frees_the_users_turn(db: Engine) -> None:
    a, b, c = add_user(db), add_user(db), add_user(db)
    for user in (a, a, a, a, b, b, b, c):
        add_turn(db, user)
    owner = {j.id: j.user_id for j in jobs(db)}
    got = claim(db, "w", limit=5)  # each user's first, then the second ones
    assert sorted(owner[i] for i in got) == [a, a, b, b, c]
    with db.begin() as conn:  # a's jobs finish; b's second is still running
        for job_id in got:
            if owner[job_id] == a:
                conn.execute(complete_stmt(job_id, "w"))
    # a: none in flight, 2 queued; b: 2 in flight, 1 queued: a's come first.
    assert [owner[i] for i in claim(db, "w", limit=2)] == [a, a]
    assert [owner[i] for i in claim(db, "w", limit=2)] == [b]


def test_heads_held_by_another_transaction_do_not_leave_the_claim_empty(db: Engine) -> None:
    user = add_user(db)
    for _ in range(5):
        add_turn(db, user)
    ids = [j.id for j in jobs(db)]
    with db.connect() as other:  # another worker mid-claim holds the two oldest
        other.begin()
        other.execute(text("SELECT id FROM jobs WHERE id = ANY(:ids) FOR UPDATE"),
                      {"ids": ids[:4]})
        assert claim(db, "w", limit=1) == [ids[4]]
        other.rollback()
    assert claim(db, "w", limit=4) == ids[:4]


def test_concurrent_workers_with_many_users_claim_every_job_once(db: Engine) -> None:
    users = [add_user(db) for _ in range(4)]
    for i in range(48):
        add_turn(db, users[i % 4] if i % 3 else users[0])
    claimed: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def work(name: str) -> None:
        while got := claim(db, name, limit=2):
            claimed[name] += got

    threads = [threading.Thread(target=work, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for got in claimed.values() for i in got]
    assert sorted(everything) == sorted(j.id for j in jobs(db))
    assert {j.attempts for j in jobs(db)} == {1}
