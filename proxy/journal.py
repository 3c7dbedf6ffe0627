"""The local turn journal: where turns wait while Postgres is unreachable (or overloaded).

A directory of JSONL segments, one turn record per line, in the order the turns were
journaled:

    <journal>/active.jsonl          appended to (O_APPEND, one write + fsync per batch)
    <journal>/000000000007.jsonl    sealed segments, replayed oldest first

No file is ever rewritten in place. `append` writes to the active segment under an
exclusive `flock` on `<journal>/.lock`, so several proxy processes can share one journal
without interleaving lines; a segment is sealed by renaming it (`seal`, atomic), and one
that has been stored is unlinked (`remove`). Replay streams a sealed segment line by line
(`read`), so a large journal never sits in memory. Only one process replays at a time
(`replay_lock`, a non-blocking `flock` on `<journal>/.replay.lock`). Replay is idempotent —
a turn whose uid is already stored is skipped — so a replay cut short by a crash or another
outage simply starts that segment again.

`forget_user` removes a deleted user's journaled turns: each affected segment is copied
without them to a temporary file, fsynced, and renamed over the original.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from proxy.records import TurnRecord

log = logging.getLogger("clawrl.proxy.journal")

ACTIVE = "active.jsonl"
# The active segment is sealed once it grows past this, so replay can start on it.
SEGMENT_BYTES = 8 * 1024 * 1024


@dataclass
class BadLine:
    """A journal line that is not a readable turn record (a torn write, a foreign line)."""

    segment: str
    number: int
    raw: bytes
    error: str


def encode(record: TurnRecord) -> bytes:
    """One journal line (JSON + newline)."""
    return json.dumps(record.to_json(), ensure_ascii=False).encode() + b"\n"


class Journal:
    def __init__(self, path: Path, *, legacy: Path | None = None) -> None:
        self.path = path
        self._adopt_legacy_file(legacy)
        self.pending = self.count()

    # --- layout -----------------------------------------------------------------------

    def _adopt_legacy_file(self, legacy: Path | None) -> None:
        """A journal written by an older proxy is one JSONL file (at `path` itself, or at
        `legacy`): it becomes segment 0, replayed before anything newer."""
        if self.path.is_file():
            moved = self.path.with_name(self.path.name + ".legacy")
            os.rename(self.path, moved)
            legacy = moved
        self.path.mkdir(parents=True, exist_ok=True)
        if legacy is not None and legacy.is_file():
            os.rename(legacy, self.path / f"{0:012d}.jsonl")
            self._fsync_dir()

    def segments(self) -> list[Path]:
        """Sealed segments, oldest first."""
        return sorted(p for p in self.path.glob("[0-9]*.jsonl") if p.stem.isdigit())

    def _files(self) -> list[Path]:
        active = self.path / ACTIVE
        return self.segments() + ([active] if active.exists() else [])

    def count(self) -> int:
        """Lines in the journal (every process's), read as a stream."""
        total = 0
        for path in self._files():
            try:
                with path.open("rb") as f:
                    total += sum(1 for line in f if line.strip())
            except FileNotFoundError:
                continue  # removed meanwhile by a replaying process
        return total

    def refresh(self) -> int:
        self.pending = self.count()
        return self.pending

    def has_data(self) -> bool:
        """Whether any segment holds anything (cheap: stat calls only)."""
        for path in self._files():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size > 0:
                    return True
        return False

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self, name: str = ".lock", *, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(self.path / name, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # also releases the lock

    # --- writing ------------------------------------------------------------------------

    def append(self, records: list[TurnRecord]) -> int:
        """Append records durably (one write, then fsync) in the given order; returns how
        many were written. A record that cannot be serialised is logged and left out."""
        lines = []
        for record in records:
            try:
                lines.append(encode(record))
            except (ValueError, TypeError, RecursionError) as exc:
                log.error("turn %s cannot be journaled (%s), it is lost", record.uid,
                          type(exc).__name__, extra={"action": "journal_unserialisable"})
        if not lines:
            return 0
        with self._locked():
            fd = os.open(self.path / ACTIVE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, b"".join(lines))
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size > SEGMENT_BYTES:
                self._seal_locked()
        self.pending += len(lines)
        log.warning("journaled turns", extra={"action": "journal_append",
                                              "count": len(lines), "pending": self.pending})
        return len(lines)

    def seal(self) -> None:
        """Seal the active segment (rename it to the next sequence number)."""
        with self._locked():
            self._seal_locked()

    def _seal_locked(self) -> None:
        active = self.path / ACTIVE
        try:
            if active.stat().st_size == 0:
                return
        except FileNotFoundError:
            return
        existing = self.segments()
        seq = int(existing[-1].stem) + 1 if existing else 1
        os.rename(active, self.path / f"{seq:012d}.jsonl")
        self._fsync_dir()

    # --- replaying ----------------------------------------------------------------------

    @contextlib.contextmanager
    def replay_lock(self) -> Iterator[bool]:
        """Yields True when this process may replay now (no other process is replaying)."""
        with self._locked(".replay.lock", blocking=False) as mine:
            yield mine

    def read(self, segment: Path) -> Iterator[TurnRecord | BadLine]:
        """A sealed segment's records, streamed in order; unreadable lines as BadLine."""
        with segment.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:  # json, not orjson: a record may hold -Infinity (a logprob)
                    yield TurnRecord.from_json(json.loads(line))
                except (ValueError, TypeError, RecursionError) as exc:
                    yield BadLine(segment.name, number, line.rstrip(b"\n"), str(exc)[:500])

    def remove(self, segment: Path, lines: int) -> None:
        """Forget a segment whose `lines` records are all stored (or dead-lettered)."""
        segment.unlink(missing_ok=True)
        self._fsync_dir()
        self.pending = max(0, self.pending - lines)

    # --- deleting a user ----------------------------------------------------------------

    def forget_user(self, user_id: int) -> int:
        """Remove every journaled turn of `user_id`; returns how many were removed.

        Waits for a running replay (of any process) to finish, so none of the removed
        turns is being stored meanwhile."""
        removed = 0
        fd = os.open(self.path / ".replay.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with self._locked():
                self._seal_locked()
                for segment in self.segments():
                    removed += self._filter_segment(segment, user_id)
        finally:
            os.close(fd)
        self.refresh()
        return removed

    def _filter_segment(self, segment: Path, user_id: int) -> int:
        """Rewrite `segment` without `user_id`'s turns. The copy is owner-only (0600) from
        its creation, like every segment: it holds other users' messages."""
        tmp = segment.with_suffix(".tmp")
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a crash's leftover, whatever its mode
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with segment.open("rb") as src, os.fdopen(fd, "wb") as dst:
            for line in src:
                try:
                    owner = json.loads(line).get("user_id")
                except (ValueError, AttributeError, RecursionError):
                    owner = None
                if owner == user_id:
                    removed += 1
                else:
                    dst.write(line)
            dst.flush()
            os.fsync(dst.fileno())
        if removed:
            os.rename(tmp, segment)
            self._fsync_dir()
        else:
            tmp.unlink()
        return removed
