"""The rest of the OpenAI surface through the official openai SDK, the real proxy, the real
embedded engine and Postgres: model ids and aliases (proxy/models.py), `n` > 1
(proxy/choices.py), and the fields the OpenAI API accepts that mean nothing here."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from proxyharness import (
    ProxyFactory,
    ScriptedStream,
    chunk,
    closed_port_url,
    create_user,
    query,
)

from proxy.models import clean_id

HELLO: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]


def test_clean_id_shows_a_path_as_its_last_folder() -> None:
    assert clean_id("/srv/clawrl/models/tinyworld") == "tinyworld"
    assert clean_id("/srv/models/SmolLM2-135M-Instruct/") == "SmolLM2-135M-Instruct"
    assert clean_id("./models/m") == "m"
    assert clean_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert clean_id("smollm2-135m") == "smollm2-135m"


async def test_models_list_and_retrieve_by_every_name(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str,
        tiny_model_dir: Path) -> None:
    proxy = await proxy_factory(engine_url, model_aliases={"gpt-4o-mini": "default"})
    _, key = create_user(db_url, "alice")
    served = tiny_model_dir.name  # the engine names it by its folder's absolute path
    async with proxy.client(key) as client:
        listed = await client.models.list()
        assert [m.id for m in listed.data] == [served]
        assert "/" not in served
        for name in (served, "default", "gpt-4o-mini", str(tiny_model_dir)):
            card = await client.models.retrieve(name)
            assert card.id == name and card.object == "model"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-9-nonexistent")
        # Every name serves the model; the reply names the served id.
        for name in (served, "default", "gpt-4o-mini"):
            reply = await client.chat.completions.create(
                model=name, messages=HELLO, max_tokens=2, temperature=0)
            assert reply.model == served
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=HELLO, max_tokens=2, temperature=0, stream=True)
        assert {chunk.model async for chunk in stream} == {served}
    error = missing.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert error["message"] == ("The model `gpt-9-nonexistent` does not exist or you do not "
                                "have access to it.")
    await proxy.settle()
    assert query(db_url, "SELECT params->>'model' FROM turns ORDER BY id") == [
        (served,), ("default",), ("gpt-4o-mini",), ("gpt-4o-mini",)]


async def test_unknown_model_is_404_and_nothing_is_stored(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url, model_aliases={"gpt-4o": "not-served"})
    _, key = create_user(db_url, "bob")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as http:
        auth = {"Authorization": f"Bearer {key}"}
        for path, body in (
                ("/v1/chat/completions", {"model": "gpt-9-nonexistent", "messages": HELLO}),
                ("/v1/chat/completions", {"model": "ft:gpt-4o:org::x", "messages": HELLO}),
                ("/v1/chat/completions", {"model": "gpt-4o", "messages": HELLO}),
                ("/v1/responses", {"model": "gpt-9-nonexistent", "input": "hi"})):
            response = await http.post(path, json=body, headers=auth)
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert error["type"] == "invalid_request_error"
            assert f"`{body['model']}`" in error["message"]
        assert "not served here" in error["message"] or body["model"] != "gpt-4o"
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_model_name_before_the_engine_answers_is_502_not_404(
        proxy_factory: ProxyFactory, db_url: str) -> None:
    """A name that is not `default` needs the engine's name; an engine that is down says so."""
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "carol")
    async with proxy.client(key) as client:
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="anything", messages=HELLO)
    assert failed.value.status_code == 502


