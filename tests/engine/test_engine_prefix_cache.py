"""The engine's prefix cache (clawrl/engine/prefix_cache.py): a request sharing a prefix with
an earlier one forwards only the rest, writes what it would have written without the cache,
says how many tokens it skipped, and never reuses KV across weights or adapters; the store
keeps to its memory bound, evicting least recently used leaves first.

Each scheduler here loads its own copy of the model: LoRA hooks read their scheduler's rows,
so two schedulers must not share modules.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from enginerun import run_to_end
from loras import make_adapter

from clawrl.engine.lora import Adapter, read_adapter
from clawrl.engine.prefix_cache import PrefixCache
from clawrl.engine.runtime import load_model
from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence
from clawrl.world import model as tinyworld

BLOCK = 16


def _kv(n_tokens: int, seed: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, n_tokens, 2, generator=g), torch.randn(1, n_tokens, 2, generator=g))
            for _ in range(layers)]


def test_lookup_returns_the_stored_kv_of_whole_blocks_per_namespace() -> None:
    cache = PrefixCache(1 << 20, block=4)
    kv = _kv(10, seed=0)
    cache.insert("base", list(range(10)), kv)
    assert len(cache) == 2  # whole blocks only: 8 of the 10 tokens
    n, past = cache.lookup("base", [*range(10), 99], limit=10)
    assert n == 8
    for (k, v), (k0, v0) in zip(past, kv, strict=True):
        assert k.shape == (1, 1, 8, 2)
        assert torch.equal(k[0], k0[:, :8]) and torch.equal(v[0], v0[:, :8])
    assert cache.lookup("base", [*range(10)], limit=7)[0] == 4       # the caller's bound
    assert cache.lookup("base", [0, 1, 2, 3, 4, 5, 6, 99], limit=99)[0] == 4  # diverges
    assert cache.lookup("base", [1, 2, 3, 4, 5], limit=99)[0] == 0   # not a prefix
    assert cache.lookup(7, list(range(10)), limit=99)[0] == 0        # another adapter
    cache.retire(1)                                                  # new weights
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.lookup("base", list(range(10)), limit=99)[0] == 0
    assert PrefixCache(0).lookup("base", list(range(10)), limit=99)[0] == 0


def test_the_memory_bound_evicts_least_recently_used_leaves_first() -> None:
    per_block = 2 * 2 * 1 * 4 * 2 * 4  # K and V, 2 layers, 1 head, 4 tokens, dim 2, float32
    cache = PrefixCache(5 * per_block, block=4)
    a = list(range(16))                 # 4 blocks
    b = [*range(8), 50, 51, 52, 53, 54, 55, 56, 57]  # shares a's first 2 blocks, then 2 own
    cache.insert("base", a, _kv(16, seed=1))
    cache.insert("base", b, _kv(16, seed=2))
    # 6 distinct blocks do not fit in 5: a's deepest block, the oldest leaf, went.
    assert len(cache) == 5 and cache.nbytes == 5 * per_block
    assert cache.lookup("base", [*a, 0], limit=99)[0] == 12
    assert cache.lookup("base", [*b, 0], limit=99)[0] == 16
    # A chain longer than the whole budget keeps its first blocks, not its last.
    c = list(range(100, 140))
    cache.insert("base", c, _kv(40, seed=3))
    assert cache.nbytes <= cache.budget_bytes
    assert cache.lookup("base", [*c, 0], limit=99)[0] == 20
    assert cache.lookup("base", [*a, 0], limit=99)[0] == 0


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the test model, other weights."""
    return tinyworld.init_model_dir(tmp_path_factory.mktemp("v2") / "model", seed=1)


class Engines:
    """A scheduler with the prefix cache and one without, each on its own copy of a model;
    `prefilled` records how many tokens each forward of the cached one took."""

    def __init__(self, model_dir: Path, budget_bytes: int = 64 << 20) -> None:
        self.model_dir = model_dir
        self.prefilled: list[int] = []
        self.cached = self._scheduler(PrefixCache(budget_bytes, block=BLOCK))
        self.cached.model.register_forward_pre_hook(
            lambda _m, _a, kw: self.prefilled.append(kw["input_ids"].shape[1]),
            with_kwargs=True)
        self.plain = self._scheduler(None)

    def _scheduler(self, cache: PrefixCache | None) -> Scheduler:
        model = load_model(self.model_dir, device="cpu", dtype=torch.float32)
        scheduler = Scheduler(model, eos_ids=set(), decode=lambda ids: "",
                              weight_version="v0", prefix_cache=cache)
        scheduler.start()
        return scheduler

    def adapter(self, scheduler: Scheduler, path: Path) -> Adapter:
        adapter = read_adapter("a", str(path), pinned=False, model=scheduler.model,
                               device="cpu", dtype=torch.float32)
        scheduler.call(lambda: scheduler.lora.attach(scheduler.model,
                                                     set(adapter.weights))).result()
        return adapter

    def run(self, ids: list[int], *, adapters: tuple[Adapter | None, Adapter | None] = (None,
                                                                                     None),
            **kw: Any) -> tuple[Sequence, Sequence]:
        """The same greedy request through both; asserts they wrote the same."""
        out = []
        for scheduler, adapter in zip((self.plain, self.cached), adapters, strict=True):
            seq = Sequence(rid="r", input_ids=list(ids), adapter=adapter, return_logprob=True,
                           top_logprobs_num=3, params=SamplingParams(
                               max_new_tokens=8, temperature=0.0, ignore_eos=True), **kw)
            out.append(run_to_end(scheduler, seq, timeout_s=120))
        plain, cached = out
        assert cached.output_ids == plain.output_ids
        assert cached.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-4)
        assert [[t for _, t in top] for top in cached.output_top] == \
            [[t for _, t in top] for top in plain.output_top]
        assert cached.input_logprobs == pytest.approx(plain.input_logprobs, abs=1e-4)
        return plain, cached

    def stop(self) -> None:
        self.plain.stop()
        self.cached.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_shared_prefix_skips_its_prefill_and_changes_no_output(tiny_model_dir: Path) -> None:
    engines = Engines(tiny_model_dir)
    try:
        system = _prompt(0, 90)
        _, first = engines.run(system + [5, 6, 7])
        assert first.cached_tokens == 0
        # Another request with the same system prompt reuses its 5 whole blocks.
        engines.prefilled.clear()
        _, other = engines.run(system + [9, 10])
        assert other.cached_tokens == 80
        assert engines.prefilled[0] == len(system) + 2 - 80
        # The next turn of the first conversation: prompt + reply + a new message. The KV of
        # all the first request fed (93 prompt + 7 reply tokens) was kept when it ended, so
        # one more block than its prompt alone made is reused.
        turn = system + [5, 6, 7] + first.output_ids + [11, 12, 13]
        engines.prefilled.clear()
        _, second = engines.run(turn)
        assert second.cached_tokens == 80 + BLOCK
        assert engines.prefilled[0] == len(turn) - second.cached_tokens
        # Scoring with input logprobs reuses only what precedes the first scored position.
        _, scored = engines.run(turn, logprob_start_len=40)
        assert scored.cached_tokens == 32 and len(scored.input_logprobs) == len(turn) - 40
        assert engines.cached.cached_tokens == 80 + 96 + 32
        assert engines.plain.cached_tokens == 0
    finally:
        engines.stop()


