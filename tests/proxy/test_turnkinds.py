"""Side calls told from main turns (proxy/turnkinds.py), and sessions that survive an
agent's own context (proxy/sessions.py), on traffic captured from the real OpenClaw.

tests/proxy/data/openclaw-2026.9.6.jsonl holds the chat completion requests OpenClaw
2026.9.6 sent to a recording server: two `openclaw agent --local` conversations (the
trimmed config and the default one), then its gateway with heartbeats every minute, a
message through the gateway and a `/compact`; a conversation in a context window too small
for its prompt (a memory flush and a compaction before every turn); a tool call. System prompts are cut to their head and tail
and tool schemas to their names; nothing else is changed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from proxyharness import create_user, query
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import create_async
from proxy.records import TurnRecord
from proxy.sessions import canonical_message, conversation_messages, record_turns
from proxy.turnkinds import opening_index, side_call_rule

CAPTURE = Path(__file__).parent / "data" / "openclaw-2026.9.6.jsonl"
REQUESTS = [json.loads(line) for line in CAPTURE.read_text().splitlines()]
# What each captured request is, read by a person from the capture: a conversation's turn
# ('main'), or the side call the rule should name.
EXPECTED = {
    **dict.fromkeys(range(0, 10), None),      # two CLI conversations, twice (configs)
    **dict.fromkeys(range(10, 13), "silent_poll"),  # gateway heartbeats
    13: None,                                  # a message through the gateway
    **dict.fromkeys(range(14, 17), "silent_poll"),
    17: "summary",                             # /compact's summary call
    18: None,                                  # the first message after the compaction
    # a context too small for the prompt: a memory flush and a compaction before each turn
    19: None, 20: "silent_poll", 21: "summary", 22: None, 23: "silent_poll", 24: "summary",
    25: None,
    26: None, 27: None, 28: None,              # a tool call, its result, a follow-up
}


def test_every_captured_request_is_told_apart() -> None:
    assert len(REQUESTS) == len(EXPECTED)
    got = {i: side_call_rule(r["body"]["messages"], r["body"].get("tools"))
           for i, r in enumerate(REQUESTS)}
    assert got == EXPECTED


def _rule(text: str, system: str | None = None, tools: Any = None) -> str | None:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return side_call_rule(messages, tools)


def test_chat_front_ends_title_and_task_calls_are_side() -> None:
    # Open WebUI's default title prompt (its DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE).
    assert _rule("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing "
                 "the chat history.\n### Guidelines:\n- …\n### Chat History:\n<chat_history>\n"
                 "USER: hi\nASSISTANT: hello\n</chat_history>") == "title"
    assert _rule("Tell me about whales", system="Generate a concise, 3-5 word title for a "
                 "conversation that starts with this user message.") == "title"
    assert _rule("### Task:\nGenerate 1-3 broad tags categorizing the main themes of the "
                 "chat history.\n### Chat History:\n<chat_history>\nUSER: hi\n"
                 "</chat_history>") == "app_task"


def test_a_persons_own_words_stay_main() -> None:
    for text in ("Can you summarize our conversation so far?",
                 "Suggest a title for my essay about whales.",
                 "My heart rate monitor beeps, what does that mean?",
                 "Reply with NO if you disagree.",
                 "What is a heartbeat?"):
        assert _rule(text) is None, text
    # A summarizing app's own system prompt does not make its users' turns side calls.
    assert _rule("Here is my article: …", system="You summarize documents for the user.") is None
    # Tools offered: an agent's turn, never a title or summary call.
    assert _rule("Generate a short title for this conversation", tools=[{"type": "function"}]) \
        is None


def test_the_context_an_agent_appends_is_cut_from_the_conversation() -> None:
    first = REQUESTS[0]["body"]["messages"]
    # system, the person's message, OpenClaw's internal context (a content-part array)
    assert [m["role"] for m in first] == ["system", "user", "user"]
    assert "BEGIN_OPENCLAW_INTERNAL_CONTEXT" in json.dumps(first[2])
    assert opening_index(first) == 1
    assert conversation_messages(first) == first[:2]
    second = REQUESTS[1]["body"]["messages"]
    # ... and the next request replays the person's message and the reply, not the context
    assert [canonical_message(m) for m in second[1:3]] == [
        canonical_message(first[1]), canonical_message(second[2])]
    assert not any("BEGIN_OPENCLAW_INTERNAL_CONTEXT" in json.dumps(m) for m in second[:-1])
    plain = [{"role": "user", "content": "hi"}]
    assert conversation_messages(plain) is None  # nothing appended: one fingerprint


def test_a_reply_the_agent_replays_without_its_envelope_still_matches() -> None:
    """SmolLM2 copied OpenClaw's timestamp envelope into its reply; OpenClaw replayed the
    reply without it (seen with the real OpenClaw against clawrl)."""
    stored = {"role": "assistant", "content": "[Mon 2026-12-07 01:34 UTC] What outdoor activity"
              " did I say I like? (Not about) Keeping in touch"}
    replayed = {"role": "assistant", "content": "What outdoor activity did I say I like? "
                "(Not about) Keeping in touch"}
    assert canonical_message(stored) == canonical_message(replayed)
    # only a reply's leading envelope: a user's stays, and so does one inside the text
    user = {"role": "user", "content": stored["content"]}
    assert canonical_message(user) != canonical_message({**replayed, "role": "user"})
    inner = {"role": "assistant", "content": "Noted: [Mon 2026-12-07 01:34 UTC] hi"}
    assert canonical_message(inner) != canonical_message({**inner, "content": "Noted: hi"})


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async(db_url)
    yield engine
    await engine.dispose()


def _reply_to(i: int) -> dict[str, Any]:
    """The reply request i got, as a later request of the capture replays it."""
    messages = REQUESTS[i]["body"]["messages"]
    opening = opening_index(messages)
    assert opening is not None
    for later in REQUESTS[i + 1:]:
        seen = later["body"]["messages"]
        if (len(seen) > opening + 1 and seen[opening + 1].get("role") == "assistant"
                and canonical_message(seen[opening]) == canonical_message(messages[opening])):
            return dict(seen[opening + 1])
    return {"role": "assistant", "content": "OK"}


async def test_captured_openclaw_conversations_become_one_session_each(
        db: AsyncEngine, db_url: str) -> None:
    user_id, _ = create_user(db_url, "openclaw")
    uids = []
    for i, request in enumerate(REQUESTS):
        body = request["body"]
        record = TurnRecord(uid=str(uuid.uuid4()), user_id=user_id, api_key_id=None,
                            request_messages=body["messages"], tools=body.get("tools"),
                            params={"model": body["model"]}, response_message=_reply_to(i))
        async with db.begin() as conn:
            assert await record_turns(conn, [record], include_system=False) == 1
        uids.append(uuid.UUID(record.uid))
    rows = {uid: row for uid, *row in query(
        db_url, "SELECT uid, session_id, index_in_session, kind, kind_reason, state, "
        "next_state FROM turns")}
    kind = [rows[u][2] for u in uids]
    session = [rows[u][0] for u in uids]
    state = [rows[u][4] for u in uids]
    assert kind == ["side" if EXPECTED[i] else "main" for i in range(len(uids))]
    assert [rows[u][3] for u in uids] == [EXPECTED[i] for i in range(len(uids))]
    # Each conversation is one session (the gateway message continues the CLI one it names),
    # every turn but the last continued (9 judge jobs), and the
    # next state is the person's next message (then OpenClaw's context, as sent).
    for turns in ((0, 1, 2), (3, 4), (5, 6, 7, 13), (8, 9), (18,), (26, 27, 28)):
        assert len({session[i] for i in turns}) == 1, turns
        assert [rows[uids[i]][1] for i in turns] == list(range(len(turns)))
        assert all(state[i] == "continued" for i in turns[:-1])
    assert len({session[i] for i in (0, 3, 5, 8, 18)}) == 5
    next_state = rows[uids[0]][5]
    assert "What outdoor activity did I say I like?" in next_state[0]["content"]
    # Side calls stand alone, never continued (so never judged).
    assert all(session[i] is None and state[i] == "closed"
               for i in range(len(uids)) if EXPECTED[i])
    # The tool call's next state is its result (OpenClaw replays the call with another id).
    assert rows[uids[26]][5][0]["role"] == "tool"
    assert query(db_url, "SELECT count(*) FROM jobs WHERE kind = 'judge'")[0][0] == 9


async def test_the_header_overrides_the_rules(db: AsyncEngine, db_url: str) -> None:
    """`X-Turn-Type: main` on a heartbeat keeps it main (and continuable); no header lets
    the rule decide."""
    user_id, _ = create_user(db_url, "ops")
    heartbeat = REQUESTS[10]["body"]["messages"]
    uids = []
    for kind_reason in ("header", None):
        record = TurnRecord(uid=str(uuid.uuid4()), user_id=user_id, api_key_id=None,
                            request_messages=heartbeat, params={"model": "default"},
                            response_message={"role": "assistant", "content": "NO_REPLY"},
                            kind_reason=kind_reason)
        async with db.begin() as conn:
            assert await record_turns(conn, [record], include_system=False) == 1
        uids.append(uuid.UUID(record.uid))
    got = {uid: (kind, reason, state) for uid, kind, reason, state in query(
        db_url, "SELECT uid, kind, kind_reason, state FROM turns")}
    assert got[uids[0]] == ("main", "header", "open")
    assert got[uids[1]] == ("side", "silent_poll", "closed")
