"""Parsing judge outputs and the voting rules, table-driven over real-looking outputs."""

from __future__ import annotations

import math
import random

import pytest

from judge.backends import Completion
from judge.hints import choose_hint, read_hint_vote
from judge.parse import boxed_distribution, parse_hint, parse_score
from judge.prm import draw_votes, majority, prm_from_distribution

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


LEADING_SCORES = [
    ("1 [NO_HINT]", 1),
    ("-1 [HINT] Answer in lowercase. [/HINT]", -1),
    ("0", 0),
    (" +1[NO_HINT]", 1),
    ("\n-1\n[HINT] x [/HINT]", -1),
    # not a score first
    ("The score is 1 [NO_HINT]", None),
    ("[NO_HINT] 1", None),
    ("10 [NO_HINT]", None),
    ("2 [NO_HINT]", None),
    ("1.0 [NO_HINT]", None),
    ("1st [NO_HINT]", None),
    ("\\boxed{1} [NO_HINT]", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), LEADING_SCORES)
def test_parse_leading_score(text: str, expected: int | None) -> None:
    assert parse_score(text, leading=True) == expected


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


def tok(token: str, *alts: tuple[str, float]) -> dict[str, object]:
    """A generated token with its top alternatives, as OpenAI's logprobs.content holds it."""
    return {"token": token, "logprob": -0.1,
            "top_logprobs": [{"token": t, "logprob": math.log(p)} for t, p in alts]}


BOX_HEAD = [tok("\\"), tok("box"), tok("ed"), tok("{")]


def test_distribution_is_read_where_the_box_takes_its_value() -> None:
    tokens = [*BOX_HEAD, tok("-", ("-", 0.6), ("1", 0.3), ("0", 0.05), ("x", 0.05)), tok("1"),
              tok("}"), tok(" [NO_HINT]")]
    probs = boxed_distribution(tokens)
    assert probs is not None
    assert probs == pytest.approx({-1: 0.6 / 0.95, 1: 0.3 / 0.95, 0: 0.05 / 0.95})


def test_distribution_when_the_tokenizer_joins_the_brace_and_the_value() -> None:
    # "{1" and "{-" as single tokens: the prefix "{" is matched and the rest is the score;
    # an alternative that does not start with "{" (" {") is not the same position's value.
    tokens = [tok("\\"), tok("boxed"), tok("{1", ("{1", 0.5), ("{-", 0.25), (" {", 0.25)),
              tok("}")]
    assert boxed_distribution(tokens) == pytest.approx({1: 2 / 3, -1: 1 / 3})


@pytest.mark.parametrize("tokens", [
    [tok("no"), tok(" box")],                                      # no box at all
    [*BOX_HEAD, tok("1"), tok("}"), *BOX_HEAD, tok("1"), tok("}")],  # two boxes
    [*BOX_HEAD, tok("1", ("yes", 0.9), ("maybe", 0.1))],           # no score among them
    [*BOX_HEAD],                                                   # cut before the value
])
def test_no_distribution(tokens: list[dict[str, object]]) -> None:
    assert boxed_distribution(tokens) is None


def test_distribution_of_a_score_first_answer_is_read_at_its_first_token() -> None:
    # SmolLM2 writes "-1" as "-", "1": the first token decides; a box later is not read.
    tokens = [tok("-", ("-", 0.7), ("1", 0.2), ("0", 0.05), ("The", 0.05)), tok("1"),
              tok(" ["), tok("H"), tok("INT"), tok("]")]
    assert boxed_distribution(tokens, leading=True) == pytest.approx(
        {-1: 0.7 / 0.95, 1: 0.2 / 0.95, 0: 0.05 / 0.95})
    assert boxed_distribution([tok(" "), tok("1", ("1", 0.9), ("-", 0.1))],
                              leading=True) == pytest.approx({1: 0.9, -1: 0.1})
    assert boxed_distribution([tok("The", ("The", 0.9), ("I", 0.1))], leading=True) is None
    assert boxed_distribution([], leading=True) is None


def test_votes_drawn_from_the_distribution() -> None:
    probs = {1: 0.7, -1: 0.2, 0: 0.1}
    assert draw_votes(probs, 3, 0.0, random.Random(0)) == [1, 1, 1]  # T = 0: the most likely
    draws = draw_votes(probs, 20_000, 1.0, random.Random(1))
    assert draws.count(1) / len(draws) == pytest.approx(0.7, abs=0.02)
    sharp = draw_votes(probs, 20_000, 0.5, random.Random(2))  # p^2 renormalized: 49/54
    assert sharp.count(1) / len(sharp) == pytest.approx(49 / 54, abs=0.02)
    same = [draw_votes(probs, 3, 0.6, random.Random(b"prompt")) for _ in range(2)]
    assert same[0] == same[1]


def test_logprob_mode_votes_and_abstention() -> None:
    tokens = [*BOX_HEAD, tok("1", ("1", 0.9), ("-", 0.1)), tok("}")]
    answer = Completion(text="\\boxed{1}", label="judge", tokens=tokens)
    result = prm_from_distribution(answer, "prompt", votes=3, temperature=0.0)
    assert result.reward == 1 and [v.score for v in result.votes] == [1, 1, 1]
    assert result.votes[0].as_json()["p"] == {"-1": 0.1, "1": 0.9}
    unboxed = Completion(text="yes", label="judge", tokens=[tok("yes")])
    empty = prm_from_distribution(unboxed, "prompt", votes=3, temperature=0.6)
    assert empty.reward is None and [v.score for v in empty.votes] == [None]
