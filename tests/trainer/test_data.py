"""Claiming, staleness, validation and recording against a real Postgres (trainer/data.py)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from sqlalchemy import insert, select
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion, Sample, TrainingStep, User
from trainer.config import TrainerSettings
from trainer.data import (
    ModelLimits,
    claim_batch,
    collate,
    parse_version,
    record_step,
    replay_batch,
    replay_of,
)
from trainer.ptx import PtxExample

SampleFactory = Callable[..., int]
States = Callable[[], dict[int, Any]]
LIMITS = ModelLimits(vocab_size=100, max_context=8)


def cfg(**kw: object) -> TrainerSettings:
    base: dict[str, object] = dict(batch_size=2, max_wait_s=0.0, poll_s=0.01)
    return TrainerSettings(**(base | kw))  # type: ignore[arg-type]


def test_parse_version_labels() -> None:
    assert [parse_version(v) for v in (None, "default", "7", "v12", " 3 ", "base")] == \
        [0, 0, 7, 12, 3, 0]


def test_full_batch_is_claimed_and_locked_rows_are_skipped_by_a_second_trainer(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    ids = [add_sample() for _ in range(3)]
    first, _ = claim_batch(db, cfg(max_wait_s=60), LIMITS, 0)
    assert first is not None and first.batch.sample_ids == ids[:2]
    # While the first claim's transaction is open, another claimer gets only the third row.
    second, _ = claim_batch(db, cfg(batch_size=5), LIMITS, 0)
    assert second is not None and second.batch.sample_ids == ids[2:]
    second.release()
    first.release()
    # Released claims leave the samples untouched and claimable.
    assert all(v == (None, None) for v in sample_state().values())


def test_partial_batch_after_max_wait_and_none_when_nothing_arrives(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    claim, _ = claim_batch(db, cfg(), LIMITS, 0, give_up_after_s=0.0)
    assert claim is None
    only = add_sample()
    claim, _ = claim_batch(db, cfg(batch_size=16, max_wait_s=0.05), LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == [only]
    claim.release()


def test_a_partial_batch_waits_for_min_batch_size(
        db: Engine, add_sample: SampleFactory) -> None:
    """At a person's pace a lone sample is not a version: past `max_wait_s` the batch still
    waits for a second; a full batch smaller than the minimum is a batch."""
    from trainer.personal import Ready, pick_user

    first = add_sample()
    wanted = cfg(batch_size=16, max_wait_s=0.05, min_batch_size=2)
    deadline = time.monotonic() + 0.4
    claim, _ = claim_batch(db, wanted, LIMITS, 0,
                           should_stop=lambda: time.monotonic() > deadline)
    assert claim is None
    second = add_sample()
    claim, _ = claim_batch(db, wanted, LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == [first, second]
    claim.release()
    claim, _ = claim_batch(db, cfg(batch_size=2, max_wait_s=60, min_batch_size=4), LIMITS, 0)
    assert claim is not None and len(claim.batch.sample_ids) == 2
    claim.release()
    # Personal mode picks a user by the same rule.
    lone, pair = Ready(1, 1, 99.0), Ready(2, 2, 99.0)
    assert pick_user([lone, pair], 16, 30.0, 2) == 2
    assert pick_user([lone], 16, 30.0, 1) == 1 and pick_user([lone], 16, 30.0, 2) is None


def test_stale_samples_are_skipped_and_counted(db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    stale = [add_sample(weight_version="default"), add_sample(weight_version="5")]
    fresh = [add_sample(weight_version="v6"), add_sample(weight_version="10")]
    claim, skipped = claim_batch(db, cfg(max_staleness=4), LIMITS, current_version=10)
    assert claim is not None and claim.batch.sample_ids == fresh
    assert skipped == {"stale": 2}
    assert claim.batch.staleness == [4, 0]
    claim.release()
    state = sample_state()
    assert [state[i] for i in stale] == [(None, "stale")] * 2


def test_invalid_samples_are_marked_with_the_reason(db: Engine,
                                                   add_sample: SampleFactory, sample_state: States) -> None:
    bad = {
        add_sample(response_ids=[5, 100]): "outside the vocabulary",
        add_sample(prompt_ids=[1] * 7, response_ids=[2, 3]): "exceed the context 8",
        add_sample(rollout_logprobs=[-1.0]): "1 rollout logprobs for 2 response tokens",
        add_sample(teacher_logprobs=[-1.0, -1.0, -1.0]): "3 teacher logprobs",
        add_sample(response_ids=[], rollout_logprobs=[]): "empty response",
        add_sample(rollout_logprobs=[-1.0, float("nan")]): "finite and <= 0",
        add_sample(rollout_logprobs=[-1.0, 0.5]): "finite and <= 0",
        add_sample(reward=None): "no_signal",
        add_sample(opt_out=True): "opted_out",
    }
    good = add_sample(reward=None, teacher_logprobs=[-0.5, -0.7])
    claim, skipped = claim_batch(db, cfg(batch_size=4), LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == [good]
    claim.release()
    state = sample_state()
    for sample_id, why in bad.items():
        assert state[sample_id][0] is None
        assert why in (state[sample_id][1] or ""), (sample_id, state[sample_id])
    assert skipped["invalid"] == 7 and skipped["no_signal"] == 1 and skipped["opted_out"] == 1


def test_method_decides_what_counts_as_a_signal(db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    teacher_only = add_sample(reward=None, teacher_logprobs=[-0.5, -0.7])
    reward_only = add_sample(reward=-1)
    claim, _ = claim_batch(db, cfg(method="opd"), LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == [teacher_only]
    claim.release()
    assert sample_state()[reward_only] == (None, "no_signal")


def test_collate_places_response_on_the_target_grid() -> None:
    from trainer.data import SampleRow

    a = SampleRow(1, [10, 11, 12], [13, 14], [-1.0, -2.0], [-0.5, -0.5], 1, 3)
    b = SampleRow(2, [20], [21], [-3.0], None, None, 4)
    batch = collate([a, b], current_version=4)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [20, 21, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # a: response tokens at input positions 3, 4 -> target columns 2, 3
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert batch.rollout_logp.tolist() == [[0, 0, -1, -2], [-3, 0, 0, 0]]
    assert batch.teacher_logp.tolist() == [[0, 0, -0.5, -0.5], [0, 0, 0, 0]]
    assert batch.has_teacher.tolist() == [True, False]
    assert batch.has_reward.tolist() == [True, False]
    assert batch.staleness == [1, 0] and batch.num_tokens == 3
    micro = batch.micro_batches(1)
    assert micro[1].input_ids.tolist() == [[20, 21]] and micro[1].loss_mask.tolist() == [[1]]
    # A token budget: rows × longest row ≤ max_tokens, one sample at least.
    assert [m.sample_ids for m in batch.micro_batches(4, max_tokens=4)] == [[1], [2]]
    assert [m.sample_ids for m in batch.micro_batches(4, max_tokens=10)] == [[1, 2]]


def test_sharing_by_user_weighs_each_user_the_same() -> None:
    """`share_by_user`: the weighted masked sum over N is the mean over users of each user's
    token mean — checked against those means computed apart — and the mask still sums to N."""
    from trainer.data import SampleRow, share_by_user
    from trainer.loss import policy_loss

    rows = [SampleRow(1, [1], [2] * 6, [-1.0] * 6, None, 1, 0),  # user 7: one long reply
            SampleRow(2, [1], [2], [-1.0], None, 1, 0),  # user 8: two short ones
            SampleRow(3, [1], [2, 3], [-1.0] * 2, None, 1, 0)]
    batch = collate(rows, current_version=0)
    share_by_user(batch, [7, 8, 8])
    assert batch.num_tokens == 9 and math.isclose(float(batch.loss_mask.sum()), 9.0)
    # Per-token advantages that tell the users apart: 1 for user 7, 4 for user 8.
    adv = torch.tensor([[1.0] * 6, [4.0] + [0.0] * 5, [4.0, 4.0] + [0.0] * 4])
    loss = policy_loss(logp_new=batch.rollout_logp, rollout_logp=batch.rollout_logp,
                       advantages=adv, mask=batch.loss_mask, num_tokens=batch.num_tokens,
                       eps_low=0.2, eps_high=0.2).loss
    assert math.isclose(float(loss), -(1.0 + 4.0) / 2, rel_tol=1e-6)  # not −(6·1 + 3·4) / 9
    alone = collate(rows[:2], current_version=0)
    before = alone.loss_mask.clone()
    share_by_user(alone, [7, 7])  # one user: the token mean, unchanged
    assert torch.equal(alone.loss_mask, before)


def test_record_step_marks_samples_in_the_same_transaction(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    ids = [add_sample(), add_sample()]
    claim, _ = claim_batch(db, cfg(), LIMITS, 0)
    assert claim is not None
    record_step(claim, step=dict(step=1, version=1, status="ok", num_samples=2, num_tokens=4),
                version=dict(version=1, step=1, path="/w/v000001", status="saved"), trained=True)
    assert sample_state() == {ids[0]: (1, None), ids[1]: (1, None)}
    with db.connect() as conn:
        assert conn.execute(select(TrainingStep.__table__.c.step)).scalars().all() == [1]
        assert conn.execute(select(PolicyVersion.__table__.c.status)).scalars().all() == \
            ["saved"]


def test_a_failing_commit_leaves_everything_unmarked(db: Engine,
                                                    add_sample: SampleFactory, sample_state: States) -> None:
    ids = [add_sample(), add_sample()]
    with db.begin() as conn:  # step 1 already exists: the insert will violate the PK
        conn.execute(TrainingStep.__table__.insert().values(
            step=1, status="ok", num_samples=0, num_tokens=0))
    claim, _ = claim_batch(db, cfg(), LIMITS, 0)
    assert claim is not None
    try:
        record_step(claim, step=dict(step=1, status="ok", num_samples=2, num_tokens=4),
                    version=None, trained=True)
    except Exception:
        claim.release()
    else:
        raise AssertionError("duplicate step was accepted")
    assert all(sample_state()[i] == (None, None) for i in ids)


def test_nonfinite_step_marks_samples_skipped_not_trained(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    ids = [add_sample(), add_sample()]
    claim, _ = claim_batch(db, cfg(), LIMITS, 0)
    assert claim is not None
    record_step(claim, step=dict(step=3, status="skipped", num_samples=2, num_tokens=4),
                version=None, trained=False)
    assert sample_state() == {i: (None, "nonfinite: step 3") for i in ids}


def test_replay_draws_the_users_accepted_trained_samples_only(
        db: Engine, add_sample: SampleFactory) -> None:
    accepted = [add_sample(trained_step=1, reward=1, response_ids=[10 + i, 20])
                for i in range(4)]
    with db.connect() as conn:
        alice = conn.execute(select(Sample.__table__.c.user_id)
                             .where(Sample.__table__.c.id == accepted[0])).scalar_one()
    with db.begin() as conn:
        bob = conn.execute(insert(User.__table__).values(name="bob")
                           .returning(User.__table__.c.id)).scalar_one()
    add_sample(trained_step=1, reward=-1, response_ids=[30, 20])  # corrected
    add_sample(trained_step=1, reward=0, response_ids=[31, 20])   # neither
    add_sample(reward=1, response_ids=[32, 20])                   # not trained yet
    add_sample(trained_step=1, reward=1, response_ids=[33, 20], user_id=bob)
    add_sample(trained_step=1, reward=1, response_ids=[34, 20], opt_out=True)

    def first_tokens(picked: list[PtxExample]) -> list[int]:
        return sorted(e.ids[3] for e in picked)

    rng = random.Random(0)
    mine = replay_batch(db, cfg(replay_size=16), rng, user_id=alice)
    assert first_tokens(mine) == [10, 11, 12, 13]
    # The loss falls on the response only: prompt [1, 3, 4], response [t, 20].
    assert all(e.ids[:3] == [1, 3, 4] and e.mask == [0, 0, 1, 1] for e in mine)
    assert first_tokens(replay_batch(db, cfg(replay_size=16), rng, user_id=bob)) == [33]
    # Shared mode: everyone's who still allows training.
    assert first_tokens(replay_batch(db, cfg(replay_size=16), rng)) == [10, 11, 12, 13, 33]
    # At most replay_size, from the newest replay_window.
    assert first_tokens(replay_batch(db, cfg(replay_size=16, replay_window=2), rng,
                                     user_id=alice)) == [12, 13]
    assert len(set(map(tuple, (e.ids for e in
                               replay_batch(db, cfg(replay_size=3), rng, user_id=alice))))) == 3
    # Off, or nothing accepted yet: nothing to replay.
    assert replay_of(db, cfg(), step=7, user_id=alice) is None
    with db.begin() as conn:
        carol = conn.execute(insert(User.__table__).values(name="carol")
                             .returning(User.__table__.c.id)).scalar_one()
    assert replay_of(db, cfg(replay_coef=0.5), step=7, user_id=carol) == []
    # Seeded by the step: a retried step replays the same samples.
    assert replay_of(db, cfg(replay_coef=0.5, replay_size=2), 7, alice) == \
        replay_of(db, cfg(replay_coef=0.5, replay_size=2), 7, alice)
