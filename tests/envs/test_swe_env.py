"""The SWE environment (clawrl/envs/swe/env.py) driven as the pool drives it, with the
model's replies written by hand: the tools' results, bad calls as clear errors, the outcome
from the hidden tests; and its diff applier and linter on their own."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from clawrl.envs.protocol import EnvError
from clawrl.envs.registry import make_env
from clawrl.envs.swe.env import NUDGE, TOOL_NAMES, SweEnv
from clawrl.envs.swe.lint import lint_files
from clawrl.envs.swe.patch import PatchError, apply_patch


def reply(*calls: tuple[str, dict[str, Any]] | tuple[str, str]) -> dict[str, Any]:
    """An assistant message calling each (tool, arguments); a str argument is sent as is."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {
            "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
        for i, (name, args) in enumerate(calls)]}


async def results(env: SweEnv, *calls: tuple[str, Any]) -> list[str]:
    step = await env.step(reply(*calls))
    assert [m["tool_call_id"] for m in step.messages] == [f"c{i}" for i in range(len(calls))]
    return [m["content"] for m in step.messages]


async def test_an_agent_that_reads_the_failure_and_fixes_it_succeeds() -> None:
    env = make_env("swe", 11)
    assert isinstance(env, SweEnv)
    obs = await env.reset()
    try:
        assert [t["function"]["name"] for t in obs.tools] == TOOL_NAMES
        assert obs.task == env.task.name and obs.messages[0]["role"] == "system"
        task = env.task
        (listing,) = await results(env, ("list_files", {}))
        assert set(line.split(" (")[0] for line in listing.splitlines()) == set(task.files)
        (tests,) = await results(env, ("run_tests", {}))
        assert "FAILED test_" in tests and tests.rstrip().endswith(" failed")
        (source,) = await results(env, ("read_file", {"path": task.module}))
        assert source == task.files[task.module]
        applied, rerun, lint = await results(env, ("apply_patch", {"diff": task.fix_diff}),
                                             ("run_tests", {}), ("run_linter", {}))
        assert applied == f"applied to {task.module}"
        assert rerun.splitlines()[-1] == f"{task.visible_count} passed, 0 failed"
        assert lint.startswith("no problems found in 2 files")
        step = await env.step(reply(("finish", {})))
        assert step.done and step.messages[0]["content"] == "finished"
        assert await env.outcome() == 1.0
        details = env.details()
        assert details["tested_before_finish"] and details["ended_by"] == "finish"
        assert details["test_runs"][0][1] >= 1 and details["test_runs"][-1][1] == 0
        assert details["hidden_passed"] == details["hidden_total"] == task.hidden_count
    finally:
        await env.close()


async def test_finishing_without_a_fix_fails_and_so_does_editing_the_tests() -> None:
    env = SweEnv(4)
    await env.reset()
    try:
        test_file = env.task.test_file
        (done,) = await results(env, ("replace_in_file", {
            "path": test_file, "old": env.task.files[test_file],
            "new": "def test_nothing():\n    pass\n"}))
        assert done == f"replaced 1 occurrence in {test_file}"
        (tests,) = await results(env, ("run_tests", {}))
        assert tests.splitlines()[-1] == "1 passed, 0 failed"  # the visible tests are gamed
        assert (await env.step(reply(("finish", {})))).done
        assert await env.outcome() == -1.0  # the hidden tests are not
        assert 0 <= env.details()["hidden_passed"] < env.task.hidden_count
    finally:
        await env.close()


async def test_replace_in_file_fixes_the_bug_too() -> None:
    env = SweEnv(2, split="heldout")
    await env.reset()
    try:
        (done,) = await results(env, ("replace_in_file", {
            "path": env.task.module, "old": env.task.files[env.task.module],
            "new": env.task.fixed}))
        assert done.startswith("replaced")
        assert await env.outcome() == 1.0
        assert env.details()["split"] == "heldout" and not env.details()["finished"]
    finally:
        await env.close()


async def test_read_file_with_a_name_shows_one_definition_as_it_stands() -> None:
    env = SweEnv(5)  # a stock task: a class with methods, module constants
    await env.reset()
    try:
        module, source = env.task.module, env.task.files[env.task.module]
        cls = source.split("class ", 1)[1].split(":", 1)[0]
        method, qualified, const, whole, *bad = await results(
            env, ("read_file", {"path": module, "name": "remove"}),
            ("read_file", {"path": module, "name": f"{cls}.remove"}),
            ("read_file", {"path": module, "name": "LOW_STOCK"}),
            ("read_file", {"path": module, "name": ""}),
            ("read_file", {"path": module, "name": "nothing"}),
            ("read_file", {"path": "README.md", "name": "remove"}),
            ("read_file", {"path": module, "name": 3}))
        assert method == qualified and method.startswith("    def remove(self")
        assert source.count(method) == 1 and method.endswith("\n")
        assert "def " not in method.split("def remove", 1)[1]  # the next method is not shown
        assert const.startswith("LOW_STOCK = ") and const.count("\n") == 1
        assert whole == source
        assert bad[0].startswith("error: no function, class or constant 'nothing' in")
        assert "LOW_STOCK" in bad[0] and cls in bad[0]
        assert bad[1] == "error: name only applies to Python files; read README.md without it"
        assert bad[2] == "error: read_file takes a string argument 'name'"
        await results(env, ("replace_in_file", {"path": module, "old": "class ", "new": "clas "}))
        (broken,) = await results(env, ("read_file", {"path": module, "name": "remove"}))
        assert broken.startswith(f"error: {module} does not parse (line ")
    finally:
        await env.close()


