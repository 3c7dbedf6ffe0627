"""The state file of a running `clawrl up` (clawrl/base/statefile.py): where it lives, who may read
it, when it counts, and how it points admin commands at the stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.base import statefile


@pytest.fixture
def state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "state" / "stack.json"
    monkeypatch.setenv("CLAWRL_STATE_FILE", str(path))
    return path


def test_location_follows_xdg_state_home(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.delenv("CLAWRL_STATE_FILE", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert statefile.state_file() == tmp_path / "clawrl" / "stack.json"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert statefile.state_file() == tmp_path / ".local" / "state" / "clawrl" / "stack.json"


def test_secrets_are_owner_only_from_creation(tmp_path: Path) -> None:
    """Even with a umask that lets everyone read new files."""
    old = os.umask(0)
    try:
        path = tmp_path / "dir" / "admin_key"
        statefile.write_secret(path, "ck-admin-x\n")
        assert path.stat().st_mode & 0o777 == 0o600
        statefile.write_secret(path, "ck-admin-y\n")  # replaced, still 0600
        assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "ck-admin-y\n"
    finally:
        os.umask(old)
    assert [p.name for p in path.parent.iterdir()] == ["admin_key"]  # no temp file left


def test_running_stack_is_this_process_until_removed(state_file: Path) -> None:
    statefile.write_stack({"database_url": "postgresql://u@h/db", "state_dir": "/s"})
    assert state_file.stat().st_mode & 0o777 == 0o600
    record = statefile.running_stack()
    assert record is not None and record["pid"] == os.getpid()
    assert record["database_url"] == "postgresql://u@h/db"
    statefile.remove_stack()
    assert not state_file.exists() and statefile.running_stack() is None


def test_another_stacks_record_is_not_removed(state_file: Path) -> None:
    state_file.parent.mkdir(parents=True)
    other = {"pid": 1, "pid_start": statefile._process_start(1)}
    state_file.write_text(json.dumps(other))
    statefile.remove_stack()
    assert json.loads(state_file.read_text()) == other


def test_a_gone_or_reused_pid_is_stale(state_file: Path) -> None:
    state_file.parent.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state_file.write_text(json.dumps({"pid": gone.pid, "pid_start": "1"}))
    assert statefile.running_stack() is None
    # A live pid that started at another time is another process.
    state_file.write_text(json.dumps({"pid": os.getpid(), "pid_start": "1"}))
    assert statefile.running_stack() is None
    state_file.write_text("{not json")
    assert statefile.running_stack() is None


def test_apply_to_env_fills_what_is_unset_and_an_explicit_database_wins(
        state_file: Path) -> None:
    statefile.write_stack({"database_url": "postgresql://u@h/stack", "state_dir": "/stack",
                           "engine_url": "http://127.0.0.1:31000", "engine_api_key": "k"})
    env: dict[str, str] = {"CLAWRL_STATE_DIR": "/mine"}
    assert statefile.apply_to_env(env) is not None
    assert env == {"CLAWRL_DATABASE__URL": "postgresql://u@h/stack",
                   "CLAWRL_STATE_DIR": "/mine", "CLAWRL_ENGINE__URL": "http://127.0.0.1:31000",
                   "CLAWRL_ENGINE__API_KEY": "k"}
    explicit = {"CLAWRL_DATABASE__URL": "postgresql://u@h/other"}
    assert statefile.apply_to_env(explicit) is None
    assert explicit == {"CLAWRL_DATABASE__URL": "postgresql://u@h/other"}
    statefile.remove_stack()
