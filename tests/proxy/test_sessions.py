"""Session inference on real Postgres: which turn a request continues, and what is attached.

These drive `record_turns` (the writer's storage step) with turn records shaped exactly as
the chat route builds them, so replies with tool calls — which the random tiny model cannot
be relied on to produce — are covered too. tests/proxy/test_chat.py covers the same through
HTTP with the real engine.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from proxyharness import create_user, query
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import create_async
from proxy.records import TurnRecord
from proxy.sessions import (
    close_stale_turns,
    context_fingerprint,
    explicit_session_id,
    prefix_fingerprints,
    record_turns,
)

SYS = {"role": "system", "content": "You are helpful. Time: 12:00"}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async(db_url)
    yield engine
    await engine.dispose()


class Log:
    """Records turns for one user the way the writer does, one transaction each."""

    def __init__(self, db: AsyncEngine, user_id: int, **defaults: Any) -> None:
        self.db, self.user_id, self.defaults = db, user_id, defaults

    async def turn(self, messages: list[dict[str, Any]], reply: dict[str, Any],
                   include_system: bool = False, **fields: Any) -> str:
        record = TurnRecord(uid=str(uuid.uuid4()), user_id=self.user_id, api_key_id=None,
                            request_messages=messages, params={"model": "default"},
                            response_message=reply, **{**self.defaults, **fields})
        async with self.db.begin() as conn:
            assert await record_turns(conn, [record], include_system=include_system) == 1
        return record.uid


def turn_row(db_url: str, uid: str) -> dict[str, Any]:
    cols = ("id", "session_id", "index_in_session", "state", "next_state", "next_turn_id",
            "kind", "context_fingerprint")
    rows = query(db_url, f"SELECT {', '.join(cols)} FROM turns WHERE uid = %s", uuid.UUID(uid))
    assert rows, f"turn {uid} not stored"
    return dict(zip(cols, rows[0], strict=True))


def judge_jobs(db_url: str) -> list[int]:
    return [r[0] for r in query(db_url, "SELECT turn_id FROM jobs WHERE kind = 'judge' "
                                        "ORDER BY id")]


def test_fingerprints_ignore_cosmetics_and_system_but_not_edits() -> None:
    base = [SYS, user("hi"), assistant("hello <think>hmm</think> there")]
    fp = context_fingerprint(base[:2], base[2], include_system=False)
    resent = [{"role": "system", "content": "Time: 12:01"},
              {"role": "user", "content": [{"type": "text", "text": "hi "}]},
              {"role": "assistant", "content": "hello  there", "reasoning_content": "x"},
              user("next")]
    assert prefix_fingerprints(resent, include_system=False) == [(3, fp)]
    assert prefix_fingerprints(resent, include_system=True)[0][1] != fp
    edited = [SYS, user("hi!"), base[2], user("next")]
    assert prefix_fingerprints(edited, include_system=False)[0][1] != fp
    # Tool call ids and argument formatting do not matter; names and values do.
    a = assistant("", [call("c1", "f", '{"x": 1, "y": 2}')])
    b = assistant("", [call("zz", "f", '{"y":2,"x":1}')])
    c = assistant("", [call("c1", "f", '{"x": 2, "y": 2}')])
    fa = context_fingerprint([user("q")], a, include_system=False)
    assert fa == context_fingerprint([user("q")], b, include_system=False)
    assert fa != context_fingerprint([user("q")], c, include_system=False)


async def test_plain_chat_continues_and_enqueues_judge(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "alice")
    log = Log(db, uid)
    t1 = await log.turn([SYS, user("hi")], assistant("hello"))
    t2 = await log.turn([{"role": "system", "content": "Time: 12:05"}, user("hi"),
                         assistant("hello"), user("tell me more")], assistant("more"))
    r1, r2 = turn_row(db_url, t1), turn_row(db_url, t2)
    assert r1["state"] == "continued" and r1["next_turn_id"] == r2["id"]
    assert r1["next_state"] == [user("tell me more")]
    assert r2["session_id"] == r1["session_id"] and r2["index_in_session"] == 1
    assert r2["state"] == "open"
    assert judge_jobs(db_url) == [r1["id"]]
    t3 = await log.turn([user("hi"), assistant("hello"), user("tell me more"),
                         assistant("more"), user("thanks")], assistant("welcome"))
    r3 = turn_row(db_url, t3)
    assert turn_row(db_url, t2)["next_state"] == [user("thanks")]
    assert r3["session_id"] == r1["session_id"] and r3["index_in_session"] == 2
    assert judge_jobs(db_url) == [r1["id"], r2["id"]]


async def test_nul_characters_are_stored_and_still_continue(db: AsyncEngine,
                                                              db_url: str) -> None:
    # Postgres rejects U+0000 in text/JSONB; a reply containing one must not be dropped.
    uid, _ = create_user(db_url, "nul")
    log = Log(db, uid)
    t1 = await log.turn([user("a\x00b")], assistant("re\x00ply"))
    t2 = await log.turn([user("a\x00b"), assistant("re\x00ply"), user("and\x00more")],
                        assistant("ok"))
    r1, r2 = turn_row(db_url, t1), turn_row(db_url, t2)
    assert r1["state"] == "continued" and r1["next_turn_id"] == r2["id"]
    assert r1["next_state"] == [user("and\ufffdmore")]
    stored = query(db_url, "SELECT response_message->>'content' FROM turns WHERE uid = %s",
                   uuid.UUID(t1))
    assert stored[0][0] == "re\ufffdply"


async def test_tool_rounds_attach_all_tool_results(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "bob")
    log = Log(db, uid)
    calls = [call("call_a", "weather", '{"city": "Oslo"}'),
             call("call_b", "weather", '{"city": "Rome"}')]
    first = [user("weather in Oslo and Rome?")]
    t1 = await log.turn(first, assistant("", calls))
    results = [tool("call_a", '{"temp": 3}'), tool("call_b", '{"temp": 18}')]
    # The client echoes the assistant message with content null, as the OpenAI SDK does.
    echoed = {"role": "assistant", "content": None, "tool_calls": calls}
    t2 = await log.turn([*first, echoed, *results], assistant("Oslo 3C, Rome 18C"))
    r1, r2 = turn_row(db_url, t1), turn_row(db_url, t2)
    assert r1["state"] == "continued" and r1["next_state"] == results
    assert r2["session_id"] == r1["session_id"] and r2["index_in_session"] == 1
    assert judge_jobs(db_url) == [r1["id"]]


async def test_edited_or_truncated_history_is_no_match(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "carol")
    log = Log(db, uid)
    t1 = await log.turn([user("a"), assistant("b"), user("c")], assistant("d"))
    # Edited earlier message, and a client that dropped the oldest messages.
    edited = await log.turn([user("a!"), assistant("b"), user("c"), assistant("d"),
                             user("e")], assistant("f"))
    truncated = await log.turn([user("c"), assistant("d"), user("e")], assistant("g"))
    r1 = turn_row(db_url, t1)
    assert r1["state"] == "open" and r1["next_state"] is None
    for t in (edited, truncated):
        row = turn_row(db_url, t)
        assert row["session_id"] != r1["session_id"] and row["index_in_session"] == 0
    assert judge_jobs(db_url) == []


async def test_identical_openings_continue_distinct_turns(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "dave")
    log = Log(db, uid)
    opening = [user("hi")]
    a, b = [await log.turn(opening, assistant("hello")) for _ in range(2)]
    # Both sessions continue at once, each from its own connection.
    followups = await asyncio.gather(
        log.turn([*opening, assistant("hello"), user("from session 1")], assistant("x")),
        log.turn([*opening, assistant("hello"), user("from session 2")], assistant("y")))
    ra, rb = turn_row(db_url, a), turn_row(db_url, b)
    assert ra["state"] == rb["state"] == "continued"
    assert {ra["next_turn_id"], rb["next_turn_id"]} == {turn_row(db_url, f)["id"]
                                                        for f in followups}
    assert sorted(m[0]["content"] for m in (ra["next_state"], rb["next_state"])) == [
        "from session 1", "from session 2"]
    assert sorted(judge_jobs(db_url)) == sorted([ra["id"], rb["id"]])
    # A third identical continuation finds no open turn left: a new session.
    late = await log.turn([*opening, assistant("hello"), user("third")], assistant("z"))
    assert turn_row(db_url, late)["index_in_session"] == 0


async def test_side_turns_are_never_continued_or_judged(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "erin")
    log = Log(db, uid)
    main = await log.turn([user("hi")], assistant("hello"))
    side = await log.turn([user("hi"), assistant("hello"), user("Title for this chat?")],
                          assistant("Greetings"), kind="side")
    rm, rs = turn_row(db_url, main), turn_row(db_url, side)
    assert rm["state"] == "open"  # the side turn did not consume it
    assert rs["kind"] == "side" and rs["state"] == "closed" and rs["session_id"] is None
    assert rs["context_fingerprint"] is None
    # ...so the real continuation still attaches to the main turn; a request that merely
    # echoes the side turn's exchange finds nothing to continue.
    nxt = await log.turn([user("hi"), assistant("hello"), user("go on")], assistant("ok"))
    assert turn_row(db_url, main)["next_turn_id"] == turn_row(db_url, nxt)["id"]
    echo = await log.turn([user("hi"), assistant("hello"), user("Title for this chat?"),
                           assistant("Greetings"), user("thanks")], assistant("."))
    assert turn_row(db_url, echo)["index_in_session"] == 0
    assert judge_jobs(db_url) == [rm["id"]]


async def test_explicit_session_and_done(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "frank")
    log = Log(db, uid)
    t1 = await log.turn([user("hi")], assistant("hello"), session_external_id="chat-1")
    r1 = turn_row(db_url, t1)
    assert r1["session_id"] == explicit_session_id(uid, "chat-1")
    # Inside an explicit session only that session's turns are candidates.
    other = await log.turn([user("hi"), assistant("hello"), user("elsewhere")], assistant("."),
                           session_external_id="chat-2")
    assert turn_row(db_url, t1)["state"] == "open"
    assert turn_row(db_url, other)["session_id"] == explicit_session_id(uid, "chat-2")
    t2 = await log.turn([user("hi"), assistant("hello"), user("bye")], assistant("bye"),
                        session_external_id="chat-1", session_done=True)
    r2 = turn_row(db_url, t2)
    assert turn_row(db_url, t1)["next_turn_id"] == r2["id"]
    assert r2["session_id"] == r1["session_id"] and r2["index_in_session"] == 1
    assert r2["state"] == "closed"  # the session is done: nothing will follow
    [(closed_at,)] = query(db_url, "SELECT closed_at FROM sessions WHERE id = %s",
                           r1["session_id"])
    assert closed_at is not None


async def test_an_explicit_session_attaches_by_id_when_no_prefix_matches(
        db: AsyncEngine, db_url: str) -> None:
    """A client that names its session but sends only the new message (or rewrites its
    history) still continues the session's latest open turn; the same request sent again
    (a retry) does not; another session's or another user's turns are never candidates."""
    uid, _ = create_user(db_url, "hana")
    log = Log(db, uid)
    t1 = await log.turn([SYS, user("plan a trip")], assistant("Where to?"),
                        session_external_id="s")
    retry = await log.turn([SYS, user("plan a trip")], assistant("Where to, then?"),
                           session_external_id="s")
    assert turn_row(db_url, t1)["state"] == "open"  # a retry is not its next state
    t2 = await log.turn([user("Lisbon, in May")], assistant("Nice."), session_external_id="s")
    r2 = turn_row(db_url, t2)
    # The latest open turn (the retry) is continued by the new message.
    assert turn_row(db_url, retry)["next_turn_id"] == r2["id"]
    assert turn_row(db_url, retry)["next_state"] == [user("Lisbon, in May")]
    assert r2["session_id"] == explicit_session_id(uid, "s") and r2["index_in_session"] == 2
    # Without a session id, the same bare message starts a session of its own.
    alone = await log.turn([user("Lisbon, in May")], assistant("?"))
    assert turn_row(db_url, alone)["index_in_session"] == 0
    assert turn_row(db_url, t2)["state"] == "open"
    # Another user naming the same session id gets their own session.
    other, _ = create_user(db_url, "ivan")
    theirs = await Log(db, other).turn([user("and June?")], assistant("."),
                                       session_external_id="s")
    assert turn_row(db_url, t2)["state"] == "open"
    assert turn_row(db_url, theirs)["session_id"] == explicit_session_id(other, "s")


async def test_opt_out_and_failed_turns(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "gina", train_opt_out=True)
    log = Log(db, uid, train_opt_out=True)
    t1 = await log.turn([user("hi")], assistant("hello"))
    failed = await log.turn([user("hi"), assistant("hello"), user("q")], None,
                            status="engine_error", error="boom")
    assert turn_row(db_url, t1)["state"] == "open"  # a failed request consumes nothing
    rf = turn_row(db_url, failed)
    assert rf["state"] == "closed" and rf["context_fingerprint"] is None
    await log.turn([user("hi"), assistant("hello"), user("q")], assistant("a"))
    r1 = turn_row(db_url, t1)
    assert r1["state"] == "continued" and r1["next_state"] == [user("q")]
    assert judge_jobs(db_url) == []  # opted out of training: logged, never judged


async def test_stale_turns_are_closed(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "hank")
    log = Log(db, uid)
    old = await log.turn([user("hi")], assistant("hello"),
                         created_at="2020-01-01T00:00:00+00:00")
    fresh = await log.turn([user("yo")], assistant("hey"))
    async with db.begin() as conn:
        assert await close_stale_turns(conn, 3600) == 1
    assert turn_row(db_url, old)["state"] == "closed"
    assert turn_row(db_url, fresh)["state"] == "open"
    late = await log.turn([user("hi"), assistant("hello"), user("still there?")], assistant("."))
    assert turn_row(db_url, old)["next_state"] is None
    assert turn_row(db_url, late)["index_in_session"] == 0


async def test_one_batch_with_a_turn_its_continuation_and_a_duplicate(
        db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "ivan")

    def rec(messages: list[dict[str, Any]], reply: str, uid_: str | None = None) -> TurnRecord:
        return TurnRecord(uid=uid_ or str(uuid.uuid4()), user_id=uid, api_key_id=None,
                          request_messages=messages, params={},
                          response_message=assistant(reply))

    first = rec([user("hi")], "hello")
    second = rec([user("hi"), assistant("hello"), user("more")], "sure")
    async with db.begin() as conn:
        assert await record_turns(conn, [first, second, second],
                                  include_system=False) == 2
    r1, r2 = turn_row(db_url, first.uid), turn_row(db_url, second.uid)
    assert r1["next_turn_id"] == r2["id"] and r2["index_in_session"] == 1
    assert judge_jobs(db_url) == [r1["id"]]
    async with db.begin() as conn:  # the same batch again (a replay) stores nothing
        assert await record_turns(conn, [first, second], include_system=False) == 0
    assert query(db_url, "SELECT count(*) FROM turns") == [(2,)]
