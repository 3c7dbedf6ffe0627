"""The local turn journal: where turns wait while Postgres is unreachable.

An append-only JSONL file (`Settings.journal_file()`), one turn record per line, written in
the order the turns were served. When the database is back the writer replays it in order
and then empties it. Replay is idempotent — a turn whose uid is already stored is skipped —
so a replay cut short by another outage can simply start again from the first line.
An advisory file lock keeps several proxy processes sharing one journal from interleaving
appends with a replay.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.records import TurnRecord

log = logging.getLogger("clawrl.proxy.journal")


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending = self._count()

    def _count(self) -> int:
        try:
            with self.path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    @contextmanager
    def _locked(self) -> Iterator[int]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # also releases the lock

    def append(self, records: list[TurnRecord]) -> None:
        """Append records durably (one write, then fsync) in the given order."""
        data = b"".join(json.dumps(r.to_json(), ensure_ascii=False).encode() + b"\n"
                        for r in records)
        with self._locked() as fd:
            os.write(fd, data)
            os.fsync(fd)
        self.pending += len(records)
        log.warning("journaled turns", extra={"action": "journal_append",
                                              "count": len(records), "pending": self.pending})

    def read(self) -> tuple[list[TurnRecord], int]:
        """Every journaled record, oldest first, and the number of lines read (pass it to
        `clear`); an unreadable line (a torn write) is logged and skipped."""
        records: list[TurnRecord] = []
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return records, 0
        lines = [line for line in raw.splitlines() if line.strip()]
        for number, line in enumerate(lines, 1):
            try:
                records.append(TurnRecord.from_json(json.loads(line)))
            except (ValueError, TypeError) as exc:
                log.error("unreadable journal line %d skipped: %s", number, exc,
                          extra={"action": "journal_skip"})
        return records, len(lines)

    def clear(self, replayed: int) -> None:
        """Drop the first `replayed` lines (those just stored), keeping any appended since."""
        with self._locked() as fd:
            with open(fd, "rb", closefd=False) as f:
                f.seek(0)
                lines = [line for line in f.read().splitlines() if line.strip()]
            rest = lines[replayed:]
            os.ftruncate(fd, 0)
            if rest:
                os.write(fd, b"".join(line + b"\n" for line in rest))
            os.fsync(fd)
        self.pending = len(rest)
