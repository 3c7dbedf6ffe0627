"""The journal's segments on disk: append-only with fsync, sealed by rename, shared by
several processes under flock, read as a stream, and a deleted user's turns removed.

Several processes are real child processes appending to one journal directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import journal as journal_module
from proxy.journal import ACTIVE, BadLine, Journal
from proxy.records import TurnRecord

APPEND_FROM_CHILD = """
import sys
from pathlib import Path

import pytest
from proxy.journal import Journal
from proxy.records import TurnRecord
j = Journal(Path(sys.argv[1]))
who = int(sys.argv[2])
for i in range(200):
    j.append([TurnRecord(uid=f"{who:08d}-0000-4000-8000-{i:012d}", user_id=who,
                         api_key_id=None, request_messages=[{"role": "user",
                         "content": "x" * 3000}], params={})])
"""


def record(i: int, user_id: int = 1) -> TurnRecord:
    return TurnRecord(uid=f"00000000-0000-4000-8000-{i:012d}", user_id=user_id,
                      api_key_id=None, request_messages=[{"role": "user", "content": str(i)}],
                      params={})


def test_processes_append_whole_lines(tmp_path: Path) -> None:
    """Four processes appending at once (records bigger than a pipe buffer) leave only
    whole lines, 800 of them."""
    path = tmp_path / "journal"
    Journal(path)
    children = [subprocess.Popen([sys.executable, "-c", APPEND_FROM_CHILD, str(path), str(w)])
                for w in range(1, 5)]
    assert [c.wait(timeout=120) for c in children] == [0] * 4
    journal = Journal(path)
    journal.seal()
    items = [item for segment in journal.segments() for item in journal.read(segment)]
    assert not [i for i in items if isinstance(i, BadLine)]
    assert len(items) == 800 == journal.count()
    for who in range(1, 5):  # each process's own records in its order
        mine = [i.uid for i in items if isinstance(i, TurnRecord) and i.user_id == who]
        assert mine == sorted(mine) and len(mine) == 200


def test_sealed_by_rename_and_replayed_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.append([record(1), record(2)])
    first_inode = os.stat(journal.path / ACTIVE).st_ino
    journal.seal()
    assert not (journal.path / ACTIVE).exists()
    [sealed] = journal.segments()
    assert sealed.name == "000000000001.jsonl" and os.stat(sealed).st_ino == first_inode
    journal.append([record(3)])
    journal.seal()
    uids = [i.uid for s in journal.segments() for i in journal.read(s)
            if isinstance(i, TurnRecord)]
    assert uids == [record(n).uid for n in (1, 2, 3)]
    for segment in journal.segments():
        journal.remove(segment, 1)
    assert journal.segments() == [] and not journal.has_data()


def test_active_segment_rotates_when_large(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    journal = Journal(tmp_path / "j")
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 200)
    for i in range(5):
        journal.append([record(i)])
    assert len(journal.segments()) >= 2 and journal.count() == 5 == journal.pending


def test_forget_user_removes_only_theirs(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.append([record(1, user_id=7), record(2, user_id=8)])
    journal.seal()
    journal.append([record(3, user_id=7), record(4, user_id=9)])
    assert journal.forget_user(7) == 2
    left = [i for s in journal.segments() for i in journal.read(s)]
    assert [i.user_id for i in left if isinstance(i, TurnRecord)] == [8, 9]
    raw = b"".join(s.read_bytes() for s in journal.segments())
    assert b'"user_id": 7' not in raw and journal.pending == 2


def test_forget_user_keeps_segments_owner_only(tmp_path: Path) -> None:
    """The rewritten segments hold other users' messages: 0600 like the journal writes
    them, whatever the umask, and a leftover copy's wider mode is not inherited."""
    journal = Journal(tmp_path / "j")
    journal.append([record(1, user_id=7), record(2, user_id=8)])
    journal.seal()
    journal.append([record(3, user_id=7), record(4, user_id=9)])
    first = journal.segments()[0]
    leftover = first.with_suffix(".tmp")
    leftover.write_bytes(b"")
    leftover.chmod(0o644)
    old = os.umask(0)
    try:
        assert journal.forget_user(7) == 2
    finally:
        os.umask(old)
    modes = {s.name: s.stat().st_mode & 0o777 for s in journal.segments()}
    assert len(modes) >= 2 and set(modes.values()) == {0o600}, modes
    assert not leftover.exists()


def test_legacy_file_becomes_first_segment(tmp_path: Path) -> None:
    legacy = tmp_path / "journal.jsonl"
    legacy.write_text(json.dumps(record(1).to_json()) + "\n")
    journal = Journal(tmp_path / "journal", legacy=legacy)
    journal.append([record(2)])
    journal.seal()
    uids = [i.uid for s in journal.segments() for i in journal.read(s)
            if isinstance(i, TurnRecord)]
    assert uids == [record(1).uid, record(2).uid] and not legacy.exists()
    # A configured path that is itself an old journal file is converted in place.
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(record(5).to_json()) + "\n")
    assert Journal(old).pending == 1 and old.is_dir()
