"""The environments `clawrl env NAME` knows: name -> factory(seed, **options), and
`make_env`. Each factory imports its module only when used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clawrl.envs.protocol import Env, EnvError


def _terminal(seed: int, **options: Any) -> Env:
    from clawrl.envs.terminal import TerminalEnv

    return TerminalEnv(seed, **options)


def _toolcall(seed: int, **options: Any) -> Env:
    from clawrl.envs.toolcall import ToolcallEnv

    return ToolcallEnv(seed, **options)


def _swe(seed: int, **options: Any) -> Env:
    from clawrl.envs.swe.env import SweEnv

    return SweEnv(seed, **options)


def _gui(seed: int, **options: Any) -> Env:
    from clawrl.envs.gui.env import GuiEnv

    return GuiEnv(seed, **options)


ENVS: dict[str, tuple[Callable[..., Env], str]] = {
    "terminal": (_terminal, "a sandboxed shell with small verifiable tasks (run(command))"),
    "toolcall": (_toolcall, "questions about the tiny world, answered with lookup(person, "
                 "attribute) then answer(text)"),
    "swe": (_swe, "fix the seeded bug of a generated Python project (read, patch, run the "
            "tests, lint, finish)"),
    "gui": (_gui, "reach a goal in a generated web application in headless Chromium (click, "
            "click_at, type, press, scroll, done)"),
}


def make_env(name: str, seed: int, **options: Any) -> Env:
    if name not in ENVS:
        raise EnvError(f"unknown environment {name!r} (known: {', '.join(ENVS)})")
    return ENVS[name][0](seed, **options)
