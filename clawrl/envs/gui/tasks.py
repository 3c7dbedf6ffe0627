"""The GUI track's task generator: one small web application and a goal, from a seed.

    task = draw_task(seed=7, split="train")
    task.spec      # what clawrl/envs/gui/app.js renders (labels, controls, values, layout)
    task.goal      # "Add two apples to the basket."
    task.check     # the state the application must reach (clawrl/envs/gui/apps.py goal_met)
    task.plan      # the known solution, by role and name; task.decoy: a wrong attempt

Five templates (clawrl/envs/gui/apps.py), two goal kinds each: settings (toggle, choose),
form (fill, choose), menu (navigate, choose), basket (add, remove), dialog (confirm, rename).
The seed picks the labels, how many controls and in which order, their values, the layout,
and the goal's wording.

The split, by template AND by goal kind:

- templates settings, form, menu, basket are held in; dialog is held out;
- kinds toggle, fill, navigate, add, remove are held in; choose (picking from a dropdown or a
  menu, in three templates) is held out;
- `train` draws a held-in template with a held-in kind (5 pairs); `heldout` every pair with a
  held-out template or kind (5 pairs); task `seed` takes pair `seed % pairs`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from clawrl.envs.gui.apps import TEMPLATES, Step
from clawrl.envs.protocol import EnvError

HELDOUT_TEMPLATES = ("dialog",)
HELDOUT_KINDS = ("choose",)
SPLITS = ("train", "heldout")


def pairs(split: str) -> list[tuple[str, str]]:
    """The (template, kind) pairs of a split, in a fixed order."""
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r} (train or heldout)")
    every = [(t, k) for t, (_, kinds) in TEMPLATES.items() for k in kinds]
    held_out = [(t, k) for t, k in every if t in HELDOUT_TEMPLATES or k in HELDOUT_KINDS]
    return held_out if split == "heldout" else [p for p in every if p not in held_out]


@dataclass(frozen=True)
class Task:
    name: str        # template/kind, e.g. "basket/add"
    split: str
    seed: int
    template: str
    kind: str
    spec: dict[str, Any]
    goal: str
    check: tuple[str, str, Any]
    plan: list[Step]
    decoy: list[Step]


def draw_task(seed: int, split: str = "train") -> Task:
    """The task of episode `seed` in `split` (see the module docstring)."""
    choices = pairs(split)
    template, kind = choices[seed % len(choices)]
    app = TEMPLATES[template][0](random.Random(f"gui-{split}-{seed}"), kind)
    return Task(f"{template}/{kind}", split, seed, template, kind, app.spec, app.goal,
                app.check, app.plan, app.decoy)
