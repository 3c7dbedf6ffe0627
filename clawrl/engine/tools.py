"""Tools for models whose chat template cannot render them.

A chat template that ignores `tools` (SmolLM2-135M-Instruct's does) would serve an agent's
request with no tool schema in the prompt: the model never calls a tool while the agent
believes it offered twelve. The engine checks once, at load, whether the template puts a
tool's schema in the prompt (`template_renders_tools`). When it does not, the request is
rendered in the Hermes / Qwen2.5 function-calling format, which the reply parser already
reads (`<tool_call>` JSON, clawrl/engine/chat.py `parse_tool_calls`):

- the tool schemas go in a `# Tools` block at the end of the system message (a system
  message is added when the request has none);
- an assistant message's `tool_calls` become `<tool_call>{"name": …, "arguments": …}</tool_call>`
  lines after its text;
- a `tool` message becomes a user message `<tool_response>…</tool_response>`, consecutive
  results merged into one turn.

The rendering is deterministic, so a stored turn's prompt ids are exactly what the model saw,
and training on them teaches the model this format from the tools' results.
"""

from __future__ import annotations

import json
from typing import Any

_PROBE = "clawrl_probe_tool_7f3a"

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template puts a tool's schema into the prompt."""
    probe = [{"type": "function", "function": {
        "name": _PROBE, "description": "probe", "parameters": {"type": "object",
                                                                "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe,
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that raises on tools cannot render them either
        return False
    return _PROBE in str(text)


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The system message's `# Tools` block: one schema per line, as offered."""
    return TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) \
        + TOOLS_FOOTER


def render_tool_messages(messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` (normalised: tool-call arguments parsed) rewritten for a template that
    knows only system, user and assistant text (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in message["tool_calls"])
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        block = tools_block(tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]
            out[0] = {**first, "content": f"{first.get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
