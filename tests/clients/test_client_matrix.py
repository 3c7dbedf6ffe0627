"""The client matrix: seven OpenAI client libraries, unchanged and pointed at a real `clawrl up`
as docs/clients.md tells a user to, each through chat, streaming, a tool offered, a tool
round trip, structured output (each library's default way) and the Responses API where the
library has it (instructor: chat, its default and JSON-schema modes, a partial stream and a
retry); every model call the library made must be a stored turn whose request and reply are
what the library sent and got back.

The libraries come with the `clients` extra (pyproject.toml), pinned; instructor, which cannot
share the main venv's openai, in a venv of its own that `make install` makes
($(VENV)/clients/instructor, tests/clients/instructor-requirements.txt); without it its cases
are skipped, saying how to make it. One stack serves the
whole module: `clawrl up` on the shipped tool-call tiny world model
(clawrl/world/prebuilt/tinyworld-tools, no build), without the judge or the trainer. Sampled
greedily it ends its replies (the Agents SDK refuses a Responses reply cut at the token limit),
calls `lookup` on its own for a question about the town, and a grammar makes its structured
replies and forced tool calls parse. Each library runs in a child process of its own
(tests/clients/drive.py), all started with the stack, each feature as a user of its own, so
the turns of a feature are that user's turns.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from childproc import free_port
from drive import PROMPTS
from proxyharness import create_user

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("drive.py")
MODEL = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-tools"

ALL = ("chat", "stream", "tools", "roundtrip", "structured", "responses")
FEATURES: dict[str, tuple[str, ...]] = {
    "openai": ALL,
    "langchain-openai": ALL,
    # Every call of the Agents SDK's default model is a Responses API call.
    "openai-agents": ALL[:-1],
    "pydantic-ai": ALL,
    "litellm": ALL,
    "llm": ALL,
    # chat (response_model=None), structured (its default mode, TOOLS: a forced tool call),
    # json (Mode.JSON_SCHEMA), partial (create_partial, streamed), retries (max_retries).
    "instructor": ("chat", "structured", "json", "partial", "retries"),
}
# The libraries whose round trip forces the first call with `tool_choice` (llm has none).
FORCED = {"openai", "langchain-openai", "openai-agents", "pydantic-ai", "litellm"}
CASES = [(library, feature) for library, features in FEATURES.items() for feature in features]

# instructor's venv, where `make install` makes it: $(VENV)/clients/instructor, beside the venv
# running the tests (or this checkout's .venv, for a worktree run by another checkout's venv).
INSTRUCTOR_REQUIREMENTS = Path(__file__).with_name("instructor-requirements.txt")
INSTRUCTOR_PYTHON = next((python for venv in (Path(sys.prefix), REPO / ".venv") if (
    python := venv / "clients" / "instructor" / "bin" / "python").exists()), None)
PYTHONS = {"instructor": INSTRUCTOR_PYTHON} if INSTRUCTOR_PYTHON else {}
MISSING = {} if INSTRUCTOR_PYTHON else {"instructor": (
    f"instructor's own venv is missing ({Path(sys.prefix)}/clients/instructor): `make "
    f"install` makes it, or: python3.11 -m venv --without-pip VENV/clients/instructor && "
    f"VENV/bin/pip --python VENV/clients/instructor/bin/python install -r "
    f"{INSTRUCTOR_REQUIREMENTS.relative_to(REPO)}")}


@dataclass
class Driver:
    """One library's driver (drive.py): started at once, so it imports while the stack
    starts; `go` hands it the base URL."""

    library: str
    proc: subprocess.Popen[str]
    report_path: Path
    log_path: Path

    @classmethod
    def start(cls, library: str, keys: dict[str, str], folder: Path) -> Driver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
        # litellm fetches its model price list from GitHub at import unless told not to; the
        # Agents SDK exports traces to OpenAI unless told not to (drive.py turns it off too).
        env.update(CLAWRL_KEYS=json.dumps(keys), LITELLM_LOCAL_MODEL_COST_MAP="True",
                   OPENAI_AGENTS_DISABLE_TRACING="1")
        log = folder / f"{library}.log"
        python = PYTHONS.get(library, Path(sys.executable))
        with log.open("w") as out:
            proc = subprocess.Popen([str(python), str(DRIVER), library,
                                     str(folder / f"{library}.json")], env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
        return cls(library, proc, folder / f"{library}.json", log)

    def go(self, base_url: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(base_url + "\n")
        self.proc.stdin.close()

    def report(self) -> dict[str, Any]:
        code = self.proc.wait(timeout=300)
        assert code == 0, self.log_path.read_text(errors="replace")[-3000:]
        return dict(json.loads(self.report_path.read_text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()


@dataclass
class Matrix:
    db_url: str
    users: dict[tuple[str, str], tuple[int, str]]  # (library, feature): (user id, key)
    drivers: dict[str, Driver]

    def turns(self, user_id: int, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The user's turns once `count` are stored (the proxy writes them just after
        replying); more than `count` (a call the library made twice) fails too."""
        deadline = time.monotonic() + timeout_s
        while True:
            with psycopg.connect(self.db_url) as conn:
                cur = conn.execute(
                    "SELECT id, uid, session_id, index_in_session, kind, status, state, "
                    "request_messages, tools, params, response_message, finish_reason, "
                    "next_state, next_turn_id, sampling FROM turns WHERE user_id = %s "
                    "ORDER BY id", (user_id,))
                names = [c.name for c in cur.description or ()]
                rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            if len(rows) >= count or time.monotonic() > deadline:
                assert len(rows) == count, (count, rows)
                return rows
            time.sleep(0.05)


