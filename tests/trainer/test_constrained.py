"""Constrained turns trained as distillation from their grammar (trainer/offpolicy.py,
`train_constrained`): the advantage and ratio on numbers computed by hand, the claim's
skip rules against a real Postgres, and the tiny model learning a forced token."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import insert, text
from sqlalchemy.engine import Engine

from clawrl.base.db import User
from trainer.backends.base import micro_batch_loss, needs_plain_logprobs, signal_mask
from trainer.backends.torch import TorchBackend
from trainer.config import TrainerSettings
from trainer.data import ModelLimits, SampleRow, claim_batch, collate

SampleFactory = Callable[..., int]
States = Callable[[], dict[int, Any]]
FORCED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
          "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
          "logit_bias": False, "constraint": {"tool_choice": "required"}}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def settings(**kw: object) -> TrainerSettings:
    base: dict[str, object] = dict(batch_size=8, max_wait_s=0.0, poll_s=0.01, kl_coef=0.0,
                                   device="cpu")
    return TrainerSettings(**(base | kw))  # type: ignore[arg-type]


def mixed_batch() -> Any:
    """Sample 0 forced by a grammar (drawn at T = 0.5), with hint-teacher logprobs the judge
    stored that must be ignored; sample 1 free, at T = 1, with a hint teacher."""
    return collate([
        SampleRow(0, [1, 2], [3, 4], [0.0, -0.1], [-3.0, -3.0], 1, 0, temperature=0.5,
                  constrained=True),
        SampleRow(1, [1, 2], [5, 6], [-1.0, -2.0], [-0.5, -2.5], -1, 0),
    ], 0)


def test_advantage_is_the_clipped_gap_to_the_masked_distribution_at_ratio_one() -> None:
    batch = mixed_batch()
    assert batch.has_teacher.tolist() == [True, True]
    assert batch.teacher_logp[0, 1:].tolist() == pytest.approx([0.0, -0.1])  # μ, not the hint
    cfg = settings(method="combine", constrained_adv_max=5.0)
    # The constrained sample's teacher is at its own T: no T = 1 forward is needed for it.
    assert not needs_plain_logprobs(cfg, batch)
    # The current policy's logprobs (at each sample's T) on the response columns 1 and 2.
    logp_new = torch.tensor([[0.0, -7.0, -0.3], [0.0, -1.1, -1.9]], requires_grad=True)
    terms = micro_batch_loss(cfg, batch, logp_new, num_tokens=4)
    terms.loss.backward()  # type: ignore[no-untyped-call]
    # Sample 0: r = +1; distillation log μ − log π = (0 + 7, −0.1 + 0.3) = (7 → 5, 0.2);
    # A = (6, 1.2); ratio 1, so d(−ratio·A)/d logp_new = −A.
    # Sample 1: r = −1; teacher − rollout = (0.5, −0.5); A = (−0.5, −1.5);
    # ratio = exp(logp_new − rollout) = (e^−0.1, e^0.1), inside the clip, so −ratio·A.
    r1 = [math.exp(-0.1), math.exp(0.1)]
    expected = [[0.0, -6.0, -1.2], [0.0, 0.5 * r1[0], 1.5 * r1[1]]]
    assert logp_new.grad is not None
    assert (logp_new.grad * 4).tolist() == [pytest.approx(row) for row in expected]
    assert terms.ratio_sum == pytest.approx(2.0 + sum(r1))
    assert terms.abs_log_ratio_max == pytest.approx(0.1)
    assert float(terms.loss.detach()) == pytest.approx((-7.2 + 0.5 * r1[0] + 1.5 * r1[1]) / 4)


def test_the_distillation_term_applies_under_every_method() -> None:
    """`method` picks the judge's signals; a constrained sample is distilled under each, and
    its reward term follows the method (never the vote under 'opd')."""
    batch = mixed_batch()
    logp_new = torch.tensor([[0.0, -7.0, -0.3], [0.0, -1.0, -2.0]], requires_grad=True)
    for method, reward in (("rl", 1.0), ("opd", 0.0)):
        cfg = settings(method=method, constrained_adv_max=5.0)
        assert signal_mask(cfg, batch)[0].sum() == 2
        grad = torch.autograd.grad(micro_batch_loss(cfg, batch, logp_new, 4).loss, logp_new)[0]
        assert (grad[0] * 4).tolist() == pytest.approx([0.0, -(reward + 5.0), -(reward + 0.2)])


def with_sampling(db: Engine, sample_id: int, sampling: dict[str, Any]) -> int:
    with db.begin() as conn:
        conn.execute(text("UPDATE turns SET sampling = CAST(:s AS jsonb) WHERE id = "
                          "(SELECT turn_id FROM samples WHERE id = :id)"),
                     {"s": json.dumps(sampling), "id": sample_id})
    return sample_id


LIMITS = ModelLimits(vocab_size=100, max_context=8)


def test_a_constrained_sample_is_skipped_when_not_trained_and_distilled_when_it_is(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    # No reward, no judge's teacher: the grammar is its only signal. A judge's teacher of the
    # wrong length does not make it invalid: it is replaced.
    forced = with_sampling(db, add_sample(reward=None, teacher_logprobs=[-1.0]), FORCED)
    free = with_sampling(db, add_sample(), {**FORCED, "constraint": None})
    claim, skipped = claim_batch(db, settings(), LIMITS, 0)  # 'own', one user: trained
    assert claim is not None and not skipped
    assert claim.batch.sample_ids == [forced, free]
    assert claim.batch.constrained is not None
    assert claim.batch.constrained.tolist() == [True, False]
    assert claim.batch.teacher_logp[0].tolist() == claim.batch.rollout_logp[0].tolist()
    claim.release()

    claim, skipped = claim_batch(db, settings(train_constrained="never"), LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == [free]
    assert skipped == {"off_policy": 1}
    assert sample_state()[forced] == (None, "off_policy: constrained decoding")
    claim.release()


def test_own_skips_constrained_samples_where_another_user_may_train(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    forced = with_sampling(db, add_sample(), FORCED)
    with db.begin() as conn:
        conn.execute(insert(User.__table__).values(name="bob"))
    claim, skipped = claim_batch(db, settings(), LIMITS, 0, give_up_after_s=0.0)
    assert claim is None and skipped == {"off_policy": 1}
    assert sample_state()[forced] == (None, "off_policy: constrained decoding")


def test_a_forced_token_gains_unconstrained_probability(
        db: Engine, add_sample: SampleFactory, tiny_model_dir: Path) -> None:
    """The grammar forced token `target` (μ = 1) after a prompt the tiny model would rarely
    continue with it; three steps on such samples raise the model's own, unmasked probability
    of it on that prompt."""
    backend = TorchBackend(settings(lr=1e-3, batch_size=4, micro_batch_size=4))
    backend.load(tiny_model_dir)
    prompt = [11, 12, 13, 14]
    # The least likely of a few candidate tokens: one the model does not open with.
    candidates = list(range(20, 60))
    scores = backend.compute_logprobs(collate(
        [SampleRow(i, prompt, [t], [0.0], None, None, 0) for i, t in enumerate(candidates)], 0))
    target = candidates[int(scores[:, len(prompt) - 1].argmin())]
    for _ in range(4):
        with_sampling(db, add_sample(prompt_ids=prompt, response_ids=[target],
                                     rollout_logprobs=[0.0], reward=None), FORCED)
    claim, _ = claim_batch(db, backend.cfg, backend.limits, 0)
    assert claim is not None and claim.batch.size == 4
    before = float(backend.compute_logprobs(claim.batch)[0, len(prompt) - 1])
    for _ in range(3):
        stats = backend.train_step(claim.batch)
        assert stats.status == "ok" and stats.ratio_mean == pytest.approx(1.0)
    after = float(backend.compute_logprobs(claim.batch)[0, len(prompt) - 1])
    claim.release()
    assert before < -2.0  # the grammar overruled the model here
    assert after > before + 1.0
