"""The turn writer never stops for one record: a record that breaks storing is isolated
(dead letter, counted), the writer is supervised, its queue is bounded (spilling to the
journal) and /readyz tells when it is down or behind.

Real HTTP through the proxy, real Postgres, the real embedded engine. Faults are injected
through real interfaces: a Postgres trigger that refuses some rows, a table lock that stalls
the writer, a journal file written by hand, cancelling the writer's task.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import psycopg
import pytest
from proxyharness import ProxyFactory, RunningProxy, create_user, libpq, query, turns_locked

from proxy.journal import Journal
from proxy.records import TurnRecord

CHAT = "/v1/chat/completions"
ASK: dict[str, Any] = {"model": "default", "temperature": 0, "max_tokens": 2}


def say(text: str) -> dict[str, Any]:
    return {**ASK, "messages": [{"role": "user", "content": text}]}


def deep_tool_call(depth: int = 3000) -> list[dict[str, Any]]:
    """A conversation whose earlier assistant turn called a tool with absurdly nested
    arguments (the issue's reproduction: json.loads hit RecursionError in the writer)."""
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "[" * depth}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "and now?"}]


def execute(db_url: str, sql: str) -> None:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        conn.execute(sql.encode())


async def wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def metric(proxy: RunningProxy, name: str) -> float:
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        for line in (await http.get("/metrics")).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def test_nested_tool_arguments_do_not_stop_the_writer(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "mallory")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        assert (await http.post(CHAT, json=say("a"))).status_code == 200
        hostile = await http.post(CHAT, json={**ASK, "messages": deep_tool_call()})
        assert hostile.status_code == 400, hostile.text
        assert hostile.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"
        for i in range(3):
            assert (await http.post(CHAT, json=say(f"after {i}"))).status_code == 200
        await proxy.settle()
        assert (await http.get("/readyz")).json()["turn_writer"] == "up"
    assert query(db_url, "SELECT count(*) FROM turns") == [(4,)]


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow-db"])
async def test_refused_record_is_a_dead_letter(proxy_factory: ProxyFactory,
                                              db_url: str, engine_url: str,
                                              slow: bool) -> None:
    """A turn the database refuses is kept in dead_letters (raw JSON + error), counted in
    /metrics; the turns around it, in the same batch, are stored. With the database slow,
    the guard journals the batch while it is being stored, so the refused turn is refused
    twice (as stored, then replayed): still one dead letter."""
    execute(db_url, f"""
        CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          PERFORM pg_sleep({0.3 if slow else 0});
          IF NEW.request_messages::text LIKE '%poison%' THEN
            RAISE EXCEPTION 'refusing this turn';
          END IF;
          RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_poison BEFORE INSERT ON turns
          FOR EACH ROW EXECUTE FUNCTION refuse_poison();""")
    proxy = await proxy_factory(engine_url)
    writer = proxy.app.state.writer
    # Fast: the guard never journals, so the turn is refused once, on the store path (on a
    # loaded machine storing a batch can take longer than the 50 ms default; CI saw that).
    # Slow: the guard journals the batch while it is being stored.
    writer.durable_within_s = 0.05 if slow else 3600.0
    user_id, key = create_user(db_url, "mallory")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        if slow:  # the poison turn alone in the batch the guard journals while stored
            replies = [await http.post(CHAT, json=say("poison"))]
            replies += await asyncio.gather(*(http.post(CHAT, json=say(text))
                                              for text in ("one", "two", "three")))
        else:
            replies = await asyncio.gather(*(http.post(CHAT, json=say(text)) for text in
                                             ("one", "poison", "two", "three")))
        assert [r.status_code for r in replies] == [200] * 4
        await proxy.settle()
        assert (await http.get("/readyz")).status_code == 200
    poison_uid = replies[0 if slow else 1].headers["x-clawrl-turn-id"]
    assert query(db_url, "SELECT count(*) FROM turns") == [(3,)]
    [(payload, error)] = query(db_url, "SELECT payload, error FROM dead_letters "
                                       "WHERE kind = 'turn'")
    record = json.loads(payload)
    assert record["uid"] == poison_uid and record["user_id"] == user_id
    assert record["request_messages"] == [{"role": "user", "content": "poison"}]
    assert "refusing this turn" in error
    assert await metric(proxy, "clawrl_dead_letters_total") == 1.0
    assert (writer.rescued > 0) == slow


