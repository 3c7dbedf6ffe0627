"""The env pool (clawrl/envs/pool.py) against the real proxy (`clawrl proxy`, its own
process) in front of the stand-in engine acting as an agent (clawrl/bench/fake_engine.py
`tool_command`), and a real Postgres: sessions, tool results as next states, outcomes.

The tests share one proxy, stand-in and database; each reads back only the sessions of its
own prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from clawrl.base.db import libpq_url
from clawrl.bench.procs import BenchProcs
from clawrl.bench.proxy import make_key
from clawrl.envs.pool import PoolConfig, run_pool, step_seed
from clawrl.envs.terminal import NUDGE
from proxy.auth import VERIFIER


@pytest.fixture(scope="module")
def procs(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchProcs]:
    with BenchProcs(module_db_url, tmp_path_factory.mktemp("procs")) as running:
        yield running


@pytest.fixture
def db_url(module_db_url: str) -> str:
    """The shared database (the proxy's)."""
    return module_db_url


def query(db_url: str, sql: str, wait_for: int = 0) -> list[Any]:
    """Rows of `sql`, waiting (up to 20 s) for at least `wait_for` of them: the proxy stores
    turns after it has replied."""
    deadline = time.monotonic() + 20
    while True:
        with psycopg.connect(libpq_url(db_url)) as conn:
            rows = conn.execute(sql).fetchall()
        if len(rows) >= wait_for or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


async def test_episodes_log_sessions_next_states_and_outcomes(procs: BenchProcs,
                                                              db_url: str) -> None:
    # The stand-in agent runs `rm -f *.log`: it solves delete_logs, never count_lines.
    procs.configure(tool_command="rm -f *.log")
    key = await make_key(db_url, scopes=[VERIFIER])
    cfg = PoolConfig(episodes=4, concurrency=4, max_steps=4, model="bench", session_prefix="t",
                     options={"tasks": ["delete_logs", "count_lines"]})
    result = await run_pool(cfg, f"{procs.proxy_url}/v1", key)
    assert result.errors() == {}
    by_index = {e.index: e for e in result.episodes}
    assert [by_index[i].task for i in range(4)] == ["delete_logs", "count_lines"] * 2
    assert [by_index[i].outcome for i in range(4)] == [1.0, -1.0, 1.0, -1.0]
    assert all(e.steps == 2 and not e.done_sent for e in result.episodes)  # call, then text

    sessions = query(db_url, "SELECT external_id, outcome, outcome_source FROM sessions "
                     "WHERE external_id LIKE 't-%' ORDER BY external_id", wait_for=4)
    ids = {e.index: e.session_id for e in result.episodes}
    assert sessions == sorted((ids[i], 1.0 if i % 2 == 0 else -1.0, "api") for i in range(4))
    turns = query(db_url, "SELECT s.external_id, t.index_in_session, t.state, t.next_state, "
                  "t.request_messages, t.response_message FROM turns t JOIN sessions s "
                  "ON s.id = t.session_id WHERE s.external_id LIKE 't-%' "
                  "ORDER BY s.external_id, t.index_in_session",
                  wait_for=8)
    assert len(turns) == 8  # every step is a turn of its episode's session
    for first, second in zip(turns[::2], turns[1::2], strict=True):
        assert first[0] == second[0] and (first[1], second[1]) == (0, 1)
        call = first[5]["tool_calls"][0]
        assert call["function"]["name"] == "run"
        # the tool result is the first turn's next state, and the second turn's last message
        assert first[2] == "continued" and len(first[3]) == 1
        tool = first[3][0]
        assert tool["role"] == "tool" and tool["tool_call_id"] == call["id"]
        assert tool["content"].startswith("exit code 0")
        assert second[4][-1] == tool and second[2] == "open"  # a final answer: no next state


async def test_a_group_runs_each_task_that_many_times(procs: BenchProcs, db_url: str) -> None:
    """`group` episodes share their environment's seed (GRPO's groups: the trainer's
    group_mean baseline compares them), each still its own session."""
    procs.configure(tool_command="rm -f *.log")
    key = await make_key(db_url, scopes=[VERIFIER])
    cfg = PoolConfig(episodes=4, concurrency=4, max_steps=2, model="bench", session_prefix="g",
                     group=2, options={"tasks": ["delete_logs", "count_lines"]})
    result = await run_pool(cfg, f"{procs.proxy_url}/v1", key)
    by_index = {e.index: e for e in result.episodes}
    assert [by_index[i].task for i in range(4)] == ["delete_logs"] * 2 + ["count_lines"] * 2
    assert [by_index[i].outcome for i in range(4)] == [1.0, 1.0, -1.0, -1.0]
    assert len({e.session_id for e in result.episodes}) == 4
    # Each step is sampled with its own seed (OpenAI's `seed`, stored with the turn's
    # params): a group's episodes of one task are not the same draw, and a repeated run is.
    seeds = query(db_url, "SELECT s.external_id, t.index_in_session, t.params->>'seed' "
                  "FROM turns t JOIN sessions s ON s.id = t.session_id "
                  "WHERE s.external_id LIKE 'g-%'", wait_for=8)
    by_session = {e.session_id: e.index for e in result.episodes}
    assert sorted((by_session[sid], step, int(seed)) for sid, step, seed in seeds) == [
        (i, step, step_seed(0, i, step + 1)) for i in range(4) for step in range(2)]
    assert len({int(seed) for *_, seed in seeds}) == 8


async def test_the_last_allowed_step_closes_the_session(procs: BenchProcs, db_url: str) -> None:
    procs.configure(tool_command="ls")
    key = await make_key(db_url, scopes=[VERIFIER])
    cfg = PoolConfig(episodes=2, concurrency=2, max_steps=1, model="bench", session_prefix="d",
                     options={"tasks": ["count_lines"]})
    result = await run_pool(cfg, f"{procs.proxy_url}/v1", key)
    assert result.errors() == {} and all(e.done_sent and e.steps == 1 for e in result.episodes)
    rows = query(db_url, "SELECT s.closed_at IS NOT NULL, s.outcome, t.state FROM sessions s "
                 "JOIN turns t ON t.session_id = s.id WHERE s.external_id LIKE 'd-%'",
                 wait_for=2)
    assert rows == [(True, -1.0, "closed")] * 2


async def test_a_reply_without_a_command_is_answered_with_a_nudge(procs: BenchProcs,
                                                                  db_url: str) -> None:
    procs.configure(tool_command="")  # the stand-in only ever writes text
    key = await make_key(db_url, scopes=[VERIFIER])
    cfg = PoolConfig(episodes=1, concurrency=1, max_steps=2, model="bench", session_prefix="n")
    result = await run_pool(cfg, f"{procs.proxy_url}/v1", key)
    assert [(e.steps, e.outcome, e.done_sent) for e in result.episodes] == [(2, -1.0, True)]
    rows = query(db_url, "SELECT t.index_in_session, t.state, t.next_state FROM turns t "
                 "JOIN sessions s ON s.id = t.session_id WHERE s.external_id LIKE 'n-%' "
                 "ORDER BY t.index_in_session", wait_for=2)
    assert rows == [(0, "continued", [{"role": "user", "content": NUDGE}]), (1, "closed", None)]


async def test_a_failing_proxy_fails_the_episode_not_the_pool(procs: BenchProcs,
                                                              db_url: str) -> None:
    result = await run_pool(PoolConfig(episodes=2, concurrency=2, model="bench"),
                            f"{procs.proxy_url}/v1", "ck-not-a-key")
    assert result.errors() == {"HTTP 401": 2} and result.episodes_per_s == 0.0
    assert all(e.outcome is None for e in result.episodes)
