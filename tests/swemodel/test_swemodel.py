"""The SWE model's corpus (clawrl/swemodel/corpus.py) and build (clawrl/swemodel/build.py):
episodes rendered so that the engine's own parser reads the same tool calls back, nothing of
the held-out split in them, the agents' outcomes as their plans say, a build that serves."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from clawrl.envs.swe.bugs import CMP_SWAP
from clawrl.envs.swe.env import TOOLS
from clawrl.envs.swe.tasks import HELDOUT_TEMPLATES, TEMPLATES
from clawrl.swemodel.corpus import PLANS, Episode, edit_between, play, play_many
from clawrl.world.tools import render_tool_chat

HELDOUT_MODULES = [m for t in HELDOUT_TEMPLATES for m in TEMPLATES[t].modules]


def calls_of(episode: Episode) -> list[tuple[str, dict[str, str]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for m in episode.messages if m["role"] == "assistant"
            for c in m.get("tool_calls", [])]


def test_edit_between_is_the_smallest_unique_replacement() -> None:
    before = "def f(x):\n    y = x - 1\n    return y\n\n\ndef g(x):\n    y = x - 1\n    return y\n"
    line = edit_between("a = 1\nb = x - 1\n", "a = 1\nb = x + 1\n")
    assert (line.old, line.new) == ("b = x - 1", "b = x + 1")
    twice = edit_between(before, before.replace("return y\n\n\ndef g", "return y + 1\n\n\ndef g"))
    assert before.count(twice.old) == 1  # both functions hold the changed lines: f's head
    assert twice.old == "def f(x):\n    y = x - 1\n    return y"
    assert twice.new == "def f(x):\n    y = x - 1\n    return y + 1"
    inserted = edit_between("def f(x):\n    return x\n",
                            "def f(x):\n    if x < 0:\n        x = 0\n    return x\n")
    assert (inserted.old, inserted.new) == ("def f(x):",
                                            "def f(x):\n    if x < 0:\n        x = 0")


async def test_each_agent_renders_as_the_engine_parses_it_back() -> None:
    from clawrl.engine.chat import parse_tool_calls

    for i, plan in enumerate(PLANS):
        episode = await play(100_000 + i, plan, random.Random(i))
        text, spans = render_tool_chat(episode.messages, TOOLS)
        replies = [m for m in episode.messages if m["role"] == "assistant"]
        assert len(spans) == len(replies)
        for (start, end), reply in zip(spans, replies, strict=True):
            assert text[start:end].endswith("<|im_end|>")  # the loss span ends the turn
            content, calls = parse_tool_calls(text[start:end - len("<|im_end|>")], TOOLS)
            assert content == reply["content"]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in calls] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in reply.get("tool_calls", [])]
        names = [name for name, _ in calls_of(episode)]
        assert names[-1] == "finish" and names.count("finish") == 1
        assert ("run_tests" in names[names.index("replace_in_file") if "replace_in_file" in names
                                     else names.index("apply_patch"):]) == (
            plan not in ("unchecked", "wrong_unchecked"))


async def test_the_corpus_holds_nothing_held_out_and_its_agents_spread() -> None:
    episodes = await play_many(list(range(100_000, 100_040)), 0, concurrency=4)
    for e in episodes:
        template, kind, _ = e.task.split("/")
        assert template not in HELDOUT_TEMPLATES and kind != "wrong_comparison"
        text = render_tool_chat(e.messages, TOOLS)[0]
        assert not any(f"{m}.py" in text for m in HELDOUT_MODULES)
        for name, args in calls_of(e):
            if name == "replace_in_file":  # no edit, wrong or right, swaps a comparison
                assert not any(args["old"].replace(a, b, 1) == args["new"]
                               for a, b in CMP_SWAP.items())
    outcome = {p: [e.outcome for e in episodes if e.plan == p] for p in PLANS}
    for plan in ("solve", "unchecked", "patch", "bad_patch", "wrong_then_fix"):
        assert all(o == 1.0 for o in outcome[plan]), plan
    success = sum(e.outcome > 0 for e in episodes) / len(episodes)
    assert 0.6 <= success <= 0.95  # mostly right, with spread for RL
    errors = [e for e in episodes if e.plan == "bad_patch"]
    assert errors and all(any(m["role"] == "tool" and m["content"].startswith("error: hunk")
                              for m in e.messages) for e in errors)


@pytest.mark.slow
def test_the_small_build_is_a_model_directory_the_engine_serves(tmp_path: Path) -> None:
    from clawrl.engine.runtime import Engine
    from clawrl.swemodel.build import MARKER, SMALL, build, is_built

    out = build(tmp_path / "swe", SMALL, log=lambda _: None)
    assert is_built(out, SMALL)
    report = json.loads((out / "report.json").read_text())
    assert report["corpus"]["episodes"] == SMALL.episodes
    assert set(report["episodes"]) == {"heldout", "train"}
    assert json.loads((out / "recipe.json").read_text())["train"]["lr"] == 2e-4
    assert json.loads((out / MARKER).read_text())["config"]["seed"] == 0
    engine = Engine(str(out))
    assert engine.context_len == SMALL.context
