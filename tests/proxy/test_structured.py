"""Structured outputs through the proxy (official openai SDK -> proxy -> real embedded engine
-> real Postgres): the proxy forwards `response_format` and `tool_choice` unchanged, the reply
parses into the client's type, and the turn stores the constraint it was sampled under
(`turns.sampling.constraint`, proxy/sampling.py); a bad schema is the engine's 400."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from proxyharness import ProxyFactory, create_user, query
from pydantic import BaseModel, Field

from proxy.sampling import constrained

ASK: list[Any] = [{"role": "user", "content": "Who is on call?"}]
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a person up.", "strict": True,
    "parameters": {"type": "object", "required": ["who"], "additionalProperties": False,
                   "properties": {"who": {"type": "string", "maxLength": 12}}}}}


class Person(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    age: Annotated[int, Field(ge=0, le=120)]
    role: Literal["admin", "user", "guest"]


def stored(db_url: str, uid: str) -> tuple[Any, ...]:
    rows = query(db_url, "SELECT sampling, params, response_message, finish_reason FROM turns "
                         "WHERE uid = %s", uuid.UUID(uid))
    assert len(rows) == 1
    return rows[0]


async def test_parse_into_a_pydantic_model_and_the_turn_stores_the_schema(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.parse(
            model="default", messages=ASK, response_format=Person, temperature=1.0, seed=3,
            max_tokens=200)
        completion = raw.parse()
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)
    await proxy.settle()
    sampling, params, message, finish = stored(db_url, raw.headers["x-clawrl-turn-id"])
    assert finish == "stop" and json.loads(message["content"]) == person.model_dump()
    sent = params["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["strict"] is True
    assert sampling["constraint"] == {"response_format": sent}


async def test_required_tool_choice_and_the_responses_api(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="default", messages=ASK, tools=[LOOKUP], tool_choice="required",  # type: ignore[list-item]
            temperature=1.0, seed=1, max_tokens=200)
        completion = raw.parse()
        response = await client.responses.create(
            model="default", input="Who is on call?", max_output_tokens=200, temperature=1.0,
            text={"format": {"type": "json_schema", "name": "person", "strict": True,
                             "schema": Person.model_json_schema() | {
                                 "additionalProperties": False}}})
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments),
                            LOOKUP["function"]["parameters"])  # type: ignore[index]
    Person.model_validate_json(response.output_text)
    await proxy.settle()
    sampling, _, message, finish = stored(db_url, raw.headers["x-clawrl-turn-id"])
    assert finish == "tool_calls" and message["tool_calls"]
    assert sampling["constraint"] == {"tool_choice": "required"}


async def test_a_bad_schema_is_a_400_naming_it(proxy_factory: ProxyFactory, db_url: str,
                                               engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "carol")
    async with proxy.client(key) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="default", messages=ASK, max_tokens=5, response_format={
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {
                        "type": "strin"}}})
        assert 'invalid json_schema: Unsupported type "strin"' in caught.value.message
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="default", messages=ASK, max_tokens=5, tools=[LOOKUP],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "nope"}})
        assert "Tool 'nope' not found in tools list." in caught.value.message
    async with httpx.AsyncClient(base_url=proxy.url) as http:  # the OpenAI error shape
        body = (await http.post("/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
                "model": "default", "messages": ASK, "tool_choice": "required"})).json()
    assert body["error"]["type"] == "invalid_request_error"


def test_what_counts_as_a_constraint() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {}}}
    assert constrained({"response_format": fmt, "tool_choice": "required"}) == {
        "response_format": fmt}
    assert constrained({"response_format": {"type": "text"}}) is None
    assert constrained({"tools": [LOOKUP], "tool_choice": "required"}) == {
        "tool_choice": "required"}
    named = {"type": "function", "function": {"name": "lookup"}}
    assert constrained({"tools": [LOOKUP], "tool_choice": named}) == {"tool_choice": named}
    assert constrained({"tools": [LOOKUP]}) == {"strict_tools": ["lookup"]}
    assert constrained({"tools": [LOOKUP], "tool_choice": "none"}) is None
    loose = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert constrained({"tools": [loose], "tool_choice": "auto"}) is None
