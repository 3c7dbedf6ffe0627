"""`clawrl bench env --env gui`: the GUI environment alone, driven by the scripted agent
(clawrl/envs/gui/scripted.py) that follows each task's known plan, reading ids off the page text;
no model, no proxy. Per level (episodes at once): episodes/s, actions/s, the p50/p99 of one
action (the tool call to its page text) and of a whole episode, CPU per episode (this process,
the Playwright driver and the browsers), the solved share (1.00 unless something broke). Then
memory: the browsers' PSS and RSS with no episode open, and with 1, 4 and 16 contexts open at
once — the cost of one more live episode.

    clawrl bench env --env gui [--concurrency 1,4,16] [--episodes 16,32,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from functools import partial
from typing import Any

import psutil

from clawrl.bench.levels import run_level
from clawrl.bench.proxy import machine_line, pct


def _family() -> list[psutil.Process]:
    """This process and its children: the Playwright driver and the Chromium processes."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def cpu_seconds() -> float:
    total = 0.0
    for proc in _family():
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def browser_memory() -> dict[str, float]:
    """MiB of the browser processes (not this one): PSS (shared pages split between the
    processes that share them) and RSS (each process's resident pages, shared counted again),
    and how many processes."""
    pss = rss = 0
    procs = _family()[1:]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            pss, rss = pss + info.pss, rss + info.rss
    return {"pss_mib": pss / 2**20, "rss_mib": rss / 2**20, "processes": len(procs)}


async def gui_episode(seed: int, action_ms: list[float]) -> tuple[float, float]:
    """One train-split episode played by the scripted agent: (outcome, seconds)."""
    from clawrl.envs.gui.env import GuiEnv
    from clawrl.envs.gui.scripted import scripted_reply

    start = time.perf_counter()
    env = GuiEnv(seed)
    try:
        obs = await env.reset()
        state = obs.messages[1]["content"]
        for i, plan_step in enumerate(env.task.plan):
            sent = time.perf_counter()
            step = await env.step(scripted_reply(plan_step, state, i))
            action_ms.append((time.perf_counter() - sent) * 1e3)
            state = step.messages[0]["content"]
            if step.done:
                break
        outcome = await env.outcome()
    finally:
        await env.close()
    return outcome, time.perf_counter() - start


async def live_memory(counts: list[int]) -> list[dict[str, Any]]:
    """The browsers' memory with `n` episodes reset and open at once, for each n."""
    from clawrl.envs.gui.env import GuiEnv

    rows = []
    for n in counts:
        envs = [GuiEnv(seed) for seed in range(n)]
        try:
            await asyncio.gather(*(env.reset() for env in envs))
            await asyncio.sleep(0.5)  # let the renderers settle
            rows.append({"live": n, **browser_memory()})
        finally:
            await asyncio.gather(*(env.close() for env in envs))
    return rows


def measure_gui(args: argparse.Namespace) -> dict[str, Any]:
    from clawrl.envs.gui.browser import browser_host

    asyncio.run(live_memory([1]))  # start the browser; the first page pays for warm-up
    levels = []
    for level, (concurrency, episodes) in enumerate(zip(args.concurrency, args.episodes,
                                                        strict=True)):
        action_ms: list[float] = []
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        seeds = range(level * 1000, level * 1000 + episodes)
        results = asyncio.run(run_level(concurrency, seeds,
                                        partial(gui_episode, action_ms=action_ms)))
        wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
        levels.append({"concurrency": concurrency, "episodes": episodes, "seconds": wall,
                       "episodes_per_s": episodes / wall, "actions_per_s": len(action_ms) / wall,
                       "action_p50_ms": pct(action_ms, 0.5), "action_p99_ms": pct(action_ms, 0.99),
                       "episode_p50_ms": pct([s * 1e3 for _, s in results], 0.5),
                       "episode_p99_ms": pct([s * 1e3 for _, s in results], 0.99),
                       "cpu_ms_per_episode": cpu * 1e3 / episodes,
                       "solved": sum(1 for o, _ in results if o > 0) / episodes})
        print(f"  done: {concurrency} at a time", file=sys.stderr, flush=True)
    idle = {"live": 0, **browser_memory()}
    memory = [idle, *asyncio.run(live_memory(sorted(set(args.concurrency))))]
    return {"levels": levels, "memory": memory, "browsers": browser_host().size}


def print_gui(figures: dict[str, Any]) -> None:
    head = (f"{'episodes at once':>16} {'episodes':>8} {'episodes/s':>10} {'actions/s':>9} "
            f"{'action p50':>10} {'p99':>6} {'episode p50':>11} {'p99':>6} {'CPU ms/ep':>9} "
            f"{'solved':>6}")
    print(head)
    print("-" * len(head))
    for r in figures["levels"]:
        print(f"{r['concurrency']:>16} {r['episodes']:>8} {r['episodes_per_s']:>10.2f} "
              f"{r['actions_per_s']:>9.1f} {r['action_p50_ms']:>10.0f} {r['action_p99_ms']:>6.0f} "
              f"{r['episode_p50_ms']:>11.0f} {r['episode_p99_ms']:>6.0f} "
              f"{r['cpu_ms_per_episode']:>9.0f} {r['solved']:>6.2f}")
    print(f"(one episode: context and page opened on one of {figures['browsers']} browser(s), "
          "the app loaded, the plan's actions each followed by the page text, the state "
          "checked, the context closed; ms of wall clock; CPU = this process, the driver and "
          "the browsers)")
    idle = figures["memory"][0]
    for m in figures["memory"]:
        extra = (f", {(m['pss_mib'] - idle['pss_mib']) / m['live']:.1f} MiB PSS per live "
                 "episode" if m["live"] else "")
        print(f"{m['live']:>3} episodes open: browsers {m['pss_mib']:.0f} MiB PSS, "
              f"{m['rss_mib']:.0f} MiB RSS, {m['processes']} processes{extra}")
    print(machine_line())


def main_gui(args: argparse.Namespace) -> int:
    from clawrl.envs.gui.browser import browser_missing, stop_browsers

    missing = browser_missing()
    if missing:
        print(f"clawrl bench env: the gui environment needs {missing}", file=sys.stderr)
        return 1
    try:
        figures = measure_gui(args)
    finally:
        stop_browsers()
    print_gui(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if all(r["solved"] == 1.0 for r in figures["levels"]) else 1
