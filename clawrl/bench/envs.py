"""`clawrl bench env`: episodes/s of the env pool through the real proxy, not the model; with
`--env swe` or `--env gui`, of that environment alone (gui: clawrl/bench/guienv.py).

    clawrl bench env [--concurrency 1,16,64] [--episodes 24,96,192] [--command ls]
                     [--reply-s 0] [--overhead 200] [--json FILE]
    clawrl bench env --env swe [--concurrency 1,16,64] [--episodes 16,64,128] [--json FILE]
    clawrl bench env --env gui [--concurrency 1,4,16] [--episodes 16,32,64] [--json FILE]

Starts the stand-in engine (clawrl/bench/fake_engine.py) as an agent that answers every request
with one `run(COMMAND)` call and the request after a tool result with text, and the real
proxy in front of it logging to a real Postgres (clawrl/bench/procs.py; a scratch database on
CLAWRL_DATABASE__URL's server, else an embedded one), then runs the terminal track's episodes
at each concurrency: each episode is a sandbox set up, 2 chat requests, one sandboxed command,
the check and the outcome posted. Reported per level: episodes/s and steps/s, the chat
request's p50/p99 as the SDK sees it, the proxy's CPU ms per request (compare with `clawrl
bench proxy`, docs/benchmarks.md) and the pool's own CPU per episode (this process and the
sandboxed shells); then whether every step landed in Postgres as a turn of its session and
every episode's outcome on its session; last, one step sent straight to the stand-in and
through the proxy alternately: what the proxy adds per step.

`--env swe` measures the SWE environment (clawrl/envs/swe/env.py) without a model or proxy:
a scripted agent drives each episode's `step` directly, as the pool would with the model's
replies: run_tests, read_file, apply_patch with the generator's known fix, run_tests,
run_linter, finish; then the hidden tests give the outcome. Reported per level: episodes/s,
tool calls/s, the p50/p99 of a run_tests call and of a whole episode, CPU per episode (this
process and the sandboxes' processes), the solved share (1.00 unless the fix or the sandbox
failed), and what was left behind: sandbox processes, folders and tmpfs mounts (0 each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import psycopg

from clawrl.base.db import libpq_url
from clawrl.base.dbcli import upgrade
from clawrl.bench.levels import run_level
from clawrl.bench.procs import BenchProcs
from clawrl.bench.proxy import bench_database, machine_line, make_key, pct
from clawrl.envs.pool import PoolConfig, PoolResult, run_pool
from proxy.auth import VERIFIER


def _cpu_self() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def landed(db_url: str, prefix: str) -> tuple[int, int, int]:
    """(turns, sessions, sessions with an outcome) of the sessions named `prefix…`."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute(
            "SELECT count(t.id), count(DISTINCT s.id), count(DISTINCT s.id) FILTER "
            "(WHERE s.outcome IS NOT NULL) FROM sessions s LEFT JOIN turns t "
            "ON t.session_id = s.id WHERE s.external_id LIKE %s", (prefix + "%",)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def measure(procs: BenchProcs, db_url: str, key: str, args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    assert procs.proxy is not None
    proxy = psutil.Process(procs.proxy.pid)
    rows = []
    for level, (concurrency, episodes) in enumerate(zip(args.concurrency, args.episodes,
                                                        strict=True)):
        cfg = PoolConfig(env="terminal", episodes=episodes, concurrency=concurrency,
                         max_steps=args.max_steps, seed=level * 1000, model="bench",
                         max_tokens=16, session_prefix=f"bench-c{concurrency}")
        proxy0, self0 = sum(proxy.cpu_times()[:2]), _cpu_self()
        result: PoolResult = asyncio.run(run_pool(cfg, f"{procs.proxy_url}/v1", key))
        proxy_s, self_s = sum(proxy.cpu_times()[:2]) - proxy0, _cpu_self() - self0
        steps = sum(e.steps for e in result.episodes)
        requests = [ms for e in result.ok for ms in e.request_ms]
        deadline = time.monotonic() + 30  # the proxy stores turns after replying
        while time.monotonic() < deadline:
            turns, sessions, outcomes = landed(db_url, cfg.session_prefix)
            if turns >= steps and outcomes >= len(result.ok):
                break
            time.sleep(0.5)
        rows.append({"concurrency": concurrency, "episodes": len(result.ok),
                     "errors": len(result.episodes) - len(result.ok),
                     "seconds": result.seconds, "episodes_per_s": result.episodes_per_s,
                     "steps_per_s": result.steps_per_s,
                     "request_p50_ms": pct(requests, 0.5), "request_p99_ms": pct(requests, 0.99),
                     "proxy_cpu_ms_per_request": proxy_s * 1e3 / max(1, steps),
                     "pool_cpu_ms_per_episode": self_s * 1e3 / max(1, len(result.episodes)),
                     "steps": steps, "turns_in_db": turns, "sessions": sessions,
                     "outcomes_in_db": outcomes})
        print(f"  done: {concurrency} at a time", file=sys.stderr, flush=True)
    return rows


async def step_overhead(procs: BenchProcs, key: str, n: int) -> dict[str, float]:
    """One episode's step sent `n` times straight to the stand-in and `n` times through the
    proxy (each in a session of its own), alternating, one at a time, both through the SDK:
    what the proxy adds per step, measured side by side as `clawrl bench proxy` measures it."""
    from openai import AsyncOpenAI

    from clawrl.envs.terminal import RUN_TOOL, TerminalEnv

    env = TerminalEnv(0)
    obs = await env.reset()
    await env.close()
    clients = {"direct": AsyncOpenAI(base_url=f"{procs.upstream_url}/v1", api_key="none"),
               "proxy": AsyncOpenAI(base_url=f"{procs.proxy_url}/v1", api_key=key)}
    times: dict[str, list[float]] = {"direct": [], "proxy": []}
    try:
        for i in range(n + 10):  # the first 10 of each warm up
            for path in ("direct", "proxy") if i % 2 else ("proxy", "direct"):
                headers = {"X-Session-Id": f"overhead-{i}"} if path == "proxy" else {}
                sent = time.perf_counter()
                await clients[path].chat.completions.create(
                    model="bench", messages=obs.messages,  # type: ignore[arg-type]
                    tools=[RUN_TOOL], max_tokens=16, extra_headers=headers)  # type: ignore[list-item]
                if i >= 10:
                    times[path].append((time.perf_counter() - sent) * 1e3)
    finally:
        for client in clients.values():
            await client.close()
    return {f"{path}_{q}": pct(v, f) for path, v in times.items()
            for q, f in (("p50", 0.5), ("p99", 0.99))}


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = (f"{'episodes at once':>16} {'episodes':>8} {'episodes/s':>10} {'steps/s':>8} "
            f"{'request p50':>11} {'p99':>7} {'proxy CPU ms/req':>16} {'pool CPU ms/ep':>14} "
            f"{'errors':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['concurrency']:>16} {r['episodes']:>8} {r['episodes_per_s']:>10.1f} "
              f"{r['steps_per_s']:>8.1f} {r['request_p50_ms']:>11.2f} {r['request_p99_ms']:>7.2f}"
              f" {r['proxy_cpu_ms_per_request']:>16.2f} {r['pool_cpu_ms_per_episode']:>14.1f} "
              f"{r['errors']:>6}")
    print("(request = one chat request through the proxy as the SDK sees it, ms; the stand-in "
          "engine answers at once; pool CPU = this process plus its sandboxed shells)")
    for r in rows:
        print(f"{r['concurrency']} at a time: {r['steps']} steps -> {r['turns_in_db']} turns in "
              f"Postgres, {r['sessions']} sessions, {r['outcomes_in_db']} with their outcome")
    print(machine_line())


SWE_SCRIPT = ("run_tests", "read_file", "apply_patch", "run_tests", "run_linter", "finish")


async def swe_episode(seed: int, tool_ms: dict[str, list[float]]) -> tuple[float, float]:
    """One SWE episode driven by the scripted agent: (outcome, seconds)."""
    from clawrl.envs.swe.env import SweEnv

    start = time.perf_counter()
    env = SweEnv(seed)
    try:
        await env.reset()
        args = {"read_file": {"path": env.task.module},
                "apply_patch": {"diff": env.task.fix_diff}}
        for i, name in enumerate(SWE_SCRIPT):
            call = {"id": f"c{i}", "type": "function", "function": {
                "name": name, "arguments": json.dumps(args.get(name, {}))}}
            sent = time.perf_counter()
            step = await env.step({"role": "assistant", "content": "", "tool_calls": [call]})
            tool_ms.setdefault(name, []).append((time.perf_counter() - sent) * 1e3)
            if step.done:
                break
        outcome = await env.outcome()
    finally:
        await env.close()
    return outcome, time.perf_counter() - start


def leftovers() -> dict[str, int]:
    """Sandbox processes (uids of the sandbox range), folders and tmpfs mounts now."""
    from clawrl.envs.sandbox import UID_RANGE

    procs = 0
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            procs += UID_RANGE[0] <= proc.uids().real < UID_RANGE[1]
    folders = len(list(Path(tempfile.gettempdir()).glob("clawrl-sandbox-*")))
    mounts = Path("/proc/mounts").read_text().count("clawrl-sandbox-") \
        if Path("/proc/mounts").exists() else 0
    return {"processes": procs, "folders": folders, "mounts": mounts}


def measure_swe(args: argparse.Namespace) -> list[dict[str, Any]]:
    before = leftovers()
    rows = []
    for level, (concurrency, episodes) in enumerate(zip(args.concurrency, args.episodes,
                                                        strict=True)):
        tool_ms: dict[str, list[float]] = {}
        cpu0, wall0 = _cpu_self(), time.perf_counter()
        seeds = range(level * 1000, level * 1000 + episodes)
        results = asyncio.run(run_level(concurrency, seeds,
                                        partial(swe_episode, tool_ms=tool_ms)))
        wall, cpu = time.perf_counter() - wall0, _cpu_self() - cpu0
        left = {k: v - before[k] for k, v in leftovers().items()}
        calls = sum(len(v) for v in tool_ms.values())
        rows.append({"concurrency": concurrency, "episodes": episodes, "seconds": wall,
                     "episodes_per_s": episodes / wall, "calls_per_s": calls / wall,
                     "run_tests_p50_ms": pct(tool_ms["run_tests"], 0.5),
                     "run_tests_p99_ms": pct(tool_ms["run_tests"], 0.99),
                     "episode_p50_ms": pct([s * 1e3 for _, s in results], 0.5),
                     "episode_p99_ms": pct([s * 1e3 for _, s in results], 0.99),
                     "cpu_ms_per_episode": cpu * 1e3 / episodes,
                     "solved": sum(1 for o, _ in results if o > 0) / episodes,
                     "left_behind": left})
        print(f"  done: {concurrency} at a time", file=sys.stderr, flush=True)
    return rows


def print_swe_rows(rows: list[dict[str, Any]]) -> None:
    head = (f"{'episodes at once':>16} {'episodes':>8} {'episodes/s':>10} {'calls/s':>8} "
            f"{'run_tests p50':>13} {'p99':>6} {'episode p50':>11} {'p99':>6} "
            f"{'CPU ms/ep':>9} {'solved':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['concurrency']:>16} {r['episodes']:>8} {r['episodes_per_s']:>10.1f} "
              f"{r['calls_per_s']:>8.1f} {r['run_tests_p50_ms']:>13.1f} "
              f"{r['run_tests_p99_ms']:>6.0f} {r['episode_p50_ms']:>11.0f} "
              f"{r['episode_p99_ms']:>6.0f} {r['cpu_ms_per_episode']:>9.0f} {r['solved']:>6.2f}")
    print("(one episode: sandbox made, 6 tool calls of the scripted agent, hidden tests, sandbox "
          "closed; ms of wall clock; CPU = this process plus the sandboxes)")
    for r in rows:
        left = r["left_behind"]
        print(f"{r['concurrency']} at a time: left behind {left['processes']} processes, "
              f"{left['folders']} folders, {left['mounts']} mounts")
    print(machine_line())


def main_swe(args: argparse.Namespace) -> int:
    from clawrl.envs.sandbox import network_isolated

    print("sandbox network: " + ("none (own network namespace)" if network_isolated()
                                 else "NOT isolated (unshare unavailable)"))
    rows = measure_swe(args)
    print_swe_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"levels": rows}, indent=2))
    ok = all(r["solved"] == 1.0 and not any(r["left_behind"].values()) for r in rows)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl bench env", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", choices=("terminal", "swe", "gui"), default="terminal",
                   help="terminal: the pool through the proxy; swe, gui: the environment alone")
    p.add_argument("--concurrency", default="1,16,64", help="episodes at once, per level")
    p.add_argument("--episodes", default="", help="episodes per level (default 24,96,192; "
                   "swe: 16,64,128; gui: 16,32,64 with --concurrency 1,4,16)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--command", default="ls", help="the command the stand-in agent runs")
    p.add_argument("--reply-s", type=float, default=0.0, help="the stand-in's reply time")
    p.add_argument("--overhead", type=int, default=200,
                   help="steps sent each way for the per-step proxy overhead")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.env == "gui" and args.concurrency == "1,16,64":
        args.concurrency = "1,4,16"
    args.episodes = args.episodes or {"swe": "16,64,128", "gui": "16,32,64"}.get(args.env,
                                                                              "24,96,192")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
        args.episodes = [int(c) for c in args.episodes.split(",")]
        assert len(args.concurrency) == len(args.episodes)
        assert min(args.concurrency + args.episodes) > 0
    except (ValueError, AssertionError):
        p.error("--concurrency and --episodes take as many positive integers each")
    if args.env == "swe":
        return main_swe(args)
    if args.env == "gui":
        from clawrl.bench.guienv import main_gui

        return main_gui(args)
    state_dir = Path(tempfile.mkdtemp(prefix="clawrl-bench-env-", dir="/tmp"))
    try:
        with bench_database(state_dir) as db_url:
            upgrade(db_url)
            key = asyncio.run(make_key(db_url, scopes=[VERIFIER]))  # episodes post outcomes
            with BenchProcs(db_url, state_dir) as procs:
                procs.configure(tool_command=args.command, reply_s=args.reply_s, tokens=16)
                rows = measure(procs, db_url, key, args)
                overhead = asyncio.run(step_overhead(procs, key, args.overhead))
    except (RuntimeError, OSError, psycopg.Error) as exc:
        print(f"clawrl bench env: {exc}; logs in {state_dir}", file=sys.stderr)
        return 1
    print_rows(rows)
    o = overhead
    print(f"one step, {args.overhead} each way, one at a time (ms): direct p50 "
          f"{o['direct_p50']:.2f} p99 {o['direct_p99']:.2f}, through the proxy p50 "
          f"{o['proxy_p50']:.2f} p99 {o['proxy_p99']:.2f}: the proxy adds "
          f"{o['proxy_p50'] - o['direct_p50']:+.2f} p50, {o['proxy_p99'] - o['direct_p99']:+.2f}"
          " p99 (compare `clawrl bench proxy`'s +p50 at 1 client)")
    if args.json:
        args.json.write_text(json.dumps({"levels": rows, "step_overhead": overhead}, indent=2))
    shutil.rmtree(state_dir, ignore_errors=True)
    ok = all(r["errors"] == 0 and r["turns_in_db"] == r["steps"]
             and r["outcomes_in_db"] == r["episodes"] for r in rows)
    return 0 if ok else 1
