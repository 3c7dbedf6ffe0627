"""End to end through the official openai SDK: proxy + real embedded engine + real Postgres.

Greedy decoding (temperature 0) makes the tiny model deterministic, so the token ids the
proxy logged can be compared with what the engine returns when asked directly.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from proxyharness import ProxyFactory, create_user, query

MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Tell me about the sea."}]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


def direct(engine_url: str, messages: list[Any], **kw: Any) -> dict[str, Any]:
    """Ask the engine itself (no proxy) for the same greedy completion and its ids."""
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": 8,
            "return_token_ids": True, **kw}
    data: dict[str, Any] = httpx.post(f"{engine_url}/v1/chat/completions", json=body,
                                      timeout=60).json()
    return data["choices"][0]


def turn(db_url: str, uid: str) -> dict[str, Any]:
    cols = ("user_id", "status", "kind", "request_messages", "tools", "params",
            "response_message", "prompt_ids", "response_ids", "response_logprobs",
            "weight_version", "finish_reason", "latency_ms", "error", "session_id", "state",
            "next_state", "index_in_session")
    rows = query(db_url, f"SELECT {', '.join(cols)} FROM turns WHERE uid = %s", uuid.UUID(uid))
    assert len(rows) == 1
    return dict(zip(cols, rows[0], strict=True))


async def test_non_streaming_logs_engine_ids(proxy_factory: ProxyFactory, db_url: str,
                                             engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    user_id, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=MESSAGES, temperature=0, max_tokens=8, seed=1)
        completion = raw.parse()
    uid = raw.headers["x-clawrl-turn-id"]
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.logprobs is None  # the proxy asked for logprobs, the client did not
    extra = choice.model_extra or {}
    assert "response_token_ids" not in extra and "prompt_token_ids" not in extra
    assert completion.usage is not None and completion.usage.completion_tokens >= 1

    await proxy.settle()
    row = turn(db_url, uid)
    engine = direct(engine_url, MESSAGES)
    assert row["user_id"] == user_id and row["status"] == "ok" and row["kind"] == "main"
    assert row["request_messages"] == MESSAGES
    assert row["prompt_ids"] == engine["prompt_token_ids"]
    assert row["response_ids"] == engine["response_token_ids"]
    assert len(row["response_logprobs"]) == len(row["response_ids"])
    assert all(lp <= 0 for lp in row["response_logprobs"])
    assert row["response_message"]["content"] == choice.message.content
    assert row["finish_reason"] == choice.finish_reason
    assert row["weight_version"] == "default"
    assert row["params"]["temperature"] == 0 and row["params"]["seed"] == 1
    assert row["latency_ms"] > 0 and row["error"] is None
    assert row["state"] == "open" and row["session_id"] is not None


async def test_streaming_with_usage(proxy_factory: ProxyFactory, db_url: str,
                                    engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=MESSAGES, temperature=0, max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        uid = raw.headers["x-clawrl-turn-id"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = [c async for c in raw.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all("sglext" not in (c.model_extra or {}) for c in chunks)
    assert all(ch.logprobs is None for c in chunks for ch in c.choices)
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert len(finish) == 1

    await proxy.settle()
    row = turn(db_url, uid)
    engine = direct(engine_url, MESSAGES)
    assert row["status"] == "ok" and row["finish_reason"] == finish[0]
    assert row["response_message"]["content"] == text
    assert row["prompt_ids"] == engine["prompt_token_ids"]
    assert row["response_ids"] == engine["response_token_ids"]
    assert len(row["response_logprobs"]) == len(row["response_ids"])
    assert chunks[-1].usage.completion_tokens == len(row["response_ids"])
    assert row["weight_version"] == "default"


async def test_client_logprobs_and_tools_pass_through(proxy_factory: ProxyFactory, db_url: str,
                                                      engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "carol")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True,
            tools=TOOLS, tool_choice="auto", extra_body={"top_k": 1})
        completion = raw.parse()
        stream = await client.chat.completions.create(
            model="default", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True,
            stream=True, tools=TOOLS)
        streamed = [c async for c in stream]
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(t.logprob <= 0 for t in content)
    assert any(ch.logprobs and ch.logprobs.content for c in streamed for ch in c.choices)
    await proxy.settle()
    row = turn(db_url, raw.headers["x-clawrl-turn-id"])
    assert row["tools"] == TOOLS and row["params"]["tool_choice"] == "auto"
    assert row["params"]["top_k"] == 1  # unknown to OpenAI: passed through and logged
    assert query(db_url, "SELECT count(*) FROM turns WHERE tools IS NOT NULL") == [(2,)]


async def test_conversation_is_a_session(proxy_factory: ProxyFactory, db_url: str,
                                         engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "dave")
    async with proxy.client(key) as client:
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        uids = []
        for follow_up in ("and then?", "thanks"):
            raw = await client.chat.completions.with_raw_response.create(
                model="default", messages=messages, temperature=0, max_tokens=5)
            uids.append(raw.headers["x-clawrl-turn-id"])
            reply = raw.parse().choices[0].message
            messages += [{"role": "assistant", "content": reply.content},
                         {"role": "user", "content": follow_up}]
        # A side request (e.g. a title) over the same history continues nothing.
        side = await client.chat.completions.with_raw_response.create(
            model="default", messages=[*messages, {"role": "user", "content": "title?"}],
            max_tokens=3, extra_headers={"X-Turn-Type": "side"})
    await proxy.settle()
    first, second = turn(db_url, uids[0]), turn(db_url, uids[1])
    assert first["state"] == "continued"
    assert first["next_state"] == [{"role": "user", "content": "and then?"}]
    assert second["session_id"] == first["session_id"] and second["index_in_session"] == 1
    assert second["state"] == "open"  # the side turn did not consume it
    side_row = turn(db_url, side.headers["x-clawrl-turn-id"])
    assert side_row["kind"] == "side" and side_row["state"] == "closed"
    jobs = query(db_url, "SELECT t.uid FROM jobs j JOIN turns t ON t.id = j.turn_id "
                         "WHERE j.kind = 'judge'")
    assert [str(r[0]) for r in jobs] == [uids[0]]


async def test_explicit_session_headers(proxy_factory: ProxyFactory, db_url: str,
                                        engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "erin")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            extra_headers={"X-Session-Id": "conv-42", "X-Session-Done": "1"})
    sid = raw.headers["x-clawrl-session-id"]
    await proxy.settle()
    row = turn(db_url, raw.headers["x-clawrl-turn-id"])
    assert str(row["session_id"]) == sid and row["state"] == "closed"
    assert query(db_url, "SELECT external_id, closed_at IS NOT NULL FROM sessions "
                         "WHERE id = %s", uuid.UUID(sid)) == [("conv-42", True)]


@pytest.mark.parametrize("stream", [False, True])
async def test_log_opt_out_is_served_and_not_stored(proxy_factory: ProxyFactory, db_url: str,
                                                    engine_url: str, stream: bool) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "private", log_opt_out=True)
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=MESSAGES, max_tokens=4, stream=stream)
        if stream:
            assert [c async for c in raw.parse()]  # type: ignore[union-attr]
        else:
            assert raw.parse().choices  # type: ignore[union-attr]
        assert "x-clawrl-turn-id" not in raw.headers
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_feedback(proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "frank")
    _, other_key = create_user(db_url, "mallory")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=MESSAGES, max_tokens=3)
    uid = raw.headers["x-clawrl-turn-id"]
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        mine = {"Authorization": f"Bearer {key}"}
        # Immediately after the reply: the proxy waits for the turn to be stored.
        ok = await http.post("/v1/feedback", headers=mine,
                             json={"turn_id": uid, "rating": -1, "text": "too long"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["rating"] == -1
        up = await http.post("/v1/feedback", headers=mine, json={"turn_id": uid, "rating": "up"})
        assert up.status_code == 200 and up.json()["rating"] == 1
        theirs = await http.post("/v1/feedback", headers={"Authorization": f"Bearer {other_key}"},
                                 json={"turn_id": uid, "rating": 1})
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "turn_not_found"
        for bad in ({"turn_id": uid, "rating": 5}, {"turn_id": uid}, {"turn_id": "nope"},
                    {"rating": 1}):
            response = await http.post("/v1/feedback", headers=mine, json=bad)
            assert response.status_code == 400, bad
        missing = await http.post("/v1/feedback", headers=mine,
                                  json={"turn_id": str(uuid.uuid4()), "rating": 1})
        assert missing.status_code == 404
    assert query(db_url, "SELECT f.rating, f.text FROM feedback f ORDER BY f.id") == [
        (-1, "too long"), (1, None)]


async def test_models_health_and_metrics(proxy_factory: ProxyFactory, db_url: str,
                                         engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "gina")
    async with proxy.client(key) as client:
        models = await client.models.list()
        assert [m.id for m in models.data]
        await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=3)
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["engine"] == "ok"
        await proxy.settle()
        text = (await http.get("/metrics")).text
    assert 'clawrl_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'clawrl_request_latency_seconds_count{route="/v1/chat/completions"} 1.0' in text
    assert 'clawrl_tokens_total{kind="completion"}' in text
    assert "clawrl_turn_log_backlog 0.0" in text and "clawrl_journal_turns 0.0" in text


async def test_engine_rejection_passes_its_message(proxy_factory: ProxyFactory, db_url: str,
                                                   engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "hank")
    async with proxy.client(key) as client:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(  # type: ignore[call-overload]
                    model="default", messages=MESSAGES, stream=stream,
                    logit_bias={"99999": 5})  # in bounds for the proxy, beyond the vocabulary
            assert "logit_bias token ids must be in" in info.value.message
            assert info.value.code == "engine_rejected"
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]
