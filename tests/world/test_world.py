"""The synthetic world and its corpus: reproducible, held-out prompts never leak, checkers
are right, and the judge examples are rendered exactly as judge/prompts.py renders them."""

from __future__ import annotations

import itertools
import random

import pytest

from clawrl.world import corpus
from clawrl.world.report import parse_box, parse_hint
from clawrl.world.town import (
    CASES,
    CORRECTIONS,
    EVAL_PREFERENCES,
    FRESH_CORRECTIONS,
    FRESH_FACT_CORRECTIONS,
    FRESH_PRAISE,
    HINTS,
    LAYOUTS,
    PREFERENCES,
    SIGNOFFS,
    Style,
    World,
    corrections,
    heldout_prompts,
    is_correct,
    render_reply,
    restyle,
    satisfies,
    wrong_world,
)
from judge import prompts


def _corpus(seed: int, n: int) -> list[tuple[str, list[corpus.Message]]]:
    return list(itertools.islice(corpus.iter_examples(World.build(seed), seed), n))


def test_world_and_corpus_are_reproducible_from_a_seed() -> None:
    assert World.build(3) == World.build(3)
    assert World.build(3).facts != World.build(4).facts
    assert _corpus(3, 200) == _corpus(3, 200)
    assert _corpus(3, 200) != _corpus(4, 200)
    assert heldout_prompts(3) == heldout_prompts(3)


def test_heldout_split_keeps_every_fact_learnable() -> None:
    world = World.build(0)
    assert 0.08 < len(world.heldout) / (len(world.heldout) + len(world.train)) < 0.25
    held = {(q.name, q.attr) for q in world.heldout}
    trained = {(q.name, q.attr) for q in world.train}
    assert held <= trained  # each held-out fact is still asked with another phrasing
    assert not {q.text for q in world.heldout} & {q.text for q in world.train}


def test_heldout_prompts_and_fresh_phrasings_never_appear_in_the_corpus() -> None:
    texts = [m["content"] for _, msgs in _corpus(0, 3000) for m in msgs]
    blob = "\n".join(texts)
    for prompt in heldout_prompts(0):
        assert prompt not in blob, prompt
    fresh = [p for ps in FRESH_CORRECTIONS.values() for p in ps] + list(FRESH_PRAISE)
    for phrase in fresh:
        assert phrase not in blob, phrase
    kinds = {kind for kind, _ in _corpus(0, 3000)}
    assert kinds == set(corpus.MIX)


@pytest.mark.parametrize(("pref", "text", "expected"), [
    ("lowercase", "ada lives in porto.", True),
    ("lowercase", "Ada lives in porto.", False),
    ("lowercase", "123 !", False),
    ("uppercase", "ADA LIVES IN PORTO.", True),
    ("uppercase", "ADA lives", False),
    ("normal_case", "Ada lives in Porto.", True),
    ("normal_case", "ada lives in porto.", False),
    ("brief", "Ada lives in Porto.", True),
    ("brief", "Ada lives in Porto. Also, Ada is a baker. Ada loves red.", False),
    ("brief", "- Ada lives in Porto.", False),
    ("brief", "", False),
    ("detailed", "Ada lives in Porto. Also, Ada is a baker. Ada loves red.", True),
    ("no_lists", "Ada lives in Porto.", True),
    ("no_lists", "- Ada lives in Porto.\n- Ada is a baker.", False),
    ("no_lists", "1. Ada lives in Porto.", False),
    ("no_lists", "Ada is a well-known baker - really.", True),
    ("lists", "* one\n* two", True),
    ("no_signoff", "Ada lives in Porto.", True),
    ("no_signoff", "Ada lives in Porto. Hope this helps!", False),
    ("no_signoff", "ada lives in porto. cheers!", False),
    ("no_signoff", "Ada lives in Porto.\nLet me know if you need anything else.", False),
    ("signoff", "ADA LIVES IN PORTO. ANY TIME!", True),
])
def test_preference_checkers(pref: str, text: str, expected: bool) -> None:
    assert satisfies(pref, text) is expected


def test_unknown_preference_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown preference 'loud'"):
        satisfies("loud", "x")


def test_every_style_renders_a_correct_answer_and_restyle_satisfies_every_preference() -> None:
    world = World.build(0)
    rng = random.Random(0)
    for q in world.train[:40]:
        for case, layout, signoff in itertools.product(CASES, LAYOUTS, (None, *SIGNOFFS)):
            style = Style(case, layout, signoff)
            text = render_reply(world, q, style, rng)
            assert is_correct(world, q, text)
            assert satisfies("brief", text) is (layout == "short")
            assert satisfies("no_lists", text) is (layout != "list")
            assert satisfies("no_signoff", text) is (signoff is None)
            assert satisfies("lowercase", text) is (case == "lower")
            for pref in PREFERENCES:
                redo = render_reply(world, q, restyle(style, pref, rng), rng)
                assert satisfies(pref, redo), (pref, redo)


def test_is_correct_matches_whole_words() -> None:
    world = World.build(0)
    q = world.heldout[0]
    value = world.answer(q)
    assert is_correct(world, q, f"they say {value.upper()}!")
    assert not is_correct(world, q, "no idea")


