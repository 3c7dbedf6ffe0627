"""The GUI environment (clawrl/envs/gui/env.py) in real headless Chromium, driven as the pool
drives it: for every template and goal kind the generator's solution, read off the page text
by role and name, reaches the goal (+1) while the untouched app and the decoy attempt do not
(−1); bad calls are one-line errors; the budget ends an episode; screenshots are written.

Skipped when /usr/bin/chromium or the `playwright` package is missing, as the console's browser
test is (`apt-get install -y chromium`, `pip install playwright`; never `playwright install`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawrl.envs.gui.apps import goal_met
from clawrl.envs.gui.browser import browser_missing, stop_browsers
from clawrl.envs.gui.env import NUDGE, TOOLS, GuiEnv
from clawrl.envs.gui.scripted import find_id, scripted_reply
from clawrl.envs.gui.tasks import pairs
from clawrl.envs.registry import make_env

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=f"no browser: needs {browser_missing()}")


@pytest.fixture(scope="module", autouse=True)
def _browsers() -> Iterator[None]:
    yield
    stop_browsers()  # the browsers this module started, not left for the next


async def play(env: GuiEnv, plan: str) -> tuple[float, list[str]]:
    """Reset, check that the untouched app misses the goal, follow the plan: (outcome, the
    tool results)."""
    obs = await env.reset()
    try:
        assert not goal_met(env.task.check, await env.app_state())
        state, results = obs.messages[1]["content"], []
        for i, step in enumerate(getattr(env.task, plan)):
            result = (await env.step(scripted_reply(step, state, i))).messages[0]["content"]
            results.append(result)
            state = result if not result.startswith("error") else state
        return await env.outcome(), results
    finally:
        await env.close()


async def test_every_template_and_kind_is_solved_by_its_plan_and_not_by_its_decoy() -> None:
    seeds = [(split, i) for split in ("train", "heldout") for i in range(len(pairs(split)))]

    async def both(split: str, seed: int) -> tuple[str, float, float, list[str]]:
        good, results = await play(GuiEnv(seed, split), "plan")
        bad, _ = await play(GuiEnv(seed, split), "decoy")
        return GuiEnv(seed, split).task.name, good, bad, results

    runs = await asyncio.gather(*(both(split, seed) for split, seed in seeds))
    assert {name for name, *_ in runs} == {f"{t}/{k}" for s in ("train", "heldout")
                                           for t, k in pairs(s)}
    for name, good, bad, results in runs:
        assert (good, bad) == (1.0, -1.0), name
        assert not any(r.startswith("error") for r in results), (name, results)
        assert results[-1] == "done: the episode is over"


def sizes(paths: list[str]) -> list[int]:
    return [os.path.getsize(p) for p in paths]


def call(name: str, args: dict[str, Any] | str, i: int = 0) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"c{i}", "type": "function", "function": {
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}]}


async def test_actions_errors_markers_budget_and_screenshots(tmp_path: Path) -> None:
    env = make_env("gui", 0, max_steps=9, screenshots=str(tmp_path))  # settings/toggle
    assert isinstance(env, GuiEnv)
    obs = await env.reset()
    try:
        assert [t["function"]["name"] for t in obs.tools] == [t["function"]["name"]
                                                                for t in TOOLS]
        page = obs.messages[1]["content"]
        assert page.startswith(f"Goal: {env.task.goal}\n\npage ")
        switch = next(s for s in env.task.plan if s[1] == "switch")
        sid = find_id(page, "switch", switch[2])
        assert sid is not None
        heading = find_id(page, "heading", env.task.spec["title"])
        bad = [call("click", {"element_id": 999}), call("click_at", {"x": 900, "y": 10}),
               call("type", {"element_id": sid, "text": "x"}), call("press", {"key": "Nope"}),
               call("click", "{oops"), call("click", {"element_id": "3"})]
        for reply in bad:
            (msg,) = (await env.step(reply)).messages
            assert msg["content"].startswith("error: ") and "\n" not in msg["content"], msg
        assert [m["content"] for m in (await env.step({"role": "assistant",
                                                        "content": "hm"})).messages] == [NUDGE]
        # a point inside the switch's box toggles it, marked as changed
        line = next(ln for ln in page.splitlines() if ln.startswith(f"[{sid}] "))
        x1, y1, x2, y2 = map(int, line.rsplit("@", 1)[1].split(","))
        (msg,) = (await env.step(call("click_at", {"x": (x1 + x2) / 2, "y": (y1 + y2) / 2})))\
            .messages
        assert f"\n~ [{sid}] switch " in msg["content"] and "1 changed" in msg["content"]
        assert f"\n  [{heading}] heading " in msg["content"]
        step = await env.step(call("scroll", {"dx": 0, "dy": 200}))
        assert step.done and env.details()["ended_by"] == "steps"  # the 9th reply
        assert await env.outcome() == (1.0 if env.task.spec["save"] is None else -1.0)
        details = env.details()
        assert details["errors"] == 6 and len(details["actions"]) == 8
        assert details["actions"][6]["changed"] == 1
        assert len(details["screenshots"]) == 3  # the first state, after click_at, scroll
        assert min(sizes(details["screenshots"])) > 1000  # PNGs of the page
    finally:
        await env.close()
