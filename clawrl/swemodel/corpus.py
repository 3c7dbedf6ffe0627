"""The SWE model's corpus: scripted agents fixing the generator's held-in tasks, played against
the real environment (clawrl/envs/swe/env.py) so that every prompt, tool definition and tool
result is exactly what the engine will show the model.

The scripted solve reads the first failing test's function (`read_file` with a name: a module
is ~2 KB, one function a few hundred bytes, and the model's context is short), then the
definition the bug is in when that is another one (a helper, a module constant), replaces the
buggy line with the fixed one, runs the tests again and finishes. The other agents (`PLANS`)
are deliberately imperfect, so the base model's behaviour has spread for RL to work on: they
finish without checking, edit the wrong place (then undo it and fix the right one, or give
up), send a diff written the wrong way round (it does not apply) and retry, or apply the fix as
a diff.

Only the `train` split's tasks are drawn (never the held-out template or bug kind), and a
wrong edit is a bug of a held-in kind (`WRONG_KINDS`).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clawrl.envs.swe.bugs import KINDS, find_sites
from clawrl.envs.swe.env import SweEnv
from clawrl.envs.swe.tasks import HELDOUT_KINDS, Task

Message = dict[str, Any]

# The agents and how often each plays an episode. Three in four succeed.
PLANS: dict[str, float] = {
    "solve": 0.40,          # tests, read, fix, tests, finish
    "unchecked": 0.10,      # tests, read, fix, finish (no second test run)
    "wrong_then_fix": 0.14,  # ... a wrong edit, tests still fail, undo it, fix, tests, finish
    "wrong_give_up": 0.08,  # ... a wrong edit, tests still fail, finish
    "wrong_unchecked": 0.06,  # ... a wrong edit, finish
    "patch": 0.10,          # the fix as a unified diff
    "bad_patch": 0.08,      # a diff the wrong way round (does not apply), then the fix
    "nudged": 0.04,         # a first reply without a tool call, told to use the tools
}
WRONG_KINDS = tuple(k for k in KINDS if k not in HELDOUT_KINDS)
FAILED = re.compile(r"^FAILED test_(\w+?)_\d+:", re.M)
THINKING = "Let me look at the code first."


@dataclass(frozen=True)
class Edit:
    """A `replace_in_file` of one place: `old` occurs exactly once in the file."""

    old: str
    new: str


def edit_between(before: str, after: str) -> Edit:
    """The smallest `replace_in_file` turning `before` into `after` (which differ in one
    place): the changed lines, stripped of their shared indentation when that stays unique,
    widened by a line at a time until `old` occurs once (an inserted branch takes the line
    above it)."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    assert len(ops) == 1, "the two texts differ in more than one place"
    _, i1, i2, j1, j2 = ops[0]
    lo, hi = i1, i2
    while True:
        old = "".join(a[lo:hi])
        new = "".join(a[lo:i1] + b[j1:j2] + a[i2:hi])
        if old.strip() and before.count(old) == 1:
            break
        lo, hi = (lo - 1, hi) if lo > 0 else (lo, hi + 1)
    if old.endswith("\n") and new.endswith("\n"):
        old, new = old[:-1], new[:-1]
    indent = len(old) - len(old.lstrip(" "))
    if indent and new.startswith(" " * indent) and before.count(old[indent:]) == 1:
        old, new = old[indent:], new[indent:]
    return Edit(old, new)


def diff_between(path: str, before: str, after: str) -> str:
    """A unified diff (one line of context) from `before` to `after`."""
    return "".join(difflib.unified_diff(before.splitlines(keepends=True),
                                        after.splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}", n=1))


def wrong_edit(task: Task, source: str, shown: set[str], rng: random.Random) -> str | None:
    """The module with a second bug of a held-in kind in a definition the agent has read
    (`shown`), away from the seeded one: what an agent that edits the wrong place writes."""
    bug = edit_between(task.fixed, source)
    wrong = []
    for site in find_sites(source, rng):
        near = source[max(0, site.edit.start - 40):site.edit.end + 40]
        if (site.kind in WRONG_KINDS and site.where.rpartition(".")[2] in shown
                and bug.old not in near):
            wrong.append(site.edit.apply(source))
    return rng.choice(wrong) if wrong else None


def call(tool: str, /, **arguments: str) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": "", "type": "function",
        "function": {"name": tool, "arguments": json.dumps(arguments, ensure_ascii=False)}}]}


