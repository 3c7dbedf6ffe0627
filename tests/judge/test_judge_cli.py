"""The `clawrl judge` command line: settings errors, rejudge input, graceful SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from judgedb import add_turn, add_user, jobs
from sqlalchemy import Engine

from judge.config import load_judge_settings
from judge.worker import backoff_s


def clawrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_openai_backend_needs_url_and_model() -> None:
    with pytest.raises(ValueError, match="CLAWRL_JUDGE__OPENAI__BASE_URL"):
        load_judge_settings(judge={"backend": "openai"})
    s = load_judge_settings(judge={"backend": "openai", "openai": {
        "base_url": "https://api.example.com/v1", "model": "m", "api_key": "sk-secret"}})
    assert "sk-secret" not in repr(s)
    assert (s.judge.votes, s.judge.temperature) == (3, 0.6)


def test_backoff_is_exponential_and_capped() -> None:
    s = load_judge_settings(judge={"backoff_base_s": 2, "backoff_max_s": 10}).judge
    assert [backoff_s(a, s) for a in (1, 2, 3, 4, 5)] == [2, 4, 8, 10, 10]


def test_bad_input_is_one_line_and_non_zero(db_url: str) -> None:
    env = {"CLAWRL_DATABASE__URL": db_url}
    out = clawrl("judge", "rejudge", "--since", "yesterday", env=env)
    assert out.returncode == 2 and "bad time" in out.stderr
    out = clawrl("judge", "rejudge", "--since", "2026-01-01", "--prompt-version", "v9", env=env)
    assert out.returncode == 2 and "unknown prompt version 'v9'" in out.stderr
    out = clawrl("judge", env={**env, "CLAWRL_JUDGE__BACKEND": "openai"})
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "CLAWRL_JUDGE__OPENAI__BASE_URL" in out.stderr
    out = clawrl("judge", env={"CLAWRL_DATABASE__URL": "postgresql://nobody@127.0.0.1:1/x"})
    assert out.returncode == 1 and out.stderr.startswith("clawrl judge: cannot use the database")
    assert out.stderr.count("\n") == 1
    out = clawrl("judge", "rejudge", "--since", "2026-01-01",
                 env={"CLAWRL_DATABASE__URL": "postgresql://nobody@127.0.0.1:1/x"})
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr


def test_rejudge_command_enqueues(db: Engine, db_url: str) -> None:
    add_turn(db, add_user(db), job=False)
    out = clawrl("judge", "rejudge", "--since", "2000-01-01T00:00:00Z",
                 env={"CLAWRL_DATABASE__URL": db_url})
    assert out.returncode == 0, out.stderr
    assert "enqueued 1 judge jobs" in out.stdout
    assert [j.payload["prompt_version"] for j in jobs(db)] == ["v1"]


def test_worker_process_stops_gracefully_on_sigterm(db_url: str) -> None:
    env = {**os.environ, "CLAWRL_DATABASE__URL": db_url,
           "CLAWRL_ENGINE__URL": "http://127.0.0.1:9"}
    with subprocess.Popen([sys.executable, "-m", "clawrl.cli.main", "judge", "--name", "w1"],
                          stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stderr is not None
            first = json.loads(proc.stderr.readline())
            assert (first["action"], first["worker"]) == ("worker_start", "w1")
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            actions = [json.loads(line)["action"] for line in proc.stderr.read().splitlines()
                       if line.startswith("{")]
            assert actions[-1] == "worker_stop"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_rejudge_without_a_database_refuses_and_creates_none(tmp_path: os.PathLike[str]) -> None:
    """From a folder with no stack running and no database configured, `clawrl judge rejudge`
    says where it looked in one line; no embedded database appears as a side effect."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env["CLAWRL_STATE_FILE"] = str(os.path.join(tmp_path, "no-stack.json"))
    out = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "judge", "rejudge", "--since",
                          "2026-01-01"], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "no running `clawrl up`" in out.stderr
    assert os.listdir(tmp_path) == []
