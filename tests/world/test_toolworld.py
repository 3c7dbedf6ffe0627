"""The tool-call track's world (clawrl/world/tools.py) and environment (clawrl/envs/
toolcall.py): the template the model and the corpus share, the records, the verifier, the
corpus's mix of first moves, and the shipped tool-call model."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from clawrl.envs.protocol import EnvError
from clawrl.envs.registry import make_env
from clawrl.world import pretrain
from clawrl.world.report import parse_tool_calls
from clawrl.world.tools import (
    FIRST_MOVES,
    NUDGE,
    TOOLS,
    TOOLS_CHAT_TEMPLATE,
    ToolEpisode,
    lookup_result,
    render_template,
    render_tool_chat,
    tool_episode,
)
from clawrl.world.town import World

PREBUILT = Path(__file__).resolve().parents[2] / "clawrl" / "world" / "prebuilt"
WORLD = World.build(0)


def call(name: str, args: Any, call_id: str = "c1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def reply(*calls: dict[str, Any], content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls
                                                         else {})}


def test_the_corpus_renders_exactly_what_transformers_renders_for_the_engine() -> None:
    tok = AutoTokenizer.from_pretrained(PREBUILT / "tinyworld")
    tok.chat_template = TOOLS_CHAT_TEMPLATE
    rng = random.Random(3)
    for _ in range(20):
        messages = tool_episode(WORLD, rng)
        text, spans = render_tool_chat(messages)
        assert text == tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
        # The loss spans are the assistant messages, each through its <|im_end|>.
        assistants = [m for m in messages if m["role"] == "assistant"]
        assert len(spans) == len(assistants)
        for (a, b), msg in zip(spans, assistants, strict=True):
            assert text[a:b].endswith("<|im_end|>")
            assert text[:a].endswith("<|im_start|>assistant\n")
            if msg.get("tool_calls"):
                fn = msg["tool_calls"][0]["function"]
                assert text[a:b] == ('<tool_call>\n' + json.dumps(
                    {"name": fn["name"], "arguments": fn["arguments"]}) +
                    '\n</tool_call><|im_end|>')
    # The wire format (arguments as a JSON string) renders the same as a dict.
    wire = [{"role": "user", "content": "q"}, reply(call("lookup", '{"person": "Ada", '
                                                                 '"attribute": "pet"}'))]
    as_dict = [wire[0], reply(call("lookup", {"person": "Ada", "attribute": "pet"}))]
    assert render_template(wire, TOOLS) == render_template(as_dict, TOOLS)
    header = render_template([{"role": "user", "content": "q"}], TOOLS)
    assert "lookup(person, attribute): one fact about a person" in header
    assert "answer(text): the final answer" in header
    assert len(tok(header)["input_ids"]) < 150  # Qwen2.5's JSON signatures: ~600


def test_a_generated_tool_call_parses_as_the_engine_parses_it() -> None:
    from clawrl.engine.chat import _TOOL_RE

    text = ('<tool_call>\n{"name": "lookup", "arguments": {"person": "Ada", '
            '"attribute": "pet"}}\n</tool_call>')
    parsed = parse_tool_calls(text)
    assert parsed["tool_calls"][0]["function"] == {
        "name": "lookup", "arguments": {"person": "Ada", "attribute": "pet"}}
    assert json.loads(_TOOL_RE.findall(text)[0])["arguments"] == {"person": "Ada",
                                                                  "attribute": "pet"}
    assert parse_tool_calls('<tool_call>{"name": broken</tool_call>') == {
        "role": "assistant", "content": '<tool_call>{"name": broken</tool_call>'}


def test_the_records_answer_and_refuse_in_one_line() -> None:
    ada = WORLD.facts["Ada"]
    assert lookup_result(WORLD, "Ada", "pet") == (f"Ada has a {ada['pet']}.", True)
    assert lookup_result(WORLD, " ada ", "Colour")[1]  # forgiving about case and spelling
    assert lookup_result(WORLD, "Zed", "pet") == ("error: no person named 'Zed' in the "
                                                  "records", False)
    text, found = lookup_result(WORLD, "Ada", "shoe size")
    assert not found and text.startswith("error: unknown attribute 'shoe size' (one of city")
    assert lookup_result(WORLD, None, "pet") == (
        "error: lookup needs a person and an attribute", False)


def question(attr: str = "pet") -> Any:
    return next(q for q in WORLD.heldout if q.attr == attr)


def test_looking_up_then_answering_succeeds_and_nothing_else_does() -> None:
    q = question()
    value = WORLD.answer(q)
    ep = ToolEpisode(WORLD, q)
    messages, done = ep.step(reply(call("lookup", json.dumps({"person": q.name,
                                                              "attribute": q.attr}))))
    assert not done and messages == [{"role": "tool", "tool_call_id": "c1",
                                      "content": lookup_result(WORLD, q.name, q.attr)[0]}]
    assert ep.step(reply(call("answer", {"text": f"It is a {value.upper()}."}, "c2"))) == ([],
                                                                                          True)
    assert ep.outcome() == 1.0 and ep.first_move == "lookup"

    direct = ToolEpisode(WORLD, q)  # the right answer, from memory: fails the task
    assert direct.step(reply(call("answer", {"text": value}))) == ([], True)
    assert direct.outcome() == -1.0 and direct.first_move == "answer"

    wrong = ToolEpisode(WORLD, q)  # looked up, then answered something else
    wrong.step(reply(call("lookup", {"person": q.name, "attribute": q.attr})))
    wrong.step(reply(call("answer", {"text": "no idea"})))
    assert wrong.outcome() == -1.0

    other = ToolEpisode(WORLD, q)  # looked up another fact of the person
    attr = next(a for a in WORLD.facts[q.name] if a != q.attr)
    other.step(reply(call("lookup", {"person": q.name, "attribute": attr})))
    other.step(reply(call("answer", {"text": value})))
    assert other.outcome() == -1.0

    never = ToolEpisode(WORLD, q)  # text only: nudged, never answered
    assert never.step(reply(content=value)) == ([{"role": "user", "content": NUDGE}], False)
    assert never.outcome() == -1.0 and never.first_move == "text"


def test_a_success_in_more_replies_is_worth_less_but_still_a_success() -> None:
    """Lookup + answer is +1; each reply more costs 0.25 (a nudged text reply, a lookup of
    the wrong attribute first), never below 0.25; one reply with both calls is +1."""
    q = question()
    right = {"person": q.name, "attribute": q.attr}
    wrong = {"person": q.name, "attribute": next(a for a in WORLD.facts[q.name] if a != q.attr)}
    answer = call("answer", {"text": WORLD.answer(q)}, "c9")

    def outcome(*replies: Any) -> float:
        ep = ToolEpisode(WORLD, q)
        for r in replies:
            ep.step(r)
        return ep.outcome()

    assert outcome(reply(call("lookup", right)), reply(answer)) == 1.0
    assert outcome(reply(content="hm"), reply(call("lookup", right)), reply(answer)) == 0.75
    assert outcome(reply(call("lookup", wrong)), reply(call("lookup", right)),
                   reply(answer)) == 0.75
    assert outcome(reply(content="a"), reply(content="b"), reply(call("lookup", right)),
                   reply(answer)) == 0.5
    assert outcome(*[reply(content="x")] * 6, reply(call("lookup", right)),
                   reply(answer)) == 0.25
    assert outcome(reply(call("lookup", right), answer)) == 1.0


def test_bad_calls_come_back_as_tool_errors() -> None:
    ep = ToolEpisode(WORLD, question())
    messages, done = ep.step(reply(call("search", {"q": "x"}), call("lookup", "{not json",
                                                                   "c2")))
    assert not done
    assert [m["content"] for m in messages] == ["error: unknown tool 'search' (lookup or answer)",
                                               "error: the arguments are not a JSON object"]
    assert [m["tool_call_id"] for m in messages] == ["c1", "c2"]


def test_the_corpus_mixes_first_moves_and_only_lookups_succeed() -> None:
    rng = random.Random(0)
    moves: Counter[str] = Counter()
    for _ in range(600):
        messages = tool_episode(WORLD, rng)
        q = WORLD.find(messages[1]["content"])
        assert q is not None and q in WORLD.train  # held-out questions never in the corpus
        ep = ToolEpisode(WORLD, q)
        for msg in messages[2:]:
            if msg["role"] == "assistant":
                ep.step(msg)
        moves[ep.first_move] += 1
        assert (ep.outcome() > 0) == ("lookup" in json.dumps(messages))
    for move, share in FIRST_MOVES.items():
        assert abs(moves[move] / 600 - share) < 0.06, moves


def test_the_env_draws_its_split_and_refuses_unknown_options() -> None:
    world = World.build(0)
    train = {asyncio.run(make_env("toolcall", s).reset()).messages[-1]["content"]
             for s in range(30)}
    heldout = {asyncio.run(make_env("toolcall", s, split="heldout").reset()).messages[-1][
        "content"] for s in range(30)}
    assert train <= {q.text for q in world.train}
    assert heldout <= {q.text for q in world.heldout}
    obs = asyncio.run(make_env("toolcall", 1).reset())
    assert obs.tools == TOOLS and obs.task in WORLD.facts["Ada"]
    with pytest.raises(EnvError, match="unknown split 'dev'"):
        make_env("toolcall", 0, split="dev")
    with pytest.raises(EnvError, match="takes no tasks option"):
        make_env("toolcall", 0, tasks=["x"])


def test_the_env_reports_what_happened() -> None:
    env = make_env("toolcall", 5, split="heldout")
    obs = asyncio.run(env.reset())
    q = WORLD.find(obs.messages[-1]["content"])
    assert q is not None
    asyncio.run(env.step(reply(call("answer", {"text": WORLD.answer(q)}))))
    assert asyncio.run(env.outcome()) == -1.0
    assert env.details() == {"first_move": "answer", "answered": True,  # type: ignore[attr-defined]
                             "answer_correct": True, "looked_up": False}


def test_the_shipped_tool_call_model_matches_its_build_and_calls_tools() -> None:
    """The tool-call model ships built (`clawrl eval --track toolcall` needs no build), for
    the tool episodes and the full build as they are now; its report says it calls tools
    and succeeds only part of the time (what the track has to learn)."""
    shipped = pretrain.prebuilt(pretrain.TOOLS_BUILD)
    assert shipped is not None, (
        f"no shipped tools build for key {pretrain.build_key(pretrain.TOOLS_BUILD)}; run "
        "`clawrl tinyworld build clawrl/world/prebuilt/tinyworld-tools --tools --force`")
    assert (shipped / "chat_template.jinja").read_text() == TOOLS_CHAT_TEMPLATE
    report = json.loads((shipped / pretrain.REPORT).read_text())["tools"]
    assert report["first_move"].get("lookup", 0) > 0.1
    assert 0.0 < report["success"] < 0.9
    assert pretrain.build_key(pretrain.TOOLS_BUILD) != pretrain.build_key(pretrain.FULL)
