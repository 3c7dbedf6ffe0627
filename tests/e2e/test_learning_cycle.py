"""The whole loop over HTTP: chat → follow-up → judgment → training step → publish → the next
request is served (and logged) with the new version; and streams across a swap all finish.

Real proxy, real judge worker, real trainer, real embedded engine with the tiny test model,
real Postgres. Only the judge LLM is scripted (httpx.MockTransport): the random test model
cannot judge, and the judge backend is a remote API by design.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from proxyharness import create_user, running_proxy
from sqlalchemy import text
from sqlalchemy.engine import Engine

from clawrl.base.db import create_async, create_engine
from clawrl.base.settings import EngineSettings
from judge.config import load_judge_settings
from judge.worker import Worker
from trainer.backends.torch import TorchBackend
from trainer.checkpoint import save_checkpoint
from trainer.config import Settings, TrainerSettings
from trainer.data import SampleRow, claim_batch, collate
from trainer.publish import publish_version
from trainer.train import train

# The random test model rarely stops by itself; common stop strings end replies early so the
# turn is not skipped as cut off by the length limit.
STOP = [" ", "e", "a", "o"]
HINT = "Answer in lowercase."


@pytest.fixture
def db(db_url: str) -> Any:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


def rows(db: Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(text(sql), params).all())


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 300) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.1)




def scripted_judge(request: httpx.Request) -> httpx.Response:
    """The judge LLM: a −1 verdict for PRM prompts, a hint for hint prompts."""
    prompt = json.loads(request.content)["messages"][0]["content"]
    answer = ("The user asks for lowercase. \\boxed{-1}"
              if prompt.startswith("Rate the assistant reply") else f"[HINT] {HINT} [/HINT]")
    return httpx.Response(200, json={
        "id": "c", "object": "chat.completion", "model": "judge",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": answer}}]})


@contextlib.asynccontextmanager
async def running_judge(db_url: str, engine_url: str) -> AsyncIterator[None]:
    settings = load_judge_settings(database={"url": db_url}, engine={"url": engine_url}, judge={
        "backend": "openai", "poll_interval_s": 0.1, "backoff_base_s": 0.05,
        "teacher_enabled": True, "teacher_url": engine_url, "max_attempts": 3,
        "openai": {"base_url": "http://judge.test/v1", "model": "judge", "api_key": "sk-j"}})
    adb = create_async(db_url)
    stop = asyncio.Event()
    worker = Worker(settings, adb, db_url, transport=httpx.MockTransport(scripted_judge))
    task = asyncio.create_task(worker.run(stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await adb.dispose()


def trainer_settings(tmp_path: Path, db_url: str, engine_url: str, model: Path) -> Settings:
    return Settings(state_dir=tmp_path / "trainer", database={"url": db_url},  # type: ignore[arg-type]
                    engine={"url": engine_url},  # type: ignore[arg-type]
                    trainer=TrainerSettings(model=model, batch_size=4, max_wait_s=0.2,
                                            poll_s=0.05, device="cpu", lr=1e-4))


async def test_chat_follow_up_judgment_step_publish_next_turn_has_new_version(
        db: Engine, db_url: str, tiny_model_dir: Path, tmp_path: Path,
        engine_factory: Callable[..., str]) -> None:
    torch.set_num_threads(1)
    engine_url = engine_factory(tiny_model_dir)
    key = create_user(db_url, "ada")[1]
    first = [{"role": "user", "content": "What does Ada like?"}]
    headers = {"Authorization": f"Bearer {key}"}
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            running_judge(db_url, engine_url), \
            httpx.AsyncClient(base_url=proxy_url, timeout=120, headers=headers) as client:
        r1 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": first, "max_tokens": 48, "stop": STOP})
        assert r1.status_code == 200 and r1.json()["choices"][0]["finish_reason"] == "stop"
        follow = [*first, {"role": "assistant",
                           "content": r1.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "too long. answer in lowercase please"}]
        r2 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": follow, "max_tokens": 8})
        assert r2.status_code == 200
        await wait_for(lambda: bool(rows(db, "SELECT 1 FROM samples")))

        [sample] = rows(db, "SELECT * FROM samples")
        assert sample.reward == -1 and sample.teacher_logprobs is not None
        # The trainer takes the judged sample, steps, publishes v1 (in a thread: it blocks).
        cfg = trainer_settings(tmp_path, db_url, engine_url, tiny_model_dir)
        assert await asyncio.to_thread(train, cfg, once=True) == 1

        r3 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r3.status_code == 200
        await wait_for(lambda: len(rows(db, "SELECT 1 FROM turns")) == 3, 30)

    [step] = rows(db, "SELECT * FROM training_steps")
    assert (step.step, step.status, step.num_samples) == (1, "ok", 1)
    # The proxy logged exactly the sampled ids and logprobs: the trainer's recomputed
    # logprobs agree with them, so the first ratio is 1.
    assert step.metrics["abs_log_ratio_max"] < 1e-3
    assert rows(db, "SELECT trained_step FROM samples")[0].trained_step == 1
    assert [r.status for r in rows(db, "SELECT status FROM policy_versions")] == ["published"]
    versions = [r.weight_version for r in rows(db, "SELECT weight_version FROM turns ORDER BY id")]
    assert versions[-1] == "1" and versions[0] != "1"


async def test_streams_across_a_swap_all_complete_and_are_stored(
        db: Engine, db_url: str, tiny_model_dir: Path, tmp_path: Path,
        engine_factory: Callable[..., str]) -> None:
    torch.set_num_threads(1)
    engine_url = engine_factory(tiny_model_dir)
    # 13 streams from one key, 12 at once: no limit in flight (the default is 8).
    key = create_user(db_url, "ada", max_concurrent=0)[1]
    # A changed checkpoint v1 to swap in.
    backend = TorchBackend(TrainerSettings(batch_size=2, kl_coef=0.0, lr=1e-3, device="cpu"))
    backend.load(tiny_model_dir)
    batch = collate([SampleRow(0, [1, 5, 6], [7, 8], [-1.0, -1.0], None, 1, 0),
                     SampleRow(1, [1, 9], [10, 11], [-1.0, -1.0], None, -1, 0)], 0)
    backend.train_step(batch)
    path = save_checkpoint(backend, tmp_path / "weights", 1, tiny_model_dir)

    async def stream(client: httpx.AsyncClient, started: asyncio.Event | None) -> dict[str, Any]:
        chunks, done = 0, False
        async with client.stream("POST", "/v1/chat/completions", json={
                # Greedy: deterministic text (random sampling from the untrained model can
                # emit a NUL character, which the proxy cannot store yet: see status-H4.md).
                "model": "default", "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about Ada"}]}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                chunks += 1
                if started is not None:
                    started.set()
        return {"chunks": chunks, "done": done}

    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            httpx.AsyncClient(base_url=proxy_url, timeout=300,
                              headers={"Authorization": f"Bearer {key}"}) as client:
        firsts = [asyncio.Event() for _ in range(6)]
        before = [asyncio.create_task(stream(client, e)) for e in firsts]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
        swap = asyncio.create_task(asyncio.to_thread(
            publish_version, EngineSettings(url=engine_url), path, 1))
        during = [asyncio.create_task(stream(client, None)) for _ in range(6)]
        info = await swap
        results = await asyncio.gather(*before, *during)
        after = await stream(client, None)
        await wait_for(lambda: len(rows(db, "SELECT 1 FROM turns")) == 13, 60)

    assert info["weight_version"] == "1"
    assert all(r["done"] and r["chunks"] > 0 for r in [*results, after])
    turns = rows(db, "SELECT status, weight_version FROM turns ORDER BY id")
    assert all(t.status == "ok" for t in turns), turns
    assert {t.weight_version for t in turns} <= {"default", "1"}
    assert turns[-1].weight_version == "1"


# A tool whose every argument is bounded, so the grammar ends the call on its own.
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"enum": ["paris", "oslo", "lima"]}}}}}


async def test_a_forced_tool_call_teaches_the_model_to_open_with_it(
        db: Engine, db_url: str, tiny_model_dir: Path, tmp_path: Path, engine_url: str) -> None:
    """`tool_choice: "required"` through the proxy: the engine's grammar forces the call, the
    tool's result comes back as the next state, the judge turns the turn into a sample, and
    the trainer distils toward the grammar (trainer/offpolicy.py): the model's own, unmasked
    probability of the call's opening token on that prompt rises, and of the whole call.
    (The scripted judge votes −1: on the tokens the grammar forced, the distillation wins.)"""
    torch.set_num_threads(1)
    key = create_user(db_url, "ada")[1]
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    async with running_proxy(engine_url, db_url, tmp_path) as proxy_url, \
            running_judge(db_url, engine_url), \
            httpx.AsyncClient(base_url=proxy_url, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as client:
        r1 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": ask, "tools": [WEATHER], "temperature": 0,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64})
        assert r1.status_code == 200, r1.text
        [call] = r1.json()["choices"][0]["message"]["tool_calls"]
        follow = [*ask, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
        r2 = await client.post("/v1/chat/completions", json={
            "model": "default", "messages": follow, "tools": [WEATHER], "temperature": 0,
            "max_tokens": 4})
        assert r2.status_code == 200, r2.text
        await wait_for(lambda: bool(rows(db, "SELECT 1 FROM samples")))

    [sample] = rows(db, "SELECT * FROM samples")
    backend = TorchBackend(TrainerSettings(batch_size=1, max_wait_s=0.0, poll_s=0.05,
                                           device="cpu", lr=1e-3, kl_coef=0.0))
    backend.load(tiny_model_dir)
    claim, skipped = claim_batch(db, backend.cfg, backend.limits, 0)
    assert claim is not None and not skipped
    assert claim.batch.constrained is not None and claim.batch.constrained.tolist() == [True]
    opening = len(sample.prompt_ids) - 1  # the target column of the first response token
    mask = claim.batch.loss_mask.bool()
    before = backend.compute_logprobs(claim.batch)
    for _ in range(5):
        assert backend.train_step(claim.batch).status == "ok"
    after = backend.compute_logprobs(claim.batch)
    claim.release()
    # The opening token's share of a 40-60 token call's mean is small, the call's sum large.
    assert float(after[0, opening]) > float(before[0, opening]) + 0.25
    assert float(after[mask].sum()) > float(before[mask].sum()) + 10.0
