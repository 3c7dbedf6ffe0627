"""The tiny world's tool-call track: two tools, the task's checker, and the corpus episodes
that teach the tiny world model the tool-call format.

An agent is asked one question about the town and has two tools:

    lookup(person, attribute)   the town records: "Ada has a cat." (or an error line)
    answer(text)                the final answer; ends the episode

It succeeds (outcome +1) when it looked up the asked person's asked attribute before calling
`answer` with text that states the value; anything else is −1 (`verify`). The environment
(clawrl/envs/toolcall.py) drives the proxy with these; the corpus (`tool_episode`) shows the
model a mix of agents — some look it up first, some answer straight from memory, some reply in
plain text and are told to use the tools — so the base model calls tools, but succeeds only
part of the time (what the learning has to change is the first move).

The tool-call model (`clawrl tinyworld build DIR --tools`, clawrl/world/pretrain.py) renders
tools with `TOOLS_CHAT_TEMPLATE`: the tiny world's ChatML with each tool as one line,
`name(param, …): description`, instead of Qwen2.5's JSON signatures (700 tokens of a
768-token vocabulary for two tools); tool calls are Qwen2.5's `<tool_call>` JSON, which the
engine parses (clawrl/engine/chat.py).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from clawrl.world.model import chat_template
from clawrl.world.town import ANSWERS, ATTRIBUTES, Question, Style, World, render_reply

Message = dict[str, Any]

SYSTEM = "You answer questions about the town. Look the fact up, then give the answer."
NUDGE = "Please use the tools: lookup(person, attribute), then answer(text)."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "lookup", "description": "one fact about a person from the town records",
        "parameters": {"type": "object", "properties": {
            "person": {"type": "string"},
            "attribute": {"type": "string", "enum": list(ATTRIBUTES)}},
            "required": ["person", "attribute"]}}},
    {"type": "function", "function": {
        "name": "answer", "description": "the final answer to the user",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                       "required": ["text"]}}},
]

COMPACT_TOOLS_HEADER = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{%- set params = fn.parameters.properties if fn.parameters is defined "
    "and fn.parameters.properties is defined else {} %}"
    "{{- fn.name + '(' + (params | join(', ')) + '): ' + (fn.description or '') + '\\n' }}"
    "{%- endfor %}"
    "{{- 'Call a tool as <tool_call>\\n{\"name\": NAME, \"arguments\": {...}}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
TOOLS_CHAT_TEMPLATE = chat_template(COMPACT_TOOLS_HEADER)


# --- the task ----------------------------------------------------------------------------


def record_key(person: str, attribute: str) -> tuple[str, str]:
    """(name, attribute) as the records file them: forgiving about case, spaces, "colour"."""
    return person.strip().capitalize(), attribute.strip().lower().replace("colour", "color")


def lookup_result(world: World, person: Any, attribute: Any) -> tuple[str, bool]:
    """The records' answer to `lookup(person, attribute)` and whether it found a fact."""
    if not isinstance(person, str) or not isinstance(attribute, str):
        return "error: lookup needs a person and an attribute", False
    name, attr = record_key(person, attribute)
    if name not in world.facts:
        return f"error: no person named {person.strip()!r} in the records", False
    if attr not in ATTRIBUTES:
        return (f"error: unknown attribute {attribute.strip()!r} (one of "
                f"{', '.join(ATTRIBUTES)})"), False
    return ANSWERS[attr][0].format(name=name, value=world.facts[name][attr]), True


def call_arguments(call: dict[str, Any]) -> dict[str, Any] | None:
    """A tool call's arguments as a dict (the wire format sends a JSON string), or None."""
    args = call.get("function", {}).get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    return args if isinstance(args, dict) else None


@dataclass
class Attempt:
    """What an agent did in one episode, for `verify`."""

    looked_up: set[tuple[str, str]] = field(default_factory=set)  # (person, attribute) found
    answer: str | None = None  # the `answer` tool's text, once called
    answered_after_lookup: bool = False  # the asked fact was looked up before `answer`
    replies: int = 0  # the agent's replies (steps) so far


# A success in the fewest replies (lookup, then answer) is worth +1; each reply more costs
# STEP_COST, down to SUCCESS_FLOOR (still a success: > 0). Without it the outcome credits a
# wasted step — a plain-text reply that earns a nudge, a lookup of the wrong attribute before
# the right one — exactly as much as the steps that solved the task, and training on the
# outcome alone drifted into both (docs/eval.md, "The tool-call track").
FEWEST_REPLIES = 2
STEP_COST = 0.25
SUCCESS_FLOOR = 0.25


def states_fact(world: World, question: Question, text: str) -> bool:
    """`text` names the asked value (a whole word, any case)."""
    value = world.answer(question).lower()
    return re.search(rf"\b{re.escape(value)}\b", text.lower()) is not None


