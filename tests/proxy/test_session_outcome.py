"""Session outcomes through the real proxy app, the real embedded engine and Postgres:
`POST /v1/sessions/{id}/outcome`, the `X-Session-Outcome` header, their errors, and what an
analyst sees of them through `clawrl sql` (migration 0007)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, create_user, query

from clawrl.cli.main import main as clawrl
from proxy.auth import VERIFIER

ASK: list[Any] = [{"role": "user", "content": "Who keeps the bakery?"}]


async def _episode(proxy: Any, key: str, session: str, *, last: dict[str, str] | None = None,
                   ) -> tuple[str, list[str]]:
    """Two requests of one agent session (`X-Session-Id: session`); the second one carries
    `last` as extra headers. Returns the proxy's session UUID and both turn ids."""
    uids = []
    async with proxy.client(key) as client:
        messages = list(ASK)
        for headers in ({"X-Session-Id": session}, {"X-Session-Id": session, **(last or {})}):
            raw = await client.chat.completions.with_raw_response.create(
                model="default", messages=messages, max_tokens=3, extra_headers=headers)
            reply = raw.parse().choices[0].message.content or ""
            uids.append(raw.headers["x-clawrl-turn-id"])
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": "And the mill?"}]
    return raw.headers["x-clawrl-session-id"], uids


def _session(db_url: str, session_id: str) -> tuple[Any, ...]:
    rows = query(db_url, "SELECT s.outcome, s.outcome_source, k.prefix, s.outcome_at IS NOT NULL "
                 "FROM sessions s LEFT JOIN api_keys k ON k.id = s.outcome_key_id "
                 "WHERE s.id = %s", uuid.UUID(session_id))
    assert len(rows) == 1
    return rows[0]


async def test_outcome_by_either_id_last_one_wins(proxy_factory: ProxyFactory, db_url: str,
                                                 engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "vera", scopes=[VERIFIER])
    session_id, _ = await _episode(proxy, key, "episode-1")
    prefix = query(db_url, "SELECT prefix FROM api_keys")[0][0]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        # Right after the last reply (its turn may still be queued): by the client's own id.
        by_ext = await http.post("/v1/sessions/episode-1/outcome", json={"outcome": 1})
        assert by_ext.status_code == 200, by_ext.text
        assert by_ext.json() == {"object": "session.outcome", "session_id": session_id,
                                 "outcome": 1.0, "source": "api"}
        assert _session(db_url, session_id) == (1.0, "api", prefix, True)
        # By the proxy's UUID (X-Clawrl-Session-Id): a verifier correcting itself.
        by_uuid = await http.post(f"/v1/sessions/{session_id}/outcome",
                                  json={"outcome": -0.25})
        assert by_uuid.status_code == 200 and by_uuid.json()["outcome"] == -0.25
    assert _session(db_url, session_id) == (-0.25, "api", prefix, True)


async def test_outcome_errors_are_openai_shaped(proxy_factory: ProxyFactory, db_url: str,
                                               engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "walt", scopes=[VERIFIER])
    _, other_key = create_user(db_url, "mallory", scopes=[VERIFIER])
    session_id, _ = await _episode(proxy, key, "mine")
    await proxy.settle()
    mine = {"Authorization": f"Bearer {key}"}
    theirs = {"Authorization": f"Bearer {other_key}"}
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        for body in ({"outcome": 1.5}, {"outcome": -1.0001}, {"outcome": "1"},
                     {"outcome": True}, {"outcome": None}, {}, {"outcome": 1, "extra": 2},
                     b'{"outcome": NaN}', b'{"outcome": 1e999}', b"not json", b"[1]"):
            kw: dict[str, Any] = ({"content": body} if isinstance(body, bytes)
                                  else {"json": body})
            response = await http.post("/v1/sessions/mine/outcome", headers=mine, **kw)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], error
        # Unknown, and another user's (by either id): the same 404, nothing revealed.
        answers = []
        for ref, headers in (("nope", mine), (str(uuid.uuid4()), mine), ("mine", theirs),
                             (session_id, theirs), ("x" * 300, mine)):
            response = await http.post(f"/v1/sessions/{ref}/outcome", headers=headers,
                                       json={"outcome": 1})
            assert response.status_code == 404, (ref, response.text)
            error = response.json()["error"]
            assert error["code"] == "session_not_found" and error["type"] == \
                "invalid_request_error"
            answers.append(error["message"].replace(ref, "REF"))
        assert len(set(answers)) == 1
        no_key = await http.post("/v1/sessions/mine/outcome", json={"outcome": 1})
        assert no_key.status_code == 401 and no_key.json()["error"]["type"] == \
            "authentication_error"
    assert _session(db_url, session_id) == (None, None, None, False)


async def test_outcome_header_on_the_last_request(proxy_factory: ProxyFactory, db_url: str,
                                                  engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "xena", scopes=[VERIFIER])
    session_id, uids = await _episode(
        proxy, key, "agent-7", last={"X-Session-Outcome": "-1", "X-Session-Done": "1"})
    await proxy.settle()
    prefix = query(db_url, "SELECT prefix FROM api_keys")[0][0]
    assert _session(db_url, session_id) == (-1.0, "header", prefix, True)
    assert query(db_url, "SELECT closed_at IS NOT NULL FROM sessions") == [(True,)]
    # A bad header is refused before the engine is called: nothing is stored.
    async with proxy.client(key) as client:
        for bad in ("2", "nan", "inf", "one", "0x1", "1_0", "-1.5"):
            with pytest.raises(Exception) as caught:
                await client.chat.completions.create(
                    model="default", messages=ASK, max_tokens=3,
                    extra_headers={"X-Session-Id": "agent-8", "X-Session-Outcome": bad})
            assert getattr(caught.value, "status_code", None) == 400, bad
            assert "X-Session-Outcome" in str(caught.value)
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(2,)]
    # An outcome on a request of an inferred session (no X-Session-Id) sets that session's.
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": "Hi."}], max_tokens=3,
            extra_headers={"X-Session-Outcome": "0.5"})
    await proxy.settle()
    rows = query(db_url, "SELECT s.outcome, s.outcome_source FROM turns t "
                 "JOIN sessions s ON s.id = t.session_id WHERE t.uid = %s",
                 uuid.UUID(raw.headers["x-clawrl-turn-id"]))
    assert rows == [(0.5, "header")]


