"""Tools as ordinary OpenAI function calls, shared by the tracks that use them (SWE, GUI): the
definitions sent with each request, and the reading of one call's name and arguments into
either the arguments or the one-line error the agent gets back instead."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from clawrl.envs.protocol import Step

# JSON Schema type -> the Python types a parsed argument may have (bool is no integer here).
TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,),
                                      "number": (int, float)}


def tool_def(name: str, description: str, /, optional: tuple[str, ...] = (),
             **params: str | tuple[str, str]) -> dict[str, Any]:
    """An OpenAI tool definition; each parameter is its description (a string) or (type,
    description); every parameter is required except those named in `optional`."""
    props = {}
    for param, spec in params.items():
        kind, text = ("string", spec) if isinstance(spec, str) else spec
        props[param] = {"type": kind, "description": text}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props,
                       "required": [p for p in params if p not in optional]}}}


def read_call(function: dict[str, Any], tools: list[dict[str, Any]]
              ) -> tuple[str, dict[str, Any]] | str:
    """(name, arguments) of a call to one of `tools`, or `error: …` for an unknown tool,
    arguments that are not a JSON object, or a missing or mistyped parameter."""
    names = [t["function"]["name"] for t in tools]
    name = function.get("name")
    if name not in names:
        return f"error: unknown tool {name!r} (the tools: {', '.join(names)})"
    try:
        args = json.loads(function.get("arguments") or "{}")
    except ValueError:
        return "error: the arguments are not valid JSON"
    if not isinstance(args, dict):
        return "error: the arguments must be a JSON object"
    schema = tools[names.index(name)]["function"]["parameters"]
    required = schema["required"]
    for param in schema["properties"]:  # an optional one may be left out (or null, or "")
        if param not in required and args.get(param) in (None, ""):
            continue
        kind = schema["properties"][param]["type"]
        value = args.get(param)
        if isinstance(value, bool) or not isinstance(value, TYPES[kind]):
            article = "an" if kind[0] in "aeiou" else "a"
            needs = "needs" if param in required else "takes"
            return f"error: {name} {needs} {article} {kind} argument {param!r}"
    return str(name), {p: args[p] for p in schema["properties"]
                       if p in required or args.get(p) not in (None, "")}


async def answer_calls(reply: dict[str, Any], call: Callable[[dict[str, Any]], Awaitable[str]],
                       over: Callable[[], bool], nudge: str) -> list[dict[str, Any]]:
    """The next state of a reply: one `tool` message per call, in order, each `call(function)`'s
    text, stopping after a call that ended the episode (`over()`); a reply without a tool call
    gets `nudge` as a user message."""
    calls = reply.get("tool_calls") or []
    out: list[dict[str, Any]] = []
    for c in calls:
        content = await call(c.get("function") or {})
        out.append({"role": "tool", "tool_call_id": c.get("id", ""), "content": content})
        if over():
            break
    if not calls:
        out.append({"role": "user", "content": nudge})
    return out


async def tool_step(env: Any, reply: dict[str, Any], nudge: str) -> Step:
    """One step of an environment whose actions are tool calls (SWE, GUI): its calls
    answered by `env._call`, the episode over once a call ended it (`env.ended_by`) or at
    `env.max_steps`."""
    env.steps += 1
    out = await answer_calls(reply, env._call, lambda: bool(env.ended_by), nudge)
    if not env.ended_by and env.steps >= env.max_steps:
        env.ended_by = "steps"
    return Step(out, done=bool(env.ended_by))
