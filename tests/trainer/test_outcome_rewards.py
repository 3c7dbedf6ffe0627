"""Session outcomes mixed with process rewards (trainer/loss.py `mix_rewards`, trainer/data.py):
the arithmetic by hand for rl, opd and combine, and when a sample reads its outcome."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sqlalchemy import text
from sqlalchemy.engine import Engine

from trainer.backends.base import micro_batch_loss, signal_mask
from trainer.config import TrainerSettings
from trainer.data import ModelLimits, SampleRow, claim_batch, collate, record_step
from trainer.loss import compute_advantages, group_baseline, mix_rewards, reward_baseline

SampleFactory = Callable[..., int]
LIMITS = ModelLimits(vocab_size=100, max_context=8)

# Four samples, two response tokens each. Garbage (5.0, 7.0, 9.0) sits where a value is
# absent and must never leak in.
#   s0: process −1, outcome +1, teacher    s1: process NULL, outcome −1, no teacher
#   s2: process +1, outcome NULL, teacher  s3: process NULL, outcome NULL, teacher
REWARD, HAS_REWARD = [-1.0, 5.0, 1.0, 5.0], [True, False, True, False]
OUTCOME, HAS_OUTCOME = [1.0, -1.0, 7.0, 7.0], [True, True, False, False]
ROLLOUT = [[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0], [-2.0, -1.0]]
TEACHER = [[-0.5, -3.0], [9.0, 9.0], [-0.5, -2.0], [-1.0, -1.0]]
HAS_TEACHER = [True, False, True, True]
# teacher − rollout: s0 (+0.5, −1.0), s2 (+0.5, −1.0), s3 (+1.0, 0.0)


def _adv(method: str, w_outcome: float, *, w_rl: float = 2.0,
         w_opd: float = 0.5) -> tuple[list[list[float]], list[bool]]:
    adv, signal = compute_advantages(
        method=method, w_rl=w_rl, w_opd=w_opd, reward=torch.tensor(REWARD),
        has_reward=torch.tensor(HAS_REWARD), teacher_logp=torch.tensor(TEACHER),
        has_teacher=torch.tensor(HAS_TEACHER), rollout_logp=torch.tensor(ROLLOUT),
        outcome=torch.tensor(OUTCOME), has_outcome=torch.tensor(HAS_OUTCOME),
        w_outcome=w_outcome)
    return adv.tolist(), signal.tolist()


@pytest.mark.parametrize(("method", "expected", "signal"), [
    # r: s0 0.25·(+1) + 0.75·(−1) = −0.5; s1 outcome alone −1; s2 process alone +1; s3 none.
    # A = w_rl·r = 2·r.
    ("rl", [[-1.0, -1.0], [-2.0, -2.0], [2.0, 2.0], [0.0, 0.0]], [True, True, True, False]),
    # opd never uses the process reward: r = outcome where there is one (s0 +1, s1 −1).
    # A = 2·r + 0.5·(teacher − rollout): s0 2 + (0.25, −0.5); s1 −2; s2 (0.25, −0.5);
    # s3 (0.5, 0).
    ("opd", [[2.25, 1.5], [-2.0, -2.0], [0.25, -0.5], [0.5, 0.0]], [True, True, True, True]),
    # combine: rl's reward term + opd's teacher term: s0 −1 + (0.25, −0.5); s1 −2;
    # s2 2 + (0.25, −0.5); s3 (0.5, 0).
    ("combine", [[-0.75, -1.5], [-2.0, -2.0], [2.25, 1.5], [0.5, 0.0]],
     [True, True, True, True]),
])
def test_advantages_mix_outcome_and_process_by_hand(
        method: str, expected: list[list[float]], signal: list[bool]) -> None:
    adv, has_signal = _adv(method, 0.25)
    assert torch.allclose(torch.tensor(adv), torch.tensor(expected))
    assert has_signal == signal


def test_weight_zero_ignores_outcomes_and_one_ignores_process() -> None:
    # w_o = 0: exactly the rewards without outcomes (s1 has nothing left under rl).
    assert _adv("rl", 0.0) == ([[-2.0, -2.0], [0.0, 0.0], [2.0, 2.0], [0.0, 0.0]],
                               [True, False, True, False])
    # w_o = 1: the outcome replaces the process reward where both exist (s0: +1 → A 2).
    assert _adv("rl", 1.0) == ([[2.0, 2.0], [-2.0, -2.0], [2.0, 2.0], [0.0, 0.0]],
                               [True, True, True, False])


def test_equal_weights_are_half_the_papers_sum() -> None:
    """OpenClaw-RL's agent reward o + p equals 2 · (0.5·o + 0.5·p): w_o 0.5 with w_rl 2."""
    cases = [(1.0, 1.0), (1.0, -1.0), (-1.0, 0.0), (-1.0, -1.0), (0.5, 1.0)]
    o = torch.tensor([c[0] for c in cases])
    p = torch.tensor([c[1] for c in cases])
    on = torch.ones(len(cases), dtype=torch.bool)
    r, _ = mix_rewards(method="rl", w_outcome=0.5, reward=p, has_reward=on, outcome=o,
                       has_outcome=on)
    assert (2 * r).tolist() == [2.0, 0.0, -1.0, -2.0, 1.5]


