"""Parsing judge outputs and the voting rules, table-driven over real-looking outputs."""

from __future__ import annotations

import pytest

from judge.hints import choose_hint, read_hint_vote
from judge.parse import parse_hint, parse_score
from judge.prm import majority

SCORES = [
    ("The user thanks the assistant and moves on. \\boxed{1}", 1),
    ("The user asks for a shorter answer. \\boxed{-1}", -1),
    ("Unclear whether the user is satisfied. \\boxed{0}", 0),
    ("Progress.\n\\boxed{+1}", 1),
    ("The tool call failed with an error. \\boxed{ -1 }", -1),
    ("\\boxed {1}", 1),
    # no box
    ("The user seems happy, so the score is 1.", None),
    ("", None),
    # several boxes, even agreeing ones
    ("First I thought \\boxed{1} but then \\boxed{-1}", None),
    ("\\boxed{1} \\boxed{1}", None),
    # nonsense inside the box / out of range / not a number
    ("\\boxed{2}", None),
    ("\\boxed{yes}", None),
    ("\\boxed{1.0}", None),
    ("\\boxed{}", None),
    ("\\boxed{-1", None),
    ("ttt ll5x <|im_start|>oo \\bo xed", None),
]


@pytest.mark.parametrize(("text", "expected"), SCORES)
def test_parse_score(text: str, expected: int | None) -> None:
    assert parse_score(text) == expected


HINTS = [
    # (output, ok, hint)
    ("[HINT] Answer in lowercase. [/HINT]", True, "Answer in lowercase."),
    ("The user wants it short.\n[HINT]Keep the answer to one sentence.\n[/HINT]", True,
     "Keep the answer to one sentence."),
    ("[NO_HINT]", True, None),
    ("The user just says thanks. [NO_HINT]", True, None),
    # markers missing or broken
    ("Answer in lowercase.", False, None),
    ("[HINT] Answer in lowercase.", False, None),
    ("Answer in lowercase. [/HINT]", False, None),
    ("[HINT] a [/HINT] [HINT] b [/HINT]", False, None),
    ("[HINT] Use lists. [/HINT] [NO_HINT]", False, None),
    ("[NO_HINT] [NO_HINT]", False, None),
    ("[HINT]   [/HINT]", False, None),
    ("", False, None),
]


@pytest.mark.parametrize(("text", "ok", "hint"), HINTS)
def test_parse_hint(text: str, ok: bool, hint: str | None) -> None:
    parsed = parse_hint(text)
    assert (parsed.ok, parsed.hint) == (ok, hint)


MAJORITY = [
    ([1, 1, -1], 1),
    ([-1, -1, 1], -1),
    ([0, 0, 1], 0),
    ([1, 1, 1], 1),
    ([1, None, None], 1),  # one parseable vote decides
    ([1, -1, None], None),  # tie -> abstention
    ([1, -1, 0], None),  # three-way tie -> abstention
    ([None, None, None], None),  # nothing parseable -> abstention, never 0
    ([], None),
    ([1, 1, -1, -1, 0], None),
    ([0, None, None], 0),  # a real 0 stays 0
]


@pytest.mark.parametrize(("scores", "expected"), MAJORITY)
def test_majority(scores: list[int | None], expected: int | None) -> None:
    assert majority(scores) == expected


def test_longest_accepted_hint_wins_and_short_ones_are_rejected() -> None:
    votes = [read_hint_vote(t, min_chars=10) for t in (
        "[HINT] Be brief, please. [/HINT]",
        "[HINT] Answer in lowercase, in one sentence. [/HINT]",
        "[HINT] Ok. [/HINT]",  # trivial: rejected
        "garbage",
        "[NO_HINT]",
    )]
    assert [v.accepted for v in votes] == [True, True, False, False, False]
    assert votes[2].hint == "Ok."  # parsed, kept, but not accepted
    assert choose_hint(votes) == "Answer in lowercase, in one sentence."
    assert choose_hint([read_hint_vote("[NO_HINT]", 10), read_hint_vote("x", 10)]) is None
