"""The terminal track: small shell tasks in a sandbox (clawrl/envs/sandbox.py), acted on
through one tool, `run(command)`, and verified by reading the sandbox afterwards.

One episode is one task, picked by the seed (`seed % len(tasks)`, its details drawn from
the seed too). A reply with tool calls runs each `run` in the sandbox and the results come
back as `tool` messages; a reply without one ends the episode once a command has run (the
agent's final answer), and before that gets a user message asking for a command (a next
state, so even a model that never calls a tool is judged and trained). The outcome is +1 when
the sandbox passes the task's check, −1 otherwise; a link or folder where a file is expected
fails the check (the verifier never follows links out of the sandbox).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.envs.protocol import EnvError, Message, Observation, Step
from clawrl.envs.sandbox import Limits, Sandbox

SYSTEM = ("You work in a Linux shell, in the current directory. Run shell commands with the "
          "run tool. When the task is done, answer in one short sentence without a tool call.")
NUDGE = "No command ran. Call the run tool with a shell command to do the task."
RUN_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "run", "description": "Run a shell command in the working directory; returns its "
    "exit code and output.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}},
        "required": ["command"]}}}

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "cable",
         "ocean", "pepper", "violet", "copper", "meadow", "falcon", "harbor")


@dataclass
class Task:
    """One drawn task: files to set up, what to ask, how to check, and a shell command that
    solves it (for the tests)."""

    name: str
    prompt: str
    files: dict[str, str]
    check: Callable[[Sandbox], bool]
    solution: str


def _line(sandbox: Sandbox, name: str) -> str | None:
    text = sandbox.read(name)
    return None if text is None else text.strip()


def write_file(rng: random.Random) -> Task:
    text = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    return Task("write_file", f"Create a file named note.txt whose only line is: {text}", {},
                lambda s: _line(s, "note.txt") == text, f"echo '{text}' > note.txt")


def count_lines(rng: random.Random) -> Task:
    n = rng.randint(5, 30)
    data = "".join(f"{rng.choice(WORDS)}\n" for _ in range(n))
    return Task("count_lines", "Count the lines of data.txt and write the number into "
                "count.txt.", {"data.txt": data},
                lambda s: _line(s, "count.txt") == str(n), "wc -l < data.txt > count.txt")


def find_word(rng: random.Random) -> Task:
    target, *others = rng.sample(WORDS, 7)
    names = [f"file{k}.txt" for k in range(1, 5)]
    holder = rng.choice(names)
    files = {name: " ".join(rng.sample(others, 4)) + "\n" for name in names}
    files[holder] = files[holder].replace(others[0], target) if others[0] in files[holder] \
        else files[holder].rstrip("\n") + f" {target}\n"
    return Task("find_word", f"Which file contains the word {target}? Write the file's name "
                "into answer.txt.", files, lambda s: _line(s, "answer.txt") == holder,
                f"grep -lw {target} file*.txt > answer.txt")


def move_file(rng: random.Random) -> Task:
    text = f"{rng.choice(WORDS)} notes\n"
    return Task("move_file", "Create a folder named archive and move notes.txt into it.",
                {"notes.txt": text},
                lambda s: s.read("archive/notes.txt") == text and not s.exists("notes.txt"),
                "mkdir archive && mv notes.txt archive/")


def sum_numbers(rng: random.Random) -> Task:
    numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 8))]
    return Task("sum_numbers", "Write the sum of the numbers in numbers.txt into sum.txt.",
                {"numbers.txt": "".join(f"{n}\n" for n in numbers)},
                lambda s: _line(s, "sum.txt") == str(sum(numbers)),
                "awk '{s += $1} END {print s}' numbers.txt > sum.txt")


def delete_logs(rng: random.Random) -> Task:
    logs = [f"{w}.log" for w in rng.sample(WORDS, 3)]
    keep = [f"{w}.txt" for w in rng.sample(WORDS, 2)] + ["readme.md"]
    return Task("delete_logs", "Delete every file whose name ends in .log, and nothing else.",
                {name: "x\n" for name in logs + keep},
                lambda s: all(not s.exists(n) for n in logs) and all(
                    s.read(n) == "x\n" for n in keep), "rm -f *.log")


def uppercase(rng: random.Random) -> Task:
    text = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    return Task("uppercase", "Write the text of name.txt in upper case into upper.txt.",
                {"name.txt": text + "\n"}, lambda s: _line(s, "upper.txt") == text.upper(),
                "tr a-z A-Z < name.txt > upper.txt")


def sort_lines(rng: random.Random) -> Task:
    words = rng.sample(WORDS, 6)
    return Task("sort_lines", "Write the lines of words.txt, sorted alphabetically, into "
                "sorted.txt.", {"words.txt": "\n".join(words) + "\n"},
                lambda s: (s.read("sorted.txt") or "").split() == sorted(words),
                "sort words.txt > sorted.txt")


TASKS: dict[str, Callable[[random.Random], Task]] = {f.__name__: f for f in (
    write_file, count_lines, find_word, move_file, sum_numbers, delete_logs, uppercase,
    sort_lines)}


def draw_task(seed: int, names: list[str] | None = None) -> Task:
    """The task episode `seed` gets: `names[seed % len(names)]`, its details from the seed."""
    names = names or list(TASKS)
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise EnvError(f"unknown terminal task {unknown[0]!r} (known: {', '.join(TASKS)})")
    return TASKS[names[seed % len(names)]](random.Random(f"terminal-{seed}"))


class TerminalEnv:
    """One terminal episode (the protocol in clawrl/envs/protocol.py)."""

    def __init__(self, seed: int, tasks: list[str] | None = None,
                 limits: Limits | None = None) -> None:
        self.task = draw_task(seed, tasks)
        self.limits = limits or Limits()
        self.sandbox: Sandbox | None = None
        self.commands = 0

    async def reset(self) -> Observation:
        if self.sandbox is not None:
            self.sandbox.close()
        self.sandbox = Sandbox(self.limits)
        for name, text in self.task.files.items():
            self.sandbox.write(name, text)
        self.commands = 0
        return Observation([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": self.task.prompt}],
                           [RUN_TOOL], self.task.name)

    async def step(self, reply: Message) -> Step:
        assert self.sandbox is not None, "reset() first"
        calls = reply.get("tool_calls") or []
        if not calls:
            if self.commands:
                return Step([], done=True)
            return Step([{"role": "user", "content": NUDGE}])
        out: list[Message] = []
        for call in calls:
            out.append({"role": "tool", "tool_call_id": call.get("id", ""),
                        "content": await self._call(call.get("function") or {})})
        return Step(out)

    async def _call(self, function: dict[str, Any]) -> str:
        assert self.sandbox is not None
        if function.get("name") != "run":
            return f"error: unknown tool {function.get('name')!r}; the only tool is run(command)"
        try:
            args = json.loads(function.get("arguments") or "{}")
        except ValueError:
            return "error: the arguments are not valid JSON; call run with {\"command\": \"...\"}"
        command = args.get("command") if isinstance(args, dict) else None
        if not isinstance(command, str) or not command.strip():
            return "error: run needs a non-empty string argument \"command\""
        self.commands += 1
        return (await self.sandbox.run(command)).describe()

    async def outcome(self) -> float:
        assert self.sandbox is not None, "reset() first"
        return 1.0 if self.task.check(self.sandbox) else -1.0

    async def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