def test_out_of_range_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="w_outcome"):
        _adv("rl", 1.5)
    with pytest.raises(ValueError):
        TrainerSettings(outcome_weight=-0.1)


def test_the_trainers_loss_carries_the_outcome_from_a_collated_batch() -> None:
    """Rows → collate → the backends' loss: with ratio 1 the loss is −(Σ A over signal
    tokens) / signal tokens."""
    rows = [SampleRow(0, [1, 2], [3, 4], [-1.0, -2.0], None, -1, 0, outcome=1.0),
            SampleRow(1, [1], [5, 6], [-0.5, -0.5], None, None, 0, outcome=-1.0),
            SampleRow(2, [1, 2, 3], [7, 8], [-1.0, -1.0], None, None, 0)]
    batch = collate(rows, 0)
    assert batch.outcome.tolist() == [1.0, -1.0, 0.0]
    assert batch.has_outcome.tolist() == [True, True, False]
    cfg = TrainerSettings(method="rl", w_rl=1.0, outcome_weight=0.25, kl_coef=0.0)
    mask = signal_mask(cfg, batch)
    assert int(mask.sum()) == 4  # s2 has neither a reward nor an outcome
    terms = micro_batch_loss(cfg, batch, batch.rollout_logp, int(mask.sum()))
    # s0: r = 0.25·1 + 0.75·(−1) = −0.5 on 2 tokens; s1: r = −1 on 2 tokens.
    # loss = −(2·(−0.5) + 2·(−1)) / 4 = 0.75
    assert terms.loss.item() == pytest.approx(0.75)


# --- when a sample reads its session's outcome (real Postgres) ------------------------------

def cfg(**kw: object) -> TrainerSettings:
    base: dict[str, object] = dict(batch_size=4, max_wait_s=0.0, poll_s=0.01)
    return TrainerSettings(**(base | kw))  # type: ignore[arg-type]


def _session(db: Engine, sample_ids: list[int], outcome: float | None = None) -> uuid.UUID:
    """Put the samples' turns in one new session (of their user), with `outcome`."""
    session_id = uuid.uuid4()
    with db.begin() as conn:
        conn.execute(text(
            "INSERT INTO sessions (id, user_id, outcome) SELECT :sid, user_id, :outcome "
            "FROM samples WHERE id = :first"),
            {"sid": session_id, "outcome": outcome, "first": sample_ids[0]})
        conn.execute(text("UPDATE turns SET session_id = :sid FROM samples s "
                          "WHERE s.turn_id = turns.id AND s.id = ANY(:ids)"),
                     {"sid": session_id, "ids": sample_ids})
    return session_id


def _set_outcome(db: Engine, session_id: uuid.UUID, outcome: float) -> None:
    with db.begin() as conn:
        conn.execute(text("UPDATE sessions SET outcome = :o WHERE id = :sid"),
                     {"o": outcome, "sid": session_id})


def _samples(db: Engine) -> dict[int, tuple[Any, ...]]:
    with db.connect() as conn:
        rows = conn.execute(text("SELECT id, trained_step, skipped_reason, outcome FROM samples"))
        return {r.id: (r.trained_step, r.skipped_reason, r.outcome) for r in rows}


def _step(n: int) -> dict[str, Any]:
    return dict(step=n, status="ok", num_samples=1, num_tokens=2)


