"""No one user steers the shared model: batches drawn fairly across users, a quota per user per
version (trainer/shares.py) and a cap per time window, nothing lost (trainer/data.py
`fair_order`, `claim_batch`), the `training_shares` view; against a real Postgres."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import insert, text
from sqlalchemy.engine import Engine

from clawrl.base.db import User
from trainer.config import TrainerSettings, load_settings
from trainer.data import ModelLimits, claim_batch, fair_order, record_step
from trainer.shares import ShareRule, full_size, user_limits

SampleFactory = Callable[..., int]
States = Callable[[], dict[int, Any]]
LIMITS = ModelLimits(vocab_size=100, max_context=8)


def cfg(**kw: object) -> TrainerSettings:
    base: dict[str, object] = dict(batch_size=16, max_wait_s=0.0, poll_s=0.01)
    return TrainerSettings(**(base | kw))  # type: ignore[arg-type]


def add_user(db: Engine, name: str) -> int:
    with db.begin() as conn:
        return int(conn.execute(insert(User.__table__).values(name=name)
                                .returning(User.__table__.c.id)).scalar_one())


def owners(db: Engine, ids: list[int]) -> Counter[int]:
    with db.connect() as conn:
        return Counter(conn.execute(text("SELECT user_id FROM samples WHERE id = ANY(:ids)"),
                                    {"ids": ids}).scalars())


def train(db: Engine, settings: TrainerSettings, step: int) -> list[int] | None:
    """Claim a batch and record it as trained step `step` (version `step`); its sample ids,
    or None when nothing could be claimed."""
    claim, _ = claim_batch(db, settings, LIMITS, step - 1, give_up_after_s=0.0)
    if claim is None:
        return None
    record_step(claim, step=dict(step=step, version=step, status="ok",
                                 num_samples=claim.batch.size, num_tokens=claim.batch.num_tokens),
                version=dict(version=step, step=step, path=f"/w/v{step:06d}", status="saved"),
                trained=True)
    return claim.batch.sample_ids


def rule(batch_size: int = 16, quota: int = 8, floor: int = 4,
         max_batch: int = 32) -> ShareRule:
    return ShareRule(batch_size=batch_size, quota=quota, floor=floor, max_batch=max_batch)


def test_user_limits_by_hand() -> None:
    # A user alone fills batch_size, whatever the quota.
    assert user_limits({7: 100}, rule()) == {7: 16}
    # Everyone with a quota's worth or more: a quota each, however much one user floods.
    assert user_limits({7: 100, 8: 9, 9: 8}, rule()) == {7: 8, 8: 8, 9: 8}
    # The others have few: the flooder takes the floor (4), not its quota.
    assert user_limits({7: 100, 8: 3}, rule()) == {7: 4, 8: 8}
    # ... or as many as the busiest other user puts in, when that is above the floor.
    assert user_limits({7: 100, 8: 6, 9: 2}, rule()) == {7: 6, 8: 8, 9: 8}
    # Two users level with each other: each may match the other.
    assert user_limits({7: 5, 8: 5}, rule()) == {7: 5, 8: 5}
    assert user_limits({}, rule()) == {}
    # Full: batch_size alone; the waiting users' quotas together, at most max_batch.
    assert [full_size(n, rule()) for n in (0, 1, 2, 3, 4, 5)] == [16, 16, 16, 24, 32, 32]


def test_fair_order_is_round_robin_within_the_limits() -> None:
    heads = [(1, 7), (2, 7), (3, 7), (4, 8), (5, 7), (6, 9), (9, 8)]
    # Everyone's first (oldest first), then everyone's second, …; user 7 at most the
    # busiest other user's 2 (the floor of 1 is lower), a full batch three quotas of 3.
    assert fair_order(heads, rule(batch_size=6, quota=3, floor=1, max_batch=12)) == \
        ([1, 4, 6, 2, 9], 9)
    # A user alone may fill batch_size.
    assert fair_order([(1, 7), (2, 7), (3, 7)], rule(batch_size=2, quota=1, floor=1)) == \
        ([1, 2], 2)
    # The window: user 7 trained 4 of its 5 already; user 9 all 5; user 8 none.
    assert fair_order(heads, rule(), window_cap=5, trained={7: 4, 9: 5}) == ([1, 4, 9], 16)
    # Out of window for all but one: that user alone, then up to its window.
    assert fair_order(heads, rule(batch_size=3, quota=1, floor=1, max_batch=6), window_cap=2,
                      trained={8: 2, 9: 2}) == ([1, 2], 3)
    assert fair_order([], rule()) == ([], 16)
    # Quotas past max_batch: round robin, so the first max_batch are an equal share each.
    many = [(100 * u + k, u) for u in range(1, 7) for k in range(10)]
    order, size = fair_order(many, rule(batch_size=8, quota=4, floor=2, max_batch=12))
    assert size == 12 and Counter(i // 100 for i in order[:12]) == {u: 2 for u in range(1, 7)}


def test_a_flooding_user_never_shrinks_another_users_part_of_a_version(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    """The quota: two users with a quota's worth each get the same part of a version with or
    without a third who floods; the batch grows by the flooder's quota instead."""
    ada, bob = add_user(db, "ada"), add_user(db, "bob")
    for _ in range(10):
        add_sample(user_id=ada)
        add_sample(user_id=bob)
    alone = train(db, cfg(), 1)
    assert alone is not None and owners(db, alone) == {ada: 8, bob: 8}  # 2 quotas: full
    flood = add_user(db, "flood")
    flood_ids = [add_sample(user_id=flood) for _ in range(100)]
    for _ in range(6):
        add_sample(user_id=ada)
        add_sample(user_id=bob)
    # ada and bob have 8 each again: they keep 8 each, the flooder gets a quota beside them.
    beside = train(db, cfg(), 2)
    assert beside is not None and owners(db, beside) == {ada: 8, bob: 8, flood: 8}
    assert set(flood_ids[:8]) <= set(beside)  # the flooder's oldest
    # Six users with plenty: quotas (48) past max_batch_size (32), an equal share of it each.
    for name in ("cy", "di", "ed"):
        user = add_user(db, name)
        for _ in range(10):
            add_sample(user_id=user)
    for _ in range(10):
        add_sample(user_id=ada)
        add_sample(user_id=bob)
    crowd = train(db, cfg(), 3)
    assert crowd is not None and len(crowd) == 32
    assert sorted(owners(db, crowd).values()) == [5, 5, 5, 5, 6, 6]
    # Nothing lost: every sample is trained or still waiting, none skipped.
    state = sample_state()
    assert all(why is None for _, why in state.values())
    assert sum(step is not None for step, _ in state.values()) == 16 + 24 + 32


