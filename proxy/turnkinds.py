"""Side calls told from main turns with no client change: which requests no person's next
message will follow.

Agents and chat apps make calls of their own beside the conversation — a heartbeat that
polls for work, a memory flush before compaction, the compaction's summary, a title for the
chat list. Their replies are shown to nobody and their history is rewritten before the next
call, so they are never continued; stored as main turns they would sit open and, worse, be
trained on as if a person had asked. Each rule below reads only the request (its system
messages and the message that opened this request) and names one kind of side call; a
request that matches one is stored as `kind = 'side'` with the rule's name in
`turns.kind_reason` (served and logged, never continued, judged or trained). The client's
`X-Turn-Type` header always wins (`kind_reason = 'header'`).

The rules are narrow on purpose: a person's own message that merely mentions a summary or a
title stays a main turn. They were written from captured traffic (OpenClaw 2026.9.6's
heartbeat, memory flush and compaction; the title prompts of common chat front ends) and are
tested against it (tests/proxy/test_turnkinds.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

Messages = Sequence[dict[str, Any]]
SYSTEM_ROLES = frozenset({"system", "developer"})


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined."""
    return _text(message.get("content"))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def opening_index(messages: Sequence[dict[str, Any]]) -> int | None:
    """Index of the first non-system message after the last assistant message: the one
    that opened this request (a person's message, or a tool result), or None."""
    start = 0
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            start = i + 1
            break
    for i in range(start, len(messages)):
        if messages[i].get("role") not in SYSTEM_ROLES:
            return i
    return None


def opening_message(messages: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The message that opened this request (see `opening_index`)."""
    i = opening_index(messages)
    return None if i is None else messages[i]


# A poll that tells the model to answer with a sentinel when there is nothing to do
# (OpenClaw's heartbeat and memory flush: "If nothing needs attention, reply NO_REPLY").
# No person asks a chat model to answer with a sentinel token.
_SENTINEL = re.compile(r"\b(?:reply|respond|answer)(?:\s+with)?(?:\s+only)?\s*:?\s*"
                       r"[`\"']?(?:NO_REPLY|HEARTBEAT_OK)\b")
_HEARTBEAT_MARK = re.compile(r"\[OpenClaw heartbeat poll\]|\bheartbeat monitor\b", re.I)
# A summary of a conversation handed over as data: the system message names the task and
# the transcript comes wrapped (OpenClaw's compaction: "You are a context summarization
# assistant" + "<conversation>…</conversation>").
_SUMMARISER = re.compile(r"\b(?:summari[sz]ation|summari[sz]e|summari[sz]ing)\b", re.I)
_TRANSCRIPT = re.compile(r"<conversation>|<chat_history>|\[User\]:|^### Chat History:", re.I | re.M)
# A title for the chat list: "Generate a concise, 3-5 word title … for the conversation",
# "Create a short title for this chat", "### Task: Generate a concise … title … chat history".
_TITLE = re.compile(r"\b(?:generate|create|write|suggest|give)\b[^.\n]{0,60}\btitle\b[^.\n]{0,80}"
                    r"\b(?:conversation|chat(?:\s+history)?|thread|dialog(?:ue)?)\b", re.I)


# Each rule reads the text of the message that opened the request, the system messages'
# text, and the tools offered.
def _silent_poll(opening: str, system: str, tools: Any) -> bool:
    return bool(_SENTINEL.search(opening) or _HEARTBEAT_MARK.search(opening))


def _summary(opening: str, system: str, tools: Any) -> bool:
    return bool(not tools and _SUMMARISER.search(system) and _TRANSCRIPT.search(opening))


def _title(opening: str, system: str, tools: Any) -> bool:
    return not tools and bool(_TITLE.search(opening) or _TITLE.search(system))


# A chat front end's own task over the chat so far (Open WebUI's "### Task:" prompts for
# tags and follow-up questions, with the history in <chat_history>).
_APP_TASK = re.compile(r"^\s*#+\s*Task:.*<chat_history>", re.I | re.S)


def _app_task(opening: str, system: str, tools: Any) -> bool:
    return not tools and bool(_APP_TASK.search(opening))


# name -> rule, tried in order; the first that matches names the side call.
RULES: dict[str, Callable[[str, str, Any], bool]] = {
    "silent_poll": _silent_poll,
    "summary": _summary,
    "title": _title,
    "app_task": _app_task,
}


def side_call_rule(messages: Messages, tools: Any) -> str | None:
    """The name of the first rule that marks this request a side call, or None."""
    opening = message_text(opening_message(messages) or {})
    system = "\n".join(message_text(m) for m in messages if m.get("role") in SYSTEM_ROLES)
    for name, rule in RULES.items():
        if rule(opening, system, tools):
            return name
    return None
