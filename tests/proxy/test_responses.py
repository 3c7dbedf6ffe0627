"""`POST /v1/responses` (proxy/responses.py) end to end through the official openai SDK:
the proxy in front of the real embedded engine and real Postgres, or, where a reply must
end on its own or call a tool (the random tiny model does neither), in front of a scripted
engine (an httpx transport that answers like SGLang and records what it was sent).

Each object and event the proxy sends is also validated against the SDK's own pydantic
types (`Response`, `ResponseStreamEvent`), which are stricter than what the SDK's parser
requires.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from proxyharness import ProxyFactory, create_user, query, turns_locked
from pydantic import TypeAdapter

from proxy.responses import ResponsesRenderer, ResponsesShape, parse_responses_request
from proxy.sse import StreamCollector
from proxy.upstream import parse_reply

TOOLS: list[Any] = [{"type": "function", "name": "lookup", "description": "Look a word up.",
                     "parameters": {"type": "object",
                                    "properties": {"word": {"type": "string"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def turn(db_url: str, uid: str) -> dict[str, Any]:
    cols = ("status", "kind", "request_messages", "tools", "params", "response_message",
            "prompt_ids", "response_ids", "response_logprobs", "finish_reason", "session_id",
            "state", "next_state", "index_in_session")
    rows = query(db_url, f"SELECT {', '.join(cols)} FROM turns WHERE uid = %s", uuid.UUID(uid))
    assert len(rows) == 1
    return dict(zip(cols, rows[0], strict=True))


def direct(engine_url: str, messages: list[Any], max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "return_token_ids": True}
    data: dict[str, Any] = httpx.post(f"{engine_url}/v1/chat/completions", json=body,
                                      timeout=60).json()
    return data["choices"][0]


# --- a scripted engine: replies that stop on their own, and tool calls ----------------------

PROMPT_IDS = [1, 2, 3, 4]


class ScriptedEngine:
    """Answers chat requests with `self.reply` (a chat message), whole or streamed in small
    deltas, with SGLang's token id fields; records every chat body it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.reply: dict[str, Any] = {"role": "assistant", "content": "Hello there."}
        self.finish = "stop"

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/model_info":
                return httpx.Response(200, json={"context_length": 2048,
                                                 "weight_version": "7"})
            if request.url.path != "/v1/chat/completions":
                return httpx.Response(404, json={"error": "not here"})
            body = json.loads(request.content)
            self.bodies.append(body)
            if body.get("stream"):
                return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      content=self.sse())
            return httpx.Response(200, json=self.whole())

        return httpx.MockTransport(handle)

    def response_ids(self) -> list[int]:
        return list(range(100, 100 + 3 + len(self.reply.get("tool_calls") or [])))

    def whole(self) -> dict[str, Any]:
        ids = self.response_ids()
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "default",
                "choices": [{"index": 0, "message": self.reply, "finish_reason": self.finish,
                             "prompt_token_ids": PROMPT_IDS, "response_token_ids": ids,
                             "logprobs": {"content": [{"token": "x", "logprob": -0.5,
                                                       "bytes": [], "top_logprobs": []}
                                                      for _ in ids]}}],
                "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(ids),
                          "total_tokens": len(PROMPT_IDS) + len(ids)},
                "metadata": {"weight_version": "7"}}

    def sse(self) -> bytes:
        def event(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                    "model": "default", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": finish}]}

        events = [event({"role": "assistant", "content": ""})]
        text = self.reply.get("content") or ""
        events += [event({"content": text[i:i + 4]}) for i in range(0, len(text), 4)]
        for index, call in enumerate(self.reply.get("tool_calls") or []):
            arguments = call["function"]["arguments"]
            events.append(event({"tool_calls": [{"index": index, "id": call["id"],
                                                 "type": "function", "function": {
                                                     "name": call["function"]["name"],
                                                     "arguments": ""}}]}))
            half = len(arguments) // 2
            for piece in (arguments[:half], arguments[half:]):
                events.append(event({"tool_calls": [{"index": index,
                                                     "function": {"arguments": piece}}]}))
        events.append(event({}, self.finish))
        events.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                       "model": "default", "choices": [], "sglext": {
                           "input_ids": PROMPT_IDS, "output_ids": [self.response_ids()]}})
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) \
            + b"data: [DONE]\n\n"


