"""The state file of a running `clawrl up` (clawrl/base/statefile.py): where it lives, who may read
it, when it counts, and how it points admin commands at the stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        state_file: Path, tmp_path: Path) -> None:
    statefile.write_stack({"database_url": "postgresql://u@h/stack", "state_dir": "/stack",
                           "engine_url": "http://127.0.0.1:31000", "engine_api_key": "k"})
    env: dict[str, str] = {}
    choice = statefile.apply_to_env(env, cwd=tmp_path)  # no ./.clawrl here: the last started
    assert choice.source == "last_started" and choice.note is None
    assert env == {"CLAWRL_DATABASE__URL": "postgresql://u@h/stack",
                   "CLAWRL_STATE_DIR": "/stack", "CLAWRL_ENGINE__URL": "http://127.0.0.1:31000",
                   "CLAWRL_ENGINE__API_KEY": "k"}
    explicit = {"CLAWRL_DATABASE__URL": "postgresql://u@h/other"}
    assert statefile.apply_to_env(explicit, cwd=tmp_path).record is None
    assert explicit == {"CLAWRL_DATABASE__URL": "postgresql://u@h/other"}
    statefile.remove_stack()


@pytest.fixture
def sleeper() -> Any:
    """Another live process, to stand for a second `clawrl up`."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _record(path: Path, pid: int, state_dir: Path, db: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "pid_start": statefile._process_start(pid),
                                "state_dir": str(state_dir), "database_url": db}))


def test_two_stacks_the_one_named_wins_over_the_last_started(
        state_file: Path, tmp_path: Path, sleeper: Any) -> None:
    """Stack A started last (the user's file names it); stack B runs on another state dir.
    An explicit state dir, or the folder whose ./.clawrl is B's, acts on B, and says so."""
    a_dir, b_dir = tmp_path / "a" / ".clawrl", tmp_path / "b" / ".clawrl"
    _record(state_file, os.getpid(), a_dir, "postgresql://u@h/a")
    _record(a_dir / statefile.STACK_FILE, os.getpid(), a_dir, "postgresql://u@h/a")
    _record(b_dir / statefile.STACK_FILE, sleeper.pid, b_dir, "postgresql://u@h/b")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    env = {"CLAWRL_STATE_DIR": str(b_dir)}
    choice = statefile.apply_to_env(env, cwd=elsewhere)
    assert (choice.source, env["CLAWRL_DATABASE__URL"]) == ("state_dir", "postgresql://u@h/b")
    assert choice.note is not None and str(b_dir) in choice.note and str(a_dir) in choice.note

    env = {}
    choice = statefile.apply_to_env(env, cwd=b_dir.parent)  # run from B's folder
    assert (choice.source, env["CLAWRL_DATABASE__URL"]) == ("folder", "postgresql://u@h/b")
    assert env["CLAWRL_STATE_DIR"] == str(b_dir) and choice.note is not None

    env = {}
    choice = statefile.apply_to_env(env, cwd=a_dir.parent)  # A's own folder: A, no note
    assert env["CLAWRL_DATABASE__URL"] == "postgresql://u@h/a" and choice.note is None

    env = {}
    choice = statefile.apply_to_env(env, cwd=elsewhere)  # nothing here: the last started
    assert env["CLAWRL_DATABASE__URL"] == "postgresql://u@h/a" and choice.note is None


def test_an_explicit_state_dir_never_falls_back_to_another_stack(
        state_file: Path, tmp_path: Path) -> None:
    """A state dir with no stack running: its own (embedded) database or nothing, never
    the last started stack's."""
    a_dir, mine = tmp_path / "a", tmp_path / "mine"
    _record(state_file, os.getpid(), a_dir, "postgresql://u@h/a")
    env = {"CLAWRL_STATE_DIR": str(mine)}
    choice = statefile.apply_to_env(env, cwd=tmp_path)
    assert choice.record is None and choice.state_dir == mine.resolve()
    assert env == {"CLAWRL_STATE_DIR": str(mine)}
    assert choice.note is not None and "not running" in choice.note
    # A folder whose ./.clawrl holds a stopped stack's database: that database.
    (tmp_path / "here" / ".clawrl" / "pg").mkdir(parents=True)
    (tmp_path / "here" / ".clawrl" / "pg" / "PG_VERSION").write_text("15\n")
    env = {}
    choice = statefile.apply_to_env(env, cwd=tmp_path / "here")
    assert choice.source == "folder" and choice.record is None
    assert env == {"CLAWRL_STATE_DIR": str((tmp_path / "here" / ".clawrl").resolve())}
    # A stack that wrote only the user's file is found by the state dir it names.
    env = {"CLAWRL_STATE_DIR": str(a_dir)}
    assert statefile.apply_to_env(env, cwd=tmp_path).record is not None
    assert env["CLAWRL_DATABASE__URL"] == "postgresql://u@h/a"


def test_both_records_are_written_and_removed(state_file: Path, tmp_path: Path) -> None:
    statefile.write_stack({"state_dir": str(tmp_path / "s"), "database_url": "postgresql://x"})
    own = tmp_path / "s" / statefile.STACK_FILE
    assert own.stat().st_mode & 0o777 == 0o600 and statefile.stack_in(tmp_path / "s")
    statefile.remove_stack(tmp_path / "s")
    assert not own.exists() and not state_file.exists()


def test_admin_commands_act_on_the_stack_named(state_file: Path, tmp_path: Path,
                                              db_url: str, sleeper: Any,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Through `clawrl`: the last started stack's database is unreachable, B's is real;
    `--state-dir B` (anywhere in the arguments) lists B's users and says which stack."""
    from clawrl.cli.main import main as clawrl

    for var in ("CLAWRL_DATABASE__URL", "CLAWRL_STATE_DIR", "CLAWRL_ENGINE__URL",
                "CLAWRL_ENGINE__API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    _record(state_file, os.getpid(), a_dir, "postgresql://postgres@127.0.0.1:1/nowhere")
    _record(b_dir / statefile.STACK_FILE, sleeper.pid, b_dir, db_url)
    assert clawrl(["users", "create", "--state-dir", str(b_dir), "bea", "--no-key"]) == 0
    out, err = capsys.readouterr()
    assert "created user bea" in out
    assert err.startswith(f"clawrl users: acting on the stack in {b_dir.resolve()}")
    monkeypatch.delenv("CLAWRL_STATE_DIR")
    monkeypatch.delenv("CLAWRL_DATABASE__URL")
    assert clawrl(["users", "list", f"--state-dir={b_dir}"]) == 0
    assert "bea" in capsys.readouterr().out
    monkeypatch.delenv("CLAWRL_STATE_DIR")
    monkeypatch.delenv("CLAWRL_DATABASE__URL")
    assert clawrl(["users", "list"]) == 1  # the last started: its database is down
    assert "database error at postgresql://postgres@127.0.0.1:1/nowhere" in \
        capsys.readouterr().err
    assert clawrl(["users", "list", "--state-dir"]) == 2
