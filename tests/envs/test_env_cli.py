"""`clawrl env` and `clawrl bench env` as a user runs them: bad input is one line, a real run
against the real proxy prints its table."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawrl.bench.procs import BenchProcs
from clawrl.bench.proxy import make_key
from proxy.auth import VERIFIER

ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def clawrl(*args: str, env: dict[str, str] | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("args", "message"), [
    (["nope"], "clawrl env: unknown environment 'nope' (known: terminal, toolcall, swe, gui)"),
    (["toolcall", "--split", "dev"], "clawrl env: unknown split 'dev' (train or heldout)"),
    (["terminal", "--split", "heldout"],
     "clawrl env: --split applies to the toolcall, swe and gui environments, not 'terminal'"),
    (["gui", "--split", "dev"], "clawrl env: unknown split 'dev' (train or heldout)"),
    (["swe", "--screenshots", "x"],
     "clawrl env: --screenshots applies to the gui environment, not 'swe'"),
    (["swe", "--split", "dev"], "clawrl env: unknown split 'dev' (train or heldout)"),
    (["swe", "--tasks", "text"], "clawrl env: --tasks applies to the terminal environment"),
    (["toolcall", "--tasks", "write_file"],
     "clawrl env: --tasks applies to the terminal environment, not 'toolcall'"),
    (["terminal", "--tasks", "write_file,fly"], "clawrl env: unknown terminal task 'fly'"),
    (["terminal", "--episodes", "0"], "clawrl env: --episodes must be at least 1"),
    (["terminal", "--episodes", "x"], "clawrl env: argument --episodes: invalid int value"),
    (["terminal", "--temperature", "9"], "clawrl env: --temperature must be in [0, 2]"),
    ([], "clawrl env: the following arguments are required: NAME"),
])
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    out = clawrl("env", *args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(message), out.stderr


def test_no_proxy_or_no_key_is_one_line(tmp_path: Path) -> None:
    env = {"CLAWRL_STATE_FILE": str(tmp_path / "none.json"), "CLAWRL_API_KEY": ""}
    out = clawrl("env", "terminal", env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("clawrl env: no proxy: pass --base-url")
    out = clawrl("env", "terminal", "--base-url", "http://127.0.0.1:9/v1", env=env)
    assert out.returncode == 1 and out.stderr.startswith("clawrl env: no API key")


def test_clawrl_env_runs_episodes_through_the_proxy(db_url: str, tmp_path: Path) -> None:
    key = asyncio.run(make_key(db_url, scopes=[VERIFIER]))
    with BenchProcs(db_url, tmp_path) as procs:
        procs.configure(tool_command="wc -l < data.txt > count.txt")
        out = clawrl("env", "terminal", "--base-url", f"{procs.proxy_url}/v1", "--api-key", key,
                     "--episodes", "3", "--concurrency", "3", "--tasks", "count_lines,uppercase",
                     "--model", "bench", "--json", str(tmp_path / "episodes.json"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("sandbox network: ")
    assert any(line.split()[:4] == ["count_lines", "2", "2", "1.00"] for line in lines), lines
    assert any(line.split()[:4] == ["uppercase", "1", "0", "0.00"] for line in lines), lines
    assert "3 episodes in" in out.stdout and "2 solved (0.67)" in out.stdout
    assert (tmp_path / "episodes.json").is_file()


def test_clawrl_env_runs_swe_episodes_through_the_proxy(db_url: str, tmp_path: Path) -> None:
    """The stand-in agent calls run_tests, answers the results with text (nudged back to the
    tools), and never fixes anything: the table shows the held-out tasks unsolved."""
    key = asyncio.run(make_key(db_url, scopes=[VERIFIER]))
    with BenchProcs(db_url, tmp_path) as procs:
        procs.configure(tool_command="-", tool_name="run_tests")
        out = clawrl("env", "swe", "--base-url", f"{procs.proxy_url}/v1", "--api-key", key,
                     "--episodes", "2", "--concurrency", "2", "--max-steps", "3", "--split",
                     "heldout", "--model", "bench", "--json", str(tmp_path / "episodes.json"))
    assert out.returncode == 0, out.stderr
    assert "2 episodes in" in out.stdout and "0 solved (0.00)" in out.stdout
    episodes = json.loads((tmp_path / "episodes.json").read_text())["episodes"]
    for e in episodes:
        assert e["outcome"] == -1.0 and e["steps"] == 3 and e["error"] is None
        assert e["details"]["split"] == "heldout" and e["details"]["calls"][0] == "run_tests"
        assert e["details"]["test_runs"][0][1] >= 1  # the visible tests failed, as seeded


def test_bench_env_swe_solves_every_episode_and_leaves_nothing() -> None:
    out = clawrl("bench", "env", "--env", "swe", "--concurrency", "1,3", "--episodes", "2,3")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()
            if line.split()[:1] in (["1"], ["3"]) and len(line.split()) == 10]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("1", "2", "1.00"), ("3", "3", "1.00")]
    assert "3 at a time: left behind 0 processes, 0 folders, 0 mounts" in out.stdout


def test_bench_env_prints_episodes_per_second() -> None:
    out = clawrl("bench", "env", "--concurrency", "1,4", "--episodes", "2,4", "--overhead", "5",
                 env={"CLAWRL_DATABASE__URL": ADMIN_URL})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "episodes/s" in out.stdout and "the proxy adds" in out.stdout
    assert "4 at a time: 8 steps -> 8 turns in Postgres, 4 sessions, 4 with their outcome" \
        in out.stdout


def test_the_proxy_is_the_stack_the_admin_commands_act_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two stacks running: A started last, B in this folder's .clawrl. `clawrl env` sends its
    episodes to B's proxy (and says it is not the last started), as `clawrl users` acts on
    B; named by CLAWRL_STATE_DIR, the same; elsewhere, the last started."""
    from clawrl.base import statefile
    from clawrl.envs.cli import chosen_stack

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def record(path: Path, pid: int, state_dir: Path, port: int) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({
                "pid": pid, "pid_start": statefile._process_start(pid),
                "state_dir": str(state_dir), "proxy_url": f"http://127.0.0.1:{port}"}))

        a_dir, b_dir = tmp_path / "a" / ".clawrl", tmp_path / "b" / ".clawrl"
        monkeypatch.setenv("CLAWRL_STATE_FILE", str(tmp_path / "last.json"))
        record(tmp_path / "last.json", os.getpid(), a_dir, 1111)
        record(a_dir / statefile.STACK_FILE, os.getpid(), a_dir, 1111)
        record(b_dir / statefile.STACK_FILE, sleeper.pid, b_dir, 2222)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        stack = chosen_stack({}, cwd=b_dir.parent)
        assert stack is not None and stack["proxy_url"].endswith(":2222")
        assert "not the last started one" in capsys.readouterr().err
        stack = chosen_stack({"CLAWRL_STATE_DIR": str(b_dir)}, cwd=elsewhere)
        assert stack is not None and stack["proxy_url"].endswith(":2222")
        assert "the state dir given" in capsys.readouterr().err
        stack = chosen_stack({}, cwd=elsewhere)
        assert stack is not None and stack["proxy_url"].endswith(":1111")
        assert capsys.readouterr().err == ""
        # A state dir named with no stack running there: no proxy, never the last started.
        assert chosen_stack({"CLAWRL_STATE_DIR": str(tmp_path / "idle")}, cwd=elsewhere) is None
    finally:
        sleeper.kill()
        sleeper.wait()
