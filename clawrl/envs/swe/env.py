"""The SWE track's episode: fix the seeded bug of a generated project (clawrl/envs/swe/tasks.py)
in a sandbox (clawrl/envs/sandbox.py, the terminal track's), through ordinary tool calls.

Tools (`TOOLS`, OpenAI definitions): list_files, read_file(path[, name]), replace_in_file(path,
old, new), apply_patch(diff), run_tests, run_linter, finish. Each call's result comes back as a
`tool` message (the next state): a file's text (or, with `name`, only that function, method,
class or constant's lines: a small model's context holds one function, not a whole module),
`error: …` for a bad call (a path out of the
sandbox, text not found, a patch that does not apply), the visible tests' failures and counts
(`3 passed, 1 failed`), the linter's problems. `finish` ends the episode; so does the step
budget (`max_steps` replies), and so does a test run the sandbox had to stop (killed at its time
or CPU limit, or leaving the disk full: a fork bomb, an endless loop, a disk filler). A reply
without a tool call gets a user message asking for one.

The outcome is the hidden tests', run after the episode: their calls go into the sandbox on
the command line (never written where the agent could read or edit them), the answers come
back, and each is judged outside the sandbox against the answer only the environment holds
(clawrl/envs/swe/verdict.py), so the project's code cannot forge a pass: +1 when all pass,
−1 otherwise (a partial fix is a failed fix; an episode a limit ended is −1 without a run).
"""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path
from typing import Any

from clawrl.envs.calls import read_call, tool_def, tool_step
from clawrl.envs.protocol import EnvError, Message, Observation, Step
from clawrl.envs.sandbox import Limits, RunResult, Sandbox
from clawrl.envs.swe.excerpt import definition
from clawrl.envs.swe.lint import lint_files
from clawrl.envs.swe.patch import PatchError, apply_patch
from clawrl.envs.swe.tasks import SPLITS, Task, draw_task
from clawrl.envs.swe.verdict import count_passed

RUNNER = (Path(__file__).with_name("testrun.py")).read_text()
PYTHON = "python3 -I -S -B"  # the sandbox's python3: isolated, no site, no .pyc files
KILLED = {128 + 9: "killed", 128 + 24: "CPU time limit", 128 + 25: "file size limit"}
FILE_LIMIT = 64 << 10  # read_file shows at most this much

SYSTEM = ("You fix bugs in small Python projects. Use the tools: list_files, read_file, "
          "replace_in_file or apply_patch to edit, run_tests to run the tests, run_linter to "
          "check the code. When the tests pass, call finish.")
NUDGE = "No tool was called. Use the tools to find and fix the bug, then call finish."


TOOLS = [
    tool_def("list_files", "List the project's files and their sizes."),
    tool_def("read_file", "Read a file of the project, or with name only one function, "
             "method, class or constant of it.", optional=("name",),
             path="the file's path, e.g. README.md",
             name="optional: a function, method or constant, e.g. truncate or Store.add"),
    tool_def("replace_in_file", "Replace the one occurrence of old with new in a file.",
             path="the file's path", old="the exact text to replace (it must occur once)",
             new="the text to put in its place"),
    tool_def("apply_patch", "Apply a unified diff (--- a/FILE, +++ b/FILE, @@ hunks).",
             diff="the unified diff"),
    tool_def("run_tests", "Run the project's tests; the failures, then 'N passed, M failed'."),
    tool_def("run_linter", "Check the project's Python files for errors (syntax, undefined "
             "names, unused imports and variables)."),
    tool_def("finish", "Say the bug is fixed; ends the episode."),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]


