"""Hindsight hints: did the next state say how the reply should have been different?

Each vote is parsed strictly (judge/parse.py). A hint is accepted when it parsed and has at
least `min_chars` characters; with several accepted hints the longest wins (it usually
carries the most of what the user asked for); no accepted hint means no hint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from judge.backends import ChatBackend, Completion
from judge.parse import parse_hint
from judge.prm import sample_votes


@dataclass(frozen=True)
class HintVote:
    text: str
    hint: str | None  # what was inside the markers, when the output parsed
    accepted: bool

    def as_json(self) -> dict[str, Any]:
        return {"text": self.text, "hint": self.hint, "accepted": self.accepted}


@dataclass(frozen=True)
class HintResult:
    hint: str | None
    votes: list[HintVote]


def read_hint_vote(text: str, min_chars: int) -> HintVote:
    parsed = parse_hint(text)
    hint = parsed.hint if parsed.ok else None
    return HintVote(text=text, hint=hint, accepted=hint is not None and len(hint) >= min_chars)


def choose_hint(votes: Sequence[HintVote]) -> str | None:
    """The longest accepted hint (the first one on equal length), or None."""
    accepted = [v.hint for v in votes if v.accepted and v.hint is not None]
    return max(accepted, key=len) if accepted else None


def hint_from(completions: Sequence[Completion], min_chars: int) -> HintResult:
    cast = [read_hint_vote(c.text, min_chars) for c in completions]
    return HintResult(hint=choose_hint(cast), votes=cast)


async def extract_hint(backend: ChatBackend, prompt: str, *, votes: int, temperature: float,
                       max_tokens: int, min_chars: int) -> HintResult:
    if votes == 0:
        return HintResult(hint=None, votes=[])
    return hint_from(await sample_votes(backend, prompt, votes, temperature=temperature,
                                        max_tokens=max_tokens), min_chars)
