"""The embedded engine against the tiny model: ids, logprobs, tools, weight swaps, pause, errors.

Every test talks HTTP to a real `python -m clawrl.engine` child process. Reference numbers
come from a plain Hugging Face forward in this process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawrl.engine.chat import parse_tool_calls
from clawrl.engine.runtime import Engine
from clawrl.world import model as tinyworld

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Harbor?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Harbor"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model fine-tuned until, greedily, it answers ASK with the CALL tool call."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompt = tok.encode(tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=True))
    ids = torch.tensor([prompt + tok.encode(CALL + "<|im_end|>")])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100  # loss on the reply only
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("toolmodel") / "v2"
    tinyworld.save_model_dir(out, model.eval(),
                             Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))
    return out


def reference_logprobs(model: Any, ids: list[int], temperature: float = 1.0) -> list[float]:
    """logprob of ids[i] given ids[:i], for i = 1 .. len(ids)-1 (plain batch-1 forward), under
    `log_softmax(logits / temperature)`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello there!"}],
            "max_tokens": 12, **extra}


async def stream_chunks(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def streamed_ids(chunks: list[dict[str, Any]]) -> list[int]:
    [ext] = [c["sglext"] for c in chunks if c.get("sglext")]
    ids: list[int] = ext["output_ids"][0]
    return ids


async def test_greedy_stream_and_non_stream_give_the_same_tokens(engine_url: str) -> None:
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        body = chat_body(temperature=0, return_token_ids=True)
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        choice = plain["choices"][0]
        chunks = await stream_chunks(client, chat_body(
            temperature=0, return_output_ids_in_sglext=True, return_input_ids_in_sglext=True,
            stream_options={"include_usage": True}))
    assert choice["response_token_ids"] == streamed_ids(chunks)
    assert choice["prompt_token_ids"] == [c["sglext"] for c in chunks if c.get("sglext")][0][
        "input_ids"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["usage"]["completion_tokens"] == len(choice["response_token_ids"])
    assert plain["metadata"] == {"weight_version": "default"}
    assert all(c["metadata"]["weight_version"] == "default" for c in chunks)


async def test_headers_ask_for_sglext_ids(engine_url: str) -> None:
    headers = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1"}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3),
                              headers=headers)
    ext = r.json()["sglext"]
    assert len(ext["output_ids"][0]) == r.json()["usage"]["completion_tokens"]
    assert len(ext["input_ids"]) == r.json()["usage"]["prompt_tokens"]


async def test_logprobs_equal_a_plain_forward_under_concurrent_batching(
        engine_url: str, hf_model: Any) -> None:
    prompts = ["Hi", "Tell me about the harbor and the river, please.", "x", "42 + 1 = ?",
               "café 東京", "Who is Alice?"]

    async def one(client: httpx.AsyncClient, i: int, text: str) -> dict[str, Any]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_tokens": 6 + 3 * i, "seed": i, "logprobs": True, "top_logprobs": 2,
                "return_token_ids": True, "ignore_eos": True}
        return (await client.post("/v1/chat/completions", json=body)).json()

    async with httpx.AsyncClient(base_url=engine_url, timeout=120) as client:
        answers = await asyncio.gather(*(one(client, i, t) for i, t in enumerate(prompts)))
    for answer in answers:
        choice = answer["choices"][0]
        prompt, response = choice["prompt_token_ids"], choice["response_token_ids"]
        expected = reference_logprobs(hf_model, prompt + response)[len(prompt) - 1:]
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert len(got) == len(response)
        assert got == pytest.approx(expected, abs=1e-4)
        for entry in choice["logprobs"]["content"]:
            assert len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6


