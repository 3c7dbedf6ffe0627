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
