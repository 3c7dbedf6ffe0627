"""LoRA adapters in `clawrl engine`: SGLang's load/unload routes, per-row adapters in one batch,
LRU eviction, and outputs equal to transformers + peft on the same adapter. The tests share
one engine: each starts with every adapter unloaded."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from loras import make_adapter, quiet_peft

ADMIN = {"Authorization": "Bearer admin-key"}
USER = {"Authorization": "Bearer user-key"}
KEYS = ("--api-key", "user-key", "--admin-api-key", "admin-key")
PROMPT = [5, 17, 42, 99, 7, 3]
STEPS = 12


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int],
                steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and each token's log-softmax, by transformers (+ peft), no cache."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir))
    if adapter is not None:
        with quiet_peft():
            model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(),
                                     dim=-1)
            token = int(logp.argmax())
            ids.append(token)
            logps.append(float(logp[token]))
    return ids[len(prompt):], logps


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model_dir, root / name, seed)
            for seed, name in enumerate(["a", "b", "c"], start=1)}


@pytest.fixture(scope="module")
def shared_engine(module_engine_factory: Any, tiny_model_dir: Path) -> str:
    """One engine for the module's tests (LRU bound 2, user and admin keys)."""
    return str(module_engine_factory(tiny_model_dir, "--max-loaded-loras", "2", *KEYS))


@pytest.fixture
def engine(shared_engine: str) -> str:
    """The shared engine with no adapter loaded, as a test finds a fresh one. (A name an
    earlier test's LRU evicted stays reloadable, as in SGLang; every test loads a name before
    it uses one, and unloads forget them.)"""
    models = httpx.get(f"{shared_engine}/v1/models", headers=USER).json()["data"]
    for model in models[1:]:
        r = httpx.post(f"{shared_engine}/unload_lora_adapter", headers=ADMIN,
                       json={"lora_name": model["id"]}, timeout=60)
        assert r.status_code == 200, r.text
    return shared_engine


def _generate(prompts: list[list[int]], lora: Any) -> dict[str, Any]:
    return {"input_ids": prompts, "lora_path": lora, "return_logprob": True,
            "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}}


async def _load(client: httpx.AsyncClient, name: str, path: Path,
                pinned: bool = False) -> httpx.Response:
    return await client.post("/load_lora_adapter", headers=ADMIN,
                             json={"lora_name": name, "lora_path": str(path), "pinned": pinned})


async def test_adapters_match_peft_alone_and_mixed_in_one_batch(
        engine: str, tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    url = engine
    expected = {name: peft_greedy(tiny_model_dir, adapters.get(name or ""), PROMPT, STEPS)
                for name in (None, "a", "b")}
    assert len({tuple(ids) for ids, _ in expected.values()}) == 3  # the adapters matter
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=USER) as client:
        r = await client.post("/load_lora_adapter", headers=USER,
                              json={"lora_name": "a", "lora_path": str(adapters["a"])})
        assert r.status_code == 401  # a control route: the admin key only
        for name in ("a", "b"):
            r = await _load(client, name, adapters[name])
            assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "error_message": "",
                            "loaded_adapters": {"a": str(adapters["a"]),
                                                "b": str(adapters["b"])}}
        assert (await client.get("/v1/models", headers={})).status_code == 200  # USER key
        assert (await client.get("/v1/models", headers={"Authorization": ""})).status_code == 401
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models][1:] == [
            ("a", models[0]["id"]), ("b", models[0]["id"])]

        def check(meta: dict[str, Any], ids: list[int], name: str | None) -> None:
            want_ids, want_logps = expected[name]
            assert ids == want_ids, name
            got = [lp for lp, _, _ in meta["output_token_logprobs"]]
            assert max(abs(g - w) for g, w in zip(got, want_logps, strict=True)) < 1e-4, name

        for name in (None, "a", "b"):  # alone
            out = (await client.post("/generate", json=_generate([PROMPT], [name]))).json()[0]
            check(out["meta_info"], out["output_ids"], name)
        # One request, three rows: prefilled one by one, then decoded as one batch of 3
        # (base, a, b) — the rows share every forward.
        names = [None, "a", "b", "a"]
        r = await client.post("/generate", json=_generate([PROMPT] * 4, names))
        for name, out in zip(names, r.json(), strict=True):
            check(out["meta_info"], out["output_ids"], name)
        # Chat picks the adapter by `model: "base:adapter"` or `lora_path`, as in SGLang.
        served = models[0]["id"]
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body
                                         in ({**chat, "model": f"{served}:b"},
                                             {**chat, "model": "x:b"},
                                             {**chat, "lora_path": "b"},
                                             {**chat, "model": served})))
        ids = [r.json()["choices"][0]["response_token_ids"] for r in replies]
        assert ids[0] == ids[1] == ids[2] != ids[3]


