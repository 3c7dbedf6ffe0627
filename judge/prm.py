"""PRM scoring: m votes on the next state, in parallel; the majority is the reward.

Rules (DESIGN §3, STYLE habit 14): only parseable votes count; the most frequent score wins;
a tie at the top, or no parseable vote at all, is an abstention (None, stored as NULL),
never a 0. A 0 is only ever a reward when the judges said 0.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from judge.backends import ChatBackend, Completion
from judge.errors import first_error
from judge.parse import parse_score
from judge.prompts import judge_messages

T = TypeVar("T")


async def concurrently(*coros: Coroutine[Any, Any, T]) -> list[T]:
    """Run coroutines concurrently; on the first failure cancel the rest and raise that
    error itself (not an ExceptionGroup), so the worker can classify it."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return [t.result() for t in tasks]


@dataclass(frozen=True)
class Vote:
    text: str
    score: int | None

    def as_json(self) -> dict[str, Any]:
        return {"text": self.text, "score": self.score}


@dataclass(frozen=True)
class PrmResult:
    reward: int | None
    votes: list[Vote]
    judge_model: str | None


def majority(scores: Sequence[int | None]) -> int | None:
    """The most frequent parseable score; None on a tie at the top or when none parsed."""
    counts = Counter(s for s in scores if s is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return None
    return counts[0][0]


async def sample_votes(backend: ChatBackend, prompt: str, n: int, *, temperature: float,
                       max_tokens: int) -> list[Completion]:
    """`n` independent completions of one prompt, concurrently. If one request fails the
    others are cancelled and the error propagates (the job is retried as a whole)."""
    messages = judge_messages(prompt)
    return await concurrently(*(backend.complete(messages, temperature=temperature,
                                                 max_tokens=max_tokens) for _ in range(n)))


async def score_turn(backend: ChatBackend, prompt: str, *, votes: int, temperature: float,
                     max_tokens: int) -> PrmResult:
    completions = await sample_votes(backend, prompt, votes, temperature=temperature,
                                     max_tokens=max_tokens)
    cast = [Vote(text=c.text, score=parse_score(c.text)) for c in completions]
    return PrmResult(reward=majority([v.score for v in cast]), votes=cast,
                     judge_model=completions[0].label if completions else None)
