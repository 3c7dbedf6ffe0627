"""The turn log writer: a background task that stores turns without slowing responses.

The request path only calls `TurnWriter.submit(record)` (an in-memory queue put: no I/O,
cannot fail). One background task drains the queue in batches and stores each batch in one
transaction (proxy/sessions.py infers sessions and attaches next states on the way).
Storing is idempotent by `turns.uid`. If Postgres is unreachable the batch goes to the
local journal (proxy/journal.py); while the journal holds anything, newer turns are appended
behind it, so the database always receives turns in the order they were served, and the
journal is replayed as soon as the database answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy.journal import Journal
from proxy.records import TurnRecord
from proxy.sessions import record_turns

log = logging.getLogger("clawrl.proxy.store")

_STOP = object()
# Errors that mean "this record cannot be stored" (e.g. its user was just deleted), as
# opposed to "the database cannot be reached": those records are dropped, not journaled.
_BAD_RECORD = (IntegrityError, DataError)


class TurnWriter:
    def __init__(self, db: AsyncEngine, journal: Journal, *, include_system: bool,
                 batch_size: int = 64, retry_s: float = 2.0) -> None:
        self.db = db
        self.journal = journal
        self.include_system = include_system
        self.batch_size = batch_size
        self.retry_s = retry_s
        self.dropped = 0
        self.stored = 0
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._pending: set[str] = set()
        self._batch_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: list[TurnRecord] = []
        self._conn: AsyncConnection | None = None
        self._retry_at = 0.0  # no database attempt before this (monotonic) time

    @property
    def backlog(self) -> int:
        """Turns served but not yet stored or journaled."""
        return len(self._pending)

    def submit(self, record: TurnRecord) -> None:
        self._pending.add(record.uid)
        self._queue.put_nowait(record)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="turn-writer")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Store (or journal) everything submitted so far, then end the task."""
        if self._task is None:
            return
        self._queue.put_nowait(_STOP)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            self._task.cancel()
            # A batch cut off mid-transaction was rolled back; one cut off after its
            # commit is skipped on replay (same uid), so journaling it again is safe.
            rest = self._inflight + [r for r in self._drain() if isinstance(r, TurnRecord)]
            if rest:
                self._to_journal(rest)
        self._task = None
        await self._drop_connection(broken=False)

    async def wait_stored(self, uid: str, timeout_s: float = 5.0) -> None:
        """Wait until a just-served turn has left the queue (for feedback on it)."""
        deadline = time.monotonic() + timeout_s
        while uid in self._pending and (left := deadline - time.monotonic()) > 0:
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
        await self._replay()  # left over from a previous run
        while True:
            timeout = self.retry_s if self.journal.pending else None
            try:
                first = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
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

    async def _write(self, batch: list[TurnRecord]) -> None:
        self._inflight = batch
        try:
            if self.journal.pending and not await self._replay():
                self._to_journal(batch)
            else:
                try:
                    await self._store(batch)
                except _BAD_RECORD:
                    await self._store_one_by_one(batch)
                except (SQLAlchemyError, OSError) as exc:
                    self._retry_at = time.monotonic() + self.retry_s
                    log.warning("database unreachable, journaling %d turns: %s", len(batch),
                                exc, extra={"action": "store_failed"})
                    self._to_journal(batch)
        finally:
            self._inflight = []
            for record in batch:
                self._pending.discard(record.uid)
            self._batch_done.set()
            self._batch_done = asyncio.Event()

    def _to_journal(self, batch: list[TurnRecord]) -> None:
        try:
            self.journal.append(batch)
        except OSError as exc:
            self.dropped += len(batch)
            log.error("cannot journal %d turns, they are lost: %s", len(batch), exc,
                      extra={"action": "journal_failed"})

    async def _store(self, batch: list[TurnRecord]) -> None:
        """Store a batch in one transaction on the writer's own connection (kept open, so
        a batch costs no pool checkout or ping); one retry on a fresh connection, since a
        connection idle across a database restart fails once before anything is wrong."""
        for attempt in (1, 2):
            try:
                conn = self._conn or await self.db.connect()
                self._conn = conn
                async with conn.begin():
                    self.stored += await record_turns(conn, batch,
                                                      include_system=self.include_system)
                return
            except _BAD_RECORD:
                raise
            except (SQLAlchemyError, OSError):
                await self._drop_connection()
                if attempt == 2:
                    raise

    async def _drop_connection(self, *, broken: bool = True) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if broken:
                    await conn.invalidate()
                await conn.close()
            except (SQLAlchemyError, OSError):
                pass

    async def _store_one_by_one(self, batch: list[TurnRecord]) -> None:
        for record in batch:
            try:
                await self._store([record])
            except _BAD_RECORD as exc:
                self.dropped += 1
                log.error("turn %s cannot be stored and is dropped: %s", record.uid, exc,
                          extra={"action": "store_rejected"})

    async def _replay(self) -> bool:
        """Store every journaled turn, in order; True when the journal is empty after.

        After a failed attempt the database is left alone for `retry_s`: meanwhile new turns
        go straight to the journal, so an outage costs no connection attempt per batch."""
        if not self.journal.pending:
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            records, lines = self.journal.read()
            for start in range(0, len(records), self.batch_size):
                chunk = records[start:start + self.batch_size]
                try:
                    await self._store(chunk)
                except _BAD_RECORD:
                    await self._store_one_by_one(chunk)
        except (SQLAlchemyError, OSError) as exc:
            self._retry_at = time.monotonic() + self.retry_s
            log.info("journal replay deferred: %s", exc, extra={"action": "replay_deferred"})
            return False
        self.journal.clear(lines)
        log.warning("replayed %d journaled turns", len(records),
                    extra={"action": "journal_replayed", "count": len(records)})
        return self.journal.pending == 0
