"""The environment protocol the episode pool (clawrl/envs/pool.py) drives.

An environment is one episode of a task with a verifiable outcome:

    env = make_env("terminal", seed=3)   # clawrl/envs/registry.py
    obs = await env.reset()              # the first messages and the tools the model may call
    step = await env.step(reply)         # the model's assistant message -> the next state
    ...                                  # (tool results as `tool` messages; done when over)
    outcome = await env.outcome()        # verified by the environment, in [-1, 1]
    await env.close()

The pool sends `obs.messages`, then after each step the reply and `step.messages`, so the
proxy sees exactly what a user's agent sends: the tool results of one reply are the next state
of that reply's turn (docs/proxy.md, "Sessions without client changes"), and the outcome is
the session's (docs/proxy.md, "Session outcomes").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]  # an OpenAI chat message, as sent to /v1/chat/completions


@dataclass
class Observation:
    messages: list[Message]  # the episode's opening messages (system, user task)
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool definitions
    task: str = ""  # the task's name, for the pool's table


@dataclass
class Step:
    messages: list[Message]  # the next state: one `tool` message per tool call, or a user turn
    done: bool = False       # the episode is over (the model finished, or ran out of steps)


class Env(Protocol):
    async def reset(self) -> Observation: ...

    async def step(self, reply: Message) -> Step: ...

    async def outcome(self) -> float: ...

    async def close(self) -> None: ...

    # Optional: `details() -> dict` after the episode, what the environment saw (the pool
    # keeps it in `EpisodeResult.details`; the tool-call track: the first move, the answer).


class EnvError(ValueError):
    """A bad environment name or argument: one readable line on the CLI."""
