"""Tools are never silently dropped (clawrl/engine/tools.py): a model whose chat template
cannot render them (SmolLM2-135M-Instruct's) gets them in the Hermes / Qwen2.5 format, its
tool calls in that format come back as OpenAI `tool_calls`, and a tool's result is rendered
as the next turn; a template that renders tools itself (the tiny world's tool-call model) is
left alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from clawrl.engine.chat import parse_tool_calls
from clawrl.engine.tools import render_tool_messages, template_renders_tools, tools_block

REPO = Path(__file__).resolve().parents[2]
TOOLS_MODEL = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-tools"
LS = {"type": "function", "function": {"name": "ls", "description": "List a directory",
                                       "parameters": {"type": "object", "properties": {
                                           "path": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}


def test_the_probe_tells_templates_apart(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert not template_renders_tools(AutoTokenizer.from_pretrained(smollm2_dir))
    assert template_renders_tools(AutoTokenizer.from_pretrained(TOOLS_MODEL))


def test_tool_history_is_rendered_as_text() -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "what is here?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
                {"role": "tool", "tool_call_id": "call_1", "content": "b.txt"},
                {"role": "assistant", "content": "a.txt and b.txt"}]
    out = render_tool_messages(messages, [LS])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(LS) in out[0]["content"]
    assert out[2]["content"].count('<tool_call>\n{"name": "ls", "arguments": {"path": "."}}') == 2
    assert out[3]["content"] == ("<tool_response>\na.txt\n</tool_response>\n"
                                 "<tool_response>\nb.txt\n</tool_response>")
    assert all("tool_calls" not in m for m in out)
    # no system message: one is added for the tools
    assert render_tool_messages([messages[1]], [LS])[0] == {"role": "system",
                                                             "content": tools_block([LS])}


def test_calls_come_back_in_either_format() -> None:
    one = 'Let me look.<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
    text, calls = parse_tool_calls(one, [LS])
    assert text == "Let me look." and json.loads(calls[0]["function"]["arguments"]) == {
        "path": "/tmp"}
    # SmolLM2's own: a list of calls in one tag; unknown tools are dropped
    many = '<tool_call>[{"name": "ls", "arguments": {}}, {"name": "rm", "arguments": {}}]</tool_call>'
    assert [c["function"]["name"] for c in parse_tool_calls(many, [LS])[1]] == ["ls"]


def _prompt(url: str, body: dict[str, Any], model_dir: Path) -> str:
    from transformers import AutoTokenizer

    resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        **body, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    ids = resp.json()["choices"][0]["prompt_token_ids"]
    return str(AutoTokenizer.from_pretrained(model_dir).decode(ids))


def test_the_real_model_is_offered_the_tools_and_sees_their_results(
        smollm2_dir: Path, engine_factory: Callable[..., str]) -> None:
    """Through the engine's HTTP route with SmolLM2: the prompt it actually encoded holds the
    schema, the earlier call and the tool's result; with `tool_choice: none` it holds none."""
    url = engine_factory(smollm2_dir)
    history = [{"role": "user", "content": "what is here?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{**CALL, "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "notes.md"}]
    prompt = _prompt(url, {"messages": history, "tools": [LS]}, smollm2_dir)
    assert "<tools>" in prompt and '"name": "ls"' in prompt
    assert '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>' in prompt
    assert "<tool_response>\nnotes.md\n</tool_response>" in prompt
    assert "<tools>" not in _prompt(url, {"messages": history[:1], "tools": [LS],
                                          "tool_choice": "none"}, smollm2_dir)
