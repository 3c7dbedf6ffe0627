"""`POST /v1/completions` through the official openai SDK, the real proxy, the real embedded
engine (its `/generate`) and Postgres: the reply, its stream, its logprobs, and the turn with
the prompt's own token ids (no chat template)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, closed_port_url, create_user, query

PROMPT = "Once upon a time"


def direct(engine_url: str, **sampling: Any) -> dict[str, Any]:
    """The engine's own greedy continuation of PROMPT, with its prompt ids."""
    data: dict[str, Any] = httpx.post(f"{engine_url}/generate", json={
        "text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6, **sampling},
        "return_logprob": True, "return_prompt_token_ids": True}, timeout=60).json()
    return data


async def test_completion_is_logged_with_the_prompts_own_ids(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        raw = await client.completions.with_raw_response.create(
            model="default", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
        completion = raw.parse()
    engine = direct(engine_url)
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert choice.text == engine["text"] and choice.index == 0
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(engine["output_ids"])
    assert "".join(choice.logprobs.tokens or []) == choice.text
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs or [])
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(engine["prompt_token_ids"])
    await proxy.settle()
    row = query(db_url, "SELECT request_messages, prompt_ids, response_ids, "
                        "array_length(response_logprobs, 1), params->>'api', status, "
                        "response_message->>'content', sampling->>'temperature' "
                        "FROM turns WHERE uid = %s", raw.headers["x-clawrl-turn-id"])[0]
    assert row[0] == [{"role": "user", "content": PROMPT}]
    assert row[1] == engine["prompt_token_ids"] and row[2] == engine["output_ids"]
    assert row[3] == len(row[2]) and row[4] == "completions" and row[5] == "ok"
    assert row[6] == choice.text and float(row[7]) == 0


async def test_streamed_completion(proxy_factory: ProxyFactory, db_url: str,
                                   engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        stream = await client.completions.create(
            model="default", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    engine = direct(engine_url)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == engine["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(engine["output_ids"])
    await proxy.settle()
    assert query(db_url, "SELECT prompt_ids, response_ids, status FROM turns") == [
        (engine["prompt_token_ids"], engine["output_ids"], "ok")]


async def test_completion_without_max_tokens_is_16_tokens_at_most(
        proxy_factory: ProxyFactory, db_url: str, engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "carol")
    async with proxy.client(key) as client:
        completion = await client.completions.create(model="default", prompt=PROMPT,
                                                      temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens <= 16


BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "n": 2}, "n"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "temperature": 3}, "temperature"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[str(b[0]) for b in BAD])
async def test_bad_completion_requests_are_400_naming_the_field(
        proxy_factory: ProxyFactory, db_url: str, extra: dict[str, Any], param: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "dave")
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        response = await http.post("/v1/completions", json={"model": "default", **extra},
                                   headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


async def test_unknown_model_on_completions_is_404(proxy_factory: ProxyFactory, db_url: str,
                                                   engine_url: str) -> None:
    proxy = await proxy_factory(engine_url)
    _, key = create_user(db_url, "erin")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        response = await http.post("/v1/completions", headers={
            "Authorization": f"Bearer {key}"}, json={"model": "gpt-3.5-turbo-instruct",
                                                      "prompt": PROMPT})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
