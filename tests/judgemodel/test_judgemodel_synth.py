"""The judge model's synthetic training set: coverage, consistent targets, and disjointness
from the held-out follow-ups and the simulated users' pool."""

from __future__ import annotations

import difflib
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from clawrl.judgemodel.build import AgentStage, BuildConfig
from clawrl.judgemodel.model import PROMPT_VERSION, prompts
from clawrl.judgemodel.synth import (
    AGENT_LABELS,
    LANGUAGES,
    MIX,
    NEW_HINTS,
    NEW_PREFERENCES,
    NEW_STYLE_MODES,
    NEW_STYLE_SENTENCES,
    NO_HINT,
    OBJECTION_HINT,
    OBJECTION_RESTATES,
    OBJECTIONS,
    OWN_NAMES,
    STYLE_FRAMES,
    STYLE_PREFERENCES,
    WRITTEN,
    JudgeExample,
    agent_set,
    hint_preference,
    iter_examples,
    normalize,
    perturb,
    training_set,
)
from clawrl.world.town import FACT_HINT, HINTS, PREFERENCES, World, is_correct, satisfies
from judge.config import JUDGE_MODEL_SETTINGS
from judge.parse import parse_hint, parse_score
from judge.prompts import render_fields, render_hint, render_judge, render_prm

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "clawrl" / "judgemodel" / "data"
# Never trained on: the held-out set, the simulated users' pool and the judge's dev set.
HELD_OUT = [DATA / "heldout.jsonl", REPO / "clawrl" / "world" / "data" / "sim_followups.jsonl",
            DATA / "dev_followups.jsonl"]
# The two follow-ups quoted in issue 13 (the user the judge failed): never trained on either.
ISSUE_TEXTS = ["thanks, perfect.", "please answer in lowercase only, no capital letters."]


@pytest.fixture(scope="module")
def sample() -> list[JudgeExample]:
    return list(itertools.islice(iter_examples(0), 4000))


def test_every_kind_and_preference_is_covered(sample: list[JudgeExample]) -> None:
    kinds = Counter(e.kind for e in sample)
    assert set(kinds) == set(MIX)
    for kind, share in MIX.items():
        assert abs(kinds[kind] / len(sample) - share) < 0.03, kind
    prefs = Counter(e.preference for e in sample if e.kind == "style")
    assert set(prefs) == set(STYLE_PREFERENCES) == set(PREFERENCES) | set(NEW_PREFERENCES)
    assert min(prefs.values()) >= 50
    # The nine keep most of their weight beside the six new preferences.
    assert min(prefs[p] for p in PREFERENCES) / len(sample) > 0.022


def test_follow_ups_are_varied_and_perturbed(sample: list[JudgeExample]) -> None:
    texts = [e.next_state[0]["content"] for e in sample]
    assert len(set(e.template for e in sample)) > 0.8 * len(sample)
    emoji = sum(1 for t in texts if re.search(r"[\U0001F300-\U0001FAFF]|:\)|<3", t))
    shouting = sum(1 for t in texts if t.isupper())
    lower = sum(1 for t in texts if t == t.lower())
    assert emoji > 0.1 * len(texts) and shouting > 0.02 * len(texts) and lower > 0.2 * len(texts)
    # Praise before a correction, praise of the reply's own style, and short next questions.
    style = [e.next_state[0]["content"].lower() for e in sample if e.kind == "style"]
    assert sum(1 for t in style if "but " in t) > 0.1 * len(style)
    praise_replies = [e for e in sample if e.kind == "praise"]
    assert len(praise_replies) > 1000


def test_typos_change_words_but_not_placeholders() -> None:
    import random

    rng = random.Random(1)
    outs = {perturb("please write everything in lowercase, {fact}", rng) for _ in range(300)}
    assert all("{fact}" in o for o in outs)
    words = {w for o in outs for w in re.findall(r"[a-z]+", o.lower())}
    assert words - {"please", "write", "everything", "in", "lowercase", "fact"}  # slips exist


