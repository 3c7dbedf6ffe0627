"""Parsing judge outputs: a score (boxed, or leading the answer) and a hindsight hint.

Strict on purpose: a vote counts only when its format is unambiguous. No box, several boxes
(even agreeing ones), a box with anything but 1 / +1 / -1 / 0, a hint without both markers,
or a hint together with `[NO_HINT]` all parse to None; the caller keeps the raw text. A
score-first answer (`leading=True`, prompt versions in `judge.prompts.SCORE_FIRST_VERSIONS`)
must start with the score, followed by a space, a `[` or the end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_BOX = re.compile(r"\\boxed\s*\{\s*([+-]?\s*\d+)\s*\}")
_LEADING = re.compile(r"\s*([+-]?\d+)(?=\s|\[|$)")
_HINT = re.compile(r"\[HINT\](.*?)\[/HINT\]", re.DOTALL)
_HINT_MARK = re.compile(r"\[/?HINT\]")
NO_HINT = "[NO_HINT]"


def storable(text: str) -> str:
    """The text as Postgres can store it in text/JSONB: no NUL characters, no lone
    surrogates (a random or broken model emits both)."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def parse_score(text: str, *, leading: bool = False) -> int | None:
    """The score in the one `\\boxed{…}` of `text` (with `leading`, the score the text
    starts with): 1, -1 or 0; None when ambiguous."""
    if leading:
        found = _LEADING.match(text)
        value = int(found.group(1)) if found else None
        return value if value in (1, -1, 0) else None
    if len(_BOX_OPEN.findall(text)) != 1:
        return None
    match = _BOX.search(text)
    if match is None:
        return None
    value = int(match.group(1).replace(" ", ""))
    return value if value in (1, -1, 0) else None


def _verdict(text: str) -> int | None:
    """The score a token's text starts a box with: `1`/`+1` -> 1, `-1`/`-` -> -1, `0` -> 0."""
    value = text.replace(" ", "").removesuffix("}")
    return {"1": 1, "+1": 1, "-1": -1, "-": -1, "0": 0}.get(value)


def boxed_distribution(tokens: Sequence[Mapping[str, Any]], *,
                       leading: bool = False) -> dict[int, float] | None:
    """The judge's probability of each score, read where its one `\\boxed{` takes its value
    (with `leading`, at the answer's first non-blank character).

    `tokens` are the generated tokens with their top alternatives, as OpenAI's
    `choices[0].logprobs.content` gives them (`token`, `top_logprobs` of `token`/`logprob`).
    The token holding the first character after `{` is found; every alternative there that
    continues the same prefix and reads as a score adds its probability to that score. The
    result is normalized over the scores; None when the text has no single box, or no score
    is among the alternatives at that position.
    """
    texts = [str(t.get("token", "")) for t in tokens]
    text = "".join(texts)
    if leading:
        value_at = len(text) - len(text.lstrip())
    else:
        if len(_BOX_OPEN.findall(text)) != 1:
            return None
        match = _BOX_OPEN.search(text)
        assert match is not None
        value_at = match.end()
    start = 0
    for token, piece in zip(tokens, texts, strict=True):
        end = start + len(piece)
        if start <= value_at < end:
            before = text[start:value_at]  # e.g. "{" when the tokenizer joins "{1"
            mass: dict[int, float] = {}
            for alt in token.get("top_logprobs") or []:
                alt_text, logprob = str(alt.get("token", "")), alt.get("logprob")
                if not alt_text.startswith(before) or not isinstance(logprob, (int, float)):
                    continue
                score = _verdict(alt_text[len(before):])
                if score is not None:
                    mass[score] = mass.get(score, 0.0) + math.exp(logprob)
            total = sum(mass.values())
            return {s: p / total for s, p in sorted(mass.items())} if total > 0 else None
        start = end
    return None


@dataclass(frozen=True)
class HintParse:
    """`ok`: the output followed the format. `hint`: the text inside the markers, or None
    for an explicit `[NO_HINT]` (and for unparseable output, where ok is False)."""

    ok: bool
    hint: str | None = None


def parse_hint(text: str) -> HintParse:
    """One `[HINT] … [/HINT]` block → the stripped hint; `[NO_HINT]` alone → no hint."""
    blocks = _HINT.findall(text)
    has_no_hint = NO_HINT in text
    markers = _HINT_MARK.findall(text)
    if len(blocks) == 1 and len(markers) == 2 and not has_no_hint:
        hint = " ".join(blocks[0].split())
        return HintParse(ok=bool(hint), hint=hint or None)
    if not markers and text.count(NO_HINT) == 1:
        return HintParse(ok=True, hint=None)
    return HintParse(ok=False)
