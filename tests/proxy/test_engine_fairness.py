"""No one key steers the engine for everyone (docs/proxy.md, "Fair share between keys").

- Prompt size before the engine: a prompt that cannot fit the context is refused by the
  proxy (400 `context_length_exceeded`) without the engine seeing it — by its bytes alone
  when they settle it, else by the served model's tokenizer (bounded) — and the key's tokens
  per minute are charged the counted prompt up front.
- The default in flight per key is a quarter of what the engine runs at once: one key at
  that default leaves another key's p50 within 2x, with long generations.
- Nothing grows before authentication: the key is checked from the headers before the body
  is read, a body must arrive within the read timeout, and routes without a key buffer at
  most a bounded number of bytes in total.

The served tests run the real proxy against the stand-in engine (clawrl/bench/fake_engine.py:
a bounded batch, a per-token time, a context, a count of the requests that reached it) or,
for the socket tests, the proxy app under uvicorn in the test's loop; clients are raw
sockets where what matters is what the proxy reads.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, closed_port_url, create_user

from clawrl.base.db import create_async
from clawrl.base.errors import RateLimited
from clawrl.bench.procs import BenchProcs
from proxy import admin
from proxy.limits import FALLBACK_CONCURRENT, KeyLimits, fair_concurrency
from proxy.prompt_size import CHUNK_CHARS, PromptSizer, prompt_text

CHAT = "/v1/chat/completions"
TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "clawrl/world/prebuilt/tinyworld"
CONTEXT = 4096
WORDS = ["alpha", "river", "stone", "quick", "purple", "seven", "window", "garden"]


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tiny_tokens(text: str) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


# --- what is measured, by hand --------------------------------------------------------


def test_prompt_text_is_what_templates_render() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "  be brief \n"},
            {"role": "user", "content": [{"type": "text", "text": " part one "},
                                         {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "lookup", "arguments": '{ "city" :   "Paris" }'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {
            "name": "lookup", "description": "Find the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    }
    text = prompt_text(body).text.split("\n")
    # Contents stripped, parts, the call's name and the strings inside its arguments (a
    # template may re-serialise them more compactly), the tool result, every string of
    # the tools (keys too).
    assert text[:7] == ["be brief", "part one", "part two", "lookup", "city", "Paris", "sunny"]
    assert {"function", "lookup", "Find the weather", "properties", "city"} <= set(text[7:])
    assert prompt_text({"messages": [{"role": "user", "content": "é"}]}).nbytes == 2


async def test_tokenizer_followed_from_the_engine_and_counting_stops_early() -> None:
    sizer = PromptSizer(max_token_bytes=32)
    assert sizer.tokenizer is None and sizer.max_token_bytes == 32
    await sizer.follow({"model_path": "/nowhere/at/all"})  # not on this machine: bytes only
    assert sizer.tokenizer is None
    await sizer.follow({"tokenizer_path": str(TOKENIZER_DIR), "model_path": "/elsewhere"})
    try:
        assert sizer.tokenizer is not None
        # The tiny vocabulary's longest token is '<|endoftext|>', 13 bytes.
        assert sizer.max_token_bytes == 13
        text = words(800)
        prompt = prompt_text({"messages": [{"role": "user", "content": text}]})
        counted = await sizer.count(prompt, stop_at=10**9)
        exact = tiny_tokens(text)
        assert exact - 2 <= counted <= exact  # at or just under the tokenizer's own count
        assert sizer.bound(prompt) <= counted  # the bytes bound never says more
        # A huge prompt is counted only until it is known not to fit.
        huge = prompt_text({"messages": [{"role": "user", "content": words(400_000)}]})
        stopped = await sizer.count(huge, stop_at=CONTEXT)
        assert CONTEXT <= stopped <= CONTEXT + CHUNK_CHARS
    finally:
        sizer.close()


def test_default_in_flight_is_a_quarter_of_the_engine() -> None:
    assert fair_concurrency(16) == 4 and fair_concurrency(2) == 1
    assert fair_concurrency(None) == FALLBACK_CONCURRENT == 8

    class Key:
        key_id, max_concurrent, rate_limit_tpm = 1, None, 0

    limits = KeyLimits(None, 0)
    slots: list[int | None] = [None]
    limits.engine_slots = lambda: slots[0]
    assert limits.concurrency_for(Key()) == 8
    slots[0] = 32
    assert limits.concurrency_for(Key()) == 8
    slots[0] = 12
    assert limits.concurrency_for(Key()) == 3
    assert KeyLimits(64, 0).concurrency_for(Key()) == 64  # a configured default wins
    own = Key()
    own.max_concurrent = 0
    assert limits.concurrency_for(own) == 0  # the key's own value wins (0: unlimited)


def test_a_refused_prompt_pays_for_what_was_counted() -> None:
    class Key:
        key_id, max_concurrent, rate_limit_tpm = 1, 1, 6000

    now = [0.0]
    limits = KeyLimits(0, 6000, clock=lambda: now[0])
    limits.charge(Key(), 5000)  # counted, then refused: no slot, 5,000 tokens
    with pytest.raises(RateLimited, match="6000 tokens per minute"):
        limits.admit(Key(), 1001)
    lease = limits.admit(Key(), 1000)
    with pytest.raises(RateLimited, match="1 at a time"):
        limits.check_room(Key())  # before counting: no slot, nothing taken
    lease.release(used=10)
    limits.check_room(Key())


# --- prompt size on the served proxy ----------------------------------------------------


@pytest.fixture
def procs(db_url: str, tmp_path: Path) -> Iterator[BenchProcs]:
    env = {"CLAWRL_BENCH_CONTEXT": str(CONTEXT), "CLAWRL_BENCH_SLOTS": "16",
           "CLAWRL_PROXY__TOKENIZER_PATH": str(TOKENIZER_DIR)}
    with BenchProcs(db_url, tmp_path, env=env) as running:
        yield running


async def make_keys(db_url: str, **limits: dict[str, int]) -> dict[str, str]:
    db = create_async(db_url)
    try:
        keys = {}
        for name, own in limits.items():
            await admin.create_user(db, name)
            keys[name] = (await admin.create_key(db, name, **own)).secret
        return keys
    finally:
        await db.dispose()


def engine_requests(procs: BenchProcs) -> int:
    count: int = httpx.get(f"{procs.upstream_url}/bench/stats").json()["chat_requests"]
    return count


def chat(content: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}], **extra}


async def test_prompt_that_cannot_fit_never_reaches_the_engine(procs: BenchProcs,
                                                                db_url: str) -> None:
    keys = await make_keys(db_url, u={}, tight={"rate_limit_tpm": 8000, "max_concurrent": 0})
    procs.configure(reply_s=0.0, tokens=16)
    auth = {"Authorization": f"Bearer {keys['u']}"}
    async with httpx.AsyncClient(base_url=procs.proxy_url, timeout=60, headers=auth) as http:
        before = engine_requests(procs)
        cases = {
            # The 3.8 MB single message: its bytes alone settle it.
            "single message": chat("x" * 3_800_000),
            # 128 tools of 29 KB each: the tools' strings count.
            "tools": {**chat("hi"), "tools": [
                {"type": "function", "function": {
                    "name": f"tool_{i}", "description": "d" * 29_000,
                    "parameters": {"type": "object", "properties": {}}}}
                for i in range(128)]},
            # 32 KB of words: under the bytes bound, over the context by the tokenizer.
            "counted": chat(words(5000)),
            # ~2,000 tokens: fits alone, not with the reply it asks for (the engines' rule).
            "with max_tokens": chat(words(500), max_tokens=3000),
        }
        for name, body in cases.items():
            response = await http.post(CHAT, json=body)
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded", (name, error)
            assert error["type"] == "invalid_request_error" and error["param"] == "messages"
            assert "context length" in error["message"], error
        assert engine_requests(procs) == before  # the engine tokenised none of them
        ok = await http.post(CHAT, json=chat(words(300)))  # ~1,200 tokens: fits
        assert ok.status_code == 200, ok.text
        assert engine_requests(procs) == before + 1

        # Tokens per minute are charged the counted prompt up front: three requests of
        # ~2,800 counted tokens + 1,000 asked for, at once, on a key of 8,000 a minute;
        # by bytes / 4 (~1,200 + 1,000 each) all three would be admitted.
        text = words(700, seed=1)
        counted = tiny_tokens(text)
        assert 2500 < counted < CONTEXT - 1000 and len(text) // 4 + 1000 < 8000 // 3
        procs.configure(reply_s=1.0)  # they overlap: none is corrected before the others
        replies = await asyncio.gather(*(
            http.post(CHAT, json=chat(text, max_tokens=1000),
                      headers={"Authorization": f"Bearer {keys['tight']}"}) for _ in range(3)))
        statuses = sorted(r.status_code for r in replies)
        assert statuses == [200, 200, 429], [r.text for r in replies]
        limited = next(r for r in replies if r.status_code == 429).json()["error"]
        assert "tokens per minute" in limited["message"]