def test_share_settings_from_the_environment_and_refused_when_inconsistent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWRL_TRAINER__USER_QUOTA", "0.75")
    monkeypatch.setenv("CLAWRL_TRAINER__MAX_BATCH_SIZE", "100")
    monkeypatch.setenv("CLAWRL_TRAINER__BATCH_SIZE", "40")
    assert load_settings().trainer.share_rule == rule(batch_size=40, quota=30, floor=10,
                                                      max_batch=100)
    assert cfg(batch_size=64).share_rule == rule(batch_size=64, quota=32, floor=16,
                                                 max_batch=128)
    with pytest.raises(ValidationError, match=r"user_quota \(0.2\) is below user_batch_share"):
        cfg(user_quota=0.2)
    with pytest.raises(ValidationError, match=r"max_batch_size \(8\) is below batch_size"):
        cfg(max_batch_size=8)
    with pytest.raises(ValidationError, match="user_quota"):
        cfg(user_quota=1.5)


def test_a_big_user_takes_at_most_a_quarter_while_others_have_few(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    big, small, other, fourth = (add_user(db, n) for n in ("big", "small", "other", "fourth"))
    big_ids = [add_sample(user_id=big) for _ in range(100)]
    small_ids = [add_sample(user_id=u) for u in (small, other, fourth) * 3]

    first = train(db, cfg(), 1)
    assert first is not None
    assert owners(db, first) == {big: 4, small: 3, other: 3, fourth: 3}
    assert set(first) == set(small_ids) | set(big_ids[:4])  # the big user's oldest

    # Only the big user has samples waiting now: it may fill a batch, oldest first.
    second = train(db, cfg(), 2)
    assert second == big_ids[4:20]
    # A newcomer with one sample: the big user takes the floor (a quarter, 4) beside it.
    newcomer = add_sample(user_id=add_user(db, "newcomer"))
    third = train(db, cfg(), 3)
    assert third is not None and newcomer in third and len(third) == 5
    # The other user has 6: the big user may match that, not more.
    six = [add_sample(user_id=small) for _ in range(6)]
    fourth_batch = train(db, cfg(), 4)
    assert fourth_batch is not None and owners(db, fourth_batch) == {big: 6, small: 6}
    assert set(six) <= set(fourth_batch)
    # With many samples of both, the batch fills half and half (two quotas of 8).
    more = [add_sample(user_id=small) for _ in range(12)]
    fifth = train(db, cfg(), 5)
    assert fifth is not None and owners(db, fifth) == {big: 8, small: 8}
    assert set(more[:8]) <= set(fifth)  # the small user's oldest
    # Nothing lost: every sample is trained or still waiting, none skipped.
    state = sample_state()
    assert all(why is None for _, why in state.values())
    assert sum(step is not None for step, _ in state.values()) == 13 + 16 + 5 + 12 + 16


def test_a_user_alone_is_held_by_the_window_and_loses_nothing(
        db: Engine, add_sample: SampleFactory, sample_state: States) -> None:
    loud = add_user(db, "loud")
    quiet_user = add_user(db, "quiet")  # another tenant, with nothing to train yet
    ids = [add_sample(user_id=loud) for _ in range(20)]
    settings = cfg(batch_size=4, user_window_batches=2, user_window_s=3600)
    assert train(db, settings, 1) == ids[:4]
    assert train(db, settings, 2) == ids[4:8]
    assert train(db, settings, 3) is None  # 8 trained within the hour: the window is full
    # Another user's samples still train meanwhile.
    quiet = add_sample(user_id=quiet_user)
    assert train(db, settings, 3) == [quiet]
    # Held back, not lost: the rest of the loud user's samples wait, unmarked.
    state = sample_state()
    assert [state[i] for i in ids[8:]] == [(None, None)] * 12
    # The window moves on: an hour later the loud user trains again.
    with db.begin() as conn:
        conn.execute(text("UPDATE training_steps SET created_at = now() - interval '61 minutes'"))
    assert train(db, settings, 4) == ids[8:12]
    # Without a window cap a user alone trains version after version.
    assert train(db, settings.model_copy(update={"user_window_batches": 0}), 5) == ids[12:16]


def test_a_capped_batch_waits_for_max_wait_s_like_any_partial_one(
        db: Engine, add_sample: SampleFactory) -> None:
    a, b = add_user(db, "a"), add_user(db, "b")
    for _ in range(10):
        add_sample(user_id=a)
    add_sample(user_id=b)
    # 4 of a (the floor: b has fewer) and b's one: not a full batch (two quotas, 16), so it
    # waits for more users' samples (polled until told to stop), then trains as a partial
    # batch after max_wait_s.
    polls = iter(range(5))
    claim, _ = claim_batch(db, cfg(max_wait_s=3600), LIMITS, 0,
                           should_stop=lambda: next(polls, None) is None)
    assert claim is None
    claim, _ = claim_batch(db, cfg(max_wait_s=0.05), LIMITS, 0)
    assert claim is not None and owners(db, claim.batch.sample_ids) == {a: 4, b: 1}
    claim.release()


def test_personal_mode_trains_one_users_own_samples_without_a_cap(
        db: Engine, add_sample: SampleFactory) -> None:
    a, b = add_user(db, "a"), add_user(db, "b")
    mine = [add_sample(user_id=a) for _ in range(6)]
    add_sample(user_id=b)
    # No share applies (a quota of 1 and a floor of 1 of 4 would, on the shared model).
    settings = cfg(batch_size=4, personal=True, user_window_batches=0.25, user_quota=0.25,
                   max_batch_size=4)
    claim, _ = claim_batch(db, settings, LIMITS, 0, user_id=a)
    assert claim is not None and claim.batch.sample_ids == mine[:4]
    claim.release()


def test_the_draw_reads_by_index_with_many_samples(db: Engine,
                                                   add_sample: SampleFactory) -> None:
    template = add_sample()
    with db.begin() as conn:
        users = conn.execute(text(
            "INSERT INTO users (name) SELECT 'u' || g FROM generate_series(1, 200) g "
            "RETURNING id")).scalars().all()
        conn.execute(text(
            "INSERT INTO samples (turn_id, judgment_id, user_id, prompt_ids, response_ids, "
            "rollout_logprobs, reward, weight_version, trained_step) "
            "SELECT s.turn_id, s.judgment_id, (:users)[1 + g % 200], s.prompt_ids, "
            "s.response_ids, s.rollout_logprobs, s.reward, s.weight_version, "
            "CASE WHEN g % 4 = 0 THEN NULL ELSE g / 100 + 1 END "
            "FROM samples s, generate_series(1, 40000) g WHERE s.id = :id"),
            {"users": list(users), "id": template})
        # One step every 10 minutes: the last hour holds the newest six.
        conn.execute(text("INSERT INTO training_steps (step, status, num_samples, num_tokens, "
                          "created_at) SELECT g, 'ok', 0, 0, "
                          "now() - (401 - g) * interval '10 minutes' "
                          "FROM generate_series(1, 401) g"))
        conn.execute(text("ANALYZE samples"))
        conn.execute(text("ANALYZE training_steps"))
    from trainer.data import _HEADS_SQL, _WINDOW_SQL

    def plan(sql: str) -> str:
        with db.connect() as conn:
            return "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {sql}"), {
                "per_user": 16, "window_s": 3600.0}))

    heads = plan(_HEADS_SQL.format(join="", held=""))
    assert "ix_samples_ready_user" in heads and "Seq Scan on samples" not in heads, heads
    window = plan(_WINDOW_SQL)
    assert "Seq Scan on samples" not in window, window
    claim, _ = claim_batch(db, cfg(), LIMITS, 0)
    # 200 users' quotas pass max_batch_size (32): thirty-two users' oldest.
    assert claim is not None and claim.batch.size == 32
    assert len(owners(db, claim.batch.sample_ids)) == 32
    claim.release()


