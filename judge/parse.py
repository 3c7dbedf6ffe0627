"""Parsing judge outputs: a boxed score and a hindsight hint.

Strict on purpose: a vote counts only when its format is unambiguous. No box, several boxes
(even agreeing ones), a box with anything but 1 / +1 / -1 / 0, a hint without both markers,
or a hint together with `[NO_HINT]` all parse to None; the caller keeps the raw text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_BOX = re.compile(r"\\boxed\s*\{\s*([+-]?\s*\d+)\s*\}")
_HINT = re.compile(r"\[HINT\](.*?)\[/HINT\]", re.DOTALL)
_HINT_MARK = re.compile(r"\[/?HINT\]")
NO_HINT = "[NO_HINT]"


def storable(text: str) -> str:
    """The text as Postgres can store it in text/JSONB: no NUL characters, no lone
    surrogates (a random or broken model emits both)."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def parse_score(text: str) -> int | None:
    """The score in the one `\\boxed{…}` of `text`: 1, -1 or 0; None when ambiguous."""
    if len(_BOX_OPEN.findall(text)) != 1:
        return None
    match = _BOX.search(text)
    if match is None:
        return None
    value = int(match.group(1).replace(" ", ""))
    return value if value in (1, -1, 0) else None


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
