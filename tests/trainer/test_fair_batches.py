"""No one user steers the shared model: batches drawn fairly across users, a cap per user per
batch and per time window, nothing lost (trainer/data.py `fair_order`, `claim_batch`), the
`training_shares` view; against a real Postgres."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy import insert, text
from sqlalchemy.engine import Engine

from clawrl.base.db import User
from trainer.config import TrainerSettings
from trainer.data import ModelLimits, claim_batch, fair_order, record_step

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


def test_fair_order_is_round_robin_within_the_caps() -> None:
    heads = [(1, 7), (2, 7), (3, 7), (4, 8), (5, 7), (6, 9), (9, 8)]
    # Everyone's first (oldest first), then everyone's second; user 7 capped at 2 (the cap
    # and an equal share of a batch of 6 among three users).
    assert fair_order(heads, batch_size=6, user_cap=2) == [1, 4, 6, 2, 9]
    # A user alone may fill the batch.
    assert fair_order([(1, 7), (2, 7), (3, 7)], batch_size=2, user_cap=1) == [1, 2]
    # The window: user 7 trained 4 of its 5 already; user 8 none of its 5.
    assert fair_order(heads, batch_size=16, user_cap=16, window_cap=5,
                      trained={7: 4, 9: 5}) == [1, 4, 9]
    # Out of window for all but one: that user alone, then up to its window.
    assert fair_order(heads, batch_size=3, user_cap=1, window_cap=2,
                      trained={8: 2, 9: 2}) == [1, 2]
    assert fair_order([], batch_size=4, user_cap=1) == []
    # Fewer users waiting than the cap leaves room for: each may take an equal share
    # (⌈5 / 2⌉ = 3 > the cap of 1), so the batch fills rather than waiting with two slots empty.
    two = [(1, 7), (2, 7), (3, 7), (4, 7), (5, 8), (6, 8), (7, 8), (8, 8)]
    assert fair_order(two, batch_size=5, user_cap=1) == [1, 5, 2, 6, 3, 7]
    # ... and never more than that share: one user's many samples do not fill a batch that
    # another user's few leave room in (it waits for max_wait_s instead).
    assert fair_order([(1, 7), (2, 7), (3, 7), (4, 7), (5, 8)], batch_size=4,
                      user_cap=1) == [1, 5, 2]


def test_a_big_user_takes_at_most_a_quarter_while_others_wait(
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
    # A newcomer's sample goes into the next batch; with two users waiting the big one takes
    # an equal share (8 of 16), above the quarter but never more.
    newcomer = add_sample(user_id=add_user(db, "newcomer"))
    third = train(db, cfg(), 3)
    assert third is not None and newcomer in third and len(third) == 9
    # With many samples of both, the batch fills half and half.
    more = [add_sample(user_id=small) for _ in range(12)]
    fourth_batch = train(db, cfg(), 4)
    assert fourth_batch is not None and owners(db, fourth_batch) == {big: 8, small: 8}
    assert set(more[:8]) <= set(fourth_batch)
    # Nothing lost: every sample is trained or still waiting, none skipped.
    state = sample_state()
    assert all(why is None for _, why in state.values())
    assert sum(step is not None for step, _ in state.values()) == 13 + 16 + 9 + 16


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
    # 8 of a (an equal share) and b's one: not a full batch of 16, so it waits for more users' samples
    # (polled until told to stop), then trains as a partial batch after max_wait_s.
    polls = iter(range(5))
    claim, _ = claim_batch(db, cfg(max_wait_s=3600), LIMITS, 0,
                           should_stop=lambda: next(polls, None) is None)
    assert claim is None
    claim, _ = claim_batch(db, cfg(max_wait_s=0.05), LIMITS, 0)
    assert claim is not None and owners(db, claim.batch.sample_ids) == {a: 8, b: 1}
    claim.release()


def test_personal_mode_trains_one_users_own_samples_without_a_cap(
        db: Engine, add_sample: SampleFactory) -> None:
    a, b = add_user(db, "a"), add_user(db, "b")
    mine = [add_sample(user_id=a) for _ in range(6)]
    add_sample(user_id=b)
    claim, _ = claim_batch(db, cfg(batch_size=4, personal=True, user_window_batches=0.25),
                           LIMITS, 0, user_id=a)
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
    assert claim is not None and claim.batch.size == 16
    assert len(owners(db, claim.batch.sample_ids)) == 16  # sixteen users' oldest
    claim.release()


def test_training_shares_view_per_version_and_user(db: Engine,
                                                   add_sample: SampleFactory) -> None:
    a, b = add_user(db, "ada"), add_user(db, "bob")
    for user in (a, a, a, b):
        add_sample(user_id=user)
    assert train(db, cfg(batch_size=4, user_batch_share=1.0), 1) is not None
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
