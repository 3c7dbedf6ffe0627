"""The embedded-Postgres default and `clawrl up` end to end.

Embedded Postgres runs as a separate system user when we are root and makes the parent
directories of its data dir world-readable, so its state dirs live under /tmp.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="clawrl-state-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def clawrl(args: list[str], state_dir: Path, timeout: float = 180,
           **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    environ.update(CLAWRL_STATE_DIR=str(state_dir), **env)
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def postgres_running(pgdata: Path) -> bool:
    pid_file = pgdata / "postmaster.pid"
    if not pid_file.is_file():
        return False
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_embedded_postgres_is_the_default(state_dir: Path) -> None:
    """No database URL: each command starts the embedded server, uses it, stops it on exit."""
    done = clawrl(["db", "upgrade"], state_dir)
    assert done.returncode == 0, done.stderr
    pgdata = state_dir / "pg"
    assert (pgdata / "PG_VERSION").is_file()
    assert not postgres_running(pgdata)
    done = clawrl(["users", "create", "alice"], state_dir)
    assert done.returncode == 0, done.stderr
    done = clawrl(["sql", "SELECT name FROM users"], state_dir)
    assert done.returncode == 0, done.stderr
    assert "alice" in done.stdout and "(1 row)" in done.stdout
    assert not postgres_running(pgdata)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """stdout of `proc` up to the line holding `marker` (the child never reads stdin)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r} from clawrl up:\n{''.join(seen)}")


def test_up_exit_after_ready_on_embedded_postgres(state_dir: Path,
                                                  tiny_model_dir: Path) -> None:
    done = clawrl(["up", "--model", str(tiny_model_dir), "--proxy-port", str(free_port()),
                   "--engine-port", str(free_port()), "--exit-after-ready"], state_dir,
                  timeout=300, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"API key\s+ck-\w+-\S+", done.stdout)
    assert "/v1" in done.stdout and "Ctrl-C stops everything." in done.stdout
    assert not postgres_running(state_dir / "pg")
    logs = state_dir / "logs"
    assert {p.name for p in logs.iterdir()} >= {"engine.log", "proxy.log"}


def test_up_serves_and_stops_on_sigterm(state_dir: Path, tiny_model_dir: Path,
                                        db_url: str) -> None:
    """The printed key works through the printed base URL; a dead worker is restarted;
    SIGTERM stops every child."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    environ.update(CLAWRL_DATABASE__URL=db_url, OMP_NUM_THREADS="1")
    up = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "up", "--state-dir", str(state_dir), "--model",
         str(tiny_model_dir), "--proxy-port", str(port), "--engine-port", str(free_port()),
         "--no-train"], cwd=ROOT, env=environ, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = read_until(up, "Ctrl-C stops everything.", 300)
        key = re.search(r"API key\s+(ck-\S+)", out)
        base = re.search(r"base URL\s+(\S+)", out)
        assert key and base and base.group(1) == f"http://127.0.0.1:{port}/v1"
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3  # engine, proxy, judge (and their helpers)
        client = OpenAI(base_url=base.group(1), api_key=key.group(1), max_retries=0)
        reply = client.chat.completions.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.role == "assistant"
        # A worker that dies is restarted; the stack keeps serving.
        judge = next(c for c in children if "judge" in c.cmdline())
        judge.kill()
        read_until(up, "the judge exited with code -9", 30)
        read_until(up, "restarting it (1/5)", 5)
        time.sleep(6)  # past the restart delay: the new judge is a child too
        children = psutil.Process(up.pid).children(recursive=True)
        assert any("judge" in c.cmdline() for c in children)
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=120)
        assert up.returncode == 0, out + rest
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT u.name, t.status FROM turns t JOIN users u "
                            "ON u.id = t.user_id").fetchall()
    assert rows == [("demo", "ok")]


@pytest.mark.parametrize("args, env, message", [
    (["--model", "/nonexistent"], {}, "--model /nonexistent: no Hugging Face model there"),
    ([], {"CLAWRL_DATABASE__URL": "postgresql://postgres@127.0.0.1:1/x"}, "database: "),
    ([], {"CLAWRL_DATABASE__URL": "nonsense"}, "database: "),
])
def test_up_bad_input_is_one_line(state_dir: Path, args: list[str], env: dict[str, str],
                                  message: str) -> None:
    done = clawrl(["up", "--proxy-port", str(free_port()), "--engine-port", str(free_port()),
                   *args], state_dir, timeout=60, **env)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("clawrl up:")]
    assert len(errors) == 1 and message in errors[0], done.stderr


def test_up_port_in_use_is_one_line(state_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = clawrl(["up", "--proxy-port", str(port)], state_dir, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"clawrl up: port {port} for the proxy is in use "
                                   "(Address already in use); pick another with --proxy-port")