def test_outcome_is_read_at_claim_time_and_recorded_with_the_step(
        db: Engine, add_sample: SampleFactory) -> None:
    first = [add_sample(reward=1), add_sample(reward=-1)]
    session = _session(db, first)  # no outcome yet
    claim, _ = claim_batch(db, cfg(), LIMITS, 0)
    assert claim is not None and claim.outcomes == [None, None]
    _set_outcome(db, session, -1.0)  # arrives while the batch trains: not seen by it
    record_step(claim, step=_step(1), version=None, trained=True)
    later = add_sample(reward=1)  # judged after the outcome arrived
    with db.begin() as conn:
        conn.execute(text("UPDATE turns SET session_id = :sid FROM samples s "
                          "WHERE s.turn_id = turns.id AND s.id = :id"),
                     {"sid": session, "id": later})
    claim, _ = claim_batch(db, cfg(), LIMITS, 1)
    assert claim is not None and claim.batch.sample_ids == [later]
    assert claim.outcomes == [-1.0] and claim.batch.has_outcome.tolist() == [True]
    record_step(claim, step=_step(2), version=None, trained=True)
    # Trained samples are not trained again; each row says which outcome it was trained with.
    assert _samples(db) == {first[0]: (1, None, None), first[1]: (1, None, None),
                            later: (2, None, -1.0)}


def test_an_outcome_gives_a_signal_to_samples_that_had_none(
        db: Engine, add_sample: SampleFactory) -> None:
    """Under opd a sample with no hint has a signal once its session has an outcome
    (unless outcome_weight is 0); under rl so does a judge's abstention."""
    no_hint = add_sample(reward=1)
    abstained = add_sample(reward=None)
    _session(db, [no_hint, abstained], outcome=1.0)
    claim, skipped = claim_batch(db, cfg(method="opd", outcome_weight=0.0), LIMITS, 0,
                                 give_up_after_s=0.1)
    assert claim is None
    assert skipped == {"no_signal": 2}

    again = [add_sample(reward=1), add_sample(reward=None)]
    _session(db, again, outcome=1.0)
    for method in ("opd", "rl"):
        claim, skipped = claim_batch(db, cfg(method=method), LIMITS, 0)
        assert claim is not None and claim.batch.sample_ids == again and not skipped
        assert claim.batch.has_outcome.tolist() == [True, True]
        claim.release()


def test_outcome_wait_holds_a_sample_until_its_outcome_or_the_deadline(
        db: Engine, add_sample: SampleFactory) -> None:
    waiting = add_sample()
    session = _session(db, [waiting])
    claim, _ = claim_batch(db, cfg(outcome_wait_s=30), LIMITS, 0, give_up_after_s=0.1)
    assert claim is None  # held: its session may still report an outcome
    _set_outcome(db, session, 0.5)
    claim, _ = claim_batch(db, cfg(outcome_wait_s=30), LIMITS, 0, give_up_after_s=0.1)
    assert claim is not None and claim.outcomes == [0.5]
    claim.release()

    no_outcome = add_sample()
    _session(db, [no_outcome])
    time.sleep(0.3)
    claim, _ = claim_batch(db, cfg(outcome_wait_s=0.2), LIMITS, 0, give_up_after_s=0.1)
    assert claim is not None and no_outcome in claim.batch.sample_ids
    assert claim.outcomes[claim.batch.sample_ids.index(no_outcome)] is None
    claim.release()


def test_an_outcome_only_sample_trains_on_its_outcome_under_every_method(
        db: Engine, add_sample: SampleFactory) -> None:
    """The judge's sample of a session's final turn (judge/judgment.py, outcome only) has no
    reward and no teacher: its session's outcome is its whole signal. Claimed under every
    method while outcome_weight > 0, its loss is −w_rl · o per token (ratio 1); skipped as
    no_signal when outcome_weight is 0."""
    trained: dict[int, tuple[Any, ...]] = {}
    for step, method in enumerate(("rl", "opd", "combine"), start=1):
        final = add_sample(reward=None, teacher_logprobs=None)
        _session(db, [final], outcome=-1.0)
        settings = cfg(method=method, outcome_weight=0.5, kl_coef=0.0)
        claim, skipped = claim_batch(db, settings, LIMITS, 0)
        assert claim is not None and claim.batch.sample_ids == [final] and not skipped
        assert claim.outcomes == [-1.0] and claim.batch.has_reward.tolist() == [False]
        assert claim.batch.has_teacher.tolist() == [False]
        mask = signal_mask(settings, claim.batch)
        assert int(mask.sum()) == 2, method
        terms = micro_batch_loss(settings, claim.batch, claim.batch.rollout_logp, 2)
        # r = o alone (no process reward) = −1; A = w_rl · r = −1; loss = −A = 1.
        assert terms.loss.item() == pytest.approx(1.0), method
        record_step(claim, step=_step(step), version=None, trained=True)
        trained[final] = (step, None, -1.0)

    ignored = add_sample(reward=None, teacher_logprobs=None)
    _session(db, [ignored], outcome=1.0)
    claim, skipped = claim_batch(db, cfg(outcome_weight=0.0), LIMITS, 0, give_up_after_s=0.1)
    assert claim is None and skipped == {"no_signal": 1}
    assert _samples(db) == {**trained, ignored: (None, "no_signal", None)}


