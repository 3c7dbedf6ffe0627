"""The judge worker process: claims judge jobs and runs them concurrently.

Run: `clawrl judge [--concurrency N] [--name NAME]` (settings: `CLAWRL_JUDGE__…`, see
judge/config.py), or `clawrl judge rejudge --since ISO --prompt-version V` (judge/rejudge.py).

Loop: LISTEN on clawrl.base.jobs.JOB_CHANNEL (NOTIFY is sent in the enqueueing transaction, so a
new job starts within a second), with a short poll as fallback (backoffs and expired
leases of killed workers come back by time, not by notification). Up to `concurrency` jobs
run at once; each holds a lease that a heartbeat keeps extending while it runs.
A job ends as done (results written in the same transaction), retried with exponential
backoff (transient error), or failed with its reason (permanent error, or attempts spent).
When nothing can connect to the judge or teacher endpoint (it is down or restarting), the job
goes back without spending an attempt and the worker pauses its claims (`put_back`): an
outage delays judging, it never fails the turns queued behind it.
SIGTERM/SIGINT: stop claiming, finish the jobs in flight, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid

import httpx
import psycopg
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import create_async, libpq_url
from clawrl.base.engine_client import EngineClient
from clawrl.base.jobs import (
    JOB_CHANNEL,
    ClaimedJob,
    claim_stmt,
    claimed_job,
    extend_lease_stmt,
    fail_stmt,
    retry_stmt,
)
from clawrl.base.settings import EngineSettings
from judge.backends import ChatBackend, build_judge_backend, http_client
from judge.config import (
    JudgeProcessSettings,
    JudgeSettings,
    describe_settings_error,
    load_judge_settings,
)
from judge.errors import BackendUnreachable, JudgeError
from judge.judgment import judge_job
from judge.teacher import TeacherEngine

log = logging.getLogger("clawrl.judge")
JOB_KIND = "judge"


def backoff_s(attempts: int, settings: JudgeSettings) -> float:
    """Exponential backoff after the `attempts`-th failed attempt: base, 2·base, 4·base, …"""
    return float(min(settings.backoff_max_s, settings.backoff_base_s * 2 ** max(0, attempts - 1)))


def attempt_cap(job: ClaimedJob, settings: JudgeSettings) -> int:
    return min(job.max_attempts, settings.max_attempts)


def teacher_client(settings: JudgeSettings, engine: EngineSettings,
                   transport: httpx.AsyncBaseTransport | None = None) -> EngineClient:
    """The teacher engine's client: the policy engine (with its key) unless a teacher URL is
    set."""
    url = settings.teacher_url or engine.url
    key = engine.api_key if settings.teacher_url is None else None
    return EngineClient(url, api_key=key.get_secret_value() if key else None,
                        timeout=httpx.Timeout(settings.teacher_timeout_s,
                                              connect=settings.connect_timeout_s),
                        transport=transport, max_connections=settings.backend_concurrency * 2)


class Worker:
    """One judge worker process: a claim loop, a listener and the jobs in flight."""

    def __init__(self, settings: JudgeProcessSettings, db: AsyncEngine, db_url: str, *,
                 name: str | None = None, concurrency: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 teacher_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings.judge
        self.engine_settings = settings.engine
        self.db = db
        self.db_url = db_url
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.concurrency = concurrency or self.settings.concurrency
        # Injected transports (tests: a scripted remote judge, faults); None = the network.
        self.transport = transport
        self.teacher_transport = teacher_transport
        self.wake = asyncio.Event()
        self.inflight: set[asyncio.Task[None]] = set()
        # An outage of the judge or teacher endpoint (nothing could connect): claims pause
        # until `resume_at` (time.monotonic()), for longer each time it is still down.
        self.outages = 0
        self.resume_at = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set, then finish the jobs in flight and return."""
        s = self.settings
        async with http_client(s.timeout_s, s.connect_timeout_s,
                               max_connections=s.backend_concurrency * 2,
                               transport=self.transport) as client:
            backend = build_judge_backend(s, self.engine_settings, client)
            teacher_client = self.build_teacher()
            teacher = None if teacher_client is None else TeacherEngine(
                teacher_client, concurrency=s.backend_concurrency)
            listener = asyncio.create_task(self.listen(stop))
            log.info("worker started", extra={"action": "worker_start", "worker": self.name,
                                              "concurrency": self.concurrency})
            try:
                await self.claim_loop(stop, backend, teacher)
            finally:
                if self.inflight:
                    log.info("draining", extra={"action": "worker_drain",
                                                "inflight": len(self.inflight)})
                    await asyncio.gather(*self.inflight, return_exceptions=True)
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
                if teacher_client is not None:
                    await teacher_client.aclose()
        log.info("worker stopped", extra={"action": "worker_stop", "worker": self.name})

    def build_teacher(self) -> EngineClient | None:
        """The teacher engine's client: the policy engine unless a teacher URL is set."""
        if not self.settings.teacher_enabled:
            return None
        return teacher_client(self.settings, self.engine_settings, self.teacher_transport)

    async def claim_loop(self, stop: asyncio.Event, backend: ChatBackend,
                         teacher: TeacherEngine | None) -> None:
        while not stop.is_set():
            # Cleared before claiming, so a NOTIFY that lands during the claim is not lost.
            self.wake.clear()
            paused = self.resume_at - time.monotonic()
            free = self.concurrency - len(self.inflight) if paused <= 0 else 0
            jobs: list[ClaimedJob] = []
            if free > 0:
                try:
                    jobs = await self.claim(free)
                except Exception as exc:  # the database is down: try again after the poll
                    log.warning("claim failed: %s", exc, extra={"action": "claim_error"})
            for job in jobs:
                task = asyncio.create_task(self.process(job, backend, teacher))
                self.inflight.add(task)
                task.add_done_callback(self._job_finished)
            if jobs and len(jobs) == free:
                continue  # maybe more waiting; claim again as soon as a slot frees
            waiters = [asyncio.create_task(self.wake.wait()), asyncio.create_task(stop.wait())]
            poll = self.settings.poll_interval_s
            await asyncio.wait(waiters, timeout=min(poll, paused) if paused > 0 else poll,
                               return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    def _job_finished(self, task: asyncio.Task[None]) -> None:
        self.inflight.discard(task)
        self.wake.set()

    async def claim(self, limit: int) -> list[ClaimedJob]:
        async with self.db.begin() as conn:
            rows = (await conn.execute(
                claim_stmt(JOB_KIND, self.name, limit, self.settings.lease_s))).all()
        return [claimed_job(r) for r in rows]

    async def listen(self, stop: asyncio.Event) -> None:
        """Set `wake` on every NOTIFY; reconnect after a lost connection."""
        while not stop.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                        libpq_url(self.db_url), autocommit=True) as conn:
                    await conn.execute(f"LISTEN {JOB_CHANNEL}")
                    async for _ in conn.notifies():
                        self.wake.set()
            except (OSError, psycopg.Error) as exc:
                log.warning("listen failed: %s", exc, extra={"action": "listen_error"})
                await asyncio.sleep(self.settings.poll_interval_s)

    async def heartbeat(self, job: ClaimedJob) -> None:
        """Keep extending the lease of a running job (a killed worker stops doing this)."""
        interval = self.settings.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                async with self.db.begin() as conn:
                    await conn.execute(extend_lease_stmt(job.id, self.name,
                                                         self.settings.lease_s))
            except Exception as exc:  # keep beating; the next one may get through
                log.warning("lease extension failed: %s", exc,
                            extra={"action": "lease_error", "job_id": job.id})

    async def process(self, job: ClaimedJob, backend: ChatBackend,
                      teacher: TeacherEngine | None) -> None:
        cap = attempt_cap(job, self.settings)
        extra = {"job_id": job.id, "turn_id": job.turn_id, "attempt": job.attempts}
        if job.attempts > cap:
            # Earlier attempts died without recording anything (lease expired each time).
            await self.finish_failed(job, f"gave up: {job.attempts - 1} attempts did not finish")
            return
        beat = asyncio.create_task(self.heartbeat(job))
        try:
            outcome = await judge_job(self.db, job, self.name, settings=self.settings,
                                      backend=backend, teacher=teacher)
        except BackendUnreachable as exc:
            await self.put_back(job, exc)
        except JudgeError as exc:
            await self.finish_error(job, exc, transient=exc.transient, cap=cap)
        except Exception as exc:  # DB errors and bugs: retried, then recorded — never lost
            log.exception("job crashed", extra={"action": "job_crash", **extra})
            await self.finish_error(job, exc, transient=True, cap=cap)
        else:
            self.outages = 0
            log.info("job %s", outcome.action, extra={
                "action": f"job_{outcome.action}", **extra, "reward": outcome.reward,
                "judgment_id": outcome.judgment_id, "sample_id": outcome.sample_id,
                "reason": outcome.reason})
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def put_back(self, job: ClaimedJob, exc: BackendUnreachable) -> None:
        """Nothing could connect to the endpoint: the job goes back to the queue without
        counting the attempt (an engine restarting for minutes must not spend every queued
        job's attempts and fail them), and this worker claims nothing until the pause ends:
        backoff_base_s, twice that if it is still down after, … up to backoff_max_s. Jobs
        that fail within one pause share it."""
        now = time.monotonic()
        if now >= self.resume_at:
            self.outages += 1
            self.resume_at = now + backoff_s(self.outages, self.settings)
        delay = self.resume_at - now
        message = f"{type(exc).__name__}: {exc}"[:2000]
        log.warning("endpoint unreachable, job put back; claims resume in %.1fs: %s", delay,
                    message, extra={"action": "job_put_back", "job_id": job.id,
                                    "attempt": job.attempts, "outages": self.outages})
        with contextlib.suppress(Exception):  # DB down: the lease brings it back
            async with self.db.begin() as conn:
                await conn.execute(retry_stmt(job.id, self.name, delay, message,
                                              counted=False))

    async def finish_error(self, job: ClaimedJob, exc: BaseException, *, transient: bool,
                           cap: int) -> None:
        message = f"{type(exc).__name__}: {exc}"[:2000]
        if transient and job.attempts < cap:
            delay = backoff_s(job.attempts, self.settings)
            log.warning("job retry in %.1fs: %s", delay, message, extra={
                "action": "job_retry", "job_id": job.id, "attempt": job.attempts})
            with contextlib.suppress(Exception):  # DB down: the lease brings it back
                async with self.db.begin() as conn:
                    await conn.execute(retry_stmt(job.id, self.name, delay, message))
            return
        await self.finish_failed(job, message)

    async def finish_failed(self, job: ClaimedJob, message: str) -> None:
        log.error("job failed: %s", message, extra={
            "action": "job_failed", "job_id": job.id, "attempt": job.attempts})
        with contextlib.suppress(Exception):  # DB down: the lease brings it back
            async with self.db.begin() as conn:
                await conn.execute(fail_stmt(job.id, self.name, message))


