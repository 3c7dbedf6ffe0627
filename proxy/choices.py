"""`n` > 1: several choices for one chat request, each its own engine request and its own turn.

Each choice is sampled by its own engine request (`n` is not sent: the embedded engine
samples one reply per request, and one request per choice gives each choice its own exact
token ids and logprobs on either engine), all at once; with a `seed`, choice i is drawn
with `seed + i`, so the choices differ and the same request draws the same choices again.
Each choice is logged as its own turn with the request's `group_id` and its `group_index`
(migration 0013), so a group baseline can compare the rewards of the replies sampled for one
prompt (proxy/sessions.py puts them in one session, at one index). The client reads one
`chat.completion` with the choices in order and the usage summed (the prompt counted once,
as OpenAI counts it); `X-Clawrl-Turn-Id` names the first choice's turn and
`X-Clawrl-Turn-Ids` every choice's, in order.

proxy/chat.py makes the choices' turns (`choice_turns`) and serves them; this module holds
what does not depend on a turn. If one choice fails, the others are cancelled and the request fails as a single one would
(every choice's turn is logged with the failure, none is trained).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_INT64 = 2**63


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` for a request's `seed`: `seed + index`, kept in int64."""
    return (seed + index + _INT64) % (2 * _INT64) - _INT64


def choice_body(body: dict[str, Any], index: int) -> dict[str, Any]:
    """The engine body of choice `index`: the request without `n`, its own seed."""
    out = {k: v for k, v in body.items() if k != "n"}
    if isinstance(out.get("seed"), int):
        out["seed"] = choice_seed(out["seed"], index)
    return out


def merge_choices(datas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One `chat.completion` from the engine's replies of each choice: the first reply with
    every reply's choice, indexed in order, and the usage summed (the prompt once)."""
    merged = dict(datas[0])
    choices = []
    for index, data in enumerate(datas):
        choice = dict((data.get("choices") or [{}])[0])
        choice["index"] = index
        choices.append(choice)
    merged["choices"] = choices
    usages = [d.get("usage") or {} for d in datas]
    if all(usages):
        prompt = int(usages[0].get("prompt_tokens") or 0)
        completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
        merged["usage"] = {**usages[0], "prompt_tokens": prompt,
                           "completion_tokens": completion, "total_tokens": prompt + completion}
    return merged


async def gather_all(calls: Sequence[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; the first failure (or a cancellation) cancels the rest
    and waits for them to close (their engine requests with them) before it is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
