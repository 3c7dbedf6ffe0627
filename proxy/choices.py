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

Streamed (`stream: true`), the choices' engine streams are relayed at once, interleaved as
their chunks come (`merge_relays`): each chunk carries its choice's `index` and the first
chunk's `id`; each choice's usage chunk is held back, and one usage chunk for the whole
request (summed as above) comes last when `stream_options.include_usage` asked for it, then
one `[DONE]`. Each choice's turn is logged when its own stream ends.

proxy/chat.py makes the choices' turns (`choice_turns`) and serves them; this module holds
what does not depend on a turn. If one choice fails, the others are cancelled and the request fails as a single one would
(every choice's turn is logged with the failure, none is trained).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from clawrl.base.errors import ClawrlError
from proxy.sse import DONE, Last, Renderer, error_event

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
        merged["usage"] = sum_usage(usages)
    return merged


def sum_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The request's usage from its choices': the prompt once, the completions summed."""
    prompt = int(usages[0].get("prompt_tokens") or 0)
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    return {**usages[0], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass
class MergedStream:
    """What the choices' streams share: the reply's one id (the first chunk's), and each
    choice's usage, held back for the one usage chunk at the end."""

    n: int
    id: str | None = None
    model: str | None = None
    created: Any = None
    usages: dict[int, dict[str, Any]] = field(default_factory=dict)

    def end(self) -> bytes:
        """The usage chunk (when every choice reported one), then `[DONE]`."""
        if len(self.usages) < self.n:
            return DONE
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "choices": [],
                 "usage": sum_usage([self.usages[i] for i in range(self.n)])}
        return b"data: " + orjson.dumps(chunk) + b"\n\n" + DONE


@dataclass
class ChoiceRenderer:
    """One choice's part of a streamed `n` > 1 reply: its chunks as `inner` renders them,
    with the choice's index and the reply's id; no usage and no `[DONE]` of its own (an
    error event when its stream failed)."""

    inner: Renderer
    index: int
    merged: MergedStream

    def start(self) -> bytes:
        return b""

    def chunk(self, chunk: dict[str, Any]) -> bytes | None:
        usage = chunk.pop("usage", None)
        if usage:
            self.merged.usages[self.index] = usage
        if not chunk.get("choices"):
            return None  # its usage is merged at the end; its token ids are the proxy's
        if self.merged.id is None:
            self.merged.id, self.merged.created = chunk.get("id"), chunk.get("created")
        chunk["id"] = self.merged.id
        for choice in chunk["choices"]:
            choice["index"] = self.index
        piece = self.inner.chunk(chunk)
        if self.merged.model is None:
            self.merged.model = chunk.get("model")
        return piece

    def end(self, collector: Any, failure: ClawrlError | None) -> bytes:
        return b"" if failure is None else error_event(failure)


async def merge_relays(relays: Sequence[AsyncIterator[bytes]],
                       merged: MergedStream) -> AsyncIterator[bytes]:
    """The choices' relays interleaved as their pieces come, then `merged.end()` as the
    `Last` piece. Closed early (the client left), it cancels the relays, and each is
    closed (its engine request with it, its turn logged) before this returns."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(source: AsyncIterator[bytes]) -> None:
        try:
            async for piece in source:
                if piece:
                    await queue.put(bytes(piece))
        finally:
            closer = getattr(source, "aclose", None)
            if closer is not None:
                await asyncio.shield(closer())
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(source)) for source in relays]
    try:
        running = len(tasks)
        while running:
            piece = await queue.get()
            if piece is None:
                running -= 1
            else:
                yield piece
        for task in tasks:
            task.result()  # a relay that raised: raise it here
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
    yield Last(merged.end())


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