async def test_bad_calls_are_clear_errors_and_change_nothing() -> None:
    env = SweEnv(5)
    await env.reset()
    try:
        module = env.task.module
        bad_patch = (f"--- a/{module}\n+++ b/{module}\n@@ -1,2 +1,2 @@\n-def nothing_like_this():\n"
                     "+def x():\n")
        out = await results(
            env, ("read_file", {"path": "../../etc/passwd"}), ("read_file", {"path": "/etc/passwd"}),
            ("read_file", {"path": "nope.py"}), ("replace_in_file", {"path": module, "old":
                                                                   "no such text", "new": "x"}),
            ("replace_in_file", {"path": module, "old": "\n", "new": "x"}),
            ("apply_patch", {"diff": bad_patch}), ("apply_patch", {"diff": "fix it please"}),
            ("fly", {}), ("read_file", "{not json"), ("read_file", {"file": "x"}),
            ("replace_in_file", {"path": "../outside.txt", "old": "a", "new": "b"}))
        assert out[0] == "error: '../../etc/passwd' is not a path inside the sandbox"
        assert out[1] == "error: '/etc/passwd' is not a path inside the sandbox"
        assert out[2] == "error: no file named 'nope.py' (list_files shows the files)"
        assert out[3].startswith("error: old text occurs 0 times in")
        assert "occurs" in out[4] and "exactly once" in out[4]
        assert out[5].startswith(f"error: hunk 1 of {module} does not apply")
        assert out[6].startswith("error: no hunks found")
        assert out[7].startswith("error: unknown tool 'fly'")
        assert out[8] == "error: the arguments are not valid JSON"
        assert out[9] == "error: read_file needs a string argument 'path'"
        assert out[10].startswith("error: '../outside.txt' is not a path")
        assert env.sandbox is not None and env.sandbox.read(module) == env.task.files[module]
        assert env.details()["edit_errors"] == 5 and env.details()["edits"] == 0
        nudge = await env.step({"role": "assistant", "content": "I think it works."})
        assert nudge.messages == [{"role": "user", "content": NUDGE}] and not nudge.done
    finally:
        await env.close()


async def test_the_linter_reports_a_new_error_and_the_tests_a_broken_import() -> None:
    env = SweEnv(6)
    await env.reset()
    try:
        module = env.task.module
        first_def = next(line for line in env.task.files[module].splitlines()
                         if line.startswith("def ") or line.startswith("class "))
        await results(env, ("replace_in_file", {"path": module, "old": first_def,
                                                "new": "value = undefined_name\n" + first_def}))
        lint, tests = await results(env, ("run_linter", {}), ("run_tests", {}))
        assert f"{module}:" in lint and "F821 undefined name 'undefined_name'" in lint
        assert lint.splitlines()[-1] == "1 problem"
        assert "ERROR loading" in tests and "NameError" in tests
        assert tests.splitlines()[-1] == "0 passed, 0 failed, 1 error"
    finally:
        await env.close()


async def test_the_step_budget_ends_the_episode() -> None:
    env = SweEnv(1, max_steps=2)
    await env.reset()
    try:
        assert not (await env.step(reply(("list_files", {})))).done
        step = await env.step({"role": "assistant", "content": "hmm"})
        assert step.done and env.details()["ended_by"] == "steps"
        assert await env.outcome() == -1.0
    finally:
        await env.close()


def test_bad_options_are_one_line() -> None:
    with pytest.raises(EnvError, match="unknown split 'dev'"):
        SweEnv(0, split="dev")
    with pytest.raises(EnvError, match="takes no tasks option"):
        SweEnv(0, tasks=["x"])