async def test_only_a_verifier_key_sets_an_outcome(proxy_factory: ProxyFactory,
                                                  db_url: str, engine_url: str) -> None:
    """An ordinary user's key cannot reward its own sessions: the route and the header
    answer 403 `missing_scope`, and the header's request is refused whole, before the
    engine (nothing stored, no turn, no session)."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "ursula")
    session_id, _ = await _episode(proxy, key, "self-graded")
    await proxy.settle()
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        for ref in ("self-graded", session_id):
            posted = await http.post(f"/v1/sessions/{ref}/outcome", json={"outcome": 1})
            assert posted.status_code == 403, posted.text
            error = posted.json()["error"]
            assert error["code"] == "missing_scope" and error["type"] == "permission_error"
            assert "verifier" in error["message"]
        for path, body in (("/v1/chat/completions", {"model": "default", "messages": ASK,
                                                     "max_tokens": 3}),
                           ("/v1/responses", {"model": "default", "input": "Who keeps the bakery?",
                                              "max_output_tokens": 3})):
            for stream in (False, True):
                sent = await http.post(path, json={**body, "stream": stream}, headers={
                    "X-Session-Id": "one-turn", "X-Session-Outcome": "1",
                    "X-Session-Done": "1"})
                assert sent.status_code == 403, (path, stream, sent.text)
                assert sent.json()["error"]["code"] == "missing_scope"
        # Feedback stays every user's: evidence for the judge, not a reward.
        feedback = await http.post("/v1/feedback", json={"turn_id": _last_uid(db_url),
                                                         "rating": 1})
        assert feedback.status_code == 200, feedback.text
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(2,)]
    assert query(db_url, "SELECT external_id, outcome FROM sessions") == [("self-graded", None)]


def _last_uid(db_url: str) -> str:
    return str(query(db_url, "SELECT uid FROM turns ORDER BY id DESC LIMIT 1")[0][0])


async def test_analysts_read_outcomes_in_sql(proxy_factory: ProxyFactory, db_url: str,
                                            engine_url: str, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`clawrl sql` (the read-only `clawrl_sql` role) sees the outcome columns and views."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "yuri", scopes=[VERIFIER])
    session_id, uids = await _episode(proxy, key, "graded")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        response = await http.post("/v1/sessions/graded/outcome", json={"outcome": 0.75},
                                   headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200
    await proxy.settle()
    monkeypatch.setenv("CLAWRL_DATABASE__URL", db_url)
    capsys.readouterr()
    for sql, expected in [
        ("SELECT session_id, user_name, external_id, outcome, outcome_source, turns, judged, "
         "trained_samples FROM session_outcomes",
         [f"{session_id},yuri,graded,0.75,api,2,0,0"]),
        ("SELECT turn_id, session_outcome FROM turns_with_rewards ORDER BY turn_id",
         ["1,0.75", "2,0.75"]),
        ("SELECT index_in_session, session_outcome FROM session_turns ORDER BY 1",
         ["0,0.75", "1,0.75"]),
        ("SELECT outcome, outcome_source, outcome_key_id IS NOT NULL FROM sessions",
         ["0.75,api,True"]),
        ("SELECT count(outcome) FROM samples", ["0"]),
    ]:
        assert clawrl(["sql", "--csv", sql]) == 0
        out, err = capsys.readouterr()
        assert err == "" and out.splitlines()[1:] == expected, (sql, out, err)


async def test_an_outcome_waits_for_turns_the_writer_journaled(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    """The database stalls (a lock on `turns`) with another turn in flight while an agent's
    session is served: the writer journals the session's turns to keep them durable. Its
    outcome, posted then, waits past the turn in flight until the journal is replayed, and
    finds the session (it was answered 404: the session's turns had left the queue, but for
    the journal, and the outcome looked as soon as the turn in flight was stored)."""
    import asyncio

    from proxyharness import turns_locked

    proxy = await proxy_factory(engine_url)
    writer = proxy.app.state.writer
    writer.durable_within_s = 0.2  # journal what the database has not taken within 0.2 s
    _, key = create_user(db_url, "otto", scopes=[VERIFIER])
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        with turns_locked(db_url):
            first = await http.post("/v1/chat/completions", json={
                "model": "default", "messages": ASK, "max_tokens": 2})
            assert first.status_code == 200  # its turn is in flight, stuck on the lock
            await asyncio.sleep(0.5)
            session_id, _ = await _episode(proxy, key, "stalled-episode")
            for _ in range(100):  # the guard journals the session's turns
                if writer.journal.pending >= 2:
                    break
                await asyncio.sleep(0.05)
            assert writer.journal.pending >= 2
            posted = asyncio.create_task(http.post("/v1/sessions/stalled-episode/outcome",
                                                   json={"outcome": 0.5}))
            await asyncio.sleep(0.5)
            assert not posted.done()  # waiting for the turns, not answered 404
        reply = await posted
    assert reply.status_code == 200, reply.text
    assert _session(db_url, session_id)[0] == 0.5