def test_targets_match_the_turn(sample: list[JudgeExample]) -> None:
    for e in sample:
        prm, hint = e.prm_target, e.hint_target
        assert parse_score(prm) == e.label
        parsed = parse_hint(hint)
        assert parsed.ok
        reply = e.reply["content"]
        if e.kind == "style" and e.preference in PREFERENCES:
            assert not satisfies(e.preference, reply)
            assert parsed.hint == HINTS[e.preference][0]
        elif e.kind == "style":
            assert e.preference in NEW_PREFERENCES and parsed.hint is not None
            assert hint_preference(parsed.hint) == e.preference
            if e.preference != "language":
                assert parsed.hint == NEW_HINTS[e.preference]
        elif e.kind == "objection":
            assert e.label == -1 and parsed.hint is not None
            assert parsed.hint.startswith(OBJECTION_HINT.split("{")[0])
        elif e.kind == "fact":
            fact = parsed.hint.removeprefix(FACT_HINT.format(fact="")) if parsed.hint else ""
            assert fact and fact in e.next_state[0]["content"]
        else:
            assert hint == NO_HINT and parsed.hint is None


def test_prompts_are_the_workers_prompts(sample: list[JudgeExample]) -> None:
    """The judge model trains on what the worker sends it at its prompt version: v2, a PRM
    and a hint prompt; v3, one combined prompt answered with the score, then the hint or
    [NO_HINT] (which the worker's parsers read back from the one answer); v4, the same with
    the bare score first; v5 (the shipped judge's), v4 with an agent's step beside what came
    back — for people's turns exactly v4's prompt."""
    assert PROMPT_VERSION == JUDGE_MODEL_SETTINGS["prompt_version"] == "v5"
    for example in sample[:20]:
        fields = render_fields(example.request, example.reply, example.next_state)
        assert prompts(example) == prompts(example, "v5") == prompts(example, "v4")
        (prm, prm_answer), (hint, hint_answer) = prompts(example, "v2")
        assert (prm, hint) == (render_prm(fields, "v2"), render_hint(fields, "v2"))
        assert (prm_answer, hint_answer) == (example.prm_target, example.hint_target)
        [(prompt, answer)] = prompts(example, "v3")
        assert prompt == render_judge(fields, "v3")
        assert parse_score(answer) == example.label
        assert parse_hint(answer).hint == example.hint
        [(prompt, answer)] = prompts(example, "v4")  # score first
        assert prompt == render_judge(fields, "v4")
        assert answer.startswith(str(example.label))
        assert parse_score(answer, leading=True) == example.label
        assert parse_hint(answer).hint == example.hint


def test_no_held_out_or_simulated_follow_up_is_trained_on() -> None:
    """Neither the held-out set, the simulated users' pool nor the dev set (normalized: case,
    punctuation, emoji, spacing) appears among the training follow-ups, filled or as
    templates."""
    held = {normalize(json.loads(line)["text"]) for path in HELD_OUT
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}
    held |= {normalize(t) for t in ISSUE_TEXTS}
    assert len(held) > 600
    train = training_set(BuildConfig().turns)
    more = list(itertools.islice(iter_examples(0), 30000)) + agent_set(AgentStage().agent_turns)
    seen = {normalize(e.template) for e in train + more}
    seen |= {normalize(e.next_state[0]["content"]) for e in train + more}
    overlap = sorted(seen & held)
    assert not overlap, f"{len(overlap)} held-out/simulated follow-ups in the training set"


def test_the_hand_written_lines_are_trained_on_and_near_no_held_out_line() -> None:
    """The hand-written training lines (data/train_followups.jsonl) are in the held-out
    format, cover every kind and preference, make up about `WRITTEN_SHARE` of the training
    follow-ups, and none is within a difflib ratio of 0.85 of a held-out, simulated-user or
    dev line (normalized): the lines that were are dropped from the file (data/README.md)."""
    from clawrl.judgemodel.evaluate import DEV_ROWS, PLACEHOLDERS, load_heldout

    written = load_heldout(WRITTEN)  # the held-out set's format, checked row by row
    assert len(load_heldout(DEV_ROWS)) == 300
    kinds = Counter((r["kind"], r["preference"]) for r in written)
    assert {k for k, _ in kinds} == {"praise", "move_on", "style", "fact"}
    assert {p for k, p in kinds if k == "style"} == set(PREFERENCES)
    assert min(kinds.values()) >= 30
    for r in written:
        placeholder = PLACEHOLDERS.get(r["kind"])
        assert placeholder is None or r["text"].count(placeholder) == 1
    lines = {normalize(r["text"]) for r in written}
    sample = list(itertools.islice(iter_examples(0), 2000))
    used = [e for e in sample if e.kind != "neutral"
            and any(normalize(e.template).startswith(t[:12]) for t in lines)]
    assert 0.35 < len(used) / len(sample) < 0.65
    others = [normalize(r["text"]) for path in HELD_OUT for r in load_heldout(path)]
    near = 0
    for line in lines:
        for other in others:
            m = difflib.SequenceMatcher(None, line, other)
            if m.real_quick_ratio() >= 0.85 and m.quick_ratio() >= 0.85 and m.ratio() >= 0.85:
                near += 1
    assert near == 0, f"{near} hand-written training lines are near held-out lines"


