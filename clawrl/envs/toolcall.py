"""The tool-call track: one question about the tiny world per episode, answered through two
tools, `lookup(person, attribute)` and `answer(text)` (clawrl/world/tools.py).

The episode's question is drawn by the seed from the world's held-in questions (`split
"train"`, what the loop trains on) or its held-out ones (`"heldout"`, phrasings the model never
saw: what `clawrl eval --track toolcall` probes with). A `lookup` comes back as a `tool`
message, a line of the town records or an error; `answer` ends the episode; a reply without a
tool call gets the user's nudge to use the tools. The outcome is +1 when the asked fact was
looked up before `answer` and the answer states it, −1 otherwise.
"""

from __future__ import annotations

import random
from typing import Any

from clawrl.envs.protocol import EnvError, Message, Observation, Step
from clawrl.world.tools import TOOLS, ToolEpisode, states_fact
from clawrl.world.town import World

SPLITS = ("train", "heldout")


class ToolcallEnv:
    def __init__(self, seed: int, split: str = "train", world_seed: int = 0,
                 **options: Any) -> None:
        if options:
            raise EnvError(f"the toolcall environment takes no {', '.join(options)} option")
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r} (train or heldout)")
        world = World.build(world_seed)
        questions = world.train if split == "train" else world.heldout
        self.episode = ToolEpisode(world, random.Random(f"toolcall-{seed}").choice(questions))

    async def reset(self) -> Observation:
        return Observation(list(self.episode.messages), tools=TOOLS,
                           task=self.episode.question.attr)

    async def step(self, reply: Message) -> Step:
        messages, done = self.episode.step(reply)
        return Step(messages, done)

    async def outcome(self) -> float:
        return self.episode.outcome()

    async def close(self) -> None:
        return None

    def details(self) -> dict[str, Any]:
        """The first move (`lookup`, `answer`, another tool, or `text`), whether the final
        answer states the asked fact (looked up or not), and whether it was looked up."""
        ep = self.episode
        answer = ep.attempt.answer
        return {"first_move": ep.first_move, "answered": answer is not None,
                "answer_correct": answer is not None and states_fact(ep.world, ep.question,
                                                                     answer),
                "looked_up": (ep.question.name, ep.question.attr) in ep.attempt.looked_up}
