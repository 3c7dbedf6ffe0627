"""PRM scoring: m votes on the next state; the majority is the reward.

Rules (a judge that cannot decide abstains): only parseable votes count; the most frequent score wins;
a tie at the top, or no parseable vote at all, is an abstention (None, stored as NULL),
never a 0. A 0 is only ever a reward when the judges said 0.

Two ways to get the m votes (`CLAWRL_JUDGE__PRM_MODE`):
- `sample`: m completions sampled at the judge temperature, in parallel, each parsed;
- `logprob`: one greedy completion asking for the top alternatives of each token; the
  judge's distribution over scores where its `\\boxed{` takes its value
  (judge/parse.py `boxed_distribution`) is sharpened by the temperature (p^(1/T),
  renormalized; T = 0 is the most likely score) and the m votes are drawn from it, with a
  generator seeded by the prompt so a re-judge draws the same. Drawn from the same
  distribution the first sampled token of a vote would come from, at a third of the cost for
  three votes (one prefill, one decode); it needs an endpoint that returns `top_logprobs`
  (SGLang, `clawrl engine`, OpenAI's API).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from judge.backends import ChatBackend, Completion
from judge.errors import first_error
from judge.parse import boxed_distribution, parse_score
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
    # `logprob` mode: the judge's probability of each score the vote was drawn from.
    probs: dict[int, float] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"text": self.text, "score": self.score}
        if self.probs is not None:
            out["p"] = {str(k): round(v, 4) for k, v in self.probs.items()}
        return out


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


# Alternatives asked for per generated token in `logprob` mode (OpenAI allows up to 20).
TOP_LOGPROBS = 10


def draw_votes(probs: dict[int, float], n: int, temperature: float,
               rng: random.Random) -> list[int]:
    """`n` scores drawn from `probs` sharpened by `temperature` (0: the most likely, n times)."""
    if temperature <= 0:
        return [max(probs, key=lambda s: probs[s])] * n
    weights = {s: p ** (1.0 / temperature) for s, p in probs.items()}
    scores = sorted(weights)
    return rng.choices(scores, [weights[s] for s in scores], k=n)


async def greedy_with_alternatives(backend: ChatBackend, prompt: str, *,
                                   max_tokens: int) -> Completion:
    """One greedy completion with each token's top alternatives (`logprob` mode)."""
    return await backend.complete(judge_messages(prompt), temperature=0.0,
                                  max_tokens=max_tokens, top_logprobs=TOP_LOGPROBS)


def prm_from_distribution(completion: Completion, prompt: str, *, votes: int,
                          temperature: float, leading: bool = False) -> PrmResult:
    """`votes` scores drawn from the completion's distribution over scores, with a generator
    seeded by the prompt; an abstention when it has none (no single box, no score among
    the alternatives): one vote without a score."""
    probs = boxed_distribution(completion.tokens or [], leading=leading)
    if probs is None:
        return PrmResult(reward=None, votes=[Vote(text=completion.text, score=None)],
                         judge_model=completion.label)
    rng = random.Random(hashlib.sha256(prompt.encode()).digest())
    cast = [Vote(text=completion.text, score=s, probs=probs)
            for s in draw_votes(probs, votes, temperature, rng)]
    return PrmResult(reward=majority([v.score for v in cast]), votes=cast,
                     judge_model=completion.label)


def prm_from_samples(completions: Sequence[Completion], *, leading: bool = False) -> PrmResult:
    """The majority of the sampled completions' parsed scores."""
    cast = [Vote(text=c.text, score=parse_score(c.text, leading=leading)) for c in completions]
    return PrmResult(reward=majority([v.score for v in cast]), votes=cast,
                     judge_model=completions[0].label if completions else None)


async def score_turn(backend: ChatBackend, prompt: str, *, votes: int, temperature: float,
                     max_tokens: int, mode: str = "sample") -> PrmResult:
    if mode == "logprob":
        completion = await greedy_with_alternatives(backend, prompt, max_tokens=max_tokens)
        return prm_from_distribution(completion, prompt, votes=votes, temperature=temperature)
    return prm_from_samples(await sample_votes(backend, prompt, votes,
                                               temperature=temperature, max_tokens=max_tokens))