TOOL_REPLY = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_7", "type": "function",
     "function": {"name": "lookup", "arguments": '{"word": "sea"}'}}]}


# --- the real engine ------------------------------------------------------------------------

async def test_non_streaming_text(proxy_factory: ProxyFactory, db_url: str,
                                  engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        raw = await client.responses.with_raw_response.create(
            model="default", instructions="Be brief.", input="Tell me about the sea.",
            temperature=0, max_output_tokens=8, store=False)
        response = raw.parse()
    uid = raw.headers["x-clawrl-turn-id"]
    Response.model_validate(json.loads(raw.content))  # the SDK's own types, validated
    assert response.object == "response" and response.id == f"resp_{uuid.UUID(uid).hex}"
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text == item.content[0].text  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    # The random tiny model never stops on its own: cut off by max_output_tokens.
    assert response.status == "incomplete" and item.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"

    await proxy.settle()
    row = turn(db_url, uid)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the sea."}]
    engine = direct(engine_url, messages, 8)
    assert row["status"] == "ok" and row["kind"] == "main"
    assert row["request_messages"] == messages
    assert row["params"]["api"] == "responses" and row["params"]["max_tokens"] == 8
    assert row["prompt_ids"] == engine["prompt_token_ids"]
    assert row["response_ids"] == engine["response_token_ids"]
    assert len(row["response_logprobs"]) == 8
    assert row["response_message"]["content"] == response.output_text
    assert row["finish_reason"] == "length"
    assert response.usage.input_tokens == len(row["prompt_ids"])


async def test_streaming_events_in_order(proxy_factory: ProxyFactory, db_url: str,
                                         engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        raw = await client.responses.with_raw_response.create(
            model="default", input=[{"role": "user", "content": "hi"}], temperature=0,
            max_output_tokens=6, stream=True)
        uid = raw.headers["x-clawrl-turn-id"]
        assert raw.headers["content-type"].startswith("text/event-stream")
        events = [e async for e in raw.parse()]
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] *
                     len(deltas), "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert deltas and [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event.model_dump())
    text = "".join(e.delta for e in deltas)
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-4].text == text and final.output_text == text  # type: ignore[union-attr]
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 6 and final.id == f"resp_{uuid.UUID(uid).hex}"
    await proxy.settle()
    row = turn(db_url, uid)
    assert row["status"] == "ok" and row["response_message"]["content"] == text
    assert row["request_messages"] == [{"role": "user", "content": "hi"}]
    assert row["prompt_ids"] == direct(engine_url, row["request_messages"], 6)["prompt_token_ids"]
    assert len(row["response_ids"]) == 6 and row["params"]["stream"] is True


