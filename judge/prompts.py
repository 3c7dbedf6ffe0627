"""Versioned judge prompts: load the template files and render a turn into them.

Pure functions over plain JSON-like data, stdlib only. docs/judge-format.md documents this
rendering exactly, because the tiny world model's pretraining corpus (clawrl/world/corpus.py)
replicates it without importing this module.

Templates live in `judge/templates/{kind}_{version}.txt` (kind: prm, hint, teacher; or judge
for a version that asks for the verdict and the hint in one answer) and are
filled with `str.format` after stripping trailing whitespace from the file.
The rendered judge prompt is sent as the only message, role `user`, with no system message.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
DEFAULT_VERSION = "v1"
# How many of the request's last non-system messages the judge sees (small model context).
CONTEXT_MESSAGES = 4
# A message body longer than this is cut to its first MAX_MESSAGE_CHARS characters + "...".
MAX_MESSAGE_CHARS = 600
# Combined versions answered with the bare score first ("1 [NO_HINT]", "-1 [HINT] … [/HINT]")
# instead of a `\\boxed{…}`: the answer's first token is the decision.
SCORE_FIRST_VERSIONS = frozenset({"v4", "v5"})
# System-like roles are left out of the context: agent frameworks rewrite them per request.
_SKIPPED_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class FeedbackItem:
    """One explicit feedback row: rating +1 / -1 / None and optional text."""

    rating: int | None
    text: str | None


@lru_cache(maxsize=32)
def load_template(kind: str, version: str = DEFAULT_VERSION) -> str:
    """The template text of `kind` ('prm', 'hint', 'teacher') at `version`."""
    if not kind.isidentifier() or not version.replace("_", "").isalnum():
        raise ValueError(f"bad template name {kind!r} / {version!r}")
    path = TEMPLATE_DIR / f"{kind}_{version}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"no judge template {path.name} in {TEMPLATE_DIR}")
    return path.read_text(encoding="utf-8").rstrip()


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message: a string content, or its text parts joined by newlines."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, Sequence):
        texts = [str(p.get("text", "")) for p in content
                 if isinstance(p, Mapping) and p.get("type") == "text"]
        return "\n".join(texts).strip()
    return str(content).strip()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def render_tool_call(call: Mapping[str, Any]) -> str:
    """`call NAME(ARGUMENTS)` with the arguments JSON string exactly as recorded."""
    fn = call.get("function") or {}
    name = fn.get("name", "") if isinstance(fn, Mapping) else ""
    args = fn.get("arguments", "") if isinstance(fn, Mapping) else ""
    if not isinstance(args, str):
        args = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
    return f"call {name}({args})"


def render_message(message: Mapping[str, Any], role: str | None = None) -> str:
    """`ROLE: TEXT`, then one `call NAME(ARGS)` line per tool call; `ROLE:` when empty."""
    role = role or str(message.get("role", "user"))
    lines = [_cut(message_text(message))] if message_text(message) else []
    lines += [_cut(render_tool_call(c)) for c in message.get("tool_calls") or []]
    body = "\n".join(lines)
    return f"{role}: {body}" if body else f"{role}:"


def render_context(request_messages: Sequence[Mapping[str, Any]]) -> str:
    kept = [m for m in request_messages if m.get("role") not in _SKIPPED_ROLES]
    return "\n".join(render_message(m) for m in kept[-CONTEXT_MESSAGES:])


def as_messages(next_state: Any) -> list[Mapping[str, Any]]:
    """The next state as a list of messages (it is stored as a list; a lone dict is tolerated)."""
    if next_state is None:
        return []
    if isinstance(next_state, Mapping):
        inner = next_state.get("messages")
        return list(inner) if isinstance(inner, list) else [next_state]
    return [m for m in next_state if isinstance(m, Mapping)]


def render_feedback(feedback: Sequence[FeedbackItem]) -> str:
    """`[FEEDBACK]` + one line per item (`thumbs up`, `thumbs down` or `comment`, then
    `: TEXT` when there is text), each line ending in a newline; "" when there is none."""
    if not feedback:
        return ""
    lines = []
    for item in feedback:
        label = {1: "thumbs up", -1: "thumbs down"}.get(item.rating or 0, "comment")
        text = (item.text or "").strip()
        lines.append(f"{label}: {_cut(text)}" if text else label)
    return "[FEEDBACK]\n" + "".join(line + "\n" for line in lines)


def render_step(request_messages: Sequence[Mapping[str, Any]],
                response_message: Mapping[str, Any] | None) -> str:
    """An agent's step, for a reply that calls tools: `[STEP]`, what the agent was asked (the
    request's first user message, the task, and its last one when there are more: a later
    request or a nudge) and the reply's calls, each line ending in `\n`; "" for any other
    reply, so a people turn's prompt is the same with or without it. A tool's result says
    what came back, not whether it was what was asked for; beside the task and the call, a
    judge can tell a lookup of the wrong thing from progress."""
    calls = (response_message or {}).get("tool_calls") or []
    if not calls:
        return ""
    asked = [m for m in request_messages if m.get("role") == "user"]
    lines = [render_message(m) for m in (asked[:1] + asked[1:][-1:])]
    lines += ["assistant: " + _cut(render_tool_call(c)) for c in calls]
    return "[STEP]\n" + "".join(line + "\n" for line in lines)


def render_fields(request_messages: Sequence[Mapping[str, Any]],
                  response_message: Mapping[str, Any] | None, next_state: Any,
                  feedback: Sequence[FeedbackItem] = ()) -> dict[str, str]:
    """The placeholders shared by the templates (a template uses those it names)."""
    return {
        "context": render_context(request_messages),
        "reply": render_message(response_message or {}, role="assistant"),
        "step": render_step(request_messages, response_message),
        "next_state": "\n".join(render_message(m) for m in as_messages(next_state)),
        "feedback": render_feedback(feedback),
    }


def is_combined(version: str) -> bool:
    """Whether `version` asks for the verdict and the hint in one answer (`judge_{version}.txt`,
    answered `\\boxed{..}` then `[HINT] … [/HINT]` or `[NO_HINT]`) instead of two prompts."""
    return (TEMPLATE_DIR / f"judge_{version}.txt").is_file()


def score_first(version: str) -> bool:
    """Whether `version`'s answer starts with the bare score rather than a `\\boxed{…}`."""
    return version in SCORE_FIRST_VERSIONS