def test_without_hand_written_lines_the_stream_is_the_earlier_builds() -> None:
    """`written_share` 0 draws exactly what the builds before the hand-written lines drew
    (the digest of the first 200 templates, taken from that code), so `clawrl judge build
    --written-share 0` rebuilds them; any other share draws some hand-written lines."""
    import hashlib

    plain = training_set(200, 0, 0.0)
    digest = hashlib.sha256("\n".join(e.template for e in plain).encode()).hexdigest()
    assert digest[:16] == "60a0df98f3581a96"
    mixed = training_set(200, 0, 0.5)
    assert [e.template for e in mixed] != [e.template for e in plain]


def test_the_preferences_real_people_state_are_taught(sample: list[JudgeExample]) -> None:
    """Each of the six preferences beyond the tiny world's nine comes as a correction (-1)
    after a reply that breaks it (by real.py's `breaks`, the real-replies set's own check),
    with its canonical hint, which real.py's scoring counts as the right hint; a language
    request's hint names the language the user asked for, in English."""
    from clawrl.judgemodel.real import breaks, right_hint

    world = World.build(0)
    by_pref: dict[str, list[JudgeExample]] = {p: [] for p in NEW_PREFERENCES}
    for e in sample:
        if e.kind == "style" and e.preference in NEW_PREFERENCES:
            by_pref[e.preference].append(e)
    for pref, examples in by_pref.items():
        assert len(examples) >= 50, pref
        for e in examples:
            assert e.label == -1 and e.prm_target == "\\boxed{-1}"
            reply = e.reply["content"]
            user = e.next_state[0]["content"]
            if pref == "language":
                language = e.hint.removeprefix("Reply in ").removesuffix(".") if e.hint else ""
                assert language in LANGUAGES and e.hint == NEW_HINTS[pref].format(
                    language=language)
                assert (language.lower() in user.lower()
                        or OWN_NAMES.get(language, "?").lower() in user.lower())
                if language in ("Spanish", "French", "German"):  # those real.py knows
                    assert right_hint(pref, e.hint, language)
                continue
            assert e.hint == NEW_HINTS[pref] and right_hint(pref, e.hint)
            q = world.find(e.request[-1]["content"])
            assert q is not None
            assert breaks(pref, reply, value=world.answer(q)), (pref, reply)
    assert {e.hint for e in by_pref["language"]} >= {
        f"Reply in {lang}." for lang in ("Spanish", "French", "German")}
    assert all(right_hint("language", f"Reply in {lang}.", lang)
               for lang in ("Spanish", "French", "German"))
    # Replies in the shapes they complain about also get praise, so a shape alone is no verdict.
    shaped = [e for e in sample if e.label == 1 and ("\n\n" in e.reply["content"]
                                                     or "Good question!" in e.reply["content"])]
    assert len(shaped) > 20


def test_objections_are_corrections_that_ask_the_question_again(
        sample: list[JudgeExample]) -> None:
    """An objection follows a reply that does not answer the judged question; it is -1, and
    its hint asks for that question, as the user restated it (else as it was asked). Moving
    on never asks the judged question again."""
    world = World.build(0)
    objections = [e for e in sample if e.kind == "objection"]
    assert len(objections) > 120
    restated = 0
    for e in objections:
        assert e.label == -1 and e.hint is not None
        q = world.find(e.request[-1]["content"])
        assert q is not None and not is_correct(world, q, e.reply["content"])
        asked = e.hint.removeprefix(OBJECTION_HINT.split("{")[0])
        assert e.hint == OBJECTION_HINT.format(question=asked)
        if "{question}" in e.template:
            restated += 1
            assert asked in e.next_state[0]["content"]
            assert asked.lower().rstrip("?.") == q.text.lower().rstrip("?.")
        else:
            assert asked == q.text
    assert 0.5 < restated / len(objections) < 0.8
    for e in sample:
        if e.kind == "move_on":
            asked = e.request[-1]["content"].lower()
            assert asked not in e.next_state[0]["content"].lower()