@pytest.fixture(scope="module")
def matrix(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    """`clawrl up` as a user starts it, on this module's database, a user per library and
    feature, and every library's driver (all at once: mostly imports, then waiting)."""
    users = {case: create_user(module_db_url, "-".join(case)) for case in CASES}
    folder = tmp_path_factory.mktemp("clients")
    drivers = {library: Driver.start(library, {f: users[library, f][1] for f in features},
                                     folder) for library, features in FEATURES.items()
               if library not in MISSING}
    state = folder / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env.update(CLAWRL_DATABASE__URL=module_db_url, CLAWRL_STATE_FILE=str(state / "stack.json"),
               OMP_NUM_THREADS="1")
    log = folder / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(state),
             "--model", str(MODEL), "--proxy-port", str(free_port()), "--engine-port",
             str(free_port()), "--no-train", "--no-judge", "--no-judge-engine"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "Ctrl-C stops everything." not in (text := log.read_text(errors="replace")):
            assert up.poll() is None, f"clawrl up exited:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"clawrl up not ready:\n{text[-3000:]}"
            time.sleep(0.2)
        base = re.search(r"base URL\s+(\S+)", text)
        assert base is not None, text
        for driver in drivers.values():
            driver.go(base.group(1))
        yield Matrix(module_db_url, users, drivers)
    finally:
        for driver in drivers.values():
            driver.stop()
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content)
    return content or ""


def _last_user(messages: list[dict[str, Any]]) -> str:
    return _text(next(m for m in reversed(messages) if m["role"] == "user")["content"])


def check_call(got: dict[str, Any], turn: dict[str, Any]) -> None:
    """One model call as the library saw it against its turn."""
    assert turn["status"] == "ok" and turn["kind"] == "main", turn
    assert turn["session_id"] is not None
    params = turn["params"]
    assert bool(params.get("stream")) == got["stream"], params
    assert (params.get("api") == "responses") == (got["api"] == "responses"), params
    reply = turn["response_message"]
    # The reply the library surfaced is the one stored (the CLI adds a newline).
    assert _text(reply.get("content")).strip() == got["content"].strip(), (reply, got)
    stored = [{"name": t["function"]["name"], "arguments": json.loads(t["function"]["arguments"]),
               "id": t["id"]} for t in reply.get("tool_calls") or ()]
    assert [{k: v for k, v in t.items() if k != "id"} for t in stored] == \
        [{k: v for k, v in t.items() if k != "id"} for t in got["tool_calls"]], (reply, got)
    for mine, theirs in zip(stored, got["tool_calls"], strict=True):
        assert theirs.get("id") in (None, mine["id"])  # the engine's call id, handed through
    if got.get("id") and re.fullmatch(r"resp_[0-9a-f]{32}", got["id"]):
        assert got["id"] == f"resp_{turn['uid'].hex}"  # a Responses id names its turn


@pytest.mark.parametrize(("library", "feature"), [
    pytest.param(*case, id="-".join(case), marks=[pytest.mark.skip(reason=MISSING[case[0]])]
                 if case[0] in MISSING else []) for case in CASES])
