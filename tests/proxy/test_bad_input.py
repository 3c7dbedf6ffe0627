"""Every request rejected before the engine is called: the right status, an OpenAI-shaped
error body, and nothing stored. The engine URL points at a closed port, so a request that
slipped through would come back 502 instead of the expected status."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from proxyharness import ProxyFactory, closed_port_url, create_user, query

CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code


BAD_BODIES: list[tuple[str, Any, str]] = [
    ("malformed json", b'{"messages": [', "invalid_json"),
    ("not an object", b"[1, 2]", "invalid_json"),
    ("missing messages", {"model": "default"}, "invalid_request"),
    ("empty messages", {"model": "default", "messages": []}, "invalid_request"),
    ("messages not a list", {"model": "default", "messages": "hi"}, "invalid_request"),
    ("unknown role", {"model": "default", "messages": [{"role": "wizard", "content": "x"}]},
     "invalid_request"),
    ("missing role", {"model": "default", "messages": [{"content": "x"}]}, "invalid_request"),
    ("content wrong type", {"model": "default", "messages": [{"role": "user", "content": 5}]},
     "invalid_request"),
    ("user without content", {"model": "default", "messages": [{"role": "user"}]},
     "invalid_request"),
    ("temperature wrong type", {"model": "default", "messages": OK_MESSAGES, "temperature": "hot"},
     "invalid_request"),
    ("stream wrong type", {"model": "default", "messages": OK_MESSAGES, "stream": "yes"},
     "invalid_request"),
    ("n above the maximum", {"model": "default", "messages": OK_MESSAGES, "n": 9},
     "invalid_request"),
    ("tools wrong shape", {"model": "default", "messages": OK_MESSAGES, "tools": [{"type": 1}]},
     "invalid_request"),
]


@pytest.mark.parametrize(("name", "body", "code"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
async def test_bad_bodies_are_400(proxy_factory: ProxyFactory, db_url: str, name: str,
                                  body: Any, code: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "u")
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = await http.post(CHAT, headers={"Authorization": f"Bearer {key}",
                                                  "Content-Type": "application/json"}, **kw)
    assert_openai_error(response, 400, code)
    await proxy.settle()
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_sdk_sees_bad_request(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "u")
    async with proxy.client(key) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="default", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc]
    assert "messages.0.role" in info.value.message


async def test_oversized_body_is_413(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url(), max_body_bytes=2000)
    _, key = create_user(db_url, "u")
    big = [{"role": "user", "content": "x" * 5000}]
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        response = await http.post(CHAT, json={"model": "default", "messages": big},
                                   headers={"Authorization": f"Bearer {key}"})
        assert_openai_error(response, 413, "payload_too_large")

        async def chunks() -> Any:  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b"x" * 500

        response = await http.post(CHAT, content=chunks(),
                                   headers={"Authorization": f"Bearer {key}"})
        assert_openai_error(response, 413, "payload_too_large")
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_keys_and_rate_limit(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url(), rate_limit_rpm=1)
    _, key = create_user(db_url, "u")
    _, revoked = create_user(db_url, "gone")
    query(db_url, "UPDATE api_keys SET revoked_at = now() WHERE user_id = "
                  "(SELECT id FROM users WHERE name = 'gone') RETURNING id")
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        body = {"model": "default", "messages": OK_MESSAGES}
        assert_openai_error(await http.post(CHAT, json=body), 401, "missing_api_key")
        for bad in ("Bearer nope", "Bearer ck-abc-def", "Basic xyz", f"Bearer {revoked}"):
            assert_openai_error(await http.post(CHAT, json=body,
                                                headers={"Authorization": bad}), 401)
        # The first request passes auth and fails at the (closed) engine; the second is 429.
        first = await http.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        assert first.status_code == 502
        second = await http.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        assert_openai_error(second, 429, "rate_limit_exceeded")
        assert int(second.headers["Retry-After"]) >= 1
    await proxy.settle()
    # Only the request that reached the engine was logged (as an engine error).
    assert query(db_url, "SELECT status FROM turns") == [("engine_error",)]


async def test_bad_headers_and_unknown_paths(proxy_factory: ProxyFactory, db_url: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "u")
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        body = {"model": "default", "messages": OK_MESSAGES}
        assert_openai_error(await http.post(CHAT, json=body,
                                            headers={**auth, "X-Turn-Type": "weird"}), 400)
        assert_openai_error(await http.post(CHAT, json=body,
                                            headers={**auth, "X-Session-Id": "s" * 300}), 400)
        assert_openai_error(await http.get("/v1/nothing", headers=auth), 404, "not_found")
        assert_openai_error(await http.get(CHAT, headers=auth), 405)
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]