def check_version(version: str) -> None:
    """Raise FileNotFoundError (or ValueError) unless `version`'s templates exist."""
    if is_combined(version):
        load_template("judge", version)
    else:
        load_template("prm", version)
        load_template("hint", version)
    load_template("teacher", version)


def render_judge(fields: Mapping[str, str], version: str) -> str:
    return load_template("judge", version).format(**fields)


def render_prm(fields: Mapping[str, str], version: str = DEFAULT_VERSION) -> str:
    return load_template("prm", version).format(**fields)


def render_hint(fields: Mapping[str, str], version: str = DEFAULT_VERSION) -> str:
    return load_template("hint", version).format(**fields)


def judge_messages(prompt: str) -> list[dict[str, str]]:
    """The chat messages a judge prompt is sent as: one user message, no system message."""
    return [{"role": "user", "content": prompt}]


def teacher_messages(request_messages: Sequence[Mapping[str, Any]], hint: str,
                     version: str = DEFAULT_VERSION) -> list[dict[str, Any]]:
    """The turn's request with the hint appended to the last user message.

    That message's content becomes plain text: `teacher_{version}.txt` filled with
    `content` (its text, see `message_text`) and `hint`. Raises ValueError without a user
    message.
    """
    messages = [dict(copy.deepcopy(m)) for m in request_messages]
    for msg in reversed(messages):
        if msg.get("role") == "user":
            msg["content"] = load_template("teacher", version).format(
                content=message_text(msg), hint=hint.strip())
            return messages
    raise ValueError("the request has no user message to append the hint to")