def test_client(library: str, feature: str, matrix: Matrix) -> None:
    report = matrix.drivers[library].report()
    if library == "instructor":  # its venv holds the pinned versions (not an older venv's)
        pins = dict(line.split("==") for line in INSTRUCTOR_REQUIREMENTS.read_text().split()
                    if "==" in line)
        assert report["versions"] == pins, (report["versions"], pins)
    result = report[feature]
    assert result["ok"], f"{library} {feature} raised:\n{result['error']}"
    if "same_as" in result:  # one run covers both (llm's tool call is its round trip)
        feature_run = result["same_as"]
        result = report[feature_run]
    else:
        feature_run = feature
    calls = result["calls"]
    turns = matrix.turns(matrix.users[library, feature_run][0], len(calls))
    for got, turn in zip(calls, turns, strict=True):
        check_call(got, turn)
    first = turns[0]
    assert _last_user(first["request_messages"]) == PROMPTS[feature_run]
    assert first["index_in_session"] == 0

    if feature == "stream":
        assert all(c["stream"] for c in calls)
        # It came in pieces (where the library counts them; llm prints as they come).
        assert all(c.get("chunks", 3) > 2 for c in calls)
    elif feature == "tools":  # offered, and called by the model's own choice
        assert [t["function"]["name"] for t in first["tools"]] == ["lookup"]
        assert [t["name"] for t in calls[0]["tool_calls"]] == ["lookup"]
        assert first["finish_reason"] == "tool_calls"
        assert "tool_choice" not in (first["sampling"]["constraint"] or {})
        check_round_trip(result, turns)  # the agents run the tool and go on
    elif feature == "roundtrip":
        assert len(turns) >= 2
        if library in FORCED:
            assert "tool_choice" in first["sampling"]["constraint"], first["sampling"]
        check_round_trip(result, turns)
    elif feature == "structured":
        check_structured(result, first)
    elif feature == "responses":
        assert all(c["api"] == "responses" for c in calls)
    elif feature == "json":  # instructor's Mode.JSON_SCHEMA: response_format, not a tool
        assert "response_format" in first["sampling"]["constraint"], first["sampling"]
        check_structured(result, first)
    elif feature == "partial":  # streamed, the object filled in as the JSON text came
        [call] = calls
        assert call["stream"] and call["chunks"] > 2 and result["partials"] > 2, call
        assert "response_format" in first["sampling"]["constraint"], first["sampling"]
        check_structured(result, first)
    elif feature == "retries":  # the first answer turned down, the error sent back, asked again
        assert len(result["attempts"]) == len(turns) == 2, (result, turns)
        assert all("tool_choice" in t["sampling"]["constraint"] for t in turns), turns
        assert all("Validation Error found" in out for out in result["tool_outputs"])
        check_round_trip(result, turns, tool="CheckedAnswer")
        check_structured(result, turns[-1])
    if library == "openai-agents":  # its default model: the Responses API, for every call
        assert all(t["params"].get("api") == "responses" for t in turns)


def check_round_trip(result: dict[str, Any], turns: list[dict[str, Any]],
                     tool: str = "lookup") -> None:
    """Tool calls, their results sent back, the next reply: one session, each call's turn
    continued by the next, whose request ends with the results as `tool` messages (the
    earlier turn's next state)."""
    outputs = iter(result["tool_outputs"])
    for call, then in itertools.pairwise(turns):
        calls = call["response_message"]["tool_calls"]
        assert calls and {c["function"]["name"] for c in calls} == {tool}, call
        assert call["state"] == "continued" and call["next_turn_id"] == then["id"], call
        assert then["session_id"] == call["session_id"]
        assert then["index_in_session"] == call["index_in_session"] + 1
        sent = then["request_messages"][-len(calls):]
        assert [(m["role"], m["tool_call_id"], _text(m["content"])) for m in sent] == \
            [("tool", c["id"], next(outputs)) for c in calls], sent
        assert [(m["role"], _text(m["content"])) for m in call["next_state"]] == \
            [(m["role"], _text(m["content"])) for m in sent]
    assert next(outputs, None) is None


def check_structured(result: dict[str, Any], turn: dict[str, Any]) -> None:
    """Decoded under the library's schema: the reply parses into what the library returned."""
    constraint = turn["sampling"]["constraint"]
    if "response_format" in constraint:
        schema = constraint["response_format"]["json_schema"]["schema"]
        value = json.loads(turn["response_message"]["content"])
    else:  # a tool the model must call (pydantic-ai's and instructor's default)
        assert "tool_choice" in constraint, constraint
        [call] = turn["response_message"]["tool_calls"]
        [tool] = [t for t in turn["tools"] if t["function"]["name"] == call["function"]["name"]]
        schema = tool["function"]["parameters"]
        value = json.loads(call["function"]["arguments"])
    assert schema["properties"]["answer"]["enum"] == ["yes", "no"], schema
    assert value == result["parsed"] and value["answer"] in ("yes", "no")
