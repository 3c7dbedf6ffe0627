"""The judge against the real embedded engine serving the tiny random model.

Its votes are garbage text, which is what the plumbing tests want: real requests, real
token ids, abstentions. Teacher logprobs are checked against a direct transformers forward
pass on the same model and the same tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from judgedb import add_turn, add_user, jobs, rows, wait_for
from sqlalchemy import Engine
from test_judge_worker import ScriptedJudge, settings_for

from clawrl.base.db import create_async
from clawrl.base.engine_client import EngineClient
from judge.config import load_judge_settings
from judge.prompts import teacher_messages
from judge.teacher import TeacherEngine, compute_teacher_logprobs
from judge.worker import Worker

REQUEST = [{"role": "system", "content": "Be short."},
           {"role": "user", "content": "What does Ada like?"}]
HINT = "Answer in lowercase."


def served_turn(engine_url: str, request: list[dict[str, Any]] = REQUEST) -> dict[str, Any]:
    """A turn as the proxy logs it: exact token ids and logprobs from the engine."""
    r = httpx.post(f"{engine_url}/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": request, "max_tokens": 12, "temperature": 1.0,
        "logprobs": True, "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"request_messages": request, "response_message": choice["message"],
            "prompt_ids": choice["prompt_token_ids"],
            "response_ids": choice["response_token_ids"],
            "response_logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
            "finish_reason": "stop"}


def direct_logprobs(model_dir: Path, messages: list[dict[str, Any]],
                    response_ids: list[int]) -> tuple[list[int], list[float]]:
    """Teacher prompt ids and response logprobs computed with transformers directly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    # Position p predicts token p+1: response token t sits at len(prompt)+t.
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    picked = logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0]
    return prompt, picked.tolist()


async def test_teacher_logprobs_equal_a_direct_computation(engine_url: str,
                                                           tiny_model_dir: Path) -> None:
    turn = served_turn(engine_url)
    async with EngineClient(engine_url) as client:
        engine = TeacherEngine(client, concurrency=2)
        result = await compute_teacher_logprobs(
            engine, request_messages=REQUEST, tools=None, hint=HINT,
            response_ids=turn["response_ids"], prompt_version="v1")
        engine_prompt = await engine.prompt_ids(teacher_messages(REQUEST, HINT), None)
    assert result.reason is None and result.logprobs is not None
    prompt, expected = direct_logprobs(tiny_model_dir, teacher_messages(REQUEST, HINT),
                                       turn["response_ids"])
    assert engine_prompt == prompt  # same chat template rendering, same ids
    assert len(result.logprobs) == len(turn["response_ids"])
    for got, want in zip(result.logprobs, expected, strict=True):
        assert abs(got - want) < 1e-4


async def test_policy_engine_judges_a_turn_with_real_votes(db: Engine, db_url: str,
                                                           engine_url: str) -> None:
    turn = add_turn(db, add_user(db), **served_turn(engine_url))
    settings = load_judge_settings(database={"url": db_url}, engine={"url": engine_url},
                                   judge={"poll_interval_s": 0.1, "max_tokens": 16})
    db_async = create_async(db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(settings, db_async, db_url).run(stop))
    try:
        await wait_for(lambda: jobs(db)[0].status in ("done", "failed"), timeout_s=300)
    finally:
        stop.set()
        await task
        await db_async.dispose()
    assert jobs(db)[0].status == "done", jobs(db)[0].last_error
    [j] = rows(db, "SELECT * FROM judgments")
    assert j.turn_id == turn and len(j.votes) == 3 and len(j.hint_votes) == 3
    assert all(isinstance(v["text"], str) for v in j.votes)
    assert j.judge_model == "policy@default"  # the policy and its weight version
    # Random weights: whatever they said, a reward only ever comes from a parsed majority.
    scores = [v["score"] for v in j.votes]
    assert j.reward is None or scores.count(j.reward) >= 2 or scores.count(None) == 2


async def test_hint_gets_teacher_logprobs_into_the_sample(db: Engine, db_url: str,
                                                          engine_url: str,
                                                          tiny_model_dir: Path) -> None:
    served = served_turn(engine_url)
    fits = add_turn(db, add_user(db), **served)
    long_request = [{"role": "user", "content": "tell me about Ada " * 1200}]
    too_long = add_turn(db, add_user(db), **{**served, "request_messages": long_request})
    judge = ScriptedJudge(prm=["The user asks for lowercase. \\boxed{-1}"],
                          hint=[f"[HINT] {HINT} [/HINT]"])
    settings = settings_for(db_url, teacher_enabled=True, teacher_url=engine_url)
    db_async = create_async(db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Worker(settings, db_async, db_url,
                                      transport=httpx.MockTransport(judge)).run(stop))
    try:
        await wait_for(lambda: {j.status for j in jobs(db)} <= {"done", "failed"},
                       timeout_s=300)
    finally:
        stop.set()
        await task
        await db_async.dispose()
    assert [j.status for j in jobs(db)] == ["done", "done"], [j.last_error for j in jobs(db)]
    by_turn = {j.turn_id: j for j in rows(db, "SELECT * FROM judgments")}
    assert by_turn[too_long].teacher_logprobs is None
    assert by_turn[too_long].reason.startswith("teacher: prompt too long")
    samples = {s.turn_id: s for s in rows(db, "SELECT * FROM samples")}
    s1, s2 = samples[fits], samples[too_long]
    assert s2.teacher_logprobs is None and s2.reward == -1  # reward alone still trains
    _, expected = direct_logprobs(tiny_model_dir, teacher_messages(REQUEST, HINT),
                                  served["response_ids"])
    assert len(s1.teacher_logprobs) == len(s1.response_ids) == len(expected)
    assert max(abs(a - b) for a, b in zip(s1.teacher_logprobs, expected, strict=True)) < 1e-4