async def test_n_choices_are_turns_of_one_group(proxy_factory: ProxyFactory, db_url: str,
                                                engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "dave")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=HELLO, n=3, max_tokens=6, temperature=1.0, seed=7,
            logprobs=True)
        completion = raw.parse()
        again = await client.chat.completions.create(
            model="default", messages=HELLO, n=3, max_tokens=6, temperature=1.0, seed=7)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    texts = [c.message.content for c in completion.choices]
    assert texts == [c.message.content for c in again.choices]  # seed + i per choice
    assert len(set(texts)) > 1, texts
    assert all(c.logprobs is not None and c.logprobs.content for c in completion.choices)
    uids = raw.headers["x-clawrl-turn-ids"].split(",")
    assert len(uids) == 3 and uids[0] == raw.headers["x-clawrl-turn-id"]
    await proxy.settle()
    rows = query(db_url, "SELECT uid, group_id, group_index, session_id, index_in_session, "
                         "response_message->>'content', params->>'seed', status, "
                         "array_length(response_ids, 1), array_length(response_logprobs, 1) "
                         "FROM turns WHERE uid = ANY(%s) ORDER BY group_index",
                 [uuid.UUID(u) for u in uids])
    assert [str(r[0]) for r in rows] == uids
    assert len({r[1] for r in rows}) == 1 and rows[0][1] is not None
    assert [r[2] for r in rows] == [0, 1, 2]
    assert len({(r[3], r[4]) for r in rows}) == 1  # one session, one index
    assert [r[5] for r in rows] == texts
    assert [r[6] for r in rows] == ["7", "8", "9"]
    assert all(r[7] == "ok" and r[8] == r[9] and r[8] > 0 for r in rows)
    usage = completion.usage
    assert usage is not None and usage.completion_tokens == sum(r[8] for r in rows)


async def test_n_choices_stream_interleaved_each_its_own_turn(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    """Streamed, the choices come as one stream: each chunk names its choice, the choices
    are those the same request draws whole (seed + i), one usage chunk sums them, one
    [DONE]; each choice is its own turn of one group."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "nadia")
    async with proxy.client(key) as client:
        whole = await client.chat.completions.create(
            model="default", messages=HELLO, n=3, max_tokens=6, temperature=1.0, seed=11)
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=HELLO, n=3, max_tokens=6, temperature=1.0, seed=11,
            stream=True, stream_options={"include_usage": True})
        chunks = [piece async for piece in raw.parse()]
    texts: dict[int, str] = {}
    for piece in chunks:
        for choice in piece.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len({piece.id for piece in chunks}) == 1
    finishes = [c.index for piece in chunks for c in piece.choices if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert sum(piece.usage is not None for piece in chunks) == 1
    uids = raw.headers["x-clawrl-turn-ids"].split(",")
    await proxy.settle()
    rows = query(db_url, "SELECT group_index, response_message->>'content', status, "
                         "array_length(response_ids, 1), params->>'stream', group_id "
                         "FROM turns WHERE uid = ANY(%s) ORDER BY group_index",
                 [uuid.UUID(u) for u in uids])
    assert [(r[0], r[1], r[2]) for r in rows] == [(i, texts[i], "ok") for i in range(3)]
    assert usage.completion_tokens == sum(r[3] for r in rows)
    assert all(r[4] == "true" for r in rows) and len({r[5] for r in rows}) == 1


async def test_a_client_that_leaves_a_streamed_n_reply_ends_every_choice(
        proxy_factory: ProxyFactory, db_url: str) -> None:
    """Each choice's engine stream sends a word and hangs; the user presses stop: every
    engine request is closed, every choice's turn logged as the client leaving."""
    streams: list[ScriptedStream] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/chat/completions"):
            return httpx.Response(404, json={})  # the proxy asking for the engine's info
        streams.append(ScriptedStream([chunk(), chunk("Hel", logprob=-0.5)], then="hang"))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=streams[-1])

    proxy = await proxy_factory("http://engine", transport=httpx.MockTransport(handle))
    _, key = create_user(db_url, "omar")
    async with proxy.client(key) as client:
        response = await client.chat.completions.create(
            model="default", messages=HELLO, n=2, stream=True)
        async for part in response:
            if part.choices and part.choices[0].delta.content:
                break
        await response.close()
    assert len(streams) == 2
    for stream in streams:
        await asyncio.wait_for(stream.closed.wait(), 10)
    await proxy.settle()
    rows = query(db_url, "SELECT group_index, status, response_message->>'content' "
                         "FROM turns ORDER BY group_index")
    assert [(r[0], r[1]) for r in rows] == [(0, "client_disconnected"),
                                            (1, "client_disconnected")]


