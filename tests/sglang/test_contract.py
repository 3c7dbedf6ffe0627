"""The proxy, judge and trainer against SGLang's own serving code (tests/sglang/sglang_app.py).

SGLang's routes, OpenAIServingChat and TokenizerManager build every response here; the tokens
come from the shared `clawrl engine` (greedy), so the same request asked of `clawrl engine`
directly must give the same ids and logprobs: the last test diffs the two field by field.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, create_user, query

from clawrl.base.engine_check import JUDGE_NEEDS, PROXY_NEEDS, TRAINER_NEEDS, check_engine
from clawrl.base.engine_client import EngineClient
from clawrl.base.settings import EngineSettings
from judge.teacher import TeacherEngine
from proxy.upstream import engine_body
from trainer.publish import publish_version

MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Tell me about the sea."}]
CLIENT_BODY: dict[str, Any] = {"model": "default", "messages": MESSAGES, "temperature": 0,
                               "max_tokens": 8}


def chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def chat_stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunks.append(json.loads(line[5:]))
    return chunks


def turn(db_url: str, uid: str) -> dict[str, Any]:
    cols = ("status", "prompt_ids", "response_ids", "response_logprobs", "weight_version",
            "finish_reason", "response_message")
    rows = query(db_url, f"SELECT {', '.join(cols)} FROM turns WHERE uid = %s", uuid.UUID(uid))
    assert len(rows) == 1
    return dict(zip(cols, rows[0], strict=True))


def streamed(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a stream adds up to: ids (sglext), text, logprobs, finish reason."""
    sglext = [c["sglext"] for c in chunks if c.get("sglext")]
    text, logprobs, finish = "", [], None
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            logprobs += [t["logprob"] for t in (choice.get("logprobs") or {}).get("content")
                         or []]
            finish = choice.get("finish_reason") or finish
    return {"input_ids": sglext[-1]["input_ids"] if sglext else None,
            "output_ids": sglext[-1]["output_ids"][0] if sglext else None,
            "text": text, "logprobs": logprobs, "finish_reason": finish}


async def test_proxy_stores_what_sglang_returns_non_streamed(
        proxy_factory: ProxyFactory, db_url: str, sglang_url: str) -> None:
    proxy = await proxy_factory(sglang_url)
    _, key = create_user(db_url, "alice")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(**CLIENT_BODY)
        completion = raw.parse()
    await proxy.settle()
    row = turn(db_url, raw.headers["x-clawrl-turn-id"])
    sglang = chat(sglang_url, engine_body(CLIENT_BODY, stream=False))
    choice = sglang["choices"][0]
    assert row["status"] == "ok"
    assert row["prompt_ids"] == choice["prompt_token_ids"] and row["prompt_ids"]
    assert row["response_ids"] == choice["response_token_ids"] and row["response_ids"]
    assert row["response_logprobs"] == pytest.approx(
        [t["logprob"] for t in choice["logprobs"]["content"]])
    assert row["weight_version"] == sglang["metadata"]["weight_version"] == "default"
    assert row["finish_reason"] == choice["finish_reason"] == completion.choices[0].finish_reason
    assert row["response_message"]["content"] == choice["message"]["content"]


async def test_proxy_stores_what_sglang_returns_streamed(
        proxy_factory: ProxyFactory, db_url: str, sglang_url: str) -> None:
    proxy = await proxy_factory(sglang_url)
    _, key = create_user(db_url, "bob")
    async with proxy.client(key) as client:
        raw = await client.chat.completions.with_raw_response.create(**CLIENT_BODY, stream=True)
        text = ""
        async for chunk in raw.parse():
            for ch in chunk.choices:
                text += ch.delta.content or ""
    await proxy.settle()
    row = turn(db_url, raw.headers["x-clawrl-turn-id"])
    sglang = streamed(chat_stream(sglang_url, engine_body({**CLIENT_BODY, "stream": True}, stream=True)))
    assert row["status"] == "ok"
    assert row["prompt_ids"] == sglang["input_ids"] and row["prompt_ids"]
    assert row["response_ids"] == sglang["output_ids"] and row["response_ids"]
    assert row["response_logprobs"] == pytest.approx(sglang["logprobs"])
    assert len(row["response_logprobs"]) == len(row["response_ids"])
    assert row["finish_reason"] == sglang["finish_reason"]
    assert text == sglang["text"] == row["response_message"]["content"]
    # SGLang 0.5.23's chunks carry no weight version: the proxy's is the engine's /model_info.
    assert row["weight_version"] == "default"


async def test_judge_requests_pass_sglang_request_types(sglang_url: str,
                                                        engine_url: str) -> None:
    """The teacher's chat (prompt ids) and /generate (logprobs) bodies are accepted by SGLang's
    ChatCompletionRequest, GenerateReqInput and /generate's strict schema, and give the same
    numbers as `clawrl engine`."""
    results = []
    for url in (sglang_url, engine_url):
        async with EngineClient(url) as client:
            teacher = TeacherEngine(client, concurrency=1)
            prompt = await teacher.prompt_ids(MESSAGES, None)
            response = (await client.generate(input_ids=prompt, sampling_params={
                "max_new_tokens": 4, "temperature": 0}))["output_ids"]
            results.append((prompt, response, await teacher.token_logprobs(prompt, response)))
    (prompt, response, logprobs), (e_prompt, e_response, e_logprobs) = results
    assert prompt == e_prompt and response == e_response and len(logprobs) == len(response)
    assert logprobs == pytest.approx(e_logprobs, abs=1e-5)
    # The schema check is live: SGLang refuses an unknown sampling key.
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(f"{sglang_url}/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_token": 1}})
    assert refused.status_code == 400 and "max_new_token" in refused.text