async def test_two_requests_are_one_session(proxy_factory: ProxyFactory, db_url: str,
                                            engine_url: str) -> None:
    """A Responses client resends the conversation as items (its earlier output items as
    they came): after translation it continues the first turn, which is judged."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "carol")
    history: list[Any] = [{"role": "user", "content": "hi"}]
    uids = []
    async with proxy.client(key) as client:
        for follow_up in ("and then?", "thanks"):
            raw = await client.responses.with_raw_response.create(
                model="default", instructions="You are terse.", input=history, temperature=0,
                max_output_tokens=5, store=False)
            uids.append(raw.headers["x-clawrl-turn-id"])
            output = raw.parse().output
            history += [item.model_dump(exclude_none=True) for item in output]
            history.append({"type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": follow_up}]})
    await proxy.settle()
    first, second = turn(db_url, uids[0]), turn(db_url, uids[1])
    assert first["state"] == "continued"
    assert first["next_state"] == [{"role": "user", "content": "and then?"}]
    assert second["session_id"] == first["session_id"] and second["index_in_session"] == 1
    assert second["request_messages"] == [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first["response_message"]["content"]},
        {"role": "user", "content": "and then?"}]
    jobs = query(db_url, "SELECT t.uid FROM jobs j JOIN turns t ON t.id = j.turn_id "
                         "WHERE j.kind = 'judge'")
    assert [str(r[0]) for r in jobs] == [uids[0]]


# --- the scripted engine --------------------------------------------------------------------

async def test_stream_helper_assembles_the_reply(proxy_factory: ProxyFactory,
                                                 db_url: str) -> None:
    engine = ScriptedEngine()
    proxy = await proxy_factory("http://engine", transport=engine.transport())
    _, key = create_user(db_url, "dora")
    async with proxy.client(key) as client:
        async with client.responses.stream(model="default", input="hi", store=False) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Hello there."
    assert "".join(deltas) == "Hello there." and len(deltas) == 3
    assert final.usage is not None and final.usage.input_tokens == len(PROMPT_IDS)
    assert final.usage.output_tokens == 3 and final.incomplete_details is None
    assert engine.bodies[0]["stream"] is True
    assert engine.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    await proxy.settle()
    [(status, content, ids, version)] = query(
        db_url, "SELECT status, response_message->>'content', response_ids, weight_version "
                "FROM turns")
    assert (status, content, ids) == ("ok", "Hello there.", engine.response_ids())


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_round_trip(proxy_factory: ProxyFactory, db_url: str,
                                        stream: bool) -> None:
    """The reply's tool call comes back as a function_call item; the follow-up request
    carries it and a function_call_output, which reach the engine as an assistant tool call
    and a tool message, and continue the first turn (its next state: the tool result)."""
    engine = ScriptedEngine()
    engine.reply, engine.finish = TOOL_REPLY, "tool_calls"
    proxy = await proxy_factory("http://engine", transport=engine.transport())
    _, key = create_user(db_url, "erin")
    ask = {"role": "user", "content": "What does sea mean?"}
    async with proxy.client(key) as client:
        if stream:
            async with client.responses.stream(model="default", input=[ask], tools=TOOLS,
                                               tool_choice="auto") as events:
                seen = [e async for e in events]
                first = await events.get_final_response()
            types = [e.type for e in seen]
            assert types[:3] == ["response.created", "response.in_progress",
                                 "response.output_item.added"]
            assert types.count("response.function_call_arguments.delta") == 2
            assert types[-3:] == ["response.function_call_arguments.done",
                                  "response.output_item.done", "response.completed"]
        else:
            first = await client.responses.create(model="default", input=[ask], tools=TOOLS,
                                                  tool_choice="auto")
        [call] = first.output
        assert call.type == "function_call" and call.name == "lookup"
        assert call.call_id == "call_7" and json.loads(call.arguments) == {"word": "sea"}
        assert first.status == "completed" and first.output_text == ""
        engine.reply, engine.finish = {"role": "assistant", "content": "It means sea."}, "stop"
        second = await client.responses.create(
            model="default", tools=TOOLS, input=[ask, call.model_dump(exclude_none=True), {
                "type": "function_call_output", "call_id": call.call_id,
                "output": '{"meaning": "a lot of water"}'}])
    assert second.output_text == "It means sea."
    sent = engine.bodies[0]
    assert sent["tools"] == CHAT_TOOLS and sent["tool_choice"] == "auto"
    assert engine.bodies[1]["messages"] == [
        ask,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "lookup", "arguments": '{"word": "sea"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": '{"meaning": "a lot of water"}'}]
    await proxy.settle()
    rows = query(db_url, "SELECT uid, response_message, state, next_state, session_id, "
                         "index_in_session FROM turns ORDER BY id")
    assert len(rows) == 2
    (_, reply, state, next_state, session, _), (_, _, _, _, session2, index2) = rows
    assert reply["tool_calls"][0]["function"]["name"] == "lookup"
    assert state == "continued" and session2 == session and index2 == 1
    assert next_state == [{"role": "tool", "tool_call_id": "call_7",
                           "content": '{"meaning": "a lot of water"}'}]


async def test_stream_failure_ends_with_response_failed(proxy_factory: ProxyFactory,
                                                        db_url: str) -> None:
    engine = ScriptedEngine()
    good = engine.sse()
    cut = good[:good.index(b"\n\n", 200) + 2]  # a few chunks, then the connection ends

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=cut)

    proxy = await proxy_factory("http://engine", transport=httpx.MockTransport(handle))
    _, key = create_user(db_url, "finn")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        reply = await http.post("/v1/responses", headers={"Authorization": f"Bearer {key}"},
                                json={"model": "default", "input": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    for event in events:
        EVENTS.validate_python(event)
    assert events[-1]["response"]["status"] == "failed"
    assert "before the reply finished" in events[-1]["response"]["error"]["message"]
    await proxy.settle()
    assert query(db_url, "SELECT status FROM turns") == [("engine_error",)]


async def test_sync_durability_holds_the_last_event(proxy_factory: ProxyFactory,
                                                    db_url: str) -> None:
    """durability = "sync": when response.completed arrives, the turn is already durable
    (here, with the database stalled, in the journal)."""
    engine = ScriptedEngine()
    proxy = await proxy_factory("http://engine", transport=engine.transport(),
                                durability="sync")
    writer = proxy.app.state.writer
    _, key = create_user(db_url, "hal")
    with turns_locked(db_url):
        async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                     headers={"Authorization": f"Bearer {key}"}) as http:
            ask = {"model": "default", "input": "x", "stream": True}
            async with http.stream("POST", "/v1/responses", json=ask) as stream:
                async for line in stream.aiter_lines():
                    if line == "event: response.completed":
                        assert writer.journal.pending == 1
                        break
                else:
                    raise AssertionError("no response.completed")
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(1,)]


# --- refusals and auth ----------------------------------------------------------------------

REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "unsupported_parameter"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": "hi", "background": True}, "background", "unsupported_parameter"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type", "unsupported_tool"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]},
     "tools.0.type", "unsupported_tool"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools.0.name",
     "invalid_request"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "unsupported_tool_choice"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input.0.content.1.type", "unsupported_content"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.output.0.type", "unsupported_content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type",
     "unsupported_input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type",
     "unsupported_input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "invalid_request"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id", "invalid_request"),
    ({"input": []}, "input", "invalid_request"),
    ({"instructions": "be nice", "input": [{"role": "system", "content": "x"}]}, "input",
     "invalid_request"),
    ({"model": "default"}, "input", "invalid_request"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_request"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens", "invalid_request"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", "invalid_request"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ({"input": "hi", "stream": "yes"}, "stream", "invalid_request"),
]


async def test_refusals_are_openai_shaped_and_store_nothing(proxy_factory: ProxyFactory,
                                                           db_url: str) -> None:
    engine = ScriptedEngine()
    proxy = await proxy_factory("http://engine", transport=engine.transport())
    await proxy.app.state.upstream.model_info()  # the context length (2048) is known
    _, key = create_user(db_url, "gina")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {key}"}
        for body, param, code in REFUSED:
            reply = await http.post("/v1/responses", headers=auth, json=body)
            assert reply.status_code == 400, (body, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "invalid_request_error", body
            assert (error["param"], error["code"]) == (param, code), (body, error)
            assert error["message"] and "x-clawrl-turn-id" not in reply.headers
        broken = await http.post("/v1/responses", headers=auth, content=b"{not json")
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
        for headers in ({}, {"Authorization": "Bearer ck-nope"}):
            denied = await http.post("/v1/responses", headers=headers, json={"input": "hi"})
            assert denied.status_code == 401
            assert denied.json()["error"]["type"] == "authentication_error"
        wrong_method = await http.get("/v1/responses", headers=auth)
        assert wrong_method.status_code == 405
    async with proxy.client(key) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="default", input="hi", previous_response_id="resp_1")
        assert "stores no response objects" in info.value.message
    assert engine.bodies == []
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


# --- the translation itself -----------------------------------------------------------------

def test_request_translation() -> None:
    body = {
        "model": "default", "instructions": "Be kind.", "max_output_tokens": 50, "temperature": 0.2,
        "top_p": 0.9, "parallel_tool_calls": False, "store": False, "user": "u1",
        "metadata": {"run": "7"}, "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "minimal", "summary": "auto"}, "truncation": "disabled",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"},
                            "strict": True}, "verbosity": "low"},
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "lookup"},
        "previous_response_id": None, "background": False,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Look up"}, {"type": "input_text", "text": "sea"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Sure.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "lookup",
             "arguments": '{"word": "sea"}', "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "lookup",
             "arguments": '{"word": "salt"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "water"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "NaCl"}]},
        ]}
    chat, view, request = parse_responses_request(json.dumps(body).encode())
    assert chat == {
        "model": "default",
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "text", "text": "Look up"},
                                         {"type": "text", "text": "sea"}]},
            {"role": "assistant", "content": "Sure.", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "lookup", "arguments": '{"word": "sea"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "lookup", "arguments": '{"word": "salt"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "water"},
            {"role": "tool", "tool_call_id": "c2", "content": "NaCl"}],
        "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "parallel_tool_calls": False, "temperature": 0.2, "top_p": 0.9, "user": "u1",
        "max_tokens": 50, "reasoning_effort": "low",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object"}, "strict": True}},
    }
    assert view.requested_tokens == 50 and request.metadata == {"run": "7"}


def test_output_conversion_of_a_chat_reply() -> None:
    """A chat reply with text and two tool calls (one without an id, arguments as an
    object) as a `response`: a message item, then one function_call item per call."""
    shape = ResponsesShape(parse_responses_request(b'{"input": "hi", "tools": '
                                                   + json.dumps(TOOLS).encode() + b"}")[2])
    uid = str(uuid.uuid4())
    fake_turn: Any = SimpleNamespace(uid=uid, body={"model": "default"},
                                     served_model="default")
    data = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "lookup", "arguments": '{"word": "sea"}'}},
            {"type": "function", "function": {"name": "lookup", "arguments": {"word": "x"}}}]}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    out = json.loads(shape.whole(fake_turn, data, parse_reply(data)))
    response = Response.model_validate(out)
    hexid = uuid.UUID(uid).hex
    assert response.id == f"resp_{hexid}" and response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call",
                                                        "function_call"]
    assert response.output_text == "Looking."
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_a", "lookup", {"word": "sea"}), (f"call_{hexid}_1", "lookup", {"word": "x"})]
    assert response.usage is not None and response.usage.total_tokens == 13
    assert response.tools[0].name == "lookup"  # type: ignore[union-attr]


def test_stream_rendering_of_text_and_tool_calls() -> None:
    """The renderer fed chat chunks (text, then a tool call in pieces): every event valid,
    sequence numbers in order, each item closed before response.completed."""
    engine = ScriptedEngine()
    engine.reply = {"role": "assistant", "content": "On it.", "tool_calls":
                    TOOL_REPLY["tool_calls"]}
    shape = ResponsesShape(parse_responses_request(b'{"input": "hi"}')[2])
    fake_turn: Any = SimpleNamespace(uid=str(uuid.uuid4()), body={"model": "default"},
                                     served_model="default")
    renderer, collector = ResponsesRenderer(shape, fake_turn), StreamCollector()
    pieces = [renderer.start()]
    for line in engine.sse().split(b"\n\n"):
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            collector.add(chunk)
            pieces.append(renderer.chunk(chunk) or b"")
    pieces.append(renderer.end(collector, None))
    events = [json.loads(line[6:]) for line in b"".join(pieces).split(b"\n")
              if line.startswith(b"data: ")]
    for event in events:
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [(e["type"], e.get("output_index")) for e in events if e["type"].endswith(".done")]
    assert done == [("response.output_text.done", 0), ("response.content_part.done", 0),
                    ("response.output_item.done", 0),
                    ("response.function_call_arguments.done", 1),
                    ("response.output_item.done", 1)]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "On it."
    assert final["output"][1]["arguments"] == '{"word": "sea"}'
    assert final["output"][1]["call_id"] == "call_7"


def test_agent_request_shapes_are_accepted() -> None:
    """What agent clients send by default: OpenClaw (pi-ai's openai-responses: the system
    prompt as a developer item, reasoning items replayed, prompt_cache_key, include, store
    false, a tool with strict null) and the Agents SDK (text.format text, truncation, nulls)."""
    body = {
        "model": "default", "stream": True, "store": False, "prompt_cache_key": "session-1",
        "include": ["reasoning.encrypted_content"], "max_output_tokens": 64,
        "reasoning": {"effort": "medium", "summary": "auto"}, "text": {"format": {"type": "text"}},
        "truncation": "disabled", "previous_response_id": None, "conversation": None,
        "tools": [{**TOOLS[0], "strict": None}], "tool_choice": None, "top_p": None,
        "input": [
            {"role": "developer", "content": "You are OpenClaw."},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
            {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
             "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
            {"role": "user", "content": [{"type": "input_text", "text": "look up sea"}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "water"}]}
    chat, _, _ = parse_responses_request(json.dumps(body).encode())
    assert [m["role"] for m in chat["messages"]] == ["developer", "user", "assistant", "user",
                                                     "assistant", "tool"]
    assert chat["stream"] is True and chat["reasoning_effort"] == "medium"
    assert chat["tools"] == CHAT_TOOLS and "response_format" not in chat
    assert "top_p" not in chat and "tool_choice" not in chat
