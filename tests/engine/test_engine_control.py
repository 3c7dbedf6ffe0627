"""Engine control routes: weight swaps under load, refused checkpoints, pause/continue, errors."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawrl.world import model as tinyworld


async def _stream(client: httpx.AsyncClient, body: dict[str, Any],
                  first: asyncio.Event | None = None) -> list[dict[str, Any]]:
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if first is not None:
                    first.set()
    return chunks


def _body(i: int, max_tokens: int = 120) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": max_tokens, "ignore_eos": True, "seed": i,
            "return_output_ids_in_sglext": True}


@pytest.fixture(scope="module")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as the test model, different (seed 1) weights."""
    return tinyworld.init_model_dir(tmp_path_factory.mktemp("v2") / "model", seed=1)


async def last_generate_chunk(client: httpx.AsyncClient, body: dict[str, Any],
                              started: asyncio.Event) -> dict[str, Any]:
    """Stream `/generate`, set `started` at the first chunk, return the last chunk."""
    last: dict[str, Any] = {}
    async with client.stream("POST", "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[6:])
                started.set()
    return last


async def test_weight_update_during_streaming_fails_no_request(
        engine_factory: Any, tiny_model_dir: Path, v2_dir: Path) -> None:
    url = engine_factory(tiny_model_dir)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        firsts = [asyncio.Event() for _ in range(12)]
        streams = [asyncio.create_task(_stream(client, _body(i), firsts[i])) for i in range(12)]
        await asyncio.gather(*(f.wait() for f in firsts))  # all twelve are in flight
        update = await client.post("/update_weights_from_disk",
                                   json={"model_path": str(v2_dir), "weight_version": "v2"})
        assert update.status_code == 200, update.text
        assert update.json()["success"] is True
        old = await asyncio.gather(*streams)
        later = await asyncio.gather(*(_stream(client, _body(i, 5)) for i in range(4)))
        plain = (await client.post("/v1/chat/completions", json=_body(0, 5))).json()
        info = (await client.get("/model_info")).json()
        health = await client.get("/health")
    for chunks in old:  # drained before the swap: complete, old version, never aborted
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        assert finish == "length"
        assert len([c for c in chunks if c.get("sglext")][0]["sglext"]["output_ids"][0]) == 120
        assert {c["metadata"]["weight_version"] for c in chunks} == {"default"}
    for chunks in later:
        assert {c["metadata"]["weight_version"] for c in chunks} == {"v2"}
    assert plain["metadata"] == {"weight_version": "v2"}
    assert info["weight_version"] == "v2" and info["model_path"] == str(v2_dir)
    assert health.status_code == 200


async def test_bad_checkpoints_are_refused_and_old_weights_serve(
        engine_factory: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    other_shape = tinyworld.init_model_dir(tmp_path / "small", size="small")
    url = engine_factory(tiny_model_dir)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for path in (tmp_path / "missing", no_config, corrupt, other_shape):
            r = await client.post("/update_weights_from_disk",
                                  json={"model_path": str(path), "weight_version": "bad"})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["success"] is False and r.json()["message"]
        r = await client.post("/update_weights_from_disk", json={"weight_version": "x"})
        assert r.status_code == 400 and r.json()["success"] is False
        info = (await client.get("/model_info")).json()
        out = (await client.post("/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 3}})).json()
    assert info["weight_version"] == "default" and info["model_path"] == str(tiny_model_dir)
    assert out["meta_info"]["weight_version"] == "default" and len(out["output_ids"]) >= 1


async def test_pause_retract_update_continue(
        engine_factory: Any, tiny_model_dir: Path, v2_dir: Path) -> None:
    url = engine_factory(tiny_model_dir)
    body = {"text": "a long story", "sampling_params": {
        "max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = asyncio.Event()
        task = asyncio.create_task(last_generate_chunk(client, body, started))
        await started.wait()
        paused = await client.post("/pause_generation", json={"mode": "retract"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert (await client.get("/health")).status_code == 503  # busy, not dead
        # Paused: the update skips the lock; the retracted request recomputes under v2.
        update = await client.post("/update_weights_from_disk",
                                   json={"model_path": str(v2_dir), "weight_version": "v2"})
        assert update.json()["success"] is True
        assert not task.done()
        await client.post("/continue_generation", json={})
        last = await task
    meta = last["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 400}
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 400
    assert spans[0]["end"] == spans[1]["start"]
    assert meta["weight_version"] == "v2"


async def test_pause_abort_ends_in_flight_requests(
        engine_factory: Any, tiny_model_dir: Path) -> None:
    url = engine_factory(tiny_model_dir)
    body = {"text": "go", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = asyncio.Event()
        task = asyncio.create_task(last_generate_chunk(client, body, started))
        await started.wait()
        await client.post("/pause_generation", json={})
        last = await task
        queued = asyncio.create_task(client.post("/generate", json={
            "text": "after", "sampling_params": {"max_new_tokens": 2}}))
        await client.post("/continue_generation", json={})
        after = (await queued).json()
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert after["meta_info"]["finish_reason"]["type"] == "length"


BAD_REQUESTS: list[tuple[str, Any, str]] = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", {"messages": []}, "Messages cannot be empty"),
    ("/v1/chat/completions", {"model": "x"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "return_token_ids": True}, "not supported with streaming"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "",
                                            "tool_calls": [{"function": {
                                                "name": "f", "arguments": "{oops"}}]}]},
     "valid JSON"),
    # 3,000 nested brackets: a 400, not a RecursionError and a 500
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "",
                                            "tool_calls": [{"function": {
                                                "name": "f", "arguments": "[" * 3000}}]}]},
     "valid JSON"),
    ("/generate", {"sampling_params": {}}, "Either text or input_ids"),
    ("/generate", {"text": "x", "input_ids": [1]}, "Either text or input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "unknown field 'bogus'"),
    ("/generate", {"text": "x", "sampling_params": {"stop_regex": "a+"}}, "not supported"),
    ("/generate", {"input_ids": [1, 99999]}, "input_ids must be in"),
    ("/generate", {"text": "x", "sampling_params": {"presence_penalty": 3}},
     "presence_penalty must be in [-2, 2]"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"99999": 1}}},
     "logit_bias token ids must be in"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"x": 1}}},
     "logit_bias: token ids and biases must be numbers"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"5": 101}}, "logit_bias values must be in"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "frequency_penalty": -2.5}, "frequency_penalty must be in"),
    ("/generate", {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
     "logprob_start_len"),
    ("/generate", {"input_ids": [1] * 2048}, "longer than the model's context length"),
    ("/generate", {"text": ["a", "b"], "stream": True}, "batch"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_REQUESTS)
async def test_bad_requests_get_400_in_both_error_shapes(
        engine_url: str, path: str, body: Any, needle: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        if isinstance(body, bytes):
            r = await client.post(path, content=body)
        else:
            r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert needle in err["message"] and err["object"] == "error" and err["code"] == 400
    assert err["error"]["message"] == err["message"]
    assert err["error"]["type"] == "invalid_request_error"


async def test_info_routes_and_batch_generate(engine_url: str, tiny_model_dir: Path) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        info = (await client.get("/model_info")).json()
        legacy = (await client.get("/get_model_info")).json()
        models = (await client.get("/v1/models")).json()
        flush = await client.post("/flush_cache")
        health_gen = await client.get("/health_generate")
        batch = (await client.post("/generate", json={
            "text": ["one", "two"], "sampling_params": {"max_new_tokens": 2}})).json()
        aborted = await client.post("/abort_request", json={"rid": "nobody"})
    assert info == legacy and info["weight_version"] == "default"
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert models["data"][0]["id"] == str(tiny_model_dir)
    assert flush.status_code == 200 and health_gen.status_code == 200
    assert len(batch) == 2 and all(1 <= len(b["output_ids"]) <= 2 for b in batch)
    assert aborted.status_code == 200
