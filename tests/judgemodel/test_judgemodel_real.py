"""The real-replies held-out set (clawrl/judgemodel/data/heldout_real*.jsonl): shares no text
with the judge's training sources, and its stored turns are what its files say."""

from __future__ import annotations

import difflib
import itertools
import json
from collections import Counter

from clawrl.judgemodel.build import AgentStage, BuildConfig
from clawrl.judgemodel.synth import WRITTEN, agent_set, iter_examples, normalize, training_set


def _rows(path):  # type: ignore[no-untyped-def]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def _near(a: str, b: str, at: float = 0.85) -> bool:
    m = difflib.SequenceMatcher(None, a, b)
    return m.real_quick_ratio() >= at and m.quick_ratio() >= at and m.ratio() >= at


def test_no_real_held_out_line_is_in_or_near_the_judge_training_sources() -> None:
    """No follow-up or question of the real-replies set (normalized: case, punctuation,
    emoji, spacing) is among the judge's training follow-ups (the synthetic stream the builds
    draw from, templates and filled, and the agent stage's steps), and none is within a difflib
    ratio of 0.85 of a hand-written training line (data/train_followups.jsonl) or of a
    distinct training template."""
    from clawrl.judgemodel.real import FOLLOWUPS, QUESTIONS

    held = {normalize(r["text"]) for r in _rows(FOLLOWUPS)}
    held |= {normalize(r["text"]) for r in _rows(QUESTIONS)}
    assert len(held) == 255 + 42
    train = training_set(BuildConfig().turns)
    more = list(itertools.islice(iter_examples(0), 30000)) + agent_set(AgentStage().agent_turns)
    templates = {normalize(e.template) for e in train + more}
    seen = templates | {normalize(e.next_state[0]["content"]) for e in train + more}
    seen |= {normalize(e.request[0]["content"]) for e in train + more}
    overlap = sorted(seen & held)
    assert not overlap, f"{len(overlap)} real held-out lines in the training set: {overlap[:5]}"
    written = {normalize(r["text"]) for r in _rows(WRITTEN)}
    near = sorted({h for h in held for t in written | templates if _near(h, t)})
    assert not near, f"{len(near)} real held-out lines near training lines: {near}"


def test_real_turns_pair_each_correction_with_a_reply_that_breaks_it() -> None:
    """The stored turns are the follow-ups with the stored replies, each style correction
    after a reply that breaks its preference and each fact correction after a reply that
    lacks the stated value; rebuilding the pairing from the files gives the same turns."""
    from clawrl.judgemodel.real import (
        FOLLOWUPS,
        QUESTIONS,
        REPLIES,
        TURNS,
        breaks,
        pair,
        plain,
    )

    followups, questions, replies = _rows(FOLLOWUPS), _rows(QUESTIONS), _rows(REPLIES)
    turns = _rows(TURNS)
    assert turns == pair(followups, questions, replies)
    assert len(replies) == 3 * len(questions)
    by_q = {q["id"]: q for q in questions}
    for t in turns:
        row, reply = followups[t["row"]], replies[t["reply"]]
        assert t["text"] == row["text"].replace("{question}", t.get("next_question") or "")
        assert reply["question"] in by_q
        if row["kind"] == "style":
            assert breaks(row["preference"], reply["reply"], row.get("language"),
                          by_q[reply["question"]]["value"])
        if row["kind"] == "fact":
            assert reply["question"] == row["question"]
            assert plain(by_q[row["question"]]["value"]) not in plain(reply["reply"])
    kinds = Counter(followups[t["row"]]["kind"] for t in turns)
    assert set(kinds) == {"praise", "move_on", "style", "fact", "objection"}


def test_real_cases_and_the_right_hint_rules() -> None:
    """`clawrl judge evaluate --real` judges (question, stored reply, follow-up); a right hint
    is the canonical one for the judge's nine preferences and one naming the preference for
    the others; the summary counts them apart."""
    from clawrl.judgemodel.real import REPLIES, TURNS, real_cases, right_hint, summarize

    cases = real_cases()
    assert len(cases) == len(_rows(TURNS))
    replies = {r["reply"] for r in _rows(REPLIES)}
    assert all(c.reply["content"] in replies for c in cases)
    sample = real_cases(20)
    assert 15 <= len(sample) <= 25 and {c.row["kind"] for c in sample} >= {"praise", "style"}
    assert right_hint("lowercase", "Write the whole reply in lowercase letters.")
    assert not right_hint("lowercase", "Write everything in lowercase.")
    assert right_hint("one_paragraph", "Write it as a single paragraph.")
    assert not right_hint("one_paragraph", "Keep the reply to one short sentence.")
    assert right_hint("formal", "Use a formal tone.") and not right_hint("formal", "Be informal.")
    assert right_hint("language", "Reply in Spanish.", "Spanish")
    assert not right_hint("language", "Reply in Spanish.", "German")
    base = {"expected": -1, "reward": -1, "label": "correction", "seconds": 0.5,
            "value": None, "finish_reason": "length"}
    results = [{**base, "kind": "style", "preference": "brief",
                "hint": "Keep the reply to one short sentence."},
               {**base, "kind": "style", "preference": "casual", "hint": "Be more casual."},
               {**base, "kind": "style", "preference": "formal", "hint": None},
               {**base, "kind": "fact", "preference": None, "value": "Shift+S",
                "hint": "The correct answer: press Windows + Shift + S"},
               {**base, "kind": "praise", "label": "praise", "expected": 1, "reward": 1,
                "preference": None, "hint": None, "finish_reason": "stop"}]
    s = summarize(results)
    assert s["prm"]["rate"] == 1.0 and s["prm_cut_off"]["n"] == 4
    assert (s["style_hint"]["hits"], s["style_hint_known"]["hits"],
            s["style_hint_new"]["n"]) == (2, 1, 2)
    assert s["fact_hint"]["hits"] == 1 and s["praise_hint"]["hits"] == 0
