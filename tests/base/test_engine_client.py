"""clawrl/base/engine_client.py against the real embedded engine, and its error translation.

Faults that cannot be produced on demand by a real engine (connection refused, timeouts,
500s) use `httpx.MockTransport`, which implements the real transport interface.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawrl.base.engine_client import (
    EngineBadRequest,
    EngineBusy,
    EngineClient,
    EngineClientError,
    EngineProtocolError,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    WeightUpdateFailed,
)


async def test_generate_chat_and_token_logprobs_against_the_engine(engine_url: str) -> None:
    async with EngineClient(engine_url) as engine:
        assert await engine.health() == "ok"
        assert await engine.weight_version() == "default"
        out = await engine.generate(text="Hello", sampling_params={
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, return_logprob=True)
        ids = out["output_ids"]
        prompt = out["meta_info"]["prompt_tokens"]
        sampled = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        prompt_ids = (await engine.generate(text="Hello", sampling_params={
            "max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
        )["meta_info"]["input_token_logprobs"]
        scored = await engine.token_logprobs([e[1] for e in prompt_ids], ids)
        reply = await engine.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 3, "return_token_ids": True})
        chunks = [c async for c in engine.chat_stream({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream_options": {"include_usage": True}})]
        assert await engine.token_logprobs([1, 2], []) == []
    assert len(prompt_ids) == prompt
    # Scoring the sampled tokens reproduces the logprobs they were sampled with.
    assert scored == pytest.approx(sampled, abs=1e-4)
    assert len(reply["choices"][0]["response_token_ids"]) == reply["usage"]["completion_tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


async def test_refusals_from_the_engine(engine_url: str, tmp_path: Path) -> None:
    async with EngineClient(engine_url) as engine:
        with pytest.raises(EngineBadRequest, match="unknown field") as bad:
            await engine.generate(text="x", sampling_params={"bogus": 1})
        assert bad.value.status == 400
        with pytest.raises(WeightUpdateFailed, match="not a directory"):
            await engine.update_weights_from_disk(str(tmp_path / "nope"), 3)
        with pytest.raises(EngineBadRequest):
            async for _ in engine.chat_stream({"messages": []}):
                pass
        with pytest.raises(ValueError):
            await engine.token_logprobs([], [1])
        assert await engine.weight_version() == "default"


def _mock(handler: Any) -> EngineClient:
    return EngineClient("http://engine.test", transport=httpx.MockTransport(handler))


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _slow(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def _answer(status: int, body: Any) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)
    return handler


FAULTS: list[tuple[Any, type[EngineClientError], str]] = [
    (_refuse, EngineUnavailable, "cannot reach"),
    (_slow, EngineTimeout, "timed out"),
    (_answer(503, {"error": {"message": "updating"}}), EngineBusy, "updating"),
    (_answer(400, {"object": "error", "message": "bad thing"}), EngineBadRequest, "bad thing"),
    (_answer(404, b"Not Found"), EngineBadRequest, "Not Found"),
    (_answer(500, {"error": "boom"}), EngineServerError, "boom"),
    (_answer(200, b"<html>"), EngineProtocolError, "not JSON"),
    (_answer(200, {"text": "no ids"}), EngineProtocolError, "output_ids"),
]


@pytest.mark.parametrize(("handler", "error", "needle"), FAULTS)
async def test_faults_map_to_the_exception_tree(handler: Any, error: type[Exception],
                                                needle: str) -> None:
    async with _mock(handler) as engine:
        with pytest.raises(error, match=needle):
            await engine.generate(input_ids=[1, 2])


async def test_busy_health_and_update_answers() -> None:
    async with _mock(_answer(503, b"")) as engine:
        assert await engine.health() == "busy"
    async with _mock(_refuse) as engine:
        with pytest.raises(EngineUnavailable):
            await engine.health()
    ok = {"success": True, "message": "Succeeded", "num_paused_requests": 0}
    seen: list[dict[str, Any]] = []

    def update(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=ok)

    async with _mock(update) as engine:
        assert (await engine.update_weights_from_disk("/w/v000003", 3))["success"] is True
    assert seen == [{"model_path": "/w/v000003", "weight_version": "3",
                     "abort_all_requests": False}]


async def test_misaligned_scoring_is_an_error() -> None:
    # An engine whose entries are shifted by one position against the response ids.
    body = {"text": "", "output_ids": [], "meta_info": {
        "input_token_logprobs": [[None, 5, None], [-1.0, 8, None], [-2.0, 9, None]]}}
    async with _mock(_answer(200, body)) as engine:
        with pytest.raises(EngineProtocolError, match="expected a logprob for token 7"):
            await engine.token_logprobs([5], [7, 8])
        with pytest.raises(EngineProtocolError, match="returned 3 input logprobs"):
            await engine.token_logprobs([5], [7])
