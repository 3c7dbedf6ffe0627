"""Session edge cases seen with real client libraries, through HTTP with the real engine and
Postgres: a session the client ended stays ended, an `X-Session-Id` first sent on a later
turn keeps the conversation one session, and a request without tools stores SQL NULL."""

from __future__ import annotations

from typing import Any

from proxyharness import ProxyFactory, create_user, query

from proxy.sessions import explicit_session_id

HELLO: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]


async def chat(client: Any, messages: list[Any], **headers: str) -> tuple[str, str]:
    """One greedy reply; (its content, its turn id)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="default", messages=messages, max_tokens=3, temperature=0,
        extra_headers=headers)
    return raw.parse().choices[0].message.content or "", raw.headers["x-clawrl-turn-id"]


async def test_a_done_session_stays_done(proxy_factory: ProxyFactory, db_url: str,
                                         engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    user_id, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        reply, _ = await chat(client, HELLO, **{"X-Session-Id": "ep-1"})
        history = [*HELLO, {"role": "assistant", "content": reply}]
        reply2, _ = await chat(client, [*history, {"role": "user", "content": "Bye."}],
                               **{"X-Session-Id": "ep-1", "X-Session-Done": "1"})
        await proxy.settle()
        closed_at = query(db_url, "SELECT closed_at, done_at FROM sessions")
        assert len(closed_at) == 1 and closed_at[0][0] is not None and closed_at[0][1]
        # The same id again, continuing the ended conversation: stored, closed, continuing
        # nothing; the session stays closed.
        late = [*history, {"role": "user", "content": "Bye."},
                {"role": "assistant", "content": reply2}, {"role": "user", "content": "Wait."}]
        await chat(client, late, **{"X-Session-Id": "ep-1"})
    await proxy.settle()
    session = explicit_session_id(user_id, "ep-1")
    assert query(db_url, "SELECT id, closed_at, done_at FROM sessions") == [
        (session, closed_at[0][0], closed_at[0][1])]
    assert query(db_url, "SELECT index_in_session, state, next_state IS NULL FROM turns "
                         "ORDER BY id") == [(0, "continued", False), (1, "closed", True),
                                            (2, "closed", True)]
    assert query(db_url, "SELECT count(*) FROM jobs") == [(1,)]  # the first turn's, only


async def test_a_session_closed_by_the_timeout_reopens(proxy_factory: ProxyFactory,
                                                       db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        reply, _ = await chat(client, HELLO, **{"X-Session-Id": "s"})
        await proxy.settle()
        query(db_url, "UPDATE sessions SET closed_at = now() RETURNING id")  # as the sweep does
        await chat(client, [*HELLO, {"role": "assistant", "content": reply},
                            {"role": "user", "content": "More."}], **{"X-Session-Id": "s"})
    await proxy.settle()
    assert query(db_url, "SELECT closed_at FROM sessions") == [(None,)]


async def test_a_session_id_first_sent_on_the_second_turn_adopts_the_conversation(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    user_id, key = create_user(db_url, "carol")
    async with proxy.client(key) as client:
        reply, _ = await chat(client, HELLO)  # no header: an inferred session
        history = [*HELLO, {"role": "assistant", "content": reply},
                   {"role": "user", "content": "More."}]
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=history, max_tokens=3, temperature=0,
            extra_headers={"X-Session-Id": "late", "X-Session-Outcome": ""})
        reply2 = raw.parse().choices[0].message.content
        await chat(client, [*history, {"role": "assistant", "content": reply2},
                            {"role": "user", "content": "Thanks."}], **{"X-Session-Id": "late"})
    await proxy.settle()
    session = explicit_session_id(user_id, "late")
    assert raw.headers["x-clawrl-session-id"] == str(session)
    assert query(db_url, "SELECT id, external_id FROM sessions") == [(session, "late")]
    assert query(db_url, "SELECT session_id, index_in_session, state FROM turns "
                         "ORDER BY id") == [(session, 0, "continued"), (session, 1, "continued"),
                                            (session, 2, "open")]
    assert query(db_url, "SELECT count(*) FROM jobs WHERE kind = 'judge'") == [(2,)]


async def test_no_tools_is_sql_null(proxy_factory: ProxyFactory, db_url: str,
                                    engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "dave")
    async with proxy.client(key) as client:
        await chat(client, HELLO)
    await proxy.settle()
    assert query(db_url, "SELECT tools IS NULL, jsonb_typeof(tools) FROM turns") == [
        (True, None)]