def test_a_patch_applies_despite_miscounted_headers_and_moved_lines() -> None:
    files = {"m.py": "a\nb\nc\nd\ne\n"}
    diff = "--- a/m.py\n+++ b/m.py\n@@ -9,7 +9,9 @@\n b\n-c\n+C\n+C2\n d\n"
    assert apply_patch(diff, files.get) == {"m.py": "a\nb\nC\nC2\nd\ne\n"}
    two = ("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+A\n@@ -5 +5 @@\n-e\n+E\n"
           "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n")
    assert apply_patch(two, files.get) == {"m.py": "A\nb\nc\nd\nE\n", "new.py": "x = 1\ny = 2\n"}
    for diff, error in [
        ("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-z\n+Z\n", "hunk 1 of m.py does not apply"),
        ("--- a/m.py\n@@ -1 +1 @@\n", "line 1: a '--- ' line must be followed by '+++ '"),
        ("--- a/m.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-a\n", "deleting m.py is not supported"),
        ("--- /dev/null\n+++ b/m.py\n@@ -0,0 +1 @@\n+a\n", "m.py already exists"),
        ("--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n*a\n", "line 4: a hunk line must start"),
    ]:
        with pytest.raises(PatchError, match=re.escape(error)):
            apply_patch(diff, files.get)


def test_the_linter_finds_each_kind_of_problem() -> None:
    report = lint_files({"a.py": "import os\nimport sys\n\n\ndef f(x):\n    unused = 1\n"
                                 "    if x == None:\n        return sys.argv\n    return y\n",
                         "b.py": "def broken(:\n"})
    assert report.splitlines() == [
        "a.py:1:1: F401 'os' imported but unused",
        "a.py:6:5: F841 local variable 'unused' is assigned to but never used",
        "a.py:7:8: E711 comparison to None (use `is` or `is not`)",
        "a.py:9:12: F821 undefined name 'y'",
        "b.py:1:12: E999 SyntaxError: invalid syntax",
        "5 problems"]


FORGER = '''"""Reads the verdict's command line and answers for the tests."""
import builtins
import json
import os
import sys

words = [w.decode(errors="replace") for w in open("/proc/self/cmdline", "rb").read().split(b"\\0")]
if "source" in words:  # a verdict run in this process: claim every test passed
    print(f"RESULT {words[words.index('source') + 2]} 999 0 0")
if "calls" in words:  # claim every call raised every exception there is
    at = words.index("calls")
    names = [n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
             and issubclass(getattr(builtins, n), BaseException)]
    for i in range(len([w for w in words[at + 3:] if w])):
        print(f"CALL {words[at + 2]} " + json.dumps([str(i), "raised", names]))
sys.stdout.flush()
os._exit(0)
'''


async def test_code_that_forges_the_verdict_from_inside_fails() -> None:
    """The project's code runs in the process that runs the tests: it reads the nonce from
    /proc/self/cmdline and prints the result line a verdict made in that process would
    trust. The verdict here asks the sandbox only what each call gave and judges outside it:
    the forger's answers are wrong, and its own lines beside the runner's count against it."""
    import shlex

    from clawrl.envs.swe.env import PYTHON, RUNNER

    env = SweEnv(4)
    await env.reset()
    try:
        task = env.task
        (done,) = await results(env, ("replace_in_file", {
            "path": task.module, "old": task.files[task.module], "new": FORGER}))
        assert done.startswith("replaced 1 occurrence")
        assert env.sandbox is not None
        # The forger does fool a verdict made in its own process (the runner's source mode).
        fooled = await env.sandbox.run(f"{PYTHON} -c {shlex.quote(RUNNER)} source "
                                       f"{shlex.quote(task.hidden)} n0")
        assert "RESULT n0 999 0 0" in fooled.output
        assert any(not raised for _, raised, _ in task.hidden_calls)
        assert (await env.step(reply(("finish", {})))).done
        assert await env.outcome() == -1.0
        assert env.details()["hidden_passed"] < task.hidden_count
    finally:
        await env.close()


def test_the_verdict_counts_one_right_answer_per_call() -> None:
    from clawrl.envs.swe.verdict import count_passed

    calls = (("m.f(1)", False, "2"), ("m.g()", True, "ValueError"), ("m.h()", False, "None"))
    line = 'CALL n1 ["{}", "{}", {}]'.format
    right = [line(0, "value", '"2"'), line(1, "raised", '["ValueError", "Exception"]'),
             line(2, "value", '"None"')]
    assert count_passed("\n".join(right), "n1", calls) == 3
    assert count_passed("\n".join(right), "n2", calls) == 0  # another run's nonce
    assert count_passed("\n".join(right + [right[0]]), "n1", calls) == 2  # answered twice
    assert count_passed("\n".join([line(0, "value", '"2.0"')] + right[1:]), "n1", calls) == 3
    wrong = [line(0, "value", '"3"'), line(1, "raised", '["KeyError", "LookupError"]'),
             line(2, "value", '"0"')]
    assert count_passed("\n".join(wrong), "n1", calls) == 0
    odd = [line(0, "value", '"__import__(\'os\')"'), "CALL n1 not json",
           line(1, "value", '"1"'), line(2, "raised", '"None"')]
    assert count_passed("\n".join(odd), "n1", calls) == 0
    assert count_passed("\n".join([line(0, "value", '"' + "9" * 30_000 + '"')]), "n1",
                        calls) == 0