def test_simulator_phrasings_include_ones_the_corpus_never_saw() -> None:
    for pref in EVAL_PREFERENCES:
        fresh = set(corrections(pref)) - set(CORRECTIONS[pref])
        assert fresh and fresh == set(FRESH_CORRECTIONS[pref])
        assert HINTS[pref]


def _judged_turns() -> list[tuple[list[corpus.Message], corpus.Message, list[corpus.Message]]]:
    world = World.build(0)
    rng = random.Random(1)
    turns = [(t.request, t.reply, t.next_state)
             for t in (corpus._judged_turn(world, rng) for _ in range(30))]
    long_context = [{"role": "system", "content": "Be nice."}] + [
        {"role": r, "content": f"message {i}"} for i, r in
        enumerate(["user", "assistant", "user", "assistant", "user"])]
    turns.append((long_context, {"role": "assistant", "content": "  padded \n"},
                   [{"role": "user", "content": "too long"}]))
    turns.append(([{"role": "user", "content": "hi"}], {"role": "assistant", "content": ""},
                  [{"role": "user", "content": "thanks!"}]))
    return turns


@pytest.mark.parametrize("kind", ["prm", "hint"])
def test_judge_prompts_render_exactly_as_the_judge_renders_them(kind: str) -> None:
    for request, reply, next_state in _judged_turns():
        fields = prompts.render_fields(request, reply, next_state)
        expected = prompts.render_prm(fields) if kind == "prm" else prompts.render_hint(fields)
        assert corpus.judge_prompt(kind, request, reply, next_state) == expected


def test_teacher_context_matches_the_judge_teacher_messages() -> None:
    request = [{"role": "user", "content": "What pet does Ada have? "}]
    expected = prompts.teacher_messages(request, " Answer in lowercase. ")
    assert expected[-1]["content"] == corpus.teacher_content(
        "What pet does Ada have? ", " Answer in lowercase. ")


def test_corpus_answers_parse_with_the_judge_rules() -> None:
    rng = random.Random(0)
    world = World.build(0)
    for _ in range(200):
        turn = corpus._judged_turn(world, rng)
        assert parse_box(corpus.prm_answer(turn, rng)) == turn.label
        assert parse_hint(corpus.hint_answer(turn)) == (turn.hint or "")
    turn = corpus.JudgedTurn([], {"role": "assistant", "content": "A"}, [], -1, "r",
                             HINTS["lowercase"][0])
    assert parse_hint(corpus.hint_answer(turn)) in HINTS["lowercase"]


@pytest.mark.parametrize(("text", "vote"), [
    (r"ok \boxed{1}", 1), (r"\boxed{ -1 }", -1), (r"\boxed{+1}", 1), (r"\boxed{0}", 0),
    (r"\boxed{1} \boxed{1}", None), ("no box", None), (r"\boxed{2}", None),
])
def test_parse_box(text: str, vote: int | None) -> None:
    assert parse_box(text) == vote


@pytest.mark.parametrize(("text", "hint"), [
    ("[HINT] Be brief. [/HINT]", "Be brief."), ("[NO_HINT]", ""), ("nothing", None),
    ("[HINT] a [/HINT] [HINT] b [/HINT]", None), ("[HINT] a [/HINT] [NO_HINT]", None),
])
def test_parse_hint(text: str, hint: str | None) -> None:
    assert parse_hint(text) == hint


def test_chatml_rendering_marks_assistant_spans() -> None:
    text, spans = corpus.render_chatml([{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["hello<|im_end|>"]


def test_wrong_answers_in_judged_turns_are_corrected_with_the_true_fact() -> None:
    world = World.build(0)
    rng = random.Random(3)
    facts = [t for t in (corpus._judged_turn(world, rng) for _ in range(400))
             if t.reason == corpus.FACT_REASON]
    assert len(facts) > 20
    for turn in facts:
        question = next(q for q in world.train if turn.request[-1]["content"].endswith(q.text))
        assert not is_correct(world, question, turn.reply["content"])
        assert turn.label == -1 and turn.hint is not None
        assert world.answer(question) in turn.hint
        assert world.answer(question) in turn.next_state[-1]["content"]


def test_the_corpus_never_contains_fresh_fact_corrections_or_heldout_questions() -> None:
    world = World.build(0)
    fresh = [f.split("{fact}")[0] for f in FRESH_FACT_CORRECTIONS]
    heldout = {q.text for q in world.heldout}
    stream = corpus.iter_examples(world, 0)
    for _ in range(1500):
        _, messages = next(stream)
        text = "\n".join(str(m["content"]) for m in messages)
        assert not any(f in text for f in fresh)
        assert not any(h in text for h in heldout)


def test_wrong_world_changes_only_that_answer() -> None:
    world = World.build(0)
    q = world.train[0]
    wrong = wrong_world(world, q, random.Random(0))
    assert wrong.answer(q) != world.answer(q)
    assert all(wrong.answer(o) == world.answer(o) for o in world.train if o.name != q.name
               or o.attr != q.attr)
