"""What was sampled is what is trained (trainer/offpolicy.py): the trainer recomputes logprobs
at the temperature a sample was drawn at, and skips, with a counted reason, what it cannot
correct for. Against real Postgres, the real embedded engine and the torch backend."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import text
from sqlalchemy.engine import Engine

from trainer.backends.base import student_logprobs
from trainer.backends.torch import TorchBackend
from trainer.config import TrainerSettings
from trainer.data import ModelLimits, SampleRow, claim_batch, collate
from trainer.loss import gather_logprobs, temper
from trainer.offpolicy import behaviour_temperature, off_policy_reason

SampleFactory = Callable[..., int]
States = Callable[[], dict[int, Any]]
LIMITS = ModelLimits(vocab_size=100, max_context=8)
PLAIN = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
         "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": False}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def cfg(**kw: object) -> TrainerSettings:
    base: dict[str, object] = dict(batch_size=8, max_wait_s=0.0, poll_s=0.01)
    return TrainerSettings(**(base | kw))  # type: ignore[arg-type]


def with_sampling(db: Engine, sample_id: int, sampling: dict[str, Any] | None) -> int:
    """Set the sampling of the sample's turn (as the proxy records it)."""
    with db.begin() as conn:
        conn.execute(text("UPDATE turns SET sampling = CAST(:s AS jsonb) WHERE id = "
                          "(SELECT turn_id FROM samples WHERE id = :id)"),
                     {"s": None if sampling is None else json.dumps(sampling),
                      "id": sample_id})
    return sample_id


def test_what_cannot_be_corrected_is_skipped_with_its_reason(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    cases: list[tuple[dict[str, Any] | None, str | None]] = [
        ({**PLAIN, "logit_bias": True}, "off_policy: logit_bias"),
        ({**PLAIN, "presence_penalty": 0.5}, "off_policy: presence_penalty"),
        ({**PLAIN, "frequency_penalty": -1.0}, "off_policy: frequency_penalty"),
        ({**PLAIN, "repetition_penalty": 1.1}, "off_policy: repetition_penalty"),
        ({**PLAIN, "temperature": 4}, "off_policy: temperature"),
        ({**PLAIN, "temperature": None}, "off_policy: temperature unknown"),
        ({**PLAIN, "constraint": {"response_format": {"type": "json_object"}}},
         "off_policy: constrained decoding"),
        ({**PLAIN, "constraint": {"tool_choice": "required"}}, "off_policy: constrained decoding"),
        (PLAIN, None),  # tempered, truncated: trained at its temperature
        ({**PLAIN, "constraint": None}, None),  # free decoding
        (None, None),  # a turn from before sampling was recorded: trained as before
        ({**PLAIN, "temperature": 0}, None),  # greedy
    ]
    ids = [with_sampling(db, add_sample(), sampling) for sampling, _ in cases]
    claim, skipped = claim_batch(db, cfg(train_constrained="never"), LIMITS, 0)
    assert claim is not None
    assert skipped == {"off_policy": 8}
    trained = [i for i, (_, why) in zip(ids, cases, strict=True) if why is None]
    assert claim.batch.sample_ids == trained
    assert claim.batch.temperature is not None
    assert claim.batch.temperature.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0])
    claim.release()
    state = sample_state()
    assert [state[i][1] for i in ids] == [why for _, why in cases]


def test_behaviour_temperature_and_reasons() -> None:
    assert behaviour_temperature(None) == 1.0
    assert behaviour_temperature({"temperature": 0.5}) == 0.5
    assert behaviour_temperature({"temperature": 0.5, "top_k": 1}) == 1.0
    assert behaviour_temperature({"temperature": 0.0}) == 1.0
    assert off_policy_reason({"logit_bias": False, "temperature": 2.0}) is None
    assert off_policy_reason("garbage") == "off_policy: unreadable sampling"
    assert off_policy_reason({"temperature": "hot"}) == "off_policy: temperature"
    forced = {"constraint": {"tool_choice": "required"}}
    assert off_policy_reason(forced) == "off_policy: constrained decoding"
    assert off_policy_reason(forced, train_constrained=True) is None
    assert off_policy_reason({**forced, "logit_bias": True}, train_constrained=True) \
        == "off_policy: logit_bias"