# --- the batch-mean baseline (trainer/loss.py `reward_baseline`) -----------------------------

def test_the_baseline_is_the_mean_reward_of_the_samples_that_have_one() -> None:
    """rl at w_o 0.25: r = (−0.5, −1, +1, absent); mean over the three = −1/6. A = 2·(r − b):
    s0 2·(−0.5 + 1/6) = −2/3, s1 2·(−1 + 1/6) = −5/3, s2 2·(1 + 1/6) = 7/3, s3 none (0)."""
    mixed, on = mix_rewards(method="rl", w_outcome=0.25, reward=torch.tensor(REWARD),
                            has_reward=torch.tensor(HAS_REWARD), outcome=torch.tensor(OUTCOME),
                            has_outcome=torch.tensor(HAS_OUTCOME))
    baseline = reward_baseline(mixed, on)
    assert baseline.tolist() == pytest.approx([-1 / 6] * 4)
    adv, signal = compute_advantages(
        method="rl", w_rl=2.0, w_opd=0.5, reward=torch.tensor(REWARD),
        has_reward=torch.tensor(HAS_REWARD), teacher_logp=torch.tensor(TEACHER),
        has_teacher=torch.tensor(HAS_TEACHER), rollout_logp=torch.tensor(ROLLOUT),
        outcome=torch.tensor(OUTCOME), has_outcome=torch.tensor(HAS_OUTCOME),
        w_outcome=0.25, baseline=baseline)
    assert torch.allclose(adv, torch.tensor([[-2 / 3] * 2, [-5 / 3] * 2, [7 / 3] * 2, [0.0] * 2]))
    assert signal.tolist() == [True, True, True, False]
    # No sample with a reward: nothing to average, a zero baseline.
    assert reward_baseline(mixed, torch.zeros(4, dtype=torch.bool)).tolist() == [0.0] * 4


def test_a_batch_all_alike_teaches_nothing_through_the_reward_under_the_baseline(
        db: Engine, add_sample: SampleFactory) -> None:
    """claim_batch sets the baseline for the whole batch, micro batches carry their rows of
    it: four +1 samples are a zero advantage (loss 0 at ratio 1); without the baseline the
    same batch's loss is −1."""
    ids = [add_sample(reward=1) for _ in range(4)]
    for kind, expected in (("batch_mean", 0.0), ("none", -1.0)):
        settings = cfg(method="rl", kl_coef=0.0, reward_baseline=kind, micro_batch_size=2)
        claim, _ = claim_batch(db, settings, LIMITS, 0)
        assert claim is not None and claim.batch.sample_ids == ids
        total = sum(micro_batch_loss(settings, m, m.rollout_logp, claim.batch.num_tokens).loss
                    for m in claim.batch.micro_batches(2))
        assert float(total) == pytest.approx(expected), kind
        claim.release()
    # The four (released, so claimed again) and one −1: b = (4 − 1) / 5 = 0.6.
    worse = add_sample(reward=-1)
    settings = cfg(method="rl", kl_coef=0.0, reward_baseline="batch_mean", batch_size=5)
    claim, _ = claim_batch(db, settings, LIMITS, 0)
    assert claim is not None and worse in claim.batch.sample_ids
    assert claim.batch.baseline.tolist() == pytest.approx([0.6] * 5)
    claim.release()


# --- the per-task baseline (trainer/loss.py `group_baseline`) ---------------------------------

def test_the_group_baseline_averages_within_a_task_and_falls_back_to_the_batch() -> None:
    """Rewards (+1, −1, +1, +1, −1, absent) on tasks (a, a, a, b, c, a): task a's three
    on-samples average 1/3; b and c are alone (c's −1 and b's +1 fall back to the batch mean
    over the five on-samples, 1/5); the sample without a reward has a's mean too, but it
    is not trained through the reward (compute_advantages zeroes it)."""
    mixed = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 0.0])
    on = torch.tensor([True, True, True, True, True, False])
    base = group_baseline(mixed, on, ["a", "a", "a", "b", "c", "a"])
    assert base.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.2, 0.2, 1 / 3])
    # A task (None: the turn had no user message) never groups; no groups: the batch mean.
    assert group_baseline(mixed, on, [None] * 6).tolist() == pytest.approx([0.2] * 6)
    assert group_baseline(mixed, on, ["x"] * 6).tolist() == pytest.approx([0.2] * 6)