def test_training_shares_view_per_version_and_user(db: Engine,
                                                   add_sample: SampleFactory) -> None:
    a, b = add_user(db, "ada"), add_user(db, "bob")
    for user in (a, a, a, b):
        add_sample(user_id=user)
    assert train(db, cfg(batch_size=4, user_batch_share=1.0, user_quota=1.0,
                         max_batch_size=4), 1) is not None
    with db.connect() as conn:
        rows = conn.execute(text(
            "SELECT version, user_name, samples, version_samples, share "
            "FROM training_shares ORDER BY user_name")).all()
        readonly = conn.execute(text(
            "SELECT has_table_privilege('clawrl_readonly', 'training_shares', 'SELECT') "
            "FROM pg_roles WHERE rolname = 'clawrl_readonly'")).scalar()
    assert [tuple(r) for r in rows] == [(1, "ada", 3, 4, 0.75), (1, "bob", 1, 4, 0.25)]
    assert readonly is True  # `clawrl sql` reads it (migration 0004 made the role)


def test_a_stack_with_one_user_is_not_held_by_the_window(
        db: Engine, add_sample: SampleFactory) -> None:
    """One person's own stack: the window bounds a tenant among others, not its only user."""
    ids = [add_sample() for _ in range(12)]  # the fixture's one user
    settings = cfg(batch_size=4, user_window_batches=1, user_window_s=3600)
    assert [train(db, settings, k) for k in (1, 2, 3)] == [ids[:4], ids[4:8], ids[8:12]]
    # A second user who may train makes it a shared stack: the window holds again.
    add_user(db, "guest")
    more = [add_sample() for _ in range(4)]
    assert train(db, settings, 4) is None
    with db.begin() as conn:  # the guest opts out of training: one tenant again
        conn.execute(text("UPDATE users SET train_opt_out = true WHERE name = 'guest'"))
    assert train(db, settings, 4) == more
