"""The terminal track's sandbox (clawrl/envs/sandbox.py) and tasks (clawrl/envs/terminal.py):
real shells under real limits, no network, nothing left behind."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest

from clawrl.envs.sandbox import Limits, Sandbox, network_isolated
from clawrl.envs.terminal import NUDGE, TASKS, TerminalEnv, draw_task

ROOT = os.geteuid() == 0


async def test_a_command_runs_in_the_episode_folder_as_the_sandbox_user() -> None:
    box = Sandbox()
    try:
        box.write("sub/data.txt", "three\nlines\nhere\n")
        result = await box.run("pwd; wc -l < sub/data.txt; echo made > out.txt; id -u")
        lines = result.output.split()
        assert result.exit_code == 0 and not result.timed_out
        assert lines[0] == str(box.path) and lines[1] == "3"
        assert box.read("out.txt") == "made\n"
        if ROOT:  # a uid of its own, not root
            assert lines[2] == str(box.uid) and box.uid != 0
            assert box.path.stat().st_mode & 0o777 == 0o700
    finally:
        box.close()


@pytest.mark.skipif(not network_isolated(), reason="unshare cannot make a network namespace here")
async def test_the_sandbox_has_no_network() -> None:
    with socket.socket() as server:  # a listener the host itself can reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), 1).close()
        box = Sandbox()
        try:
            code = f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)"
            result = await box.run(f'python3 -c "{code}"')
            assert result.exit_code != 0 and "Network is unreachable" in result.output
            result = await box.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1")
            assert result.output.split() == ["lo"]  # no interface but a downed loopback
        finally:
            box.close()


async def test_limits_are_enforced() -> None:
    box = Sandbox(Limits(cpu_s=1, memory_mb=256, processes=8, file_mb=1, timeout_s=20,
                         output_bytes=1000))
    try:
        big = await box.run("yes > big")  # file size: SIGXFSZ at 1 MB
        assert "File size limit exceeded" in big.output
        assert (box.path / "big").stat().st_size == 1 << 20
        started = time.monotonic()
        spin = await box.run("while :; do :; done")  # CPU: SIGXCPU after 1 s, not the timeout
        assert not spin.timed_out and spin.exit_code == 128 + 24, spin
        assert "CPU time limit exceeded" in spin.output and time.monotonic() - started < 15
        memory = await box.run("python3 -c 'bytearray(400 * 2**20)'")
        assert memory.exit_code == 1 and "MemoryError" in memory.output
        if ROOT or network_isolated():  # counted for the sandbox's own uid
            forks = await box.run("for i in $(seq 20); do sleep 3 & done; wait")
            assert forks.exit_code != 0 and "Cannot fork" in forks.output
        chatty = await box.run("yes | head -c 100000")
        assert chatty.truncated and len(chatty.output) == 1000
        assert "[output truncated]" in chatty.describe()
    finally:
        box.close()


async def test_a_command_past_its_time_is_killed_with_its_children() -> None:
    box = Sandbox(Limits(timeout_s=1.0))
    try:
        started = time.monotonic()
        result = await box.run("sleep 60 & sleep 60; echo never")
        assert result.timed_out and "never" not in result.output
        assert time.monotonic() - started < 10
        assert "ran past its time limit" in result.describe()
        assert (await box.run("echo still usable")).output == "still usable\n"
    finally:
        box.close()


@pytest.mark.skipif(not ROOT, reason="leftovers are found by the sandbox's own uid (root)")
async def test_close_kills_what_was_left_and_removes_the_folder() -> None:
    box = Sandbox()
    await box.run("setsid sleep 300 > /dev/null 2>&1 & nohup sleep 300 > /dev/null 2>&1 &")
    uid, path = box.uid, box.path
    box.close()
    assert not path.exists()
    assert [p.pid for p in psutil.process_iter() if p.uids().real == uid] == []
    box.close()  # idempotent


async def test_the_verifier_does_not_follow_links_out_of_the_sandbox() -> None:
    box = Sandbox()
    try:
        await box.run("ln -s /etc/hostname note.txt; mkdir dir.txt")
        assert box.read("note.txt") is None and box.read("dir.txt") is None
        assert box.exists("note.txt")
        with pytest.raises(ValueError):
            box.read("../etc/hostname")
    finally:
        box.close()


@pytest.mark.parametrize("name", list(TASKS))
async def test_each_task_fails_untouched_and_passes_when_solved(name: str) -> None:
    seed = list(TASKS).index(name)
    env = TerminalEnv(seed)
    assert env.task.name == name == draw_task(seed).name
    try:
        obs = await env.reset()
        assert obs.tools[0]["function"]["name"] == "run" and obs.task == name
        assert await env.outcome() == -1.0
        call = {"id": "c1", "type": "function", "function": {
            "name": "run", "arguments": json.dumps({"command": env.task.solution})}}
        step = await env.step({"role": "assistant", "content": "", "tool_calls": [call]})
        assert not step.done and step.messages[0]["role"] == "tool"
        assert step.messages[0]["tool_call_id"] == "c1"
        assert step.messages[0]["content"].startswith("exit code 0")
        assert await env.outcome() == 1.0
        assert (await env.step({"role": "assistant", "content": "Done."})).done
    finally:
        await env.close()


async def test_bad_tool_calls_and_text_replies_get_a_next_state() -> None:
    env = TerminalEnv(0)
    await env.reset()
    try:
        nudge = await env.step({"role": "assistant", "content": "hello"})  # no command yet
        assert not nudge.done and nudge.messages == [{"role": "user", "content": NUDGE}]
        calls = [{"id": "a", "function": {"name": "ls", "arguments": "{}"}},
                 {"id": "b", "function": {"name": "run", "arguments": "{not json"}},
                 {"id": "c", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]
        step = await env.step({"role": "assistant", "content": "", "tool_calls": calls})
        texts = [m["content"] for m in step.messages]
        assert [m["tool_call_id"] for m in step.messages] == ["a", "b", "c"]
        assert "unknown tool 'ls'" in texts[0] and "not valid JSON" in texts[1]
        assert "non-empty string argument" in texts[2]
        assert not (await env.step({"role": "assistant", "content": "done"})).done  # none ran
    finally:
        await env.close()
