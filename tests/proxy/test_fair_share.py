"""Fair share between keys: requests in flight and tokens per minute, per key.

The limits' arithmetic is checked on `KeyLimits` with a clock the test moves; what clients
see, and that one key at its limit leaves another key's latency alone, is checked on the
real proxy (its own process) in front of the stand-in engine (clawrl/bench/fake_engine.py),
which takes a fixed time per request and serves a fixed number at a time (an engine's
slots), waiting requests in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from proxyharness import make_keys

from clawrl.base.errors import RateLimited
from clawrl.bench.client import Connection
from clawrl.bench.procs import BenchProcs
from proxy.limits import KeyLimits, estimate_tokens, used_tokens

CHAT = "/v1/chat/completions"


class Key:
    def __init__(self, key_id: int, max_concurrent: int | None = None,
                 rate_limit_tpm: int | None = None) -> None:
        self.key_id = key_id
        self.max_concurrent = max_concurrent
        self.rate_limit_tpm = rate_limit_tpm


def test_in_flight_limit_per_key() -> None:
    limits = KeyLimits(default_concurrent=2, default_tpm=0)
    a, b, free = Key(1), Key(2), Key(3, max_concurrent=0)
    held = [limits.admit(a, 10), limits.admit(a, 10)]
    with pytest.raises(RateLimited) as info:
        limits.admit(a, 10)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
    assert "2 at a time" in info.value.message
    limits.admit(b, 10)  # another key is not affected
    for _ in range(50):
        limits.admit(free, 10)  # 0: unlimited
    held[0].release()
    held[0].release()  # idempotent: frees one slot only
    limits.admit(a, 10)
    with pytest.raises(RateLimited):
        limits.admit(a, 10)
    assert limits.in_flight(1) == 2


def test_tokens_per_minute_admit_on_estimate_then_correct() -> None:
    now = [0.0]
    limits = KeyLimits(default_concurrent=0, default_tpm=600, clock=lambda: now[0])  # 10/s
    key = Key(1)
    lease = limits.admit(key, 500)
    with pytest.raises(RateLimited) as info:
        limits.admit(key, 500)  # 100 left: admission by the estimate
    assert "600 tokens per minute" in info.value.message
    assert info.value.headers["Retry-After"] == "40"  # (500 - 100) / 10 per s
    lease.release(used=50)  # the engine used 50: 450 come back
    limits.admit(key, 500).release(used=600)  # under-estimated: pays the 100 more
    with pytest.raises(RateLimited):
        limits.admit(key, 500)  # 550 - 600 = -50 left
    now[0] = 55.0  # 550 tokens refilled
    limits.admit(key, 500)
    huge = Key(2)
    limits.admit(huge, 10_000)  # more than a minute's worth: waits for a full bucket only
    with pytest.raises(RateLimited):
        limits.admit(huge, 1)


def test_estimates_and_engine_counts() -> None:
    assert estimate_tokens(400, 50) == 150
    assert estimate_tokens(400, None) == 100 + 256
    assert used_tokens([1, 2, 3], [4, 5], {"prompt_tokens": 99}) == 5  # the ids win
    assert used_tokens(None, None, {"prompt_tokens": 7, "completion_tokens": 3}) == 10
    assert used_tokens(None, None, {}) is None


@pytest.fixture
def procs(db_url: str, tmp_path: Path) -> Iterator[BenchProcs]:
    with BenchProcs(db_url, tmp_path) as running:
        yield running


def body(max_tokens: int = 16, stream: bool = False) -> bytes:
    return json.dumps({"model": "default", "max_tokens": max_tokens, "stream": stream,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


async def test_limits_answer_429_openai_shaped(procs: BenchProcs, db_url: str) -> None:
    keys = await make_keys(db_url, one={"max_concurrent": 1},
                           tokens={"rate_limit_tpm": 2000, "max_concurrent": 0})
    procs.configure(reply_s=0.5, tokens=16)
    async with httpx.AsyncClient(base_url=procs.proxy_url, timeout=30) as client:
        def post(key: str, max_tokens: int = 16, stream: bool = False) -> object:
            return client.post(CHAT, content=body(max_tokens, stream),
                               headers={"Authorization": f"Bearer {keys[key]}"})

        first, second = await asyncio.gather(post("one", stream=True), post("one"))
        statuses = sorted([first.status_code, second.status_code])  # type: ignore[attr-defined]
        assert statuses == [200, 429]
        refused = first if first.status_code == 429 else second  # type: ignore[attr-defined]
        assert refused.headers["retry-after"] == "1"  # type: ignore[attr-defined]
        error = refused.json()["error"]  # type: ignore[attr-defined]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "in flight" in error["message"]
        assert (await post("one")).status_code == 200  # the slot is free again

        # 2,000 tokens a minute; each request is admitted for ~1,530 (max_tokens 1,500)
        # but uses 48 (32 prompt + 16 reply ids): the second fits only because the first
        # was corrected to what the engine reported.
        # The replies take 1 s so the concurrent pair overlaps: with an instant engine the
        # first could end (and be corrected to 48) before the second is admitted.
        procs.configure(reply_s=1.0)
        assert (await post("tokens", 1500)).status_code == 200
        assert (await post("tokens", 1500)).status_code == 200
        concurrent = await asyncio.gather(post("tokens", 1500), post("tokens", 1500))
        refused = [r for r in concurrent if r.status_code == 429]  # type: ignore[attr-defined]
        assert len(refused) == 1
        error = refused[0].json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "tokens per minute" in error["message"]
        assert int(refused[0].headers["retry-after"]) >= 1


async def timed(conn: Connection, payload: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    reply = await conn.post(payload)
    return reply.status, time.perf_counter() - start


async def hammer(url: str, key: str, loops: int, stop: asyncio.Event,
                 tally: dict[int, int]) -> None:
    """`loops` clients sending back to back; after a 429 each waits 100 ms (a client that
    retries eagerly but does not spin)."""
    async def loop() -> None:
        conn = Connection(url + CHAT, {"Authorization": f"Bearer {key}"})
        try:
            while not stop.is_set():
                status, _ = await timed(conn, body())
                tally[status] = tally.get(status, 0) + 1
                if status == 429:
                    await asyncio.sleep(0.1)
        finally:
            await conn.close()

    await asyncio.gather(*(loop() for _ in range(loops)))


async def victim_latencies(url: str, key: str, n: int) -> list[float]:
    conn = Connection(url + CHAT, {"Authorization": f"Bearer {key}"})
    out = []
    try:
        for _ in range(n):
            status, seconds = await timed(conn, body())
            assert status == 200
            out.append(seconds)
    finally:
        await conn.close()
    return out


async def p50_beside(url: str, victim: str, hog: str | None, n: int
                     ) -> tuple[float, dict[int, int]]:
    stop, tally = asyncio.Event(), {}
    hogging = (asyncio.create_task(hammer(url, hog, 16, stop, tally))
               if hog is not None else None)
    try:
        if hogging is not None:
            await asyncio.sleep(0.5)  # the hog holds what it can before measuring
        return statistics.median(await victim_latencies(url, victim, n)), tally
    finally:
        stop.set()
        if hogging is not None:
            await hogging


async def test_one_key_at_its_limit_leaves_another_keys_p50(procs: BenchProcs,
                                                             db_url: str) -> None:
    """An engine with 4 slots and 150 ms per request. The hog (16 clients) may hold 2; the
    victim (1 client) keeps its p50 within 2x of its p50 alone. The control — the same hog
    with no limit — does push it past 2x, so the measurement can tell the difference."""
    keys = await make_keys(db_url, victim={}, hog={"max_concurrent": 2},
                           unlimited_hog={"max_concurrent": 0})
    procs.configure(reply_s=0.15, tokens=16, slots=4)
    url = procs.proxy_url
    await victim_latencies(url, keys["victim"], 3)  # warm-up
    alone, _ = await p50_beside(url, keys["victim"], None, 15)
    limited, tally = await p50_beside(url, keys["victim"], keys["hog"], 15)
    control, control_tally = await p50_beside(url, keys["victim"], keys["unlimited_hog"], 8)
    figures = (f"victim p50 alone {alone * 1e3:.0f} ms, beside the limited hog "
               f"{limited * 1e3:.0f} ms ({limited / alone:.2f}x; hog answers {tally}), beside "
               f"the unlimited hog {control * 1e3:.0f} ms ({control / alone:.2f}x; "
               f"{control_tally})")
    print(figures)
    assert tally.get(200, 0) > 0 and tally.get(429, 0) > 0, figures  # it was at its limit
    assert limited <= 2 * alone, figures
    assert control > 2 * alone, figures
    assert 429 not in control_tally, figures
