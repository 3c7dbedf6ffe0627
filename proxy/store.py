"""The turn log writer: a background task that stores turns without slowing responses.

The request path only calls `TurnWriter.submit(record)` (an in-memory queue put: no I/O in
the common case, cannot fail). One background task drains the queue in batches and stores
each batch in one transaction (proxy/sessions.py infers sessions and attaches next states on
the way). Storing is idempotent by `turns.uid`.

Nothing one record does can stop the writer:
- a batch that fails for any reason other than an unreachable database is stored again one
  record at a time; a record that still fails while the database answers goes to the
  `dead_letters` table (its raw JSON and the error), or is dropped when its user has been
  deleted meanwhile;
- the task is supervised: should it end unexpectedly anyway, its in-flight batch is
  journaled and it is restarted (counted in /metrics);
- the queue is bounded (`turn_backlog_max`): past the bound the queued turns spill to the
  journal, in order, and /readyz answers 503 until the backlog is down again.

If Postgres is unreachable a batch goes to the local journal (proxy/journal.py); while the
journal holds anything, newer turns are appended behind it, so the database receives turns
in the order they were served, and the journal is replayed (streamed, a segment at a time)
as soon as the database answers again.

Durability (`ProxySettings.durability`). A turn is durable once its transaction has
committed or it is in an fsynced journal segment. The writer commits whatever is queued as
soon as the previous commit ends (group commit: under load a batch gathers every turn
served meanwhile, up to `batch_size`). A guard task bounds how long a served turn stays in
memory only: a turn not durable `durable_within_s` (50 ms) after it was submitted — the
database is slow, or the batch ahead of it is — is journaled with everything queued behind
it (the batch already sent to Postgres is journaled too; should both copies land, replay
skips the stored uid). So a `kill -9` of the proxy loses at most the turns of the last
~`durable_within_s` plus one fsync. With `durability = "sync"` the chat endpoint awaits
`durable(uid)` before the reply's final byte (the body of a reply, `[DONE]` of a stream):
a reply the client has read in full is never lost.

The next state as the request arrives (`attach_early`): the request path hands the writer a
request's record before its reply; a short transaction of its own attaches the request's
next state to the turn it continues and enqueues that turn's judge job
(proxy/sessions.py, `attach_next_state`), so the judge need not wait for the reply. It is an
optimisation the store does not depend on: it is skipped while the journal holds turns or
`EARLY_MAX` attaches are in flight, and its failure is logged and changes nothing, since
storing the request's turn attaches the next state anyway. The writer stores a record only
after its attach has ended (`EARLY_WAIT_S`, then it is cancelled and rolled back), so the
two never compete for the continued turn's lock.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import insert, select, text
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from clawrl.base.db import DeadLetter, User
from clawrl.base.jobs import notify_stmt
from proxy.journal import BadLine, Journal
from proxy.records import TurnRecord, scrub_nul
from proxy.sessions import attach_next_state, record_turns

if TYPE_CHECKING:
    from proxy.metrics import ProxyMetrics

log = logging.getLogger("clawrl.proxy.store")

_STOP = object()
# Put by the guard after it journaled turns (`_rescue`, `_spill`): the writer, perhaps asleep
# on an empty queue for up to 30 s, wakes and replays them now. Turns journaled while the
# writer waits for the queue were otherwise left there until a later turn arrived — an
# outcome posted for them (`wait_queued`) waited out its 30 s (seen under load in CI).
_NUDGE = object()
_UNREACHABLE = (OSError, TimeoutError, PoolTimeout, OperationalError, InterfaceError,
                DisconnectionError)
_MAX_ERROR_CHARS = 2000
EARLY_MAX = 8  # next-state attaches in flight at once; past it a request's waits for its turn
EARLY_WAIT_S = 5.0  # how long storing a turn waits for its request's attach


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be reached (as opposed to: it refused this)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, _UNREACHABLE)


def describe(exc: BaseException) -> str:
    """The error for a dead letter or a log line: the database's own message (never the
    statement's parameters), or the Python exception's type and message."""
    inner = getattr(exc, "orig", None) or exc
    return str(scrub_nul(f"{type(inner).__name__}: {inner}"))[:_MAX_ERROR_CHARS]


def error_kind(exc: BaseException) -> str:
    """The error's kind for a log line: class and SQLSTATE only (a database message can
    quote the data, and no message text goes to the logs)."""
    inner = getattr(exc, "orig", None) or exc
    state = getattr(inner, "sqlstate", None)
    return f"{type(inner).__name__}" + (f" (SQLSTATE {state})" if state else "")


class TurnWriter:
    def __init__(self, db: AsyncEngine, journal: Journal, *, include_system: bool,
                 batch_size: int = 64, retry_s: float = 2.0, backlog_max: int = 10_000,
                 durable_within_s: float = 0.05, metrics: ProxyMetrics | None = None,
                 early_next_state: bool = True) -> None:
        self.db = db
        self.early_next_state = early_next_state
        self._early: dict[str, asyncio.Task[None]] = {}  # uid -> its request's attach
        self.early_attached = 0  # judge jobs enqueued as their continuing request arrived
        self.journal = journal
        self.include_system = include_system
        self.batch_size = batch_size
        self.retry_s = retry_s
        self.backlog_max = backlog_max
        self.metrics = metrics
        self.dropped = 0
        self.stored = 0
        self.dead_letters = 0
        self.restarts = 0
        self.spilled = 0
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._pending: set[str] = set()
        self._batch_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._stopping = False
        self._inflight: list[TurnRecord] = []
        self._conn: AsyncConnection | None = None
        self._retry_at = 0.0  # no database attempt before this (monotonic) time
        self.durable_within_s = durable_within_s
        self.rescued = 0  # turns journaled by the guard because the database was slow
        # Submitted, not yet committed or journaled: uid -> when submitted (oldest first).
        self._exposed: dict[str, float] = {}
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._rescued: set[str] = set()  # in-flight uids the guard has journaled already
        self._submitted = asyncio.Event()
        self._guard: asyncio.Task[None] | None = None

    # --- the request path -----------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Turns served but not yet stored or journaled."""
        return len(self._pending) - len(self._rescued)

    @property
    def alive(self) -> bool:
        """Whether the writer task is running (false between a crash and its restart)."""
        return self._worker is not None and not self._worker.done()

    @property
    def ready(self) -> bool:
        return self.alive and self.backlog < self.backlog_max

    def submit(self, record: TurnRecord) -> None:
        self._exposed[record.uid] = time.monotonic()
        self._submitted.set()
        if self.backlog >= self.backlog_max:
            self._spill(record)
            return
        self._pending.add(record.uid)
        self._queue.put_nowait(record)

    def attach_early(self, record: TurnRecord) -> None:
        """The request of `record` has arrived, its reply not yet: attach its next state to
        the turn it continues now (the module's docstring)."""
        if (not self.early_next_state or self._stopping or record.kind != "main"
                or record.train_opt_out or len(self._early) >= EARLY_MAX
                or self.journal.pending):
            return
        task = self._early[record.uid] = asyncio.create_task(self._attach(record),
                                                             name="turn-writer-attach")
        # Ended before its turn came to be stored (or its turn never comes: the request
        # failed before its reply): nothing to wait for.
        task.add_done_callback(functools.partial(self._attached, record.uid))

    def _attached(self, uid: str, task: asyncio.Task[None]) -> None:
        if self._early.get(uid) is task:
            del self._early[uid]

    async def _attach(self, record: TurnRecord) -> None:
        try:
            async with self.db.begin() as conn:
                if await attach_next_state(conn, record, include_system=self.include_system):
                    await conn.execute(notify_stmt("judge"))
                    self.early_attached += 1
        except Exception as exc:  # the store attaches it anyway
            log.warning("next state not attached early: %s", error_kind(exc),
                        extra={"action": "early_attach_failed"})

    async def _after_attaches(self, batch: list[TurnRecord]) -> None:
        """Wait for the attaches in flight (cancelling one that takes longer than
        `EARLY_WAIT_S`), so storing a turn never finds the turn it continues locked by an
        attach: its own request's, or its group's (the later choices of `n` are stored
        beside the first, whose request attached)."""
        tasks = [t for t in self._early.values() if not t.done()]
        for record in batch:
            self._early.pop(record.uid, None)
        if not tasks:
            return
        _, late = await asyncio.wait(tasks, timeout=EARLY_WAIT_S)
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)

    async def durable(self, uid: str, timeout_s: float = 30.0) -> None:
        """Wait until a submitted turn is committed or in an fsynced journal segment
        (the guard bounds this by `durable_within_s` plus an fsync while the writer runs)."""
        if uid not in self._exposed:
            return
        waiter = self._waiters.get(uid)
        if waiter is None:
            waiter = self._waiters[uid] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            log.error("turn %s not durable after %.0f s", uid, timeout_s,
                      extra={"action": "durable_timeout"})

    def _settled(self, records: list[TurnRecord]) -> None:
        """These turns are committed or journaled (or lost for good): wake their waiters."""
        for record in records:
            self._exposed.pop(record.uid, None)
            waiter = self._waiters.pop(record.uid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _spill(self, record: TurnRecord) -> None:
        """The queue is full: journal everything queued, then `record` (served order kept;
        the batch in flight is older than all of them)."""
        queued = self._drain()
        records = [r for r in queued if isinstance(r, TurnRecord)] + [record]
        if any(r is _STOP for r in queued):
            self._queue.put_nowait(_STOP)
        for r in records:
            self._pending.discard(r.uid)
        self._to_journal(records)
        self._queue.put_nowait(_NUDGE)
        self._settled(records)
        self.spilled += len(records)
        if self.metrics is not None:
            self.metrics.turns_spilled.inc(len(records))
        log.warning("turn backlog full, %d turns spilled to the journal", len(records),
                    extra={"action": "backlog_spill", "count": len(records)})

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._supervise(), name="turn-writer-supervisor")
        self._guard = asyncio.create_task(self._guard_exposed(), name="turn-writer-guard")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Store (or journal) everything submitted so far, then end the task."""
        if self._task is None:
            return
        self._stopping = True
        self._queue.put_nowait(_STOP)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            # A batch cut off mid-transaction was rolled back; one cut off after its
            # commit is skipped on replay (same uid), so journaling it again is safe.
            rest = self._inflight + [r for r in self._drain() if isinstance(r, TurnRecord)]
            if rest:
                self._to_journal(rest)
            self._inflight = []
            self._finish_batch(rest)
        self._task = None
        early, self._early = list(self._early.values()), {}
        for task in early:
            task.cancel()
        await asyncio.gather(*early, return_exceptions=True)
        if self._guard is not None:
            self._guard.cancel()
            await asyncio.gather(self._guard, return_exceptions=True)
            self._guard = None
        for waiter in self._waiters.values():  # nothing is left to wait for
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        self._exposed.clear()
        await self._drop_connection(broken=False)

    async def _supervise(self) -> None:
        """Run the writer; if it ever ends other than by `stop`, journal what it held and
        start it again (with a short, growing pause)."""
        pause = 0.1
        while True:
            worker = self._worker = asyncio.create_task(self._run(), name="turn-writer")
            try:
                await asyncio.wait({worker})
            except asyncio.CancelledError:
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
                raise
            if not worker.cancelled() and worker.exception() is None:
                return  # stopped
            why = "cancelled" if worker.cancelled() else repr(worker.exception())
            self.restarts += 1
            if self.metrics is not None:
                self.metrics.writer_restarts.inc()
            log.error("turn writer died (%s); restarting", why[:500],
                      extra={"action": "writer_restart", "restarts": self.restarts})
            held, self._inflight = self._inflight, []
            if held:
                self._to_journal(held)
            self._finish_batch(held)
            await self._drop_connection()
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)

    async def wait_stored(self, uid: str, timeout_s: float = 5.0) -> None:
        """Wait until a just-served turn has left the queue (for feedback on it)."""
        deadline = time.monotonic() + timeout_s
        while uid in self._pending and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._batch_done.wait(), left)
            except TimeoutError:
                return

    async def wait_queued(self, timeout_s: float = 30.0) -> None:
        """Wait until every turn queued now is in the database (for a session outcome posted
        right after the session's last reply, which may be what creates it): out of the
        queue, and out of the journal where a slow database sent it. Returns at once when
        nothing is queued or journaled; 30 s, because on a loaded machine a batch took over
        5 s to store and the outcome of a one-step episode was answered 404 — and so it was,
        under the full test suite, for turns the writer had journaled while it waited."""
        queued = set(self._pending)
        deadline = time.monotonic() + timeout_s
        while (queued & self._pending or self.journal.pending) \
                and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._batch_done.wait(), left)
            except TimeoutError:
                return

    def _drain(self) -> list[object]:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    async def _run(self) -> None:
        await self._replay()  # left over from a previous run (or another process)
        while True:
            if self._stopping and self._queue.empty():
                return
            # Also wake up now and then to pick up what other processes journaled; turns
            # the guard journaled while the database answers are replayed at once.
            timeout = self.retry_s if self.journal.pending else 30.0
            if self.journal.pending and self._queue.empty() \
                    and time.monotonic() >= self._retry_at:
                timeout = 0.01
            try:
                first = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                if self.journal.pending or self.journal.has_data():
                    await self._replay()
                continue
            batch: list[TurnRecord] = []
            stop = first is _STOP
            if isinstance(first, TurnRecord):
                batch.append(first)
            while not stop and len(batch) < self.batch_size and not self._queue.empty():
                item = self._queue.get_nowait()
                stop = item is _STOP
                if isinstance(item, TurnRecord):
                    batch.append(item)
            if batch:
                await self._write(batch)
            if stop:
                rest = [r for r in self._drain() if isinstance(r, TurnRecord)]
                if rest:
                    await self._write(rest)
                return

    # --- the guard: nothing served stays in memory only for long ---------------------------

    async def _guard_exposed(self) -> None:
        """Journal every turn still not durable once the oldest is `durable_within_s` old."""
        while True:
            if not self._exposed:
                self._submitted.clear()
                await self._submitted.wait()
                continue
            oldest = next(iter(self._exposed.values()))
            wait = oldest + self.durable_within_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                if not self._rescue():
                    await asyncio.sleep(0.005)  # the oldest is between queue and batch
            except Exception:  # never let the guard die; the writer still stores everything
                log.exception("turn guard failed", extra={"action": "guard_failed"})
                await asyncio.sleep(self.durable_within_s)

    def _rescue(self) -> bool:
        """The database is slow: journal the batch in flight (still being stored; replay
        skips whichever copy lands second), then everything queued behind it, in served
        order. Later turns follow them into the journal until it is replayed."""
        inflight = [r for r in self._inflight
                    if r.uid in self._exposed and r.uid not in self._rescued]
        queued = self._drain()
        records = [r for r in queued if isinstance(r, TurnRecord)]
        if any(r is _STOP for r in queued):
            self._queue.put_nowait(_STOP)
        if not inflight and not records:
            # Exposed but neither queued nor in flight: settled elsewhere meanwhile.
            stale = [uid for uid in self._exposed
                     if uid not in self._pending or uid in self._rescued]
            for uid in stale:
                self._exposed.pop(uid, None)
                waiter = self._waiters.pop(uid, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            return bool(stale)
        self._to_journal(inflight + records)
        self._queue.put_nowait(_NUDGE)
        self._rescued.update(r.uid for r in inflight)
        for r in records:
            self._pending.discard(r.uid)
        self._settled(inflight + records)
        self.rescued += len(inflight) + len(records)
        log.warning("database slow: %d turns journaled to keep them durable",
                    len(inflight) + len(records),
                    extra={"action": "durable_rescue", "count": len(inflight) + len(records)})
        self._signal_done()
        return True

    # --- storing ------------------------------------------------------------------------------

    def _finish_batch(self, batch: list[TurnRecord]) -> None:
        self._settled(batch)
        for record in batch:
            self._pending.discard(record.uid)
            self._rescued.discard(record.uid)
        self._signal_done()

    def _signal_done(self) -> None:
        """Wake whoever waits for turns to leave the queue or the journal."""
        self._batch_done.set()
        self._batch_done = asyncio.Event()

    async def _write(self, batch: list[TurnRecord]) -> None:
        # Should this raise (or be cancelled), the batch stays in `_inflight`: the
        # supervisor (or `stop`) journals it.
        self._inflight = batch
        if self.journal.pending and not await self._replay():
            self._to_journal(batch)
        else:
            try:
                await self._store_isolated(batch)
            except Exception as exc:
                if not unreachable(exc):
                    raise
                self._retry_at = time.monotonic() + self.retry_s
                log.warning("database unreachable, journaling %d turns: %s", len(batch),
                            error_kind(exc), extra={"action": "store_failed"})
                self._to_journal(batch)
        self._inflight = []
        self._finish_batch(batch)

    def _to_journal(self, batch: list[TurnRecord]) -> None:
        batch = [r for r in batch if r.uid not in self._rescued]  # journaled by the guard
        if not batch:
            return
        try:
            written = self.journal.append(batch)
        except OSError as exc:
            written = 0
            log.error("cannot journal %d turns, they are lost: %s", len(batch), exc,
                      extra={"action": "journal_failed"})
        self.dropped += len(batch) - written

    async def _store(self, batch: list[TurnRecord]) -> None:
        """Store a batch in one transaction on the writer's own connection (kept open, so
        a batch costs no pool checkout or ping); one retry on a fresh connection, since a
        connection idle across a database restart fails once before anything is wrong."""
        await self._after_attaches(batch)
        for attempt in (1, 2):
            try:
                conn = self._conn or await self.db.connect()
                self._conn = conn
                async with conn.begin():
                    self.stored += await record_turns(conn, batch,
                                                      include_system=self.include_system)
                return
            except Exception as exc:
                if not unreachable(exc):
                    raise
                await self._drop_connection()
                if attempt == 2:
                    raise

    async def _store_isolated(self, batch: list[TurnRecord]) -> None:
        """Store a batch; if that fails other than by an unreachable database, store its
        records one by one and dead-letter each one that the database still refuses.
        Raises only when the database is unreachable (the caller journals the batch)."""
        try:
            await self._store(batch)
            return
        except Exception as exc:
            if unreachable(exc) and not await self._db_answers():
                raise
            if len(batch) == 1:
                await self._reject(batch[0], exc)
                return
        for record in batch:
            try:
                await self._store([record])
            except Exception as exc:
                if unreachable(exc) and not await self._db_answers():
                    raise
                await self._reject(record, exc)

    async def _db_answers(self) -> bool:
        try:
            async with self.db.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return True
        except Exception as exc:
            if unreachable(exc):
                return False
            raise

    async def _reject(self, record: TurnRecord, exc: BaseException) -> None:
        """A record the database refuses while it answers: dropped when its user is gone
        (deleted meanwhile: nothing of theirs is kept), else kept as a dead letter."""
        error = describe(exc)
        try:
            async with self.db.begin() as conn:
                user = (await conn.execute(select(User.id).where(User.id == record.user_id))
                        ).scalar()
                if user is None:
                    self.dropped += 1
                    log.warning("turn %s dropped: its user no longer exists", record.uid,
                                extra={"action": "store_rejected"})
                    return
                if await _dead_lettered(conn, record.uid):
                    return  # its other copy (journaled by the guard while stored) came first
                await self._dead_letter(conn, "turn", dead_letter_payload(record), error)
        except Exception as failed:
            if unreachable(failed):
                raise
            self.dropped += 1
            log.error("turn %s refused and cannot be dead-lettered (%s); it is lost",
                      record.uid, error_kind(failed),
                      extra={"action": "dead_letter_failed"})
            return
        log.error("turn %s refused by the database, kept in dead_letters: %s", record.uid,
                  error_kind(exc), extra={"action": "dead_letter"})

    async def _dead_letter(self, conn: AsyncConnection, kind: str, payload: str,
                           error: str) -> None:
        await conn.execute(insert(DeadLetter).values(kind=kind, payload=payload, error=error))
        self.dead_letters += 1
        if self.metrics is not None:
            self.metrics.dead_letters.inc()

    async def _drop_connection(self, *, broken: bool = True) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if broken:
                    await conn.invalidate()
                await conn.close()
            except (SQLAlchemyError, OSError):
                pass

    # --- the journal ----------------------------------------------------------------------------

    async def _replay(self) -> bool:
        """Store every journaled turn, in order, a sealed segment at a time; True when the
        journal is empty after.

        After a failed attempt the database is left alone for `retry_s`: meanwhile new turns
        go straight to the journal, so an outage costs no connection attempt per batch."""
        if not self.journal.pending and not self.journal.has_data():
            return True
        if time.monotonic() < self._retry_at:
            return False
        replayed = 0
        with self.journal.replay_lock() as mine:
            if not mine:  # another process is replaying this journal
                return False
            try:
                for _ in range(3):  # turns spilled during a replay are taken in the next round
                    self.journal.seal()
                    segments = self.journal.segments()
                    if not segments:
                        break
                    for segment in segments:
                        replayed += await self._replay_segment(segment)
            except Exception as exc:
                if not unreachable(exc):
                    raise
                self._retry_at = time.monotonic() + self.retry_s
                log.info("journal replay deferred: %s", error_kind(exc),
                         extra={"action": "replay_deferred"})
                return False
        if replayed:
            log.warning("replayed %d journaled turns", replayed,
                        extra={"action": "journal_replayed", "count": replayed})
        empty = self.journal.refresh() == 0
        self._signal_done()  # wakes `wait_queued`, which waits for the journal too
        return empty

    async def _replay_segment(self, segment: Any) -> int:
        lines, chunk = 0, []
        for item in self.journal.read(segment):
            lines += 1
            if isinstance(item, BadLine):
                await self._store_bad_line(item)
                continue
            chunk.append(item)
            if len(chunk) >= self.batch_size:
                await self._store_isolated(chunk)
                chunk = []
        if chunk:
            await self._store_isolated(chunk)
        self.journal.remove(segment, lines)
        return lines

    async def _store_bad_line(self, line: BadLine) -> None:
        payload = line.raw.decode("utf-8", "replace")
        try:
            async with self.db.begin() as conn:
                await self._dead_letter(conn, "journal_line", scrub_nul(payload),
                                        scrub_nul(f"{line.segment}:{line.number}: {line.error}"))
        except Exception as exc:
            if unreachable(exc):
                raise
            self.dropped += 1
            log.error("unreadable journal line %s:%d cannot be dead-lettered (%s)",
                      line.segment, line.number, error_kind(exc),
                      extra={"action": "dead_letter_failed"})


async def _dead_lettered(conn: AsyncConnection, uid: str) -> bool:
    """Whether a turn is already a dead letter. A turn the guard journaled while its batch
    was being stored has two copies, and a refused one is refused twice: like replay's
    skip of stored uids, the second copy is dropped. The transaction-scoped advisory lock
    orders two processes rejecting the same uid at once."""
    await conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:uid))"), {"uid": uid})
    found = await conn.execute(text(
        "SELECT 1 FROM dead_letters WHERE kind = 'turn' AND payload::jsonb ->> 'uid' = :uid "
        "LIMIT 1"), {"uid": uid})
    return found.first() is not None


def dead_letter_payload(record: TurnRecord) -> str:
    """The record as JSON text for `dead_letters.payload` (always JSON, so SQL can read
    `payload::jsonb ->> 'user_id'`)."""
    try:
        return json.dumps(record.scrubbed().to_json(), ensure_ascii=True)
    except (ValueError, TypeError, RecursionError) as exc:
        return json.dumps({"uid": record.uid, "user_id": record.user_id,
                           "unserialisable": f"{type(exc).__name__}",
                           "repr": repr(record)[:100_000]}, ensure_ascii=True)