def test_claim_batch_groups_samples_by_their_conversations_first_user_message(
        db: Engine, add_sample: SampleFactory) -> None:
    """The group is read from each turn's request: two episodes of "Where does Ada live?"
    (one solved: +1 at both steps, one failed: −1) and one of another question (+1)."""
    ada = [{"role": "system", "content": "tools"}, {"role": "user", "content": "Where does Ada live?"}]
    later = ada + [{"role": "assistant", "content": "lookup"}, {"role": "tool", "content": "Oslo"}]
    bo = [{"role": "user", "content": "What is Bo's job?"}]
    ids = [add_sample(reward=1, request_messages=ada), add_sample(reward=1, request_messages=later),
           add_sample(reward=-1, request_messages=ada), add_sample(reward=1, request_messages=bo)]
    settings = cfg(method="rl", reward_baseline="group_mean", batch_size=4)
    claim, _ = claim_batch(db, settings, LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == ids
    # Ada's three samples: (1 + 1 − 1) / 3; Bo's alone: the batch mean (1 + 1 − 1 + 1) / 4.
    assert claim.batch.baseline.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.5])
    claim.release()


def test_the_user_baseline_leaves_a_user_who_praises_everything_with_nothing(
        db: Engine, add_sample: SampleFactory) -> None:
    """`user_mean`: each sample against its own user's mean. A user whose every reply was
    praised (+1, +1, +1) gets advantage 0 on all of them; another user's (+1, −1) keep
    their contrast around their own mean 0 — a batch mean would have rewarded the praiser."""
    from clawrl.base.db import User

    with db.begin() as conn:
        praiser = conn.execute(User.__table__.insert().values(name="praiser")
                               .returning(User.__table__.c.id)).scalar_one()
    ids = [add_sample(reward=1, user_id=praiser) for _ in range(3)]
    ids += [add_sample(reward=1), add_sample(reward=-1)]
    settings = cfg(method="rl", reward_baseline="user_mean", batch_size=5,
                   user_batch_share=1, user_quota=1, max_batch_size=5)
    claim, _ = claim_batch(db, settings, LIMITS, 0)
    assert claim is not None and sorted(claim.batch.sample_ids) == sorted(ids)
    by_id = dict(zip(claim.batch.sample_ids, claim.batch.baseline.tolist(), strict=True))
    assert [by_id[i] for i in ids] == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])
    advantages = claim.batch.reward.float() - claim.batch.baseline
    assert [float(advantages[claim.batch.sample_ids.index(i)]) for i in ids] == \
        pytest.approx([0.0, 0.0, 0.0, 1.0, -1.0])
    claim.release()


def test_the_shared_models_default_baseline_is_each_users_mean_for_several_users(
        db: Engine, add_sample: SampleFactory) -> None:
    """Unset, the shared model's batch of several users is `user_mean` (a praiser's +1s are
    worth nothing); a batch of one user's samples keeps the raw reward (no baseline), as the
    person-pace runs were measured."""
    from clawrl.base.db import User

    with db.begin() as conn:
        praiser = conn.execute(User.__table__.insert().values(name="praiser")
                               .returning(User.__table__.c.id)).scalar_one()
    alone = [add_sample(reward=-1), add_sample(reward=-1)]
    settings = cfg(method="rl", batch_size=2)
    assert settings.reward_baseline is None and not settings.personal
    claim, _ = claim_batch(db, settings, LIMITS, 0)
    assert claim is not None and claim.batch.sample_ids == alone
    assert claim.batch.baseline.tolist() == [0.0, 0.0]  # one user: the raw −1s push
    claim.release()
    with db.begin() as conn:  # trained: out of the next draw
        conn.execute(text("UPDATE samples SET trained_step = 1"))
    ids = [add_sample(reward=1, user_id=praiser) for _ in range(2)]
    ids += [add_sample(reward=1), add_sample(reward=-1)]
    settings = cfg(method="rl", batch_size=4, user_batch_share=1, user_quota=1,
                   max_batch_size=4)
    claim, _ = claim_batch(db, settings, LIMITS, 0)
    assert claim is not None and sorted(claim.batch.sample_ids) == sorted(ids)
    by_id = dict(zip(claim.batch.sample_ids, claim.batch.baseline.tolist(), strict=True))
    assert [by_id[i] for i in ids] == pytest.approx([1.0, 1.0, 0.0, 0.0])
    claim.release()
