"""The GUI track's task generator (clawrl/envs/gui/tasks.py, apps.py) and its page text
(view.py), without a browser: the split, determinism and variety, the state checks, the
markers of what changed and the caps on an observation's size."""

from __future__ import annotations

import json

import pytest

from clawrl.envs.gui.apps import TEMPLATES, goal_met
from clawrl.envs.gui.tasks import HELDOUT_KINDS, HELDOUT_TEMPLATES, draw_task, pairs
from clawrl.envs.gui.view import render
from clawrl.envs.protocol import EnvError


def test_the_split_is_by_template_and_by_goal_kind() -> None:
    train, heldout = pairs("train"), pairs("heldout")
    every = {(t, k) for t, (_, kinds) in TEMPLATES.items() for k in kinds}
    assert len(train) == 5 and len(heldout) == 5 and set(train) | set(heldout) == every
    assert not set(train) & set(heldout)
    assert {k for _, k in heldout} & set(HELDOUT_KINDS) and len(
        {t for t, k in heldout if k in HELDOUT_KINDS}) == 3  # choose, in three templates
    for seed in range(40):
        task = draw_task(seed, "train")
        assert task.template not in HELDOUT_TEMPLATES and task.kind not in HELDOUT_KINDS
        held = draw_task(seed, "heldout")
        assert held.template in HELDOUT_TEMPLATES or held.kind in HELDOUT_KINDS
    with pytest.raises(EnvError, match="unknown split 'dev'"):
        draw_task(0, "dev")


def test_tasks_are_deterministic_and_hundreds_differ() -> None:
    assert draw_task(17) == draw_task(17)
    assert draw_task(17) != draw_task(17, "heldout")
    seen, goals = set(), set()
    for split in ("train", "heldout"):
        for seed in range(200):
            task = draw_task(seed, split)
            seen.add(json.dumps([task.spec, task.goal], sort_keys=True))
            goals.add(task.goal)
    assert len(seen) == 400  # every draw a different app or goal
    assert len(goals) >= 250  # and mostly a different goal in words


def test_the_check_reads_the_state_and_a_decoy_is_a_different_attempt() -> None:
    for split in ("train", "heldout"):
        for seed in range(10):
            task = draw_task(seed, split)
            assert not goal_met(task.check, task.spec["state"]), task.name  # nothing done
            assert task.plan != task.decoy and task.plan[-1] == ("done",)
    assert goal_met(("submitted", "includes", {"name": "Ada"}), {"submitted": {"name": "Ada",
                                                                               "city": "Oslo"}})
    assert not goal_met(("submitted", "includes", {"name": "Ada"}), {"submitted": None})
    assert not goal_met(("page", "equals", "pricing"), None)


def snap(*items: tuple[int, str, str, str | None, list[str], bool],
         below: int = 0) -> dict[str, object]:
    return {"title": "T", "width": 800, "height": 600, "scroll": [0, 0], "above": 0,
            "below": below, "items": [{"id": i, "role": r, "name": n, "value": v, "states": s,
                                       "covered": c, "box": [0, 10 * i, 100, 10 * i + 9]}
                                      for i, r, n, v, s, c in items]}


def test_the_page_text_marks_changes_and_keeps_covered_elements() -> None:
    first = render(snap((1, "heading", "Settings", None, [], False),
                        (2, "switch", "Dark mode", None, ["off"], False),
                        (3, "button", "Save", None, [], False)), None)
    assert first.text.splitlines() == ['page "T" 800x600', '[1] heading "Settings" @0,10,100,19',
                                       '[2] switch "Dark mode" off @0,20,100,29',
                                       '[3] button "Save" @0,30,100,39']
    second = render(snap((1, "heading", "Settings", None, [], False),
                         (2, "switch", "Dark mode", None, ["on"], True),
                         (4, "dialog", "Sure?", None, [], False)), first.view)
    lines = second.text.splitlines()
    assert lines[0] == 'page "T" 800x600; 0 changed, 1 new, 1 gone'  # covered: not a change
    assert lines[1:] == ['  [1] heading "Settings" @0,10,100,19',
                         '+ [4] dialog "Sure?" @0,40,100,49', '- [3] button "Save"',
                         "(1 elements behind the dialog)"]
    third = render(snap((1, "heading", "Settings", None, [], False),
                        (2, "switch", "Dark mode", None, ["on"], False)), second.view, "changes")
    assert third.text.splitlines()[1:] == ['~ [2] switch "Dark mode" on @0,20,100,29',
                                           '- [4] dialog "Sure?"',
                                           "(1 unchanged elements not shown)"]
    assert (third.changed, third.new, third.gone) == (1, 0, 1)


def test_the_page_text_is_capped() -> None:
    items = [(i, "text", "x" * 100, None, [], False) for i in range(1, 61)]
    shown = render(snap(*items, below=7), None, max_lines=40)
    lines = shown.text.splitlines()
    assert len(lines) == 1 + 40 + 2
    assert lines[1] == '[1] text "' + "x" * 47 + '…" @0,10,100,19'
    assert lines[-2:] == ["(20 more elements not shown)",
                          "(7 more elements below the viewport: scroll to see them)"]