class SweEnv:
    """One SWE episode (the protocol in clawrl/envs/protocol.py)."""

    def __init__(self, seed: int, split: str = "train", max_steps: int = 12,
                 limits: Limits | None = None, **options: Any) -> None:
        if options:
            raise EnvError(f"the swe environment takes no {', '.join(options)} option")
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r} (train or heldout)")
        if max_steps < 1:
            raise EnvError("max_steps must be at least 1")
        self.task: Task = draw_task(seed, split)
        self.limits = limits or Limits()
        self.max_steps = max_steps
        self.sandbox: Sandbox | None = None
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.steps = 0
        self.calls: list[str] = []        # every tool call's name, in order
        self.test_runs: list[tuple[int, int]] = []  # (passed, failed) of each run_tests
        self.edits = 0
        self.edit_errors = 0
        self.finished = False
        self.ended_by = ""                # why the episode ended: finish, steps, a limit
        self.hidden: tuple[int, int] | None = None  # (passed, total) once verified

    async def reset(self) -> Observation:
        await self.close()
        self.sandbox = Sandbox(self.limits)
        for name, text in self.task.files.items():
            self.sandbox.write(name, text)
        self._reset_counts()
        prompt = (f"The project {self.task.module[:-3]} has a bug: some of its tests fail. Find "
                  "the bug, fix the code (not the tests), check that the tests pass, then "
                  "call finish.")
        return Observation([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": prompt}], list(TOOLS), self.task.name)

    async def step(self, reply: Message) -> Step:
        assert self.sandbox is not None, "reset() first"
        return await tool_step(self, reply, NUDGE)

    async def _call(self, function: dict[str, Any]) -> str:
        if function.get("name") in TOOL_NAMES:  # counted even when its arguments are bad
            self.calls.append(str(function["name"]))
        call = read_call(function, TOOLS)
        if isinstance(call, str):
            return call
        name, args = call
        try:
            text: str = await getattr(self, f"_{name}")(**args)
            return text
        except (ValueError, PatchError) as exc:  # a path out of the sandbox, a bad patch
            if name in ("replace_in_file", "apply_patch"):
                self.edit_errors += 1
            return f"error: {exc}"

    # The tools. Each returns the tool message's text; ValueError -> "error: …".

    def _files(self) -> list[Path]:
        """The project's files, relative (links listed, never followed; no __pycache__)."""
        assert self.sandbox is not None
        root = self.sandbox.path
        found = []
        for folder, dirs, files in os.walk(root):
            links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and d not in links)
            found += [Path(folder, name).relative_to(root) for name in sorted(files + links)]
        return found

    async def _list_files(self) -> str:
        assert self.sandbox is not None
        lines = []
        for rel in self._files():
            path = self.sandbox.path / rel
            kind = " (link)" if path.is_symlink() else ""
            lines.append(f"{rel} ({path.lstat().st_size} bytes){kind}")
        return "\n".join(lines) or "(no files)"

    def _read(self, path: str) -> str | None:
        assert self.sandbox is not None
        return self.sandbox.read(path, FILE_LIMIT)

    async def _read_file(self, path: str, name: str = "") -> str:
        text = self._read(path)
        if text is None:
            raise ValueError(f"no file named {path!r} (list_files shows the files)")
        return definition(text, path, name) if name else text

    async def _replace_in_file(self, path: str, old: str, new: str) -> str:
        assert self.sandbox is not None
        text = await self._read_file(path)
        count = text.count(old) if old else 0
        if count != 1:
            raise ValueError(f"old text occurs {count} times in {path}; it must occur exactly "
                             "once (include more of the surrounding lines)" if old else
                             "old text is empty")
        self.sandbox.write(path, text.replace(old, new))
        self.edits += 1
        return f"replaced 1 occurrence in {path}"

    async def _apply_patch(self, diff: str) -> str:
        assert self.sandbox is not None
        changes = apply_patch(diff, self._read)
        for path in changes:
            self.sandbox.inside(path)  # every path checked before anything is written
        for path, text in changes.items():
            self.sandbox.write(path, text)
        self.edits += 1
        return "applied to " + ", ".join(sorted(changes))

    async def _run_tests(self) -> str:
        result = await self._run(f"file {shlex.quote(self.task.test_file)}")
        counts = _counts(result.output)
        if counts is not None:
            self.test_runs.append(counts)
        return result.output + result.notes() + self._limit_note(result)

    async def _run_linter(self) -> str:
        files = {}
        for rel in self._files():
            text = self._read(str(rel)) if rel.suffix == ".py" else None
            if text is not None:
                files[str(rel)] = text
        return lint_files(files)

    async def _finish(self) -> str:
        self.finished = True
        self.ended_by = "finish"
        return "finished"

    async def _run(self, args: str) -> RunResult:
        assert self.sandbox is not None
        return await self.sandbox.run(f"{PYTHON} -c {shlex.quote(RUNNER)} {args}")

    def _limit_note(self, result: RunResult) -> str:
        """Ends the episode when the sandbox had to stop the run; the note says why."""
        reason = ("time limit" if result.timed_out else "disk full" if result.disk_full
                  else KILLED.get(result.exit_code, ""))
        if not reason:
            return ""
        self.ended_by = f"limit: {reason}"
        return f"\n[the episode ends: the tests hit the sandbox's {reason}]"

    async def outcome(self) -> float:
        assert self.sandbox is not None, "reset() first"
        if self.hidden is None:
            if self.ended_by.startswith("limit"):
                self.hidden = (0, self.task.hidden_count)
            else:
                nonce = secrets.token_hex(8)
                calls = " ".join(shlex.quote(call) for call, _, _ in self.task.hidden_calls)
                module = self.task.module.removesuffix(".py")
                result = await self._run(f"calls {module} {nonce} {calls}")
                passed = count_passed(result.output, nonce, self.task.hidden_calls)
                self.hidden = (passed, self.task.hidden_count)
        passed, total = self.hidden
        return 1.0 if passed == total else -1.0

    def details(self) -> dict[str, Any]:
        """What the episode did, for the pool's results and the eval: the task, the calls,
        whether the tests ran before finish, the hidden tests' count."""
        t = self.task
        tested_before_finish = "run_tests" in self.calls[: self.calls.index("finish")] \
            if "finish" in self.calls else False
        return {"template": t.template, "kind": t.kind, "where": t.where, "split": t.split,
                "calls": list(self.calls), "test_runs": list(self.test_runs),
                "edits": self.edits, "edit_errors": self.edit_errors,
                "finished": self.finished, "tested_before_finish": tested_before_finish,
                "ended_by": self.ended_by or "pool",
                "hidden_passed": None if self.hidden is None else self.hidden[0],
                "hidden_total": t.hidden_count}

    async def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


def _counts(output: str) -> tuple[int, int] | None:
    """(passed, failed) from the runner's `N passed, M failed` line."""
    for line in reversed(output.splitlines()):
        parts = line.replace(",", "").split()
        if len(parts) >= 4 and parts[1] == "passed" and parts[3] == "failed":
            return int(parts[0]), int(parts[2]) + (1 if "error" in line else 0)
    return None