class Script:
    """One episode in progress: the env, the messages so far, the ids of the calls."""

    def __init__(self, env: SweEnv, messages: list[Message]) -> None:
        self.env, self.messages, self.calls = env, messages, 0

    async def send(self, reply: Message) -> str:
        """Send a reply (a call gets the next id) and return the first result's text."""
        if reply.get("tool_calls"):
            self.calls += 1
            reply["tool_calls"][0]["id"] = f"call_{self.calls}"
        self.messages.append(reply)
        step = await self.env.step(reply)
        self.messages.extend(step.messages)
        return str(step.messages[0]["content"]) if step.messages else ""

    async def edit(self, before: str, after: str) -> None:
        change = edit_between(before, after)
        await self.send(call("replace_in_file", path=self.env.task.module, old=change.old,
                             new=change.new))


@dataclass(frozen=True)
class Episode:
    seed: int
    plan: str
    task: str  # template/kind/where
    messages: list[Message]  # system, user, then each reply and its results
    outcome: float


async def play(seed: int, plan: str, rng: random.Random) -> Episode:
    """Episode `seed` of the train split played by agent `plan`."""
    env = SweEnv(seed, "train", max_steps=20)
    try:
        messages = await _script(env, plan, rng)
        return Episode(seed, plan, env.task.name, messages, await env.outcome())
    finally:
        await env.close()


async def _script(env: SweEnv, plan: str, rng: random.Random) -> list[Message]:
    obs = await env.reset()
    s = Script(env, list(obs.messages))
    task, module = env.task, env.task.module
    buggy = task.files[module]
    if plan == "nudged":
        await s.send({"role": "assistant", "content": THINKING})
    tests = await s.send(call("run_tests"))
    named = FAILED.search(tests)
    where = task.where.rpartition(".")[2]
    first = named.group(1) if named else where
    await s.send(call("read_file", path=module, name=first))
    if where != first:
        await s.send(call("read_file", path=module, name=task.where))
    wrong = wrong_edit(task, buggy, {first, where}, rng) if plan.startswith("wrong") else None
    if plan.startswith("wrong") and wrong is not None:
        await s.edit(buggy, wrong)
        if plan == "wrong_unchecked":
            await s.send(call("finish"))
            return s.messages
        await s.send(call("run_tests"))
        if plan == "wrong_give_up":
            await s.send(call("finish"))
            return s.messages
        await s.edit(wrong, buggy)
    if plan == "bad_patch":
        await s.send(call("apply_patch", diff=diff_between(module, task.fixed, buggy)))
    if plan == "patch":
        await s.send(call("apply_patch", diff=diff_between(module, buggy, task.fixed)))
    else:
        await s.edit(buggy, task.fixed)
    if plan != "unchecked":
        await s.send(call("run_tests"))
    await s.send(call("finish"))
    return s.messages


def draw_plan(rng: random.Random) -> str:
    return rng.choices(list(PLANS), list(PLANS.values()))[0]


async def play_many(seeds: list[int], corpus_seed: int, concurrency: int = 4) -> list[Episode]:
    """Episodes of `seeds` (train split), `concurrency` at a time; the plan and the random
    choices of each from (`corpus_seed`, its seed)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> Episode:
        rng = random.Random(f"swe-corpus-{corpus_seed}-{seed}")
        plan = draw_plan(rng)
        async with gate:
            return await play(seed, plan, rng)

    return list(await asyncio.gather(*(one(s) for s in seeds)))


def iter_shuffled(episodes: list[Episode], seed: int) -> Iterator[Episode]:
    """The episodes, reshuffled each epoch, forever (what the build trains on)."""
    rng = random.Random(f"swe-epochs-{seed}")
    order = list(range(len(episodes)))
    while True:
        rng.shuffle(order)
        yield from (episodes[i] for i in order)