def test_temper_divides_each_sample_by_its_temperature() -> None:
    logits = torch.randn(2, 3, 5)
    out = temper(logits, torch.tensor([0.5, 2.0]))
    assert torch.allclose(out[0], logits[0] / 0.5) and torch.allclose(out[1], logits[1] / 2.0)
    assert temper(logits, None) is logits


async def engine_samples(engine_url: str, temperatures: list[float]) -> list[dict[str, Any]]:
    """Replies of the real engine at each temperature, with exact ids and logprobs."""
    out = []
    async with httpx.AsyncClient(base_url=engine_url, timeout=120) as client:
        for i, t in enumerate(temperatures):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me {i}"}],
                    "max_tokens": 6, "seed": i, "temperature": t, "top_p": 0.9,
                    "logprobs": True, "return_token_ids": True, "ignore_eos": True}
            choice = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
            out.append({"prompt": choice["prompt_token_ids"],
                        "response": choice["response_token_ids"],
                        "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]})
    return out


async def test_a_tempered_sample_has_ratio_one_at_the_behaviour_policy(
        engine_url: str, tiny_model_dir: Path) -> None:
    """The engine samples at T = 0.5 and 1.5; on unchanged weights the trainer's logprobs at
    each sample's T equal the engine's, so the first step's importance ratio is 1. Recomputed
    at T = 1 (the old behaviour) they are not."""
    temperatures = [0.5, 1.5, 0.5]
    replies = await engine_samples(engine_url, temperatures)
    b = TorchBackend(TrainerSettings(batch_size=4, micro_batch_size=2, kl_coef=0.1, lr=1e-3,
                                     device="cpu", method="combine", entropy_coef=0.01))
    b.load(tiny_model_dir)

    def batch(temps: list[float]) -> Any:
        rows = [SampleRow(i, r["prompt"], r["response"], r["logprobs"],
                          # the last sample also carries teacher logprobs (distillation)
                          [-1.0] * len(r["response"]) if i == 2 else None, 1, 0,
                          temperature=t)
                for i, (r, t) in enumerate(zip(replies, temps, strict=True))]
        return collate(rows, 0)

    tempered = batch(temperatures)
    ours = b.compute_logprobs(tempered)
    mask = tempered.loss_mask.bool()
    assert ours[mask].tolist() == pytest.approx(tempered.rollout_logp[mask].tolist(), abs=1e-4)
    untempered = batch([1.0] * len(replies))
    wrong = b.compute_logprobs(untempered)
    assert (wrong[mask] - untempered.rollout_logp[mask]).abs().max() > 1e-2
    stats = b.train_step(tempered)
    assert stats.status == "ok"
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.abs_log_ratio_max is not None and stats.abs_log_ratio_max < 1e-3


def test_distillation_compares_with_the_students_untempered_logprobs() -> None:
    """The teacher scores at T = 1; for a tempered sample the student's logprob it is
    compared with is the policy's at T = 1, for a T = 1 sample the rollout's own."""
    rows = [SampleRow(0, [1, 2], [3, 4], [-0.1, -0.2], [-1.0, -1.0], None, 0, temperature=0.5),
            SampleRow(1, [1, 2], [5, 6], [-0.3, -0.4], [-1.0, -1.0], None, 0)]
    batch = collate(rows, 0)
    logits = torch.randn(2, 4, 8)
    plain = gather_logprobs(logits, batch.input_ids)
    student = student_logprobs(batch, plain)
    assert torch.equal(student[0], plain[0])
    assert torch.equal(student[1], batch.rollout_logp[1])
    with pytest.raises(ValueError):
        student_logprobs(batch, None)