async def test_writer_is_restarted(proxy_factory: ProxyFactory, db_url: str,
                                   engine_url: str) -> None:
    """The writer task ending unexpectedly is noticed, counted and undone."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "alice")
    writer = proxy.app.state.writer
    assert writer._worker is not None
    writer._worker.cancel()  # the fault: the task dies as if by an unforeseen error
    await wait_for(lambda: writer.restarts == 1 and writer.alive)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        assert (await http.post(CHAT, json=say("still logged?"))).status_code == 200
        await proxy.settle()
        assert (await http.get("/readyz")).status_code == 200
    assert query(db_url, "SELECT count(*) FROM turns") == [(1,)]
    assert await metric(proxy, "clawrl_turn_writer_restarts_total") == 1.0
    assert await metric(proxy, "clawrl_turn_writer_up") == 1.0


async def test_turns_the_guard_journals_while_the_writer_sleeps_are_stored_at_once(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    """On a starved event loop the guard can journal a turn (the database looked slow) before
    the writer, asleep on its empty queue, ever took it: the writer must wake and replay it
    then, not when the next turn arrives. Seen in CI: an outcome posted for such a session
    waited out its 30 s wait for the writer (`wait_queued`) and the client timed out."""
    proxy = await proxy_factory(engine_url)
    writer = proxy.app.state.writer
    user_id, _ = create_user(db_url, "alice")
    await proxy.settle()
    await asyncio.sleep(0.2)  # the writer is asleep on the empty queue (for up to 30 s)
    record = TurnRecord(uid="00000000-0000-4000-8000-0000000000aa", user_id=user_id,
                        api_key_id=None, request_messages=[{"role": "user", "content": "hi"}],
                        params={}, response_message={"role": "assistant", "content": "yo"})
    writer.submit(record)
    assert writer._rescue()  # the guard's move, before the writer's task runs again
    assert writer.journal.pending == 1 and writer.rescued == 1
    started = asyncio.get_running_loop().time()
    await wait_for(lambda: writer.journal.pending == 0, timeout_s=10)
    await writer.wait_queued(timeout_s=10)
    assert asyncio.get_running_loop().time() - started < 10
    assert query(db_url, "SELECT uid::text FROM turns") == [(record.uid,)]


async def test_backlog_bound_spills_to_journal_and_unreadies(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    """With the writer stalled (a lock held on `turns`), the queue stops at its bound: later
    turns go to the journal, /readyz answers 503; all are stored, in order, after."""
    proxy = await proxy_factory(engine_url, turn_backlog_max=2)
    writer = proxy.app.state.writer
    writer.retry_s = 0.2
    writer.durable_within_s = 600.0  # the bound alone (the guard would journal them first)
    _, key = create_user(db_url, "alice")
    with turns_locked(db_url):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            served = []
            for i in range(5):
                reply = await http.post(CHAT, json=say(f"turn {i}"))
                assert reply.status_code == 200
                served.append(reply.headers["x-clawrl-turn-id"])
            await wait_for(lambda: writer.backlog >= 1 and writer.journal.pending >= 2)
            assert writer.spilled >= 2 and writer.backlog < writer.backlog_max
            spilled = await metric(proxy, "clawrl_turns_spilled_total")
            assert spilled == writer.spilled
    await wait_for(lambda: writer.backlog == 0 and writer.journal.pending == 0)
    rows = query(db_url, "SELECT uid::text FROM turns ORDER BY id")
    assert [r[0] for r in rows] == served


async def test_unready_while_backlog_full(proxy_factory: ProxyFactory, db_url: str,
                                          engine_url: str) -> None:
    proxy = await proxy_factory(engine_url, turn_backlog_max=1)
    writer = proxy.app.state.writer
    writer.durable_within_s = 600.0  # the bound alone (the guard would journal them first)
    _, key = create_user(db_url, "alice")
    with turns_locked(db_url):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            assert (await http.post(CHAT, json=say("stuck"))).status_code == 200
            await wait_for(lambda: writer.backlog == 1)
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["turn_log_backlog"] == 1
    await proxy.settle()
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        assert (await http.get("/readyz")).status_code == 200


async def test_journal_bad_lines_and_legacy_records(proxy_factory: ProxyFactory, db_url: str,
                                                    engine_url: str, tmp_path: Any) -> None:
    """A journal left by an older proxy, holding a torn line and a record whose tool-call
    arguments nest 3,000 deep, is replayed: the record is stored, the torn line becomes a
    dead letter, the writer keeps going."""
    user_id, _ = create_user(db_url, "old")
    deep = TurnRecord(uid="00000000-0000-4000-8000-000000000001", user_id=user_id,
                      api_key_id=None, request_messages=deep_tool_call(),
                      params={}, response_message={"role": "assistant", "content": "y"})
    fine = TurnRecord(uid="00000000-0000-4000-8000-000000000002", user_id=user_id,
                      api_key_id=None, request_messages=[{"role": "user", "content": "yo"}],
                      params={}, response_message={"role": "assistant", "content": "z"})
    legacy = tmp_path / "old-journal.jsonl"
    legacy.write_bytes(json.dumps(deep.to_json()).encode() + b"\n{\"uid\": \"torn\n"
                       + json.dumps(fine.to_json()).encode() + b"\n")
    proxy = await proxy_factory(engine_url, journal_path=legacy)
    writer = proxy.app.state.writer
    await wait_for(lambda: writer.journal.pending == 0)
    assert [r[0] for r in query(db_url, "SELECT uid::text FROM turns ORDER BY id")] == [
        deep.uid, fine.uid]
    assert query(db_url, "SELECT kind FROM dead_letters") == [("journal_line",)]
    assert writer.alive and isinstance(writer.journal, Journal)