def test_a_weight_swap_or_an_adapter_never_reuses_other_kv(
        tiny_model_dir: Path, v2_dir: Path, tmp_path: Path) -> None:
    engines = Engines(tiny_model_dir)
    try:
        prompt = _prompt(1, 70)
        engines.run(prompt)
        assert engines.run(prompt + [3])[1].cached_tokens == 64
        # New weights under the same version label: nothing cached serves them.
        for scheduler in (engines.plain, engines.cached):
            scheduler.swap_model(load_model(v2_dir, device="cpu", dtype=torch.float32), "v0")
        assert engines.run(prompt + [4])[1].cached_tokens == 0
        assert engines.run(prompt + [5])[1].cached_tokens == 64
        # An adapter's KV and the base model's are kept apart, both ways.
        path = make_adapter(v2_dir, tmp_path / "adapter", seed=3)
        pair = (engines.adapter(engines.plain, path), engines.adapter(engines.cached, path))
        assert engines.run(prompt + [6], adapters=pair)[1].cached_tokens == 0
        assert engines.run(prompt + [7], adapters=pair)[1].cached_tokens == 64
        assert engines.run(prompt + [8])[1].cached_tokens == 64  # the base's own blocks
        # The same adapter loaded again is a new load: its KV starts afresh.
        again = (engines.adapter(engines.plain, path), engines.adapter(engines.cached, path))
        assert engines.run(prompt + [9], adapters=again)[1].cached_tokens == 0
    finally:
        engines.stop()


def test_a_small_budget_keeps_the_latest_prefix(tiny_model_dir: Path) -> None:
    config = load_model(tiny_model_dir, device="cpu", dtype=torch.float32).config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K, V
    engines = Engines(tiny_model_dir, budget_bytes=5 * BLOCK * per_token)
    try:
        a, b = _prompt(2, 70), _prompt(3, 70)
        engines.run(a)
        engines.run(b)  # 4 + 4 blocks > 5: a's 3 deepest blocks, the oldest leaves, go
        cache = engines.cached.prefix_cache
        assert len(cache) == 5 and cache.nbytes <= cache.budget_bytes
        assert engines.run(b + [1])[1].cached_tokens == 64
        assert engines.run(a + [1])[1].cached_tokens == BLOCK
    finally:
        engines.stop()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


async def test_the_server_reports_cached_tokens_and_flushes(
        engine_factory: Any, tiny_model_dir: Path) -> None:
    url = engine_factory(tiny_model_dir, "--prefix-cache-mb", "4")
    system = {"role": "system", "content": "You are a careful agent. " * 40}

    async def chat(client: httpx.AsyncClient, question: str) -> dict[str, Any]:
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            "messages": [system, {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    def cached(answer: dict[str, Any]) -> int:
        n: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        return n

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        first = await chat(client, "Hi?")
        second = await chat(client, "And you?")
        assert cached(first) == 0
        assert cached(second) >= 128 and cached(second) % 64 == 0
        assert cached(second) < second["usage"]["prompt_tokens"]
        # /generate shares the store: the chat's prompt ids hit it too.
        ids = second["choices"][0]["prompt_token_ids"]
        out = (await client.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 1}})).json()
        assert out["meta_info"]["cached_tokens"] == cached(second)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "sglang:cached_tokens_total") == 2 * cached(second)
        assert 0 < _metric(metrics, "clawrl_engine_prefix_cache_bytes") <= 4 * 2**20
        assert 0 < _metric(metrics, "sglang:cache_hit_rate") < 1
        # /flush_cache empties it, as SGLang's flushes its radix cache.
        assert (await client.post("/flush_cache")).status_code == 200
        assert _metric((await client.get("/metrics")).text,
                       "clawrl_engine_prefix_cache_bytes") == 0
        assert cached(await chat(client, "Again?")) == 0
        # A weight update drops it (the same directory: still new weights, same label).
        r = await client.post("/update_weights_from_disk",
                              json={"model_path": str(tiny_model_dir)})
        assert r.json()["success"] is True
        assert cached(await chat(client, "Again?")) == 0
        assert cached(await chat(client, "Again?")) > 0