class ActionFormatter(logging.Formatter):
    """One JSON object per line with a stable `action` key (and any extra fields)."""

    _BASE = set(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": self.formatTime(record), "level": record.levelname,
               "action": getattr(record, "action", "log"), "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items()
                    if k not in self._BASE and k not in out and k != "message"})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ActionFormatter())
    root = logging.getLogger("clawrl")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


async def serve(settings: JudgeProcessSettings, db_url: str, *, name: str | None,
                concurrency: int | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    db = create_async(db_url, pool_size=(concurrency or settings.judge.concurrency) + 2)
    try:
        await Worker(settings, db, db_url, name=name, concurrency=concurrency).run(stop)
    finally:
        await db.dispose()


def main(argv: list[str]) -> int:
    if argv and argv[0] == "rejudge":
        from judge.rejudge import main as rejudge_main

        return rejudge_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="clawrl judge", description="Run a judge worker: claims judge jobs and runs them.",
        epilog="Re-judge: clawrl judge rejudge --since ISO [--until ISO] [--prompt-version V]")
    p.add_argument("--concurrency", type=int, help="jobs in flight (CLAWRL_JUDGE__CONCURRENCY)")
    p.add_argument("--name", help="worker name stored in jobs.locked_by")
    args = p.parse_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        print("clawrl judge: --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        settings = load_judge_settings()
    except ValidationError as exc:
        print(f"clawrl judge: bad settings: {describe_settings_error(exc)}", file=sys.stderr)
        return 2
    from clawrl.base.dbcli import resolve_url

    try:
        db_url = resolve_url(settings)
        check_database(db_url)
    except Exception as exc:  # bad URL, server down, not migrated: one line, exit 1
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"clawrl judge: cannot use the database: {first}", file=sys.stderr)
        return 1
    if settings.judge.teacher_enabled:  # the teacher engine must score fixed responses
        from clawrl.base.engine_check import check_at_start

        problem = check_at_start(teacher_client(settings.judge, settings.engine),
                                 ("teacher_logprobs",))
        if problem:
            print(f"clawrl judge: {problem}", file=sys.stderr)
            return 1
    setup_logging()
    asyncio.run(serve(settings, db_url, name=args.name, concurrency=args.concurrency))
    return 0


def check_database(db_url: str) -> None:
    """Fail fast at startup (later outages are waited out): reachable and migrated."""
    with psycopg.connect(libpq_url(db_url), connect_timeout=5) as conn:
        conn.execute("SELECT 1 FROM jobs LIMIT 0")
