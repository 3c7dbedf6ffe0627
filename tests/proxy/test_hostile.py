"""The hostile-input suite: a corpus of unfriendly chat bodies sent through the real proxy to
the real embedded engine, with real Postgres behind. Whatever comes in, the proxy answers
without a 5xx, the turn writer stays up, and every accepted turn is stored (turns ==
answers 200, nothing in dead_letters).

Run `pytest tests/proxy/test_hostile.py -s` to see the figures (requests tried, 5xx
answers, writer restarts, turns stored vs accepted).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
from proxyharness import ProxyFactory, create_user, query

CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}


def nest(depth: int, leaf: Any = "x") -> Any:
    value = leaf
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


def deep_text(depth: int) -> bytes:
    """Nesting as raw JSON text, for depths no Python encoder would produce."""
    return b"[" * depth + b"1" + b"]" * depth


def call(arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


def conversation_with_call(arguments: Any) -> list[Any]:
    return [USER, call(arguments), {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "go on"}]


def corpus() -> Iterator[tuple[str, bytes | dict[str, Any], dict[str, Any]]]:
    """(name, body, extra headers): JSON bodies as dicts, raw bodies as bytes."""
    base: dict[str, Any] = {"model": "default", "max_tokens": 2, "temperature": 0}
    ok = {**base, "messages": [USER]}
    yield "plain", ok, {}
    yield "plain stream", {**ok, "stream": True}, {}
    # Deep nesting in every field, within and past the parser's own limit.
    fields = ["messages", "model", "tools", "tool_choice", "response_format", "stop",
              "stream_options", "logit_bias", "user", "seed", "temperature", "max_tokens"]
    for field in fields:
        for depth in (70, 500):
            yield f"deep {field} {depth}", {**ok, field: nest(depth)}, {}
    yield "deep message content", {**base, "messages": [
        {"role": "user", "content": nest(300)}]}, {}
    yield "deep tool parameters", {**ok, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": nest(200)}}]}, {}
    yield "deep content part", {**base, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "extra": nest(100)}]}]}, {}
    for depth in (1000, 5000, 100_000):
        yield f"raw nesting {depth}", deep_text(depth), {}
        raw = json.dumps(ok).encode()[:-1] + b', "x": ' + deep_text(depth) + b"}"
        yield f"raw nesting in a field {depth}", raw, {}
    # NUL everywhere.
    yield "nul in content", {**base, "messages": [{"role": "user", "content": "a\x00b"}]}, {}
    yield "nul in model", {**ok, "model": "ti\x00ny"}, {}
    yield "nul in name", {**base, "messages": [{**USER, "name": "a\x00"}]}, {}
    yield "nul in key", {**base, "messages": [{**USER, "\x00": 1}]}, {}
    yield "nul in arguments", {**base, "messages": conversation_with_call('{"a": "\\u0000"}')}, {}
    yield "nul in stop", {**ok, "stop": ["\x00"]}, {}
    yield "raw nul byte", b'{"messages": [{"role": "user", "content": "a\x00"}]}', {}
    # Big strings (the limit is 4 MB), and many small things.
    yield "10 MB content", {**base, "messages": [{"role": "user", "content": "x" * 10_000_000}]}, {}
    yield "3 MB content", {**base, "messages": [{"role": "user", "content": "x" * 3_000_000}]}, {}
    yield "10,000 messages", {**base, "messages": [USER] * 10_000}, {}
    yield "10,000 content parts", {**base, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}] * 10_000}]}, {}
    yield "10,000 tools", {**ok, "tools": [{"type": "function", "function": {"name": "f"}}]
                           * 10_000}, {}
    yield "long model name", {**ok, "model": "default" * 100_000}, {}
    yield "long header session", ok, {"X-Session-Id": "s" * 10_000}
    yield "bad turn type", ok, {"X-Turn-Type": "é".encode() * 10}
    # Invalid UTF-8 and other broken encodings.
    yield "invalid utf-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', {}
    yield "lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}
    yield "overlong utf-8", b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', {}
    yield "utf-16 body", json.dumps(ok).encode("utf-16"), {}
    yield "bom", b"\xef\xbb\xbf" + json.dumps(ok).encode(), {}
    yield "empty body", b"", {}
    yield "trailing garbage", json.dumps(ok).encode() + b"}}}", {}
    # Huge and odd numbers.
    for field in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                  "top_logprobs", "n", "top_k", "frequency_penalty"):
        for raw_number in (b"1e308", b"-1e308", b"1e999", b"123456789012345678901234567890",
                           b"18446744073709551616", b"-0", b"NaN", b"Infinity", b"0.5", b"-1"):
            raw = json.dumps(ok).encode()[:-1] + f', "{field}": '.encode() + raw_number + b"}"
            yield f"{field}={raw_number.decode()}", raw, {}
    yield "huge int content", b'{"messages": [{"role": "user", "content": ' \
        + b"9" * 5000 + b"}]}", {}
    # Roles.
    for role in ("wizard", "", "SYSTEM", "function", None, 5, ["user"], "user\x00"):
        yield f"role {role!r}", {**base, "messages": [{"role": role, "content": "x"}]}, {}
    yield "tool without id", {**base, "messages": [{"role": "tool", "content": "x"}]}, {}
    yield "system only", {**base, "messages": [{"role": "system", "content": "x"}]}, {}
    yield "assistant last", {**base, "messages": [USER, {"role": "assistant",
                                                         "content": "y"}]}, {}
    # Think-tag floods (the old lazy regex was quadratic on these).
    flood = "<think>" * 50_000
    yield "think flood reply", {**base, "messages": [
        USER, {"role": "assistant", "content": flood}, {"role": "user", "content": "ok"}]}, {}
    yield "think flood user", {**base, "messages": [{"role": "user", "content": flood}]}, {}
    yield "think pairs", {**base, "messages": [
        USER, {"role": "assistant", "content": "<think></think>" * 20_000 + "a"},
        {"role": "user", "content": "ok"}]}, {}
    yield "short think", {**base, "messages": [
        USER, {"role": "assistant", "content": "<think>hmm</think>hello"},
        {"role": "user", "content": "ok"}]}, {}
    # Tool calls with broken arguments.
    for name, arguments in [("brackets 3000", "[" * 3000), ("braces 3000", "{" * 3000),
                            ("brackets 60", "[" * 60), ("not json", "not json"),
                            ("empty", ""), ("null", "null"), ("nan", '{"a": NaN}'),
                            ("unterminated", '{"a": "'), ("quotes", '"' * 10_000),
                            ("dict", {"a": 1}), ("deep dict", nest(100)), ("number", 5),
                            ("list", ["a"]), ("huge", "[" + "1," * 500_000 + "1]"),
                            ("escaped deep", json.dumps("[" * 3000))]:
        yield f"arguments {name}", {**base, "messages": conversation_with_call(arguments)}, {}
    yield "tool call no function", {**base, "messages": [
        USER, {"role": "assistant", "tool_calls": [{"id": "x"}]}, USER]}, {}
    yield "tool calls not a list", {**base, "messages": [
        USER, {"role": "assistant", "tool_calls": "x"}, USER]}, {}
    # Shapes.
    for name, body in [("array", [ok]), ("string", "hi"), ("null", None), ("number", 1),
                       ("messages object", {**base, "messages": {"0": USER}}),
                       ("message string", {**base, "messages": ["hi"]}),
                       ("content object", {**base, "messages": [{"role": "user",
                                                                 "content": {"a": 1}}]})]:
        yield f"shape {name}", json.dumps(body).encode(), {}


async def test_hostile_corpus(proxy_factory: ProxyFactory, db_url: str,
                              engine_url: str) -> None:
    proxy = await proxy_factory(engine_url, read_timeout_s=120)
    writer = proxy.app.state.writer
    _, key = create_user(db_url, "mallory")
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    tried = 0
    async with httpx.AsyncClient(base_url=proxy.url, timeout=180) as http:
        for name, body, headers in corpus():
            tried += 1
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await http.post(CHAT, content=content, headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/json",
                **headers})
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                failures.append(f"{name}: {response.status_code} {response.text[:200]}")
            elif response.status_code != 200:
                error = response.json()["error"]
                assert error["message"] and error["type"], name
            assert writer.alive, f"writer down after {name}"
        await proxy.settle(60)
        ready = await http.get("/readyz")
    accepted = statuses[200]
    stored = query(db_url, "SELECT count(*) FROM turns")[0][0]
    dead = query(db_url, "SELECT count(*) FROM dead_letters")[0][0]
    print(f"\nhostile corpus: {tried} requests tried, {sum(v for s, v in statuses.items() if s >= 500)}"
          f" 5xx, writer restarts {writer.restarts}, turns stored {stored} / accepted "
          f"{accepted}, dead letters {dead}, statuses {dict(sorted(statuses.items()))}")
    assert not failures, failures
    assert writer.restarts == 0 and ready.status_code == 200
    assert stored == accepted and dead == 0
