"""Input the proxy accepts is bounded and linear-time: an allow-list of request fields,
capped `stop` / params / `max_tokens`, depth-limited JSON, one body limit on every route
checked before parsing or auth, and `<think>` stripping without a backtracking regex."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, closed_port_url, create_user, query

from proxy.openai_types import MAX_JSON_DEPTH, bracket_depth, json_depth
from proxy.sessions import canonical_message, strip_think

CHAT = "/v1/chat/completions"
OK = [{"role": "user", "content": "hi"}]

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("input_ids", {"input_ids": [1, 2, 3]}, "input_ids"),
    ("chat_template", {"chat_template": "{{ 'owned' }}"}, "chat_template"),
    ("chat_template_kwargs", {"chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs"),
    ("ignore_eos", {"ignore_eos": True}, "ignore_eos"),
    ("min_tokens", {"min_tokens": 100}, "min_tokens"),
    ("return_token_ids", {"return_token_ids": True}, "return_token_ids"),
    ("made-up field", {"frobnicate": 1}, "frobnicate"),
    ("message field", {"messages": [{"role": "user", "content": "x", "input_ids": [1]}]},
     "messages.0.input_ids"),
    ("content part type", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}, "messages.0.content.0.type"),
    ("megabyte stop", {"stop": "x" * 1_000_000}, "stop"),
    ("too many stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("huge seed", {"seed": 2**64 - 1}, "seed"),
    ("deep arguments", {"messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f", "arguments": "{\"a\":" * 100 + "1" + "}" * 100}}]},
        {"role": "user", "content": "x"}]}, "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize(("name", "extra", "param"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_fields_outside_the_allow_list_are_400(
        proxy_factory: ProxyFactory, db_url: str, name: str, extra: dict[str, Any],
        param: str) -> None:
    proxy = await proxy_factory(closed_port_url(), max_body_bytes=2_000_000)
    _, key = create_user(db_url, "u")
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        response = await http.post(CHAT, json={"model": "default", "messages": OK, **extra},
                                   headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split(".")[-1] in error["message"]
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_reply_fields_sent_back_are_dropped(proxy_factory: ProxyFactory, db_url: str,
                                                  engine_url: str) -> None:
    """An assistant message resent as the SDK returned it (`refusal: null`, ...) is fine, and
    so is one resent as litellm returned it (its `provider_specific_fields`, whatever they
    hold: litellm's bookkeeping, never part of the conversation)."""
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "u")
    call = {"index": 0, "function": {"arguments": "{}", "name": "now"}, "id": "call_1",
            "type": "function"}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "audio": None,
                 "function_call": None, "annotations": []},
                {"role": "user", "content": "time?"},
                {"content": "", "role": "assistant", "tool_calls": [call],
                 "function_call": None, "provider_specific_fields": {"refusal": None}},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
                {"role": "assistant", "content": "noon",
                 "provider_specific_fields": {"citations": ["x"]}},
                {"role": "user", "content": "more"}]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as http:
        response = await http.post(CHAT, json={"model": "default", "messages": messages,
                                               "max_tokens": 2},
                                   headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    await proxy.settle()
    [(stored,)] = query(db_url, "SELECT request_messages FROM turns")
    assert stored[1] == {"role": "assistant", "content": "hello"}
    assert stored[3] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert stored[5] == {"role": "assistant", "content": "noon"}


async def test_max_tokens_capped_at_context(proxy_factory: ProxyFactory, db_url: str,
                                            engine_url: str) -> None:
    """The proxy learns the context length from the engine (/model_info) and refuses more."""
    async with httpx.AsyncClient() as direct:
        context = (await direct.get(f"{engine_url}/model_info")).json()["context_length"]
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "u")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        for _ in range(100):
            if proxy.app.state.upstream.context_length:
                break
            await asyncio.sleep(0.05)
        for field in ("max_tokens", "max_completion_tokens"):
            response = await http.post(CHAT, json={"messages": OK, field: context + 1})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == field
            assert str(context) in response.json()["error"]["message"]
        ok = await http.post(CHAT, json={"messages": OK, "max_tokens": 2})
        assert ok.status_code == 200
    capped = await proxy_factory(engine_url, max_context_tokens=5)
    async with httpx.AsyncClient(base_url=capped.url, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        assert (await http.post(CHAT, json={"messages": OK, "max_tokens": 6})).status_code \
            == 400


async def test_body_limit_before_auth_on_every_route(proxy_factory: ProxyFactory,
                                                     db_url: str) -> None:
    """Admin, feedback and unknown routes all refuse a declared oversized body with 413
    before looking at the key (no key is sent) or reading anything. A body sent without a
    length is refused 401 before it is read where the route takes a key, and 413 while
    reading where it takes none."""
    proxy = await proxy_factory(closed_port_url(), max_body_bytes=1000,
                                admin_key="sekrit-admin-key-0123")
    big = b'{"name": "' + b"x" * 5000 + b'"}'

    async def chunks() -> Any:  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b"x" * 500

    async with httpx.AsyncClient(base_url=proxy.url) as http:
        for method, path in [("POST", "/admin/users"), ("PATCH", "/admin/users/x"),
                             ("POST", "/admin/keys"), ("POST", "/v1/feedback"),
                             ("POST", CHAT), ("GET", "/v1/models"), ("POST", "/nowhere")]:
            response = await http.request(method, path, content=big)
            assert response.status_code == 413, (method, path, response.text)
            assert response.json()["error"]["code"] == "payload_too_large"
            response = await http.request(method, path, content=chunks())
            expected = 413 if path == "/nowhere" else 401
            assert response.status_code == expected, (method, path, response.text)
        # Within the limit, the admin key is checked as before.
        response = await http.post("/admin/users", json={"name": "x"})
        assert response.status_code == 401


async def test_deep_body_is_400(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "u")
    nested: Any = "x"
    for _ in range(MAX_JSON_DEPTH + 5):
        nested = {"a": nested}
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        for where in ({"response_format": nested},
                      {"tools": [{"type": "function", "function": {"name": "f",
                                                                   "parameters": nested}}]}):
            response = await http.post(CHAT, json={"messages": OK, **where},
                                       headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 400 and "deeper" in response.text


def test_think_stripping_is_linear_and_unchanged() -> None:
    """Same result as the old lazy regex on tricky inputs; a 56 KB flood of `<think>`
    (2.4 s with the regex) takes milliseconds."""
    lazy = re.compile(r"<think>.*?</think>", re.DOTALL)
    for text in ["a<think>x</think>b<think>y</think>c", "<think>a<think>b</think>c</think>d",
                 "<think>never closed", "x</think><think>y", "<think><think></think>", ""]:
        assert strip_think(text) == lazy.sub("", text)
    flood = "<think>" * 8000
    started = time.perf_counter()
    canonical_message({"role": "assistant", "content": flood})
    assert time.perf_counter() - started < 0.1


def test_depth_helpers() -> None:
    assert bracket_depth("[" * 3000) == 3000
    assert bracket_depth('{"a": "[[[[[", "b": [1, [2]]}') == 3
    assert json_depth({"a": [[{"b": 1}]]}, 64) == 4
    assert json_depth([[[[[]]]]], 3) == 4  # stops counting past the limit
