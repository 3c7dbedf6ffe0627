"""What was sampled is recorded: sampling parameters are bounded, resolved over the engine's
defaults, sent to the engine explicitly and stored in `turns.sampling` (proxy/sampling.py),
through real HTTP, the embedded engine and Postgres."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, closed_port_url, create_user, query

from proxy.sampling import applied_sampling, parse_defaults
from proxy.upstream import engine_body

CHAT = "/v1/chat/completions"
OK = [{"role": "user", "content": "hi"}]

OUT_OF_BOUNDS: list[tuple[str, str, dict[str, Any], str]] = [
    ("temperature 4", CHAT, {"temperature": 4}, "temperature"),
    ("negative temperature", CHAT, {"temperature": -0.1}, "temperature"),
    ("top_p 0", CHAT, {"top_p": 0}, "top_p"),
    ("top_p above 1", CHAT, {"top_p": 1.5}, "top_p"),
    ("top_k 0", CHAT, {"top_k": 0}, "top_k"),
    ("top_k -2", CHAT, {"top_k": -2}, "top_k"),
    ("presence_penalty 3", CHAT, {"presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty -5", CHAT, {"frequency_penalty": -5}, "frequency_penalty"),
    ("logit_bias value", CHAT, {"logit_bias": {"17": 300}}, "logit_bias.17"),
    ("logit_bias key", CHAT, {"logit_bias": {"hello": 1}}, "logit_bias.hello"),
    ("logit_bias entries", CHAT, {"logit_bias": {str(i): 1 for i in range(301)}},
     "logit_bias"),
    ("min_p", CHAT, {"min_p": 0.1}, "min_p"),
    ("repetition_penalty", CHAT, {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("responses temperature 4", "/v1/responses", {"temperature": 4}, "temperature"),
    ("responses top_p 0", "/v1/responses", {"top_p": 0}, "top_p"),
]


@pytest.mark.parametrize(("name", "path", "extra", "param"), OUT_OF_BOUNDS,
                         ids=[c[0] for c in OUT_OF_BOUNDS])
async def test_sampling_out_of_bounds_is_400_naming_the_parameter(
        proxy_factory: ProxyFactory, db_url: str, name: str, path: str, extra: dict[str, Any],
        param: str) -> None:
    proxy = await proxy_factory(closed_port_url())
    _, key = create_user(db_url, "u")
    body = {"model": "default", **({"input": "hi"} if path != CHAT else {"messages": OK}), **extra}
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        response = await http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and param.split(".")[-1] in error["message"]
    assert query(db_url, "SELECT count(*) FROM turns") == [(0,)]


def test_applied_sampling_is_the_request_over_the_engine_defaults() -> None:
    defaults = parse_defaults(json.dumps({"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 9,
                                          "top_k": "x"}))
    assert defaults == {"temperature": 0.2, "top_p": 0.9}
    assert parse_defaults(None) == {} and parse_defaults("not json") == {}
    sampling = applied_sampling({"temperature": 0.0, "logit_bias": {"5": 10}}, defaults)
    assert sampling == {"temperature": 0.0, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
                        "presence_penalty": 0.0, "frequency_penalty": 0.0,
                        "repetition_penalty": 1.0, "logit_bias": True, "constraint": None}
    # Every distribution parameter goes to the engine explicitly: its own defaults never apply.
    sent = engine_body({"messages": OK, "logit_bias": {"5": 10}}, stream=False,
                       sampling=sampling)
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                 "frequency_penalty", "repetition_penalty")} == {
        "temperature": 0.0, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert sent["logit_bias"] == {"5": 10}
    # Defaults not read yet: what the request leaves unset is unknown, and not sent.
    unknown = applied_sampling({"top_p": 0.5}, None)
    assert unknown["temperature"] is None and unknown["top_k"] is None
    assert unknown["top_p"] == 0.5 and unknown["repetition_penalty"] == 1.0
    sent = engine_body({"messages": OK}, stream=True, sampling=unknown)
    assert "temperature" not in sent and "top_k" not in sent and sent["top_p"] == 0.5


@pytest.fixture(scope="module")
def warm_engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                    module_engine_factory: Callable[..., str]) -> str:
    """The tiny model served with generation_config defaults temperature 0.7, top_p 0.95."""
    model_dir = tmp_path_factory.mktemp("warm") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.7,
                                "top_p": 0.95}))
    return module_engine_factory(model_dir)


async def test_turns_store_the_sampling_the_engine_applied(
        proxy_factory: ProxyFactory, db_url: str, warm_engine_url: str) -> None:
    """A request that leaves temperature unset is sampled at the model's default and stores
    it: the same seed at that temperature, explicit, gives the same tokens and logprobs; at
    another temperature, other logprobs. Whole and streamed replies alike."""
    proxy = await proxy_factory(warm_engine_url)
    _, key = create_user(db_url, "u")
    # What the start-up poll does, done here so the first request surely finds it done.
    await proxy.app.state.upstream.model_info()
    base = {"model": "default", "messages": OK, "max_tokens": 6, "seed": 11}
    bodies = [base, {**base, "temperature": 0.7}, {**base, "temperature": 1.3, "top_k": 20},
              {**base, "stream": True}, {**base, "temperature": 0}]
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as http:
        for body in bodies:
            response = await http.post(CHAT, json=body,
                                       headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, response.text
    await proxy.settle()
    rows = query(db_url, "SELECT sampling, response_ids, response_logprobs, params FROM turns "
                         "ORDER BY created_at")
    assert len(rows) == len(bodies)
    common = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
              "repetition_penalty": 1.0, "logit_bias": False, "constraint": None}
    assert [r[0] for r in rows] == [
        {"temperature": 0.7, "top_p": 0.95, "top_k": -1, **common},
        {"temperature": 0.7, "top_p": 0.95, "top_k": -1, **common},
        {"temperature": 1.3, "top_p": 0.95, "top_k": 20, **common},
        {"temperature": 0.7, "top_p": 0.95, "top_k": -1, **common},
        {"temperature": 0, "top_p": 0.95, "top_k": -1, **common}]
    default, explicit, hotter, streamed, _ = rows
    assert default[1] == explicit[1] == streamed[1]
    assert default[2] == pytest.approx(explicit[2]) and default[2] == pytest.approx(streamed[2])
    assert hotter[2][0] != pytest.approx(default[2][0], abs=1e-3)
    assert "temperature" not in default[3]  # params: what the client sent, as before
