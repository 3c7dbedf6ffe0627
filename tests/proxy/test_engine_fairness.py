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
from proxyharness import ProxyFactory, closed_port_url, create_user, make_keys

from clawrl.base.errors import RateLimited
from clawrl.bench.procs import BenchProcs
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


def engine_requests(procs: BenchProcs) -> int:
    count: int = httpx.get(f"{procs.upstream_url}/bench/stats").json()["chat_requests"]
    return count


def chat(content: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": "default", "max_tokens": max_tokens,
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


# --- the default in flight per key --------------------------------------------------------


async def timed(http: httpx.AsyncClient, key: str, max_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    reply = await http.post(CHAT, json=chat("hello", max_tokens=max_tokens),
                            headers={"Authorization": f"Bearer {key}"})
    return reply.status_code, time.perf_counter() - start


async def victim_p50(url: str, victim: str, hog: str | None, n: int
                     ) -> tuple[float, dict[int, int]]:
    """The victim's p50 over `n` short requests (40 tokens), one at a time, while `hog`
    (when given) runs 20 clients of long generations (200 tokens) back to back; after a
    429 a hog client waits 100 ms."""
    stop, tally = asyncio.Event(), {}

    async def hog_client(http: httpx.AsyncClient) -> None:
        assert hog is not None
        while not stop.is_set():
            status, _ = await timed(http, hog, 200)
            tally[status] = tally.get(status, 0) + 1
            if status == 429:
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        hogs = [asyncio.create_task(hog_client(http)) for _ in range(20 if hog else 0)]
        try:
            if hogs:
                await asyncio.sleep(1.0)  # the hog holds what it can before measuring
            latencies = []
            for _ in range(n):
                status, seconds = await timed(http, victim, 40)
                assert status == 200
                latencies.append(seconds)
            return statistics.median(latencies), tally
        finally:
            stop.set()
            await asyncio.gather(*hogs)


async def test_one_key_at_the_default_leaves_another_keys_p50(procs: BenchProcs,
                                                               db_url: str) -> None:
    """An engine of 16 slots at 5 ms a token (a 200-token generation holds a slot 1 s).
    The hog, with the default limit, may hold 16 / 4 = 4; the victim keeps its p50 within
    2x of its p50 alone. The control — the same hog with no limit — takes every slot and
    pushes the victim past 2x, so the measurement can tell the difference."""
    keys = await make_keys(db_url, victim={}, hog={}, unlimited={"max_concurrent": 0})
    procs.configure(token_s=0.005, slots=16)
    url = procs.proxy_url
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(3):  # warm-up
            await timed(http, keys["victim"], 40)
    alone, _ = await victim_p50(url, keys["victim"], None, 9)
    limited, tally = await victim_p50(url, keys["victim"], keys["hog"], 9)
    control, control_tally = await victim_p50(url, keys["victim"], keys["unlimited"], 5)
    figures = (f"victim p50 alone {alone * 1e3:.0f} ms, beside the hog at the default "
               f"{limited * 1e3:.0f} ms ({limited / alone:.2f}x; hog answers {tally}), beside "
               f"the unlimited hog {control * 1e3:.0f} ms ({control / alone:.2f}x; "
               f"{control_tally})")
    print(figures)
    assert tally.get(200, 0) > 0 and tally.get(429, 0) > 0, figures  # it was at its limit
    assert limited <= 2 * alone, figures
    assert control > 2 * alone, figures
    # The default followed the engine's 16 running requests: 4 at a time.
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        held = [asyncio.create_task(timed(http, keys["hog"], 200)) for _ in range(4)]
        await asyncio.sleep(0.3)
        refused = await http.post(CHAT, json=chat("x"),
                                  headers={"Authorization": f"Bearer {keys['hog']}"})
        await asyncio.gather(*held)
    assert refused.status_code == 429 and "the limit is 4 at a time" in refused.text


# --- nothing grows before authentication ------------------------------------------------


class Raw:
    """One raw HTTP/1.1 connection: what the proxy answers, and whether it closed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Raw:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send_head(self, path: str, length: int, key: str | None = None,
                        body: bytes = b"") -> None:
        head = (f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n")
        if key is not None:
            head += f"Authorization: Bearer {key}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        await self.writer.drain()

    async def answer(self, timeout_s: float = 20.0) -> tuple[int, dict[str, Any], bool]:
        """The status and JSON body of the answer, and whether the connection then closed
        (EOF or reset within 5 s)."""
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        body = await self.reader.readexactly(int(headers["content-length"]))
        try:
            async with asyncio.timeout(5):
                closed = await self.reader.read(1) == b""
        except ConnectionError:
            closed = True
        except TimeoutError:
            closed = False
        return status, json.loads(body) if body else {}, closed

    def close(self) -> None:
        self.writer.close()


async def test_no_key_no_body_read(proxy_factory: ProxyFactory, db_url: str) -> None:
    """60 connections each declaring a 4 MB body, sending 64 KB of it and holding back the
    rest, with no key or a made-up one: every one is answered 401 from its headers (the
    body is never waited for) and closed; the same on the other routes that take a key."""
    proxy = await proxy_factory(closed_port_url(), admin_key="sekrit-admin-key-0123")
    size = 4 * 1024 * 1024
    made_up = "ck-0123456789ab-" + "x" * 43

    async def one(i: int) -> tuple[int, dict[str, Any], bool]:
        conn = await Raw.open(proxy.url)
        try:
            await conn.send_head(CHAT, size, key=made_up if i % 2 else None,
                                 body=b"x" * 65536)
            return await conn.answer()
        finally:
            conn.close()

    answers = await asyncio.gather(*(one(i) for i in range(60)))
    for status, body, closed in answers:
        assert status == 401 and body["error"]["type"] == "authentication_error", body
        assert closed
    codes = {body["error"]["code"] for _, body, _ in answers}
    assert codes == {"missing_api_key", "invalid_api_key"}
    for path in ("/v1/responses", "/v1/feedback", "/v1/sessions/s/outcome", "/admin/users"):
        conn = await Raw.open(proxy.url)
        try:
            await conn.send_head(path, size, body=b"{")
            status, body, closed = await conn.answer()
        finally:
            conn.close()
        assert (status, closed) == (401, True), (path, body)
    assert proxy.app.unauth_budget.held == 0  # type: ignore[attr-defined]


async def test_a_body_held_back_is_cut_at_the_read_timeout(proxy_factory: ProxyFactory,
                                                           db_url: str) -> None:
    """A client that sends all but the last byte is answered 408 at the read timeout (1 s
    here) and its connection closed: on chat, on another keyed route and on one without a
    key (whose bytes are given back)."""
    proxy = await proxy_factory(closed_port_url(), body_timeout_s=1.0)
    _, key = create_user(db_url, "u")
    for path, with_key in ((CHAT, True), ("/v1/feedback", True), ("/nowhere", False)):
        conn = await Raw.open(proxy.url)
        try:
            start = time.monotonic()
            await conn.send_head(path, 1000, key=key if with_key else None, body=b"x" * 999)
            status, body, closed = await conn.answer()
            waited = time.monotonic() - start
        finally:
            conn.close()
        assert status == 408 and body["error"]["code"] == "request_timeout", (path, body)
        assert closed, path
        assert waited >= 1.0, path  # not before the timeout
    assert proxy.app.unauth_budget.held == 0  # type: ignore[attr-defined]


async def test_unauthenticated_bytes_are_bounded_in_total(proxy_factory: ProxyFactory,
                                                          db_url: str) -> None:
    """Routes without a key (here an unknown path; the console's sign-in alike) take bodies
    of at most `max_unauth_body_bytes`, and hold at most `max_unauth_buffered_bytes` of them
    at once: two stalled 50 KB bodies hold 100 KB of 120 KB (the gauge says so), a third
    is 503 at once, and when the two are cut at the timeout the bytes come back."""
    proxy = await proxy_factory(closed_port_url(), body_timeout_s=3.0,
                                max_unauth_body_bytes=60_000,
                                max_unauth_buffered_bytes=120_000)

    async def gauge() -> float:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            text = (await http.get("/metrics")).text
        line = next(line for line in text.splitlines()
                    if line.startswith("clawrl_unauth_body_bytes "))
        return float(line.split()[1])

    stalled = [await Raw.open(proxy.url) for _ in range(2)]
    try:
        for conn in stalled:
            await conn.send_head("/nowhere", 50_000, body=b"x" * 10)
        deadline = time.monotonic() + 10
        while await gauge() != 100_000:
            assert time.monotonic() < deadline, await gauge()
            await asyncio.sleep(0.05)
        third = await Raw.open(proxy.url)
        try:
            await third.send_head("/nowhere", 50_000, body=b"x" * 10)
            status, body, _ = await third.answer(timeout_s=2.0)
        finally:
            third.close()
        assert status == 503 and body["error"]["code"] == "server_busy", body
        too_big = await Raw.open(proxy.url)
        try:
            await too_big.send_head("/nowhere", 60_001)
            status, body, _ = await too_big.answer(timeout_s=2.0)
        finally:
            too_big.close()
        assert status == 413, body
        for conn in stalled:
            status, _, closed = await conn.answer()
            assert (status, closed) == (408, True)
    finally:
        for conn in stalled:
            conn.close()
    assert await gauge() == 0
    async with httpx.AsyncClient(base_url=proxy.url) as http:  # room again
        response = await http.post("/nowhere", content=b"x" * 50_000)
    assert response.status_code == 404
