"""Never lose a turn: with Postgres cut off the proxy keeps serving, journals turns locally
and replays them in order — exactly once — when the database is back.

The outage is real: the proxy reaches Postgres through a TCP relay that the test cuts
(open connections dropped, new ones refused) and restores.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from proxyharness import ProxyFactory, TcpRelay, create_user, query
from sqlalchemy.engine import make_url

from proxy.journal import Journal
from proxy.records import TurnRecord


async def wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def test_outage_journal_and_replay(proxy_factory: ProxyFactory, db_url: str,
                                         engine_url: str) -> None:
    url = make_url(db_url)
    relay = TcpRelay(url.host or "127.0.0.1", url.port or 5432)
    await relay.start()
    via_relay = url.set(port=relay.port).render_as_string(hide_password=False)
    proxy = await proxy_factory(engine_url, db_url_override=via_relay)
    writer = proxy.app.state.writer
    writer.retry_s = 0.2
    _, key = create_user(db_url, "alice")
    ask = {"model": "default", "temperature": 0, "max_tokens": 4}
    try:
        async with proxy.client(key) as client:
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            first = await client.chat.completions.create(messages=messages, **ask)
            await proxy.settle()
            assert query(db_url, "SELECT count(*) FROM turns") == [(1,)]

            await relay.stop()  # Postgres is unreachable from here on
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "go on"}]
            served = [await client.chat.completions.with_raw_response.create(
                messages=messages, **ask)]
            served.append(await client.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": "other"}], stream=True, **ask))
            async for _ in served[1].parse():
                pass
            await proxy.settle(stored=False)
            assert writer.journal.pending == 2
            assert query(db_url, "SELECT count(*) FROM turns") == [(1,)]
            async with httpx.AsyncClient(base_url=proxy.url) as http:
                assert "clawrl_journal_turns 2.0" in (await http.get("/metrics")).text

            await relay.start()  # back: the journal is replayed in order
            await wait_for(lambda: writer.journal.pending == 0)
    finally:
        await relay.stop()

    uids = [r.headers["x-clawrl-turn-id"] for r in served]
    rows = query(db_url, "SELECT uid::text, status, state, next_state FROM turns ORDER BY id")
    assert [r[0] for r in rows[1:]] == uids  # stored in the order served
    assert all(r[1] == "ok" for r in rows)
    # Session inference ran on replay: the second turn continued the first.
    assert rows[0][2] == "continued" and rows[0][3] == [{"role": "user", "content": "go on"}]
    assert query(db_url, "SELECT count(*) FROM jobs WHERE kind = 'judge'") == [(1,)]
    assert not writer.journal.has_data() and writer.journal.segments() == []


async def test_replay_is_idempotent(proxy_factory: ProxyFactory, db_url: str,
                                    engine_url: str, tmp_path: Path) -> None:
    """A journal left by a proxy that died between storing turns and removing the segment
    is replayed at the next start: nothing is stored twice, the missing turns are stored."""
    proxy = await proxy_factory(engine_url)
    user_id, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    await proxy.settle()
    stored_uid = raw.headers["x-clawrl-turn-id"]
    again = TurnRecord(uid=stored_uid, user_id=user_id, api_key_id=None,
                       request_messages=[{"role": "user", "content": "hi"}], params={},
                       response_message={"role": "assistant", "content": "x"})
    new = TurnRecord(uid="00000000-0000-4000-8000-000000000001", user_id=user_id,
                     api_key_id=None, request_messages=[{"role": "user", "content": "yo"}],
                     params={}, response_message={"role": "assistant", "content": "y"})
    journal = Journal(tmp_path / "left-over")
    journal.append([again, new, new])
    restarted = await proxy_factory(engine_url, journal_path=journal.path)
    await wait_for(lambda: restarted.app.state.writer.journal.pending == 0)
    rows = query(db_url, "SELECT uid::text FROM turns ORDER BY id")
    assert [r[0] for r in rows] == [stored_uid, new.uid]
    assert not journal.has_data()
