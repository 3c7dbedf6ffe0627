"""The SWE track's verdict: the hidden tests' calls run in the sandbox, their answers are
judged here, outside it.

The project's code runs in the process that runs its tests, so whatever that process says
about the tests, the code could have said: it can read the command line (`/proc/self/
cmdline`), print a result line of its own, or end the process before the real one. So the
sandbox is never asked whether a test passed. It is asked what each call gave
(clawrl/envs/swe/testrun.py `calls`: one `CALL NONCE [...]` line per call), and this module
holds what each call must give, which never enters the sandbox. A call passes when exactly
one line answers it and that line gives the expected value (read back as a Python literal,
compared with `==`, or `is` for None) or an exception of the expected class (or a subclass,
as `except ValueError:` would). Two lines for one call (code that prints answers of its
own), none, a value that is no literal, or one too long to read count as failed.
"""

from __future__ import annotations

import ast
import json
from typing import Any

MAX_ANSWER = 20_000  # characters of one call's answer that are read


def answers(output: str, nonce: str) -> dict[int, list[list[Any]]]:
    """Each call's index -> the answers printed for it under `nonce`."""
    out: dict[int, list[list[Any]]] = {}
    prefix = f"CALL {nonce} "
    for line in output.splitlines():
        if not line.startswith(prefix) or len(line) > MAX_ANSWER + 200:
            continue
        try:
            answer = json.loads(line[len(prefix):])
            index = int(answer[0])
        except (ValueError, TypeError, IndexError, KeyError, RecursionError):
            continue
        if isinstance(answer, list) and len(answer) == 3:
            out.setdefault(index, []).append(answer)
    return out


def passes(answer: list[Any], raised: bool, expected: str) -> bool:
    _, kind, got = answer
    if raised:
        return kind == "raised" and isinstance(got, list) and expected in got
    if kind != "value" or not isinstance(got, str) or len(got) > MAX_ANSWER:
        return False
    try:
        value, want = ast.literal_eval(got), ast.literal_eval(expected)
        return value is None if want is None else bool(value == want)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def count_passed(output: str, nonce: str, calls: tuple[tuple[str, bool, str], ...]) -> int:
    """How many of `calls` the output answers right (see the module docstring)."""
    got = answers(output, nonce)
    return sum(len(got.get(i, [])) == 1 and passes(got[i][0], raised, expected)
               for i, (_, raised, expected) in enumerate(calls))