def verify(world: World, question: Question, attempt: Attempt) -> float:
    """A success — the asked fact looked up before `answer`, whose text states it — is
    positive: +1 in the fewest replies, less for each reply more (STEP_COST, at least
    SUCCESS_FLOOR). Anything else is −1."""
    if attempt.answer is None or not attempt.answered_after_lookup:
        return -1.0
    if not states_fact(world, question, attempt.answer):
        return -1.0
    extra = max(0, attempt.replies - FEWEST_REPLIES)
    return max(SUCCESS_FLOOR, 1.0 - STEP_COST * extra)


class ToolEpisode:
    """One episode's state: the opening messages, then each reply's next state.

    `step(reply)` takes the model's assistant message (OpenAI form) and returns the next state
    and whether the episode is over: a `tool` message per call (`lookup`'s records line or an
    error; `answer` ends the episode), or, for a reply without tool calls, the user's nudge to
    use the tools. `outcome()` is `verify` of what happened (a success in [SUCCESS_FLOOR, 1],
    less the more replies it took; −1 otherwise).
    """

    def __init__(self, world: World, question: Question, system: bool = True) -> None:
        self.world, self.question = world, question
        self.attempt = Attempt()
        self.first_move = ""  # the first reply's first tool, or "text"
        self.messages: list[Message] = (
            ([{"role": "system", "content": SYSTEM}] if system else [])
            + [{"role": "user", "content": question.text}])

    def step(self, reply: Message) -> tuple[list[Message], bool]:
        self.attempt.replies += 1
        calls = reply.get("tool_calls") or []
        if not self.first_move:
            self.first_move = (str(calls[0].get("function", {}).get("name", "")) or "?"
                               if calls else "text")
        if not calls:
            return [{"role": "user", "content": NUDGE}], False
        out: list[Message] = []
        for call in calls:
            name = str(call.get("function", {}).get("name", ""))
            args = call_arguments(call)
            if name == "answer":
                text = args.get("text") if args else None
                self.attempt.answer = text if isinstance(text, str) else ""
                self.attempt.answered_after_lookup = (
                    (self.question.name, self.question.attr) in self.attempt.looked_up)
                return out, True
            if name == "lookup" and args is not None:
                content, found = lookup_result(self.world, args.get("person"),
                                               args.get("attribute"))
                if found:  # (found: both are strings)
                    self.attempt.looked_up.add(record_key(args["person"], args["attribute"]))
            elif args is None:
                content = "error: the arguments are not a JSON object"
            else:
                content = f"error: unknown tool {name!r} (lookup or answer)"
            out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        return out, False

    def outcome(self) -> float:
        return verify(self.world, self.question, self.attempt)


# --- corpus episodes ---------------------------------------------------------------------

# The first move of the corpus's agents: look up first, answer from memory, or plain text
# (then told to use the tools). The base model learns this mix; only the first succeeds.
FIRST_MOVES = {"lookup": 0.35, "answer": 0.45, "text": 0.20}


def tool_call(name: str, arguments: dict[str, Any], call_id: str) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def tool_episode(world: World, rng: random.Random) -> list[Message]:
    """One agent episode on a held-in question, as messages (tool calls in OpenAI form)."""
    q = rng.choice(world.train)
    messages: list[Message] = [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": q.text}]
    short = Style(rng.choice(("normal", "normal", "lower")), "short", None)
    first = rng.choices(list(FIRST_MOVES), list(FIRST_MOVES.values()))[0]
    ids = iter(f"call_{i}" for i in range(8))
    if first == "text":
        messages.append({"role": "assistant",
                         "content": render_reply(world, q, Style.random(rng), rng)})
        messages.append({"role": "user", "content": NUDGE})
        first = "lookup"
    if first == "lookup":
        call_id = next(ids)
        messages.append(tool_call("lookup", {"person": q.name, "attribute": q.attr}, call_id))
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": lookup_result(world, q.name, q.attr)[0]})
    messages.append(tool_call("answer", {"text": render_reply(world, q, short, rng)},
                              next(ids)))
    return messages


def render_tool_chat(messages: list[Message], tools: list[dict[str, Any]] | None = TOOLS,
                     ) -> tuple[str, list[tuple[int, int]]]:
    """`TOOLS_CHAT_TEMPLATE`'s text for `messages` and the char spans that carry the loss
    (each assistant message after its `<|im_start|>assistant\\n`, through `<|im_end|>`).
    Rendered by the template itself, message by message, so the corpus is exactly what the
    engine will show the model."""
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            before = render_template(messages[:i], tools, add_generation_prompt=True)
            upto = render_template(messages[:i + 1], tools)
            spans.append((len(before), len(upto.rstrip("\n"))))
    return render_template(messages, tools), spans


def render_template(messages: list[Message], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool = False) -> str:
    """Render `TOOLS_CHAT_TEMPLATE` as transformers' `apply_chat_template` does (a sandboxed
    jinja environment, `tojson` without ASCII escapes)."""
    return str(_compiled().render(messages=messages, tools=tools,
                                  add_generation_prompt=add_generation_prompt))


_TEMPLATE: list[Any] = []


def _compiled() -> Any:
    if not _TEMPLATE:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
        _TEMPLATE.append(env.from_string(TOOLS_CHAT_TEMPLATE))
    return _TEMPLATE[0]