async def test_unknown_adapters_are_clean_errors_and_lru_evicts(
        engine: str, tiny_model_dir: Path, adapters: dict[str, Path],
        tmp_path: Path) -> None:
    url = engine  # --max-loaded-loras 2
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=USER) as client:
        r = await client.post("/unload_lora_adapter", headers=ADMIN, json={"lora_name": "nope"})
        assert r.status_code == 400
        assert r.json()["success"] is False and "nope" in r.json()["error_message"]
        for body in ({"lora_name": "x", "lora_path": str(tmp_path / "missing")},
                     {"lora_name": "x", "lora_path": str(tiny_model_dir)},  # no adapter config
                     {"lora_name": "x"}):
            r = await client.post("/load_lora_adapter", headers=ADMIN, json=body)
            assert r.status_code == 400 and r.json()["success"] is False
            assert r.json()["error_message"] and r.json()["loaded_adapters"] == {}

        # A request naming an adapter that was never loaded: 400, OpenAI-shaped, both routes.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for path, body in (("/v1/chat/completions", {**chat, "model": "base:ghost"}),
                           ("/v1/chat/completions", {**chat, "stream": True,
                                                     "lora_path": "ghost"}),
                           ("/generate", {"text": "hi", "lora_path": "ghost"})):
            r = await client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "ghost" in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "invalid_request_error"

        async def loaded() -> list[str]:
            return [m["id"] for m in (await client.get("/v1/models")).json()["data"][1:]]

        async def use(name: str) -> None:
            r = await client.post("/generate", json=_generate([PROMPT], name))
            assert r.status_code == 200, r.text

        assert (await _load(client, "a", adapters["a"])).status_code == 200
        assert (await _load(client, "b", adapters["b"])).status_code == 200
        await use("a")  # now b is the least recently used
        r = await _load(client, "c", adapters["c"])
        assert set(r.json()["loaded_adapters"]) == {"a", "c"}
        # An evicted adapter is reloaded by the next request naming it (SGLang's cache of
        # known adapters), evicting the LRU one in turn.
        await use("b")
        assert sorted(await loaded()) == ["b", "c"]
        # An unloaded one is gone for good.
        r = await client.post("/unload_lora_adapter", headers=ADMIN, json={"lora_name": "b"})
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"c": str(adapters["c"])}
        r = await client.post("/generate", json=_generate([PROMPT], "b"))
        assert r.status_code == 400 and "never been loaded" in r.json()["error"]["message"]
        # Pinned adapters are never evicted; a full set of pinned ones refuses a new load.
        await client.post("/unload_lora_adapter", headers=ADMIN, json={"lora_name": "c"})
        assert (await _load(client, "a", adapters["a"], pinned=True)).status_code == 200
        assert (await _load(client, "b", adapters["b"])).status_code == 200
        r = await _load(client, "c", adapters["c"])
        assert set(r.json()["loaded_adapters"]) == {"a", "c"}
        assert (await _load(client, "b", adapters["b"], pinned=True)).status_code == 200
        r = await _load(client, "x", adapters["b"])
        assert r.status_code == 400 and "pinned" in r.json()["error_message"]
        r = await _load(client, "a", adapters["a"])
        assert r.status_code == 400 and "already loaded" in r.json()["error_message"]


async def _stream(client: httpx.AsyncClient, body: dict[str, Any],
                  started: asyncio.Event) -> tuple[float, list[dict[str, Any]]]:
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                started.set()
    return time.monotonic(), chunks


async def test_unload_waits_for_in_flight_and_lru_skips_adapters_in_use(
        engine: str, adapters: dict[str, Path]) -> None:
    url = engine  # --max-loaded-loras 2
    long = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 300,
            "ignore_eos": True, "lora_path": "a"}
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=USER) as client:
        for name in ("a", "b"):
            assert (await _load(client, name, adapters[name])).status_code == 200
        started = asyncio.Event()
        stream = asyncio.create_task(_stream(client, long, started))
        await started.wait()
        r = await client.post("/generate", json=_generate([PROMPT], "b"))  # a is now the LRU
        assert r.status_code == 200
        r = await _load(client, "c", adapters["c"])  # evicts b: a is in use
        assert set(r.json()["loaded_adapters"]) == {"a", "c"}
        assert not stream.done()

        unload = asyncio.create_task(client.post("/unload_lora_adapter", headers=ADMIN,
                                                 json={"lora_name": "a"}))
        await asyncio.sleep(0.3)
        # Unregistered at once: new requests for it are refused while the old one runs.
        r = await client.post("/generate", json=_generate([PROMPT], "a"))
        assert r.status_code == 400
        ended, chunks = await stream
        r = await unload
        unloaded = time.monotonic()
        assert r.status_code == 200 and r.json()["loaded_adapters"] == {"c": str(adapters["c"])}
        assert unloaded >= ended - 0.05  # the unload returned only after the stream ended
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["delta"].get("content") or "") for c in chunks
                   if c["choices"]) > 0


async def test_an_adapter_folder_with_a_chat_template_renders_its_requests(
        engine: str, tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """A chat request naming an adapter whose folder has `chat_template.jinja` is rendered with
    that template (the judge's ChatML without a system message), also after the LRU evicted
    it; the base model and an adapter without one keep the model's own template."""
    import shutil

    from transformers import AutoTokenizer

    own = tmp_path / "templated"
    shutil.copytree(adapters["a"], own)
    template = ("{% for m in messages %}{{ '<<' + m['role'] + '>>' + m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<<assistant>>' }}{% endif %}")
    (own / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    messages = [{"role": "user", "content": "rate this reply"}]
    expected_own = tokenizer.encode("<<user>>rate this reply<<assistant>>",
                                    add_special_tokens=False)
    expected_base = tokenizer.encode(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert expected_own != expected_base
    async with httpx.AsyncClient(base_url=engine, timeout=120, headers=USER) as client:

        async def prompt_of(lora: str | None) -> list[int]:
            body: dict[str, Any] = {"messages": messages, "max_tokens": 1,
                                    "return_token_ids": True}
            if lora is not None:
                body["lora_path"] = lora
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return list(r.json()["choices"][0]["prompt_token_ids"])

        assert (await _load(client, "judge", own)).status_code == 200
        assert (await _load(client, "a", adapters["a"])).status_code == 200
        assert await prompt_of("judge") == expected_own
        assert await prompt_of("a") == expected_base
        assert await prompt_of(None) == expected_base
        assert (await _load(client, "b", adapters["b"])).status_code == 200  # evicts judge
        names = [m["id"] for m in (await client.get("/v1/models")).json()["data"][1:]]
        assert "judge" not in names
        assert await prompt_of("judge") == expected_own  # rendered as before, then reloaded
