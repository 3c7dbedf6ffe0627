"""The SWE environment under a hostile patch: code that forks without end, fills the disk,
reaches for the network or links out of the sandbox. Each run is stopped by the terminal
track's sandbox (clawrl/envs/sandbox.py), the episode ends with a clear outcome, and closing it
leaves nothing behind: no process of its uid, no folder, no mount."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import psutil
import pytest

from clawrl.envs.sandbox import Limits, network_isolated
from clawrl.envs.swe.env import SweEnv

ROOT = os.geteuid() == 0

FORK_BOMB = """import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
DISK_FILLER = """for i in range(30):  # 12 MB at most, whatever the limit
    try:
        with open("fill%d" % i, "wb") as f:
            f.write(b"x" * 400000)
    except OSError:
        break
"""


async def inject(env: SweEnv, code: str) -> str:
    """Put `code` at the top of the module (runs when the tests import it), run the tests;
    the run_tests result."""
    module = env.task.module
    first = env.task.files[module].splitlines()[0]
    step = await env.step({"role": "assistant", "content": "", "tool_calls": [
        {"id": "p", "type": "function", "function": {"name": "replace_in_file", "arguments":
         json.dumps({"path": module, "old": first, "new": first + "\n" + code})}},
        {"id": "t", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]})
    assert step.messages[0]["content"].startswith("replaced")
    return str(step.messages[1]["content"])


def mounts() -> str:
    return Path("/proc/mounts").read_text()


def on_host(path: str) -> bool:
    return os.path.lexists(path)


async def close_and_check(env: SweEnv) -> None:
    assert env.sandbox is not None
    path, uid = env.sandbox.path, env.sandbox.uid
    await env.close()
    assert not path.exists()
    assert str(path) not in mounts()
    if uid is not None:
        left = []
        for p in psutil.process_iter():
            try:
                if p.uids().real == uid:
                    left.append(p.pid)
            except psutil.Error:
                continue
        assert left == []


@pytest.mark.skipif(not (ROOT or network_isolated()),
                    reason="the process limit counts the caller's own processes here")
async def test_a_fork_bomb_ends_the_episode_and_leaves_nothing() -> None:
    env = SweEnv(3, limits=Limits(cpu_s=1, timeout_s=2, processes=16))
    await env.reset()
    try:
        result = await inject(env, FORK_BOMB)
        assert "[the episode ends: the tests hit the sandbox's" in result, result
        assert env.ended_by.startswith("limit: ")
        assert await env.outcome() == -1.0 and env.details()["hidden_passed"] == 0
    finally:
        await close_and_check(env)


async def test_filling_the_disk_ends_the_episode_and_leaves_nothing() -> None:
    env = SweEnv(8, limits=Limits(disk_mb=4))
    await env.reset()
    try:
        result = await inject(env, DISK_FILLER)
        assert result.endswith("[the episode ends: the tests hit the sandbox's disk full]")
        assert "[the sandbox's disk is full]" in result
        assert env.ended_by == "limit: disk full"
        assert await env.outcome() == -1.0
        assert env.sandbox is not None
        if env.sandbox.mounted:  # root: a tmpfs of its own, the writes stopped at 4 MB
            assert env.sandbox.disk_used() <= 4 << 20
        else:  # measured after the run: the 12 MB were written, then flagged
            assert env.sandbox.disk_used() > 4 << 20
    finally:
        await close_and_check(env)


@pytest.mark.skipif(not network_isolated(), reason="unshare cannot make a network namespace here")
async def test_reaching_for_the_network_fails_and_the_hidden_tests_decide() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        env = SweEnv(9)
        await env.reset()
        try:
            result = await inject(env, "import socket\n"
                                       f"socket.create_connection(('127.0.0.1', {port}), 2)\n")
            assert "Network is unreachable" in result and "1 error" in result
            assert not env.ended_by  # not a limit: the agent can undo it
            with pytest.raises(TimeoutError):
                server.accept()  # nothing reached the host
            assert await env.outcome() == -1.0
        finally:
            await close_and_check(env)


async def test_a_link_made_by_the_tests_does_not_lead_out() -> None:
    env = SweEnv(10)
    await env.reset()
    try:
        await inject(env, "import os\ntry:\n    os.symlink('/', 'out')\nexcept OSError:\n"
                          "    pass\n")
        assert env.sandbox is not None and env.sandbox.path.joinpath("out").is_symlink()
        step = await env.step({"role": "assistant", "content": "", "tool_calls": [
            {"id": str(i), "type": "function", "function": {"name": name, "arguments":
             json.dumps(args)}} for i, (name, args) in enumerate([
                 ("read_file", {"path": "out/etc/hostname"}),
                 ("replace_in_file", {"path": "out/etc/hostname", "old": "a", "new": "b"}),
                 ("apply_patch", {"diff": "--- /dev/null\n+++ b/out/tmp/clawrl-x\n"
                                          "@@ -0,0 +1 @@\n+x\n"}),
                 ("list_files", {}), ("run_linter", {})])]})
        texts = [m["content"] for m in step.messages]
        assert texts[0] == "error: 'out/etc/hostname' is not a path inside the sandbox"
        assert texts[1] == texts[0]
        assert texts[2] == "error: 'out/tmp/clawrl-x' is not a path inside the sandbox"
        assert not on_host("/tmp/clawrl-x")
        assert "out (1 bytes) (link)" in texts[3]
        assert texts[4].startswith("no problems found")
    finally:
        await close_and_check(env)
