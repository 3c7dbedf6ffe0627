"""How the tiny world's models train: the settings its builds write into their model
directory (`recipe.json`) and the corpus term's data (`ptx.jsonl`), which the trainer reads
as data (trainer/config.py `model_recipe`) without importing the world.

The settings are those `clawrl eval` measured the world learning with; how each was chosen,
and on which seeds, is in docs/results/. The trainer's own defaults are for real models.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

RECIPE_FILE = "recipe.json"  # the name trainer/config.py reads
PTX_FILE = "ptx.jsonl"
PTX_EXAMPLES = 4000

# The chat model. `adapter_lr`: personal mode's adapters. `ptx_coef`: the world's own corpus
# mixed into every step (trainer/ptx.py) holds its facts while a user's style moves.
TINYWORLD_RECIPE: dict[str, float | int | str] = {"lr": 8e-4, "kl_coef": 0.05, "batch_size": 64,
                                                  "adapter_lr": 3e-3, "ptx_coef": 0.25}
# Personal mode's adapters, over the recipe above: a stronger KL to the base instead of the
# corpus term. A style's reward pushes the same tokens every step while the noise that
# garbles facts pushes different ones, and the KL holds back the second more; the corpus term
# kept the adapters' facts but held their style back.
PERSONAL_RECIPE: dict[str, float | int | str] = {"kl_coef": 0.2, "ptx_coef": 0.0}
# The tool-call model (`clawrl tinyworld build --tools`), over the chat recipe, without its
# corpus term (its corpus is mostly the first moves an agent is trained away from): a smaller
# learning rate, at which its tool-call JSON holds, and a batch-mean baseline.
TOOLS_RECIPE: dict[str, float | int | str] = {"lr": 2e-4, "reward_baseline": "batch_mean"}


def tinyworld_recipe(*, tools: bool = False, personal: bool = False,
                     ) -> dict[str, float | int | str]:
    """The tiny world's training settings for the chat or the tool-call model, shared or
    personal mode."""
    recipe: dict[str, float | int | str] = dict(TINYWORLD_RECIPE)
    if tools:
        del recipe["ptx_coef"]
        recipe |= TOOLS_RECIPE
    return recipe | PERSONAL_RECIPE if personal else recipe


def write_recipe(model_dir: Path, seed: int, tool_share: float = 0.0) -> None:
    """Write `recipe.json` and the corpus it names (`ptx.jsonl`: the build's own mix, used
    when the corpus term is on) into a model directory being built."""
    write_tinyworld_ptx(model_dir / PTX_FILE, seed, tool_share=tool_share)
    recipe: dict[str, Any] = {"train": tinyworld_recipe(tools=tool_share > 0),
                              "personal": PERSONAL_RECIPE, "ptx_data": PTX_FILE}
    (model_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")


def write_tinyworld_ptx(path: Path, seed: int, examples: int = PTX_EXAMPLES,
                        tool_share: float = 0.0) -> Path:
    """The tiny world's own chat corpus (clawrl/world/corpus.py `chat_example`, held-in
    questions only: the held-out probes never appear) as a ptx file; with `tool_share`, tool
    episodes (with the tools offered) among the chats, as the tool-call build mixes them."""
    from clawrl.world.corpus import chat_example
    from clawrl.world.tools import TOOLS, tool_episode
    from clawrl.world.town import World

    world, rng = World.build(seed), random.Random(f"ptx-{seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _ in range(examples):
            row = ({"messages": tool_episode(world, rng), "tools": TOOLS}
                   if rng.random() < tool_share else {"messages": chat_example(world, rng)})
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path