async def test_a_streamed_choice_that_fails_is_one_error_event_the_others_go_on(
        proxy_factory: ProxyFactory, db_url: str) -> None:
    scripts = iter([ScriptedStream([chunk(), chunk("Hi"), chunk(finish="stop")], then="end"),
                    ScriptedStream([chunk(), chunk("Hel")], then="drop")])

    def handle(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/chat/completions"):
            return httpx.Response(404, json={})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=next(scripts))

    proxy = await proxy_factory("http://engine", transport=httpx.MockTransport(handle))
    _, key = create_user(db_url, "pia")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        response = await http.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}"}, json={"model": "default", "messages": HELLO,
                                                     "n": 2, "stream": True})
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    errors = [e for e in events[:-1] if '"error"' in e]
    assert len(errors) == 1
    await proxy.settle()
    rows = query(db_url, "SELECT group_index, status, response_message->>'content' "
                         "FROM turns ORDER BY group_index")
    assert rows == [(0, "ok", "Hi"), (1, "engine_error", "Hel")]


async def test_n_choices_continue_one_conversation(proxy_factory: ProxyFactory, db_url: str,
                                                   engine_url: str) -> None:
    """The turn a request with n choices continues is continued once; the choices share its
    session; the reply the client picks is the one its next request continues."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "erin")
    async with proxy.client(key) as client:
        first = await client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=4, temperature=0)
        history = [*HELLO, {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "More."}]
        picked = await client.chat.completions.create(
            model="default", messages=history, n=2, max_tokens=4, temperature=1.0, seed=3)
        follow = [*history, {"role": "assistant",
                             "content": picked.choices[1].message.content},
                  {"role": "user", "content": "Thanks."}]
        await client.chat.completions.create(model="default", messages=follow, max_tokens=2,
                                             temperature=0)
    await proxy.settle()
    rows = query(db_url, "SELECT index_in_session, group_index, state, session_id "
                         "FROM turns ORDER BY id")
    assert len({r[3] for r in rows}) == 1
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (0, None, "continued"), (1, 0, "open"), (1, 1, "continued"), (2, None, "open")]
    assert query(db_url, "SELECT count(*) FROM jobs WHERE kind = 'judge'") == [(2,)]


async def test_n_bad_values_are_400(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "frank")
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        for extra, param in (({"n": 0}, "n"), ({"n": 9}, "n"),
                             ({"modalities": ["text", "audio"]}, "modalities"),
                             ({"metadata": {"k": 5}}, "metadata.k")):
            response = await http.post("/v1/chat/completions", headers={
                "Authorization": f"Bearer {key}"}, json={"model": "default",
                                                          "messages": HELLO, **extra})
            assert response.status_code == 400, (extra, response.text)
            assert response.json()["error"]["param"] == param, response.text
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_fields_the_openai_api_accepts_are_accepted_and_stored(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "grace")
    extra: dict[str, Any] = {
        "metadata": {"app": "notes"}, "store": True, "service_tier": "auto",
        "prompt_cache_key": "k1", "safety_identifier": "u-42", "verbosity": "low",
        "modalities": ["text"], "reasoning_effort": "minimal"}
    async with proxy.client(key) as client:
        reply = await client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=2, temperature=0, **extra)
        stream = await client.chat.completions.create(
            model="default", messages=HELLO, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
            reasoning_effort="none")
        chunks = [chunk async for chunk in stream]
    assert reply.choices[0].message.content is not None
    assert chunks[-1].usage is not None
    await proxy.settle()
    params = [r[0] for r in query(db_url, "SELECT params FROM turns ORDER BY id")]
    assert {k: params[0][k] for k in extra} == extra
    assert params[1]["stream_options"]["include_obfuscation"] is False
    assert params[1]["reasoning_effort"] == "none"