def test_no_new_phrasing_is_in_or_near_a_held_out_line() -> None:
    """The phrasings of the new preferences and objections (alone, in their frames, with
    each language filled) are not in, nor within a difflib ratio of 0.85 of, a line of the
    held-out set, the simulated users' pool, the dev set or the real-replies set
    (normalized). Only our own phrasings are named when one is."""
    from clawrl.judgemodel.real import FOLLOWUPS

    held = {normalize(json.loads(line)["text"]) for path in [*HELD_OUT, FOLLOWUPS]
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}
    assert len(held) > 800
    ours = {t for pref in NEW_PREFERENCES for t in NEW_STYLE_SENTENCES[pref]}
    ours |= {f.replace("{m}", m) for pref in NEW_PREFERENCES for m in NEW_STYLE_MODES[pref]
             for f in STYLE_FRAMES}
    ours |= set(OBJECTIONS) | {r.replace("{o}", o.rstrip("?!.")) for o in OBJECTIONS
                               for r in OBJECTION_RESTATES}
    filled = {t.replace("{language}", lang) for t in ours for lang in
              (*LANGUAGES, *OWN_NAMES.values())}
    texts = {normalize(t) for t in ours | filled}
    inside = sorted(t for t in texts if t in held)  # ours only: the held-out lines stay unread
    assert not inside, f"{len(inside)} new phrasings are held-out lines: {inside}"
    near = []
    for t in texts:
        for h in held:
            m = difflib.SequenceMatcher(None, t, h)
            if m.real_quick_ratio() >= 0.85 and m.quick_ratio() >= 0.85 and m.ratio() >= 0.85:
                near.append(t)
                break
    assert not near, f"{len(near)} new phrasings near held-out lines: {sorted(near)}"


def test_written_share_zero_keeps_the_earlier_stream() -> None:
    """At written share 0 (the builds before the hand-written lines) nothing new is drawn:
    no objections, no new preferences."""
    plain = training_set(600, 0, 0.0)
    assert {e.kind for e in plain} <= {"praise", "move_on", "style", "fact", "neutral"}
    assert {e.preference for e in plain if e.kind == "style"} <= set(PREFERENCES)


def test_agent_steps_are_judged_by_what_came_back() -> None:
    """The agent stage's steps: a tool's result is progress, a tool's error or the user
    asking for the tools is not; no hints; reproducible from the seed."""
    steps = agent_set(600)
    world = World.build(0)
    assert [(e.kind, e.next_state) for e in steps[:50]] == [
        (e.kind, e.next_state) for e in agent_set(50)]
    kinds = Counter(e.kind for e in steps)
    assert set(kinds) == set(AGENT_LABELS) and min(kinds.values()) > 60
    for e in steps:
        assert e.label == AGENT_LABELS[e.kind] and e.hint is None
        role = e.next_state[0]["role"]
        assert role == ("user" if e.kind == "nudge" else "tool")
        q = next(x for x in world.train if x.text.lower() == e.request[0]["content"].lower())
        if e.kind in ("tool_ok", "tool_wrong"):  # a true result, of the call it made
            call = e.reply["tool_calls"][0]["function"]["arguments"]
            args = json.loads(call) if isinstance(call, str) else call
            asked = (args["person"], args["attribute"]) == (q.name, q.attr)
            assert asked == (e.kind == "tool_ok"), e
            value = world.facts[args["person"]][args["attribute"]]
            assert value in e.next_state[0]["content"]
            # The judge sees the task and the call beside the result (prompt v5).
            step = render_fields(e.request, e.reply, e.next_state)["step"]
            assert step.startswith(f"[STEP]\nuser: {e.request[0]['content']}\n")
            assert f'"attribute": "{args["attribute"]}"' in step or \
                f'"attribute":"{args["attribute"]}"' in step
    prompt, answer = prompts(steps[0])[0]
    assert answer in ("1 [NO_HINT]", "-1 [NO_HINT]")
