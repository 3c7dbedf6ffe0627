"""The next state as the request arrives: the judge job of the turn a request continues is
enqueued before that request's own reply exists (proxy/sessions.py `attach_next_state`,
proxy/store.py `attach_early`).

The storage rules are driven directly, with records shaped as the chat route builds them
(as tests/proxy/test_sessions.py does); what a person's follow-up does is checked on the
real proxy in its own process, in front of the stand-in engine taking seconds per reply.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import create_user, make_keys, query
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import create_async
from clawrl.bench.procs import BenchProcs
from proxy.records import TurnRecord
from proxy.sessions import attach_next_state, record_turns


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async(db_url)
    yield engine
    await engine.dispose()


def record(user_id: int, messages: list[dict[str, Any]], **fields: Any) -> TurnRecord:
    return TurnRecord(uid=str(uuid.uuid4()), user_id=user_id, api_key_id=None,
                      request_messages=messages, params={"model": "default"}, **fields)


async def store(db: AsyncEngine, rec: TurnRecord, reply: str, status: str = "ok") -> None:
    rec.response_message, rec.status = assistant(reply), status
    async with db.begin() as conn:
        assert await record_turns(conn, [rec], include_system=False) == 1


async def arrive(db: AsyncEngine, rec: TurnRecord) -> bool:
    async with db.begin() as conn:
        return await attach_next_state(conn, rec, include_system=False)


def row(db_url: str, uid: str) -> dict[str, Any]:
    cols = ("id", "session_id", "index_in_session", "state", "next_state", "next_turn_id")
    found = query(db_url, f"SELECT {', '.join(cols)} FROM turns WHERE uid = %s",
                  uuid.UUID(uid))
    assert found, f"turn {uid} not stored"
    return dict(zip(cols, found[0], strict=True))


def judge_jobs(db_url: str) -> list[int]:
    return [r[0] for r in query(db_url, "SELECT turn_id FROM jobs WHERE kind = 'judge' "
                                        "ORDER BY id")]


async def test_a_follow_up_is_judged_as_it_arrives_and_once(db: AsyncEngine,
                                                              db_url: str) -> None:
    uid, _ = create_user(db_url, "early")
    first = record(uid, [user("how do I boil an egg?")])
    await store(db, first, "Put it in boiling water for nine minutes.")
    follow = record(uid, [user("how do I boil an egg?"),
                          assistant("Put it in boiling water for nine minutes."),
                          user("too long, one line please")])
    assert await arrive(db, follow)
    r1 = row(db_url, first.uid)
    # Judgeable now, while the follow-up's reply is still to come; the turn stays open.
    assert r1["next_state"] == [user("too long, one line please")] and r1["state"] == "open"
    assert judge_jobs(db_url) == [r1["id"]]
    assert not await arrive(db, follow)  # the same request again attaches nothing more
    await store(db, follow, "Boil it nine minutes.")
    r1, r2 = row(db_url, first.uid), row(db_url, follow.uid)
    assert r1["state"] == "continued" and r1["next_turn_id"] == r2["id"]
    assert r2["session_id"] == r1["session_id"] and r2["index_in_session"] == 1
    assert judge_jobs(db_url) == [r1["id"]]  # no second job when it is stored


async def test_a_failed_reply_leaves_the_turn_for_the_retry(db: AsyncEngine,
                                                            db_url: str) -> None:
    uid, _ = create_user(db_url, "retry")
    first = record(uid, [user("name a river")])
    await store(db, first, "The Nile.")
    messages = [user("name a river"), assistant("The Nile."), user("another one")]
    failed = record(uid, messages)
    assert await arrive(db, failed)
    await store(db, failed, "", status="error")  # the engine failed this reply
    assert row(db_url, first.uid)["state"] == "open"
    retry = record(uid, messages)
    assert not await arrive(db, retry)  # judged already, on the same next state
    await store(db, retry, "The Danube.")
    r1, r3 = row(db_url, first.uid), row(db_url, retry.uid)
    assert r1["state"] == "continued" and r1["next_turn_id"] == r3["id"]
    assert r3["session_id"] == r1["session_id"]
    assert judge_jobs(db_url) == [r1["id"]]


async def test_a_request_before_its_turn_is_stored_leaves_older_turns_alone(
        db: AsyncEngine, db_url: str) -> None:
    """A reply is sent before its turn commits, so the next request can arrive first: its
    conversation then matches only an older turn, by a shorter prefix, which it must not
    take (the store, in served order, continues the right turn)."""
    uid, _ = create_user(db_url, "quick")
    first = record(uid, [user("hi")])
    await store(db, first, "Hello!")
    second = record(uid, [user("hi"), assistant("Hello!"), user("more")])
    assert await arrive(db, second)
    third = record(uid, [user("hi"), assistant("Hello!"), user("more"),
                         assistant("Here is more."), user("thanks")])
    assert not await arrive(db, third)  # the second turn is not stored yet
    assert row(db_url, first.uid)["next_state"] == [user("more")]
    await store(db, second, "Here is more.")
    await store(db, third, "You're welcome.")
    r1, r2, r3 = (row(db_url, r.uid) for r in (first, second, third))
    assert r1["next_turn_id"] == r2["id"] and r2["next_turn_id"] == r3["id"]
    assert r2["next_state"] == [user("thanks")]
    assert r1["session_id"] == r2["session_id"] == r3["session_id"]
    assert judge_jobs(db_url) == [r1["id"], r2["id"]]


async def test_what_arrives_early_attaches_nothing(db: AsyncEngine, db_url: str) -> None:
    uid, _ = create_user(db_url, "none")
    opted, _ = create_user(db_url, "opted", train_opt_out=True)
    first = record(uid, [user("hi")])
    await store(db, first, "Hello!")
    later = [user("hi"), assistant("Hello!"), user("and you?")]
    assert not await arrive(db, record(uid, later, kind="side"))
    assert not await arrive(db, record(uid, later, group_id=str(uuid.uuid4()), group_index=1))
    assert not await arrive(db, record(uid, [user("something new")]))  # continues nothing
    assert not await arrive(db, record(opted, later, train_opt_out=True))
    # A session the client ended attaches nothing, though its turn matches.
    done = record(uid, [user("bye")], session_external_id="s1", session_done=True)
    await store(db, done, "Goodbye.")
    assert not await arrive(db, record(uid, [user("bye"), assistant("Goodbye."),
                                             user("wait")], session_external_id="s1"))
    assert row(db_url, first.uid)["next_state"] is None and judge_jobs(db_url) == []


# --- through the real proxy -------------------------------------------------------------


@pytest.fixture
def procs(db_url: str, tmp_path: Path) -> Iterator[BenchProcs]:
    with BenchProcs(db_url, tmp_path) as running:
        yield running


def chat_body(messages: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "default", "max_tokens": 8, "messages": messages}).encode()


async def test_the_judge_job_exists_while_the_follow_ups_reply_is_generated(
        procs: BenchProcs, db_url: str) -> None:
    keys = await make_keys(db_url, person={"max_concurrent": 0})
    headers = {"Authorization": f"Bearer {keys['person']}"}
    async with httpx.AsyncClient(base_url=procs.proxy_url, timeout=60) as client:
        procs.configure(reply_s=0.0, tokens=8)
        asked = [user("what is a good name for a cat?")]
        first = await client.post("/v1/chat/completions", content=chat_body(asked),
                                  headers=headers)
        assert first.status_code == 200, first.text
        first_uid = uuid.UUID(first.headers["x-clawrl-turn-id"])
        reply = first.json()["choices"][0]["message"]
        for _ in range(100):  # the writer stores a turn within ~50 ms
            if query(db_url, "SELECT 1 FROM turns WHERE uid = %s", first_uid):
                break
            await asyncio.sleep(0.05)
        procs.configure(reply_s=4.0, tokens=8)  # the follow-up's reply takes 4 s
        sent = time.monotonic()
        follow = asyncio.create_task(client.post(
            "/v1/chat/completions", headers=headers,
            content=chat_body([*asked, {"role": "assistant", "content": reply["content"]},
                               user("shorter please")])))
        jobs: list[tuple[Any, ...]] = []
        while not follow.done() and not jobs:
            jobs = query(db_url, "SELECT j.id FROM jobs j JOIN turns t ON t.id = j.turn_id "
                                 "WHERE j.kind = 'judge' AND t.uid = %s", first_uid)
            await asyncio.sleep(0.05)
        enqueued_after = time.monotonic() - sent
        answered = await follow
        assert answered.status_code == 200
        assert jobs, "no judge job before the follow-up's reply was done"
        assert enqueued_after < 3.0, enqueued_after
        second_uid = uuid.UUID(answered.headers["x-clawrl-turn-id"])
        for _ in range(100):
            if query(db_url, "SELECT 1 FROM turns WHERE uid = %s", second_uid):
                break
            await asyncio.sleep(0.05)
    rows = query(db_url, "SELECT t.state, t.next_turn_id = n.id, t.next_state "
                         "FROM turns t JOIN turns n ON n.uid = %s WHERE t.uid = %s",
                 second_uid, first_uid)
    assert rows == [("continued", True, [user("shorter please")])]
    assert len(query(db_url, "SELECT 1 FROM jobs j JOIN turns t ON t.id = j.turn_id "
                             "WHERE j.kind = 'judge' AND t.uid = %s", first_uid)) == 1
