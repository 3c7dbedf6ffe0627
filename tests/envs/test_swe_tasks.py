"""The SWE track's task generator (clawrl/envs/swe/tasks.py, bugs.py, templates.py): the
split, determinism and variety, the bug kinds' edits, and that every task is honest — its
hidden tests fail with the bug and pass with the fix, run in the real sandbox."""

from __future__ import annotations

import asyncio
import random
import shlex

import pytest

from clawrl.envs.protocol import EnvError
from clawrl.envs.sandbox import Sandbox
from clawrl.envs.swe.bugs import KINDS, find_sites
from clawrl.envs.swe.env import PYTHON, RUNNER
from clawrl.envs.swe.lint import lint_source
from clawrl.envs.swe.tasks import HELDOUT_KINDS, HELDOUT_TEMPLATES, Task, draw_task, pairs
from clawrl.envs.swe.templates import TEMPLATES
from clawrl.envs.swe.verdict import count_passed


def seed_of(split: str, template: str, kind: str, k: int = 0) -> int:
    """The k-th seed of `split` whose task is of this template and kind."""
    choices = pairs(split)
    return choices.index((template, kind)) + k * len(choices)


def test_the_split_is_by_template_and_by_kind() -> None:
    train, heldout = pairs("train"), pairs("heldout")
    assert len(train) == 20 and len(heldout) == 10
    assert set(train) | set(heldout) == {(t, k) for t in TEMPLATES for k in KINDS}
    assert not set(train) & set(heldout)
    for seed in range(60):
        task = draw_task(seed, "train")
        assert task.template not in HELDOUT_TEMPLATES and task.kind not in HELDOUT_KINDS
        held = draw_task(seed, "heldout")
        assert held.template in HELDOUT_TEMPLATES or held.kind in HELDOUT_KINDS
        assert held.split == "heldout" and task.split == "train"
    with pytest.raises(EnvError, match="unknown split 'dev'"):
        draw_task(0, "dev")


def test_tasks_are_deterministic_and_hundreds_differ() -> None:
    assert draw_task(17) == draw_task(17)
    projects = set()
    names = set()
    for split in ("train", "heldout"):
        for seed in range(150):
            task = draw_task(seed, split)
            projects.add(task.files[task.module] + task.files[task.test_file] + task.hidden)
            names.add(task.name)
    assert len(projects) == 300  # every draw a different project or different tests
    assert len(names) >= 80      # template/kind/function: many different bugs, not one each


def test_a_task_differs_from_its_fix_in_one_place_and_says_where() -> None:
    task = draw_task(3)
    buggy = task.files[task.module]
    assert buggy != task.fixed
    changed = [line for line in task.fix_diff.splitlines()
               if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    assert 1 <= len(changed) <= 4, task.fix_diff
    assert task.visible_count >= 2 * 6 and task.hidden_count >= task.visible_count
    assert "Hidden" not in "".join(task.files.values())


SOURCE = '''X = 5


def f(a, b):
    """doc"""
    if a < b:
        return g(a, b) + 1
    total = a * X
    return total
'''


def test_each_bug_kind_edits_what_it_says() -> None:
    sites = find_sites(SOURCE, random.Random(0))
    by_kind: dict[str, list[str]] = {}
    for site in sites:
        by_kind.setdefault(site.kind, []).append(site.edit.apply(SOURCE))
    assert "    if a <= b:\n" in by_kind["wrong_comparison"][0]
    assert {"        return g(a, b) - 1\n" in m for m in by_kind["wrong_operator"]} == {True, False}
    assert any("    total = a + X\n" in m for m in by_kind["wrong_operator"])
    assert "        return g(b, a) + 1\n" in by_kind["swapped_arguments"][0]
    assert any(m.startswith("X = ") and not m.startswith("X = 5\n")
               for m in by_kind["wrong_constant"])
    assert any("return g(a, b) + 2" in m or "return g(a, b) + 0" in m
               for m in by_kind["off_by_one"])
    assert by_kind["missing_branch"] == [SOURCE.replace(
        "    if a < b:\n        return g(a, b) + 1\n", "")]
    assert set(by_kind) == set(KINDS)
    assert all('"""doc"""' in m for ms in by_kind.values() for m in ms)  # docstrings untouched


def test_the_templates_are_clean_and_the_linter_reads_them_so() -> None:
    for seed in range(0, 60, 2):
        task = draw_task(seed, "train" if seed % 4 else "heldout")
        assert lint_source(task.module, task.fixed) == []
        assert lint_source(task.test_file, task.files[task.test_file]) == []


async def _run_tests(box: Sandbox, task: Task, module_text: str) -> tuple[str, int]:
    """(visible output, hidden calls answered right) with `module_text` as the module."""
    box.write(task.module, module_text)
    visible = await box.run(f"{PYTHON} -c {shlex.quote(RUNNER)} file {task.test_file}")
    calls = " ".join(shlex.quote(c) for c, _, _ in task.hidden_calls)
    hidden = await box.run(f"{PYTHON} -c {shlex.quote(RUNNER)} calls "
                           f"{task.module.removesuffix('.py')} n0 {calls}")
    return visible.output, count_passed(hidden.output, "n0", task.hidden_calls)


async def _check_honest(task: Task) -> None:
    box = Sandbox()
    try:
        for name, text in task.files.items():
            box.write(name, text)
        assert len(task.hidden_calls) == task.hidden_count
        visible, passed = await _run_tests(box, task, task.files[task.module])
        assert passed <= task.hidden_count - 1, task.name  # the bug fails a hidden call
        assert "FAILED test_" in visible and " passed, 0 failed" not in visible, task.name
        visible, passed = await _run_tests(box, task, task.fixed)
        assert passed == task.hidden_count, task.name
        assert visible.splitlines()[-1] == f"{task.visible_count} passed, 0 failed", visible
    finally:
        box.close()


async def test_every_template_and_kind_fails_with_the_bug_and_passes_with_the_fix() -> None:
    """30 pairs (5 templates x 6 kinds), a seed each, both splits' numbering: in the sandbox,
    with the python3 the episodes use."""
    tasks = []
    for split in ("train", "heldout"):
        for k, (template, kind) in enumerate(pairs(split)):
            tasks.append(draw_task(seed_of(split, template, kind, 1 + k % 3), split))
    assert {(t.template, t.kind) for t in tasks} == {(t, k) for t in TEMPLATES for k in KINDS}
    for start in range(0, len(tasks), 8):
        await asyncio.gather(*(_check_honest(t) for t in tasks[start:start + 8]))
