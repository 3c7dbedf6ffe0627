"""The GUI track's episode: reach a goal in a generated web application (clawrl/envs/gui/tasks.py)
open in headless Chromium (clawrl/envs/gui/browser.py), reading the page as text and acting
through ordinary tool calls.

Tools (`TOOLS`): click(element_id), click_at(x, y), type(element_id, text), press(key),
scroll(dx, dy), done. Each call's result is a `tool` message: the action, then the page after
it marked against the page before (clawrl/envs/gui/view.py). A bad call is one `error: …` line
and changes nothing: an id the last state did not list, a point off the page, typing into
something that is no text field, an unknown key. `done` ends the episode; so does the step
budget (`max_steps` replies). A reply without a tool call gets a user message asking for one.

The outcome is read from the application's own state (window.app.state) when the episode
ends, never from what the agent says: +1 when it meets the task's check, −1 otherwise (an
episode the budget ended is checked all the same: a goal reached without `done` counts).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from clawrl.envs.calls import read_call, tool_def, tool_step
from clawrl.envs.gui.apps import goal_met
from clawrl.envs.gui.browser import VIEWPORT, BrowserHost, Tab, browser_host
from clawrl.envs.gui.server import app_server
from clawrl.envs.gui.tasks import SPLITS, Task, draw_task
from clawrl.envs.gui.view import View, render
from clawrl.envs.protocol import EnvError, Message, Observation, Step

SYSTEM = ("You use web pages through tools. A page state lists its elements, one a line: "
          "[id] role \"name\" = \"value\" states @left,top,right,bottom (pixels). Act with "
          "click(element_id), click_at(x, y), type(element_id, text), press(key) and "
          "scroll(dx, dy); after each action you see the page again, changes marked "
          "(~ changed, + new, - gone). Call done when the goal is reached.")
NUDGE = "No tool was called. Act on the page with the tools, then call done."
TEXT_ROLES = ("textbox", "searchbox", "combobox")

TOOLS = [
    tool_def("click", "Click an element of the page.",
             element_id=("integer", "the element's id, as listed in the page state")),
    tool_def("click_at", "Click a point of the page.",
             x=("number", "pixels from the left"), y=("number", "pixels from the top")),
    tool_def("type", "Replace the text of a text field with `text`.",
             element_id=("integer", "the text field's id"), text="the text to put in it"),
    tool_def("press", "Press a key, e.g. Enter, Tab, Escape, ArrowDown.",
             key="the key's name"),
    tool_def("scroll", "Scroll the page.", dx=("number", "pixels to the right"),
             dy=("number", "pixels down")),
    tool_def("done", "Say the goal is reached; ends the episode."),
]


class GuiEnv:
    """One GUI episode (the protocol in clawrl/envs/protocol.py)."""

    def __init__(self, seed: int, split: str = "train", max_steps: int = 10,
                 view: str = "full", max_lines: int = 40, screenshots: str = "",
                 **options: Any) -> None:
        if options:
            raise EnvError(f"the gui environment takes no {', '.join(options)} option")
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r} (train or heldout)")
        if view not in ("full", "changes"):
            raise EnvError(f"unknown view {view!r} (full or changes)")
        if max_steps < 1 or max_lines < 1:
            raise EnvError("max_steps and max_lines must be at least 1")
        self.task: Task = draw_task(seed, split)
        self.max_steps, self.mode, self.max_lines = max_steps, view, max_lines
        self.shots_dir = screenshots
        self.host: BrowserHost | None = None
        self.tab: Tab | None = None
        self.url = ""
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.steps = 0
        self.view: View | None = None
        self.actions: list[dict[str, Any]] = []  # each call: what, changed/new/gone or error
        self.screenshots: list[str] = []
        self.chars: list[int] = []                # each state's length in characters
        self.ended_by = ""
        self.met: bool | None = None
        self.shot_prefix = f"gui-{self.task.split}-{self.task.seed}-{uuid.uuid4().hex[:6]}"

    async def reset(self) -> Observation:
        await self.close()
        self._reset_counts()
        self.host = browser_host()
        self.url = app_server().add(self.task.spec)
        self.tab = await self.host.run(self.host.open(self.url))
        state = await self._observe()
        prompt = f"Goal: {self.task.goal}\n\n{state}"
        return Observation([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": prompt}], list(TOOLS), self.task.name)

    async def _observe(self) -> str:
        """The page now, marked against the last state; remembered for the next."""
        assert self.host is not None and self.tab is not None
        snap = await self.host.run(self.tab.snapshot())
        shown = render(snap, self.view, self.mode, self.max_lines)
        self.view = shown.view
        if self.shots_dir:
            path = os.path.join(self.shots_dir, f"{self.shot_prefix}-{len(self.screenshots):02d}.png")
            await self.host.run(self.tab.screenshot(path))
            self.screenshots.append(path)
        self.chars.append(len(shown.text))
        if self.actions:
            self.actions[-1].update(changed=shown.changed, new=shown.new, gone=shown.gone)
        return shown.text

    async def step(self, reply: Message) -> Step:
        assert self.tab is not None, "reset() first"
        return await tool_step(self, reply, NUDGE)

    async def _call(self, function: dict[str, Any]) -> str:
        call = read_call(function, TOOLS)
        if isinstance(call, str):
            self.actions.append({"call": str(function.get("name")), "error": call})
            return call
        name, args = call
        what = f"{name}({', '.join(str(v) for v in args.values())})"
        self.actions.append({"call": what})
        if name == "done":
            self.ended_by = "done"
            return "done: the episode is over"
        assert self.host is not None and self.tab is not None
        try:
            said = await getattr(self, f"_{name}")(*args.values())
            await self.host.run(self.tab.settle())
        except ValueError as exc:
            self.actions[-1]["error"] = f"error: {exc}"
            return f"error: {exc}"
        except Exception as exc:  # noqa: BLE001 - Playwright's Error: the agent's bad input
            if type(exc).__name__ not in ("Error", "TimeoutError"):
                raise
            line = f"error: {str(exc).splitlines()[0].removeprefix(type(exc).__name__ + ': ')}"
            self.actions[-1]["error"] = line
            return line
        return f"{said}\n{await self._observe()}"

    # The actions. Each returns what it did in words; ValueError -> "error: …".

    def _element(self, element_id: int) -> str:
        assert self.view is not None
        if element_id not in self.view.lines:
            raise ValueError(f"no element [{element_id}] in the last page state")
        if element_id in self.view.covered:
            raise ValueError(f"element [{element_id}] is behind the dialog")
        return self.view.lines[element_id]

    async def _click(self, element_id: int) -> str:
        assert self.host is not None and self.tab is not None
        line = self._element(element_id)
        point = await self.host.run(self.tab.center(element_id))
        if point is None:
            raise ValueError(f"element [{element_id}] is no longer on the page")
        await self.host.run(self.tab.click_at(*point))
        return f"clicked {line}"

    async def _click_at(self, x: float, y: float) -> str:
        assert self.host is not None and self.tab is not None
        w, h = VIEWPORT["width"], VIEWPORT["height"]
        if not (0 <= x < w and 0 <= y < h):
            raise ValueError(f"({x}, {y}) is off the page (it is {w}x{h})")
        await self.host.run(self.tab.click_at(x, y))
        return f"clicked at ({x}, {y})"

    async def _type(self, element_id: int, text: str) -> str:
        assert self.host is not None and self.tab is not None and self.view is not None
        line = self._element(element_id)
        if self.view.roles[element_id] not in TEXT_ROLES:
            raise ValueError(f"[{element_id}] is a {self.view.roles[element_id]}, not a text "
                             "field")
        if not await self.host.run(self.tab.fill(element_id, text)):
            raise ValueError(f"element [{element_id}] is no longer on the page")
        return f"typed into {line}"

    async def _press(self, key: str) -> str:
        assert self.host is not None and self.tab is not None
        await self.host.run(self.tab.press(key))
        return f"pressed {key}"

    async def _scroll(self, dx: float, dy: float) -> str:
        assert self.host is not None and self.tab is not None
        await self.host.run(self.tab.scroll(dx, dy))
        return f"scrolled by ({dx}, {dy})"

    async def outcome(self) -> float:
        assert self.tab is not None, "reset() first"
        if self.met is None:
            assert self.host is not None
            self.met = goal_met(self.task.check, await self.host.run(self.tab.state()))
        return 1.0 if self.met else -1.0

    async def app_state(self) -> Any:
        """The application's state now (what `outcome()` checks)."""
        assert self.host is not None and self.tab is not None, "reset() first"
        return await self.host.run(self.tab.state())

    def details(self) -> dict[str, Any]:
        """What the episode did: the task, every action and what it changed (or its error),
        the screenshots' paths, each state's length, why it ended, whether the goal was met."""
        t = self.task
        return {"template": t.template, "kind": t.kind, "split": t.split, "goal": t.goal,
                "actions": [dict(a) for a in self.actions],
                "errors": sum(1 for a in self.actions if "error" in a),
                "screenshots": list(self.screenshots), "state_chars": list(self.chars),
                "ended_by": self.ended_by or "pool", "met": self.met}

    async def close(self) -> None:
        if self.tab is not None and self.host is not None:
            tab, self.tab = self.tab, None
            await self.host.run(self.host.close(tab))
        if self.url:
            app_server().drop(self.url)
            self.url = ""