def test_trainer_publish_passes_sglang_weight_update(tiny_model_dir: Path, engine_factory: Any,
                                                      sglang_factory: Any) -> None:
    """publish_version's /update_weights_from_disk body through SGLang's route and
    UpdateWeightFromDiskReqInput; SGLang then reports the new version."""
    sglang = sglang_factory(tiny_model_dir, engine_factory(tiny_model_dir))
    info = publish_version(EngineSettings(url=sglang), tiny_model_dir, 3, verify=False,
                           attempts=1)
    assert info["weight_version"] == "3"
    # SGLang renames the served model to the loaded folder after a disk update.
    assert info["served_model_name"] == str(tiny_model_dir.resolve())
    assert chat(sglang, engine_body(CLIENT_BODY, stream=False))["metadata"] == {
        "weight_version": "3"}


# Fields our engine adds that SGLang 0.5.23 does not send (the proxy reads none of them
# from SGLang; `metadata` on stream chunks is clawrl's per-chunk weight version).
_OURS_ONLY_STREAM = {"metadata"}


def test_engine_answers_like_sglang(sglang_url: str, engine_url: str) -> None:
    """`clawrl engine` vs SGLang's serving code for the proxy's exact request bodies."""
    ours = chat(engine_url, engine_body(CLIENT_BODY, stream=False))
    theirs = chat(sglang_url, engine_body(CLIENT_BODY, stream=False))
    o, t = ours["choices"][0], theirs["choices"][0]
    for name in ("prompt_token_ids", "response_token_ids", "finish_reason", "matched_stop",
                 "index"):
        assert o.get(name) == t.get(name), name
    assert o["message"]["content"] == t["message"]["content"]
    assert o["message"]["role"] == t["message"]["role"]
    for ot, tt in zip(o["logprobs"]["content"], t["logprobs"]["content"], strict=True):
        assert (ot["token"], ot["bytes"]) == (tt["token"], tt["bytes"])
        assert ot["logprob"] == pytest.approx(tt["logprob"], abs=1e-5)
    assert ours["metadata"] == theirs["metadata"]
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert ours["usage"][name] == theirs["usage"][name], name
    assert set(ours) == set(theirs)
    assert set(o) == set(t)

    ours_s = chat_stream(engine_url, engine_body({**CLIENT_BODY, "stream": True}, stream=True))
    theirs_s = chat_stream(sglang_url, engine_body({**CLIENT_BODY, "stream": True}, stream=True))
    o_sum, t_sum = streamed(ours_s), streamed(theirs_s)
    assert o_sum["logprobs"] == pytest.approx(t_sum["logprobs"], abs=1e-5)
    assert {**o_sum, "logprobs": None} == {**t_sum, "logprobs": None}
    assert ours_s[0]["choices"][0]["delta"]["role"] == theirs_s[0]["choices"][0]["delta"]["role"]
    for chunks in (ours_s, theirs_s):  # the ids come in one last chunk with no choices
        assert [c["choices"] for c in chunks if c.get("sglext")] == [[]]
    assert {k for c in ours_s for k in c} - _OURS_ONLY_STREAM == {k for c in theirs_s for k in c}


async def test_start_check_passes_on_sglang(sglang_url: str) -> None:
    """What the proxy, judge and trainer ask the engine at start, SGLang 0.5.23 answers."""
    async with EngineClient(sglang_url) as client:
        assert await check_engine(client, (*PROXY_NEEDS, *JUDGE_NEEDS, *TRAINER_NEEDS))


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
# strict: SGLang puts a call's arguments under the schema only for a strict function.
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.", "strict": True,
    "parameters": {"type": "object", "required": ["word"], "additionalProperties": False,
                   "properties": {"word": {"type": "string", "maxLength": 12}}}}}


def test_structured_outputs_pass_through_sglang_unchanged(
        engine_factory: Any, sglang_factory: Any) -> None:
    """What the proxy forwards unchanged (`response_format`, `tool_choice`), SGLang's own
    adapter turns into its grammar (`json_schema`; its tool parser's `structural_tag`), which
    the engine under it decodes: SGLang's answers parse and validate. On the tiny world's
    tool model: SGLang's tag for `required` lets free text follow the call, which a trained
    model ends, and the random-weight one fills with noise."""
    import jsonschema

    tools_model = Path(__file__).resolve().parents[2] / "clawrl/world/prebuilt/tinyworld-tools"
    url = sglang_factory(tools_model, engine_factory(tools_model))
    for seed in range(3):
        body = chat(url, {**CLIENT_BODY, "temperature": 1.0, "seed": seed, "max_tokens": 200,
                          "response_format": {"type": "json_schema", "json_schema": {
                              "name": "person", "schema": PERSON}}})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        body = chat(url, {**CLIENT_BODY, "temperature": 1.0, "seed": seed, "max_tokens": 200,
                          "tools": [LOOKUP], "tool_choice": "required"})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "lookup" for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                LOOKUP["function"]["parameters"])  # type: ignore[index]