async def test_logprobs_are_those_of_the_tempered_distribution(
        engine_url: str, hf_model: Any) -> None:
    """Sampled at T, a token's logprob is log_softmax(logits / T) of it (top_p does not
    renormalise it), in one batch with rows at other temperatures; greedy rows get T = 1.
    The same on `/generate`."""
    temperatures = [0.5, 1.7, 0.0, 0.5]

    async def one(client: httpx.AsyncClient, i: int, t: float) -> dict[str, Any]:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Hello {i}"}],
                "max_tokens": 10, "seed": i, "temperature": t, "top_p": 0.9,
                "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                "ignore_eos": True}
        return (await client.post("/v1/chat/completions", json=body)).json()

    async with httpx.AsyncClient(base_url=engine_url, timeout=120) as client:
        answers = await asyncio.gather(*(one(client, i, t)
                                         for i, t in enumerate(temperatures)))
        generated = (await client.post("/generate", json={
            "input_ids": [1, 2, 3, 4], "return_logprob": True, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0.5, "ignore_eos": True,
                "sampling_seed": 3}})).json()
    for t, answer in zip(temperatures, answers, strict=True):
        choice = answer["choices"][0]
        prompt, response = choice["prompt_token_ids"], choice["response_token_ids"]
        at = t if t > 0 else 1.0
        expected = reference_logprobs(hf_model, prompt + response, at)[len(prompt) - 1:]
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert got == pytest.approx(expected, abs=1e-4)
        if at != 1.0:  # not the untempered distribution
            untempered = reference_logprobs(hf_model, prompt + response)[len(prompt) - 1:]
            assert max(abs(a - b) for a, b in zip(got, untempered, strict=True)) > 1e-2
        top = [entry["top_logprobs"][0]["logprob"] for entry in choice["logprobs"]["content"]]
        assert all(x >= g - 1e-6 for x, g in zip(top, got, strict=True))
    out = generated["output_ids"]
    got = [e[0] for e in generated["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(reference_logprobs(hf_model, [1, 2, 3, 4, *out], 0.5)[3:],
                                abs=1e-4)


def test_model_info_names_the_sampling_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`preferred_sampling_params` (SGLang's field, a JSON string) carries the generation_config
    defaults a chat request that leaves them unset is sampled with."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "temperature": 0.2, "top_p": 0.9, "top_k": 40}))
    info = Engine(str(model_dir)).model_info()
    assert json.loads(info["preferred_sampling_params"]) == {"temperature": 0.2, "top_p": 0.9,
                                                             "top_k": 40}


async def test_generate_scores_a_response_with_max_new_tokens_zero(
        engine_url: str, hf_model: Any, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    response = tok.encode("Hello, how are you?<|im_end|>")
    body = {"input_ids": prompt + response, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "return_text_in_logprobs": True}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        out = (await client.post("/generate", json=body)).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    # SGLang: one entry per position from logprob_start_len; the first is unscored.
    assert entries[0] == [None, prompt[-1], tok.decode([prompt[-1]])]
    assert [e[1] for e in entries[1:]] == response
    expected = reference_logprobs(hf_model, prompt + response)[len(prompt) - 1:]
    assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-4)


async def test_generate_response_shape_and_cumulative_stream(engine_url: str) -> None:
    body = {"text": "The quick brown fox", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, "return_logprob": True}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        out = (await client.post("/generate", json=body)).json()
        chunks = []
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == 5 == len(out["output_ids"])
    assert meta["weight_version"] == "default" and meta["prompt_tokens"] > 0
    # -1 (the default) reports only the last prompt position, unscored.
    assert len(meta["input_token_logprobs"]) == 1 and meta["input_token_logprobs"][0][0] is None
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert chunks[-1]["output_ids"] == out["output_ids"] and chunks[-1]["text"] == out["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths)  # cumulative


def test_parse_tool_calls_like_sglang_qwen25() -> None:
    text = f'Let me check.\n{CALL}\n<tool_call>\n{{"name": "nope", "arguments": {{}}}}\n</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Harbor"}'}]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert parse_tool_calls("plain text", TOOLS) == ("plain text", [])
    assert parse_tool_calls("<tool_call>\n{not json\n</tool_call>", TOOLS) == ("", [])


async def test_tool_calls_from_a_model_that_calls_tools(
        engine_factory: Any, tool_model_dir: Path) -> None:
    url = engine_factory(tool_model_dir)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "temperature": 0,
            "max_tokens": 40, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        chunks = await stream_chunks(client, {**body, "return_token_ids": False})
        no_tools = (await client.post("/v1/chat/completions",
                                      json={**body, "tool_choice": "none"})).json()
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Harbor"}'}
    assert choice["response_token_ids"][-1] == 2  # <|im_end|> is part of the sampled ids
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    streamed_calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert [tc["function"] for tc in streamed_calls[0]] == [call["function"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not any("<tool_call>" in (d["delta"].get("content") or "") for d in deltas)
    assert no_tools["choices"][0]["message"]["tool_calls"] is None


async def test_openai_sdk_streams_from_the_engine(engine_url: str, tiny_model_dir: Path) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{engine_url}/v1", api_key="unused")
    try:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True}, logprobs=True)
        chunks = [c async for c in stream]
        models = await client.models.list()
    finally:
        await client.close()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [m.id for m in models.data] == [str(tiny_model_dir)]  # served name = model path


async def test_seeded_sampling_is_reproducible(engine_url: str) -> None:
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 8, "sampling_seed": 7,
                                                "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        first, second = [(await client.post("/generate", json=body)).json() for _ in range(2)]
    assert first["output_ids"] == second["output_ids"]


async def test_client_disconnect_aborts_the_request(
        engine_factory: Any, tiny_model_dir: Path) -> None:
    url = engine_factory(tiny_model_dir)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.aiter_lines()  # read by hand: leaving an iterator closes the response
            while not (line := await lines.__anext__()).startswith('data: {"id"') or \
                    '"content": ""' in line:
                pass  # until a token arrived: the request is in the scheduler
            # Frozen in place, the request keeps its KV cache: the engine is not idle ...
            await client.post("/pause_generation", json={"mode": "in_place"})
            assert (await client.post("/flush_cache")).status_code == 400
            await r.aclose()
        # ... until the client goes away, which aborts it.
        for _ in range(300):
            if (await client.post("/flush_cache")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert (await client.post("/flush_cache")).status_code == 200
        await client.post("/continue_generation", json={})


async def test_stop_strings_and_stop_token_ids(engine_url: str) -> None:
    greedy = {"text": "The river", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        full = (await client.post("/generate", json=greedy)).json()
        text, ids = full["text"], full["output_ids"]
        stop = text[4:7]
        params = {**greedy["sampling_params"], "stop": [stop]}
        cut = (await client.post("/generate", json={**greedy, "sampling_params": params})).json()
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me"}],
                "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        chat_full = (await client.post("/v1/chat/completions", json=chat)).json()
        chat_text = chat_full["choices"][0]["message"]["content"]
        chat_stop = chat_text[5:8]
        plain = (await client.post("/v1/chat/completions", json={**chat, "stop": chat_stop})
                 ).json()["choices"][0]
        chunks = await stream_chunks(client, {**chat, "stop": chat_stop})
        by_id = (await client.post("/generate", json={**greedy, "sampling_params": {
            **greedy["sampling_params"], "stop_token_ids": [ids[3]]}})).json()
    assert cut["text"] == text[: text.find(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert ids[: len(cut["output_ids"])] == cut["output_ids"]  # ids keep the stop's tokens
    assert plain["finish_reason"] == "stop" and plain["matched_stop"] == chat_stop
    assert plain["message"]["content"] == chat_text[: chat_text.find(chat_stop)]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == plain["message"]["content"]
    assert by_id["output_ids"] == ids[: ids.index(ids[3]) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}


def test_engine_cli_refuses_a_missing_model_dir(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "clawrl.engine", "--model",
                          str(tmp_path / "nope")], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "no config.json" in out.stderr


def test_auto_dtype_is_bfloat16_only_where_the_hardware_computes_in_it() -> None:
    """`--dtype auto` (the judge engine's default): on a CPU without AVX-512 BF16 or AMX,
    bfloat16 products are emulated and slower than float32, so auto keeps float32 there.
    Checked against the kernel's own CPU flags, not against the oneDNN call it uses."""
    from clawrl.engine.runtime import resolve_dtype

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(" ".join(line.split(":", 1)[1] for line in cpuinfo.read_text().splitlines()
                         if line.startswith("flags")).split())
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (`name{labels} value`)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics:\n{text}")


async def test_metrics_count_tokens_requests_and_accepted_drafts(
        engine_factory: Any, tiny_model_dir: Path) -> None:
    """GET /metrics: SGLang's names for tokens and queue sizes, the finished requests, and the
    n-gram drafts' proposed and accepted tokens, with their rate."""
    url = engine_factory(tiny_model_dir, "--speculative-algorithm", "ngram")
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        start = (await client.get("/metrics")).text
        assert _metric(start, "sglang:prompt_tokens_total") == 0
        assert _metric(start, "clawrl_engine_draft_accept_rate") == 0
        usage = []
        for _ in range(3):  # the same greedy answer: the 2nd and 3rd are drafted from the 1st
            r = await client.post("/v1/chat/completions",
                                  json=chat_body(temperature=0, max_tokens=24))
            usage.append(r.json()["usage"])
        text = (await client.get("/metrics")).text
    assert _metric(text, "sglang:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert _metric(text, "sglang:generation_tokens_total") == sum(
        u["completion_tokens"] for u in usage)
    finished = sum(_metric(text, "clawrl_engine_requests_finished_total", finish=kind)
                   for kind in ("stop", "length") if f'finish="{kind}"' in text)
    assert finished == 3
    assert _metric(text, "sglang:num_running_reqs") == 0
    assert _metric(text, "sglang:num_queue_reqs") == 0
    proposed = _metric(text, "clawrl_engine_draft_tokens_proposed_total")
    accepted = _metric(text, "clawrl_engine_draft_tokens_accepted_total")
    assert proposed > 0 and 0 < accepted <= proposed
    assert _metric(text, "clawrl_engine_draft_accept_rate") == pytest.approx(accepted / proposed)


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-9])
def test_a_top_p_below_float32s_smallest_still_keeps_the_top_token(top_p: float) -> None:
    """A top_p too small for float32 compares as 0: the nucleus still holds the most likely
    token (the fuzzer's 1e-300 once left nothing to sample: a 500)."""
    from clawrl.engine.scheduler import SamplingParams, _sample

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    picks = {_sample(logits, SamplingParams(temperature=1.5, top_p=top_p), generator)
             for _ in range(20)}
    assert picks == {1}


def test_penalties_and_bias_adjust_the_logits_as_openai_says() -> None:
    from clawrl.engine.scheduler import SamplingParams, adjust_logits

    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.0})
    out = adjust_logits(torch.zeros(10), p, [3, 3, 5])
    assert out.tolist() == [0, 0, 0, -1.0, 0, -0.75, 0, 2.0, 0, 0]
    assert adjust_logits(torch.zeros(4), SamplingParams(presence_penalty=1.0), []).tolist() == \
        [0, 0, 0, 0]


async def test_logit_bias_and_penalties_steer_what_is_sampled(engine_url: str) -> None:
    """A +100 bias makes greedy decoding pick one token every time, on /generate and on
    chat; a frequency penalty then takes it away after its first pick. The logprobs are
    those of the adjusted distribution (the biased token's is ~0)."""
    token = 40
    body: dict[str, Any] = {"text": "The quick brown fox", "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                "ignore_eos": True,
                                                "logit_bias": {str(token): 100}}}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60) as client:
        out = (await client.post("/generate", json=body)).json()
        assert out["output_ids"] == [token] * 4
        assert all(lp > -1e-3 for lp, *_ in out["meta_info"]["output_token_logprobs"])
        # Two units of frequency penalty per appearance beat a bias of 3: the token once.
        body["sampling_params"].update(logit_bias={str(token): 3}, frequency_penalty=2.0,
                                       presence_penalty=2.0)
        penalised = (await client.post("/generate", json=body)).json()["output_ids"]
        assert penalised[0] == token and token not in penalised[1:]
        chat = (await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "logit_bias": {str(token): 100}, "ignore_eos": True},
            headers={"x-sglext-return-output-ids": "1"})).json()
    assert chat["sglext"]["output_ids"] == [[token] * 3], chat
