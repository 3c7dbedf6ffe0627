"""Trainer test helpers: sample rows inserted straight into a real Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.engine import Engine

from clawrl.base.db import Judgment, Sample, Turn, User, create_engine

SampleFactory = Callable[..., int]


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def add_sample(db: Engine) -> SampleFactory:
    """`add_sample(prompt_ids=…, response_ids=…, rollout_logprobs=…, reward=…, …) -> id`.

    Creates the user / turn / judgment rows a sample needs. Defaults: a 3-token prompt, a
    2-token response with logprobs −1, reward +1, no teacher, weight_version '0'.
    """
    with db.begin() as conn:
        user_id = conn.execute(insert(User.__table__).values(name="alice")
                               .returning(User.__table__.c.id)).scalar_one()

    def make(*, opt_out: bool = False, **fields: Any) -> int:
        uid = user_id
        with db.begin() as conn:
            if opt_out:
                uid = conn.execute(insert(User.__table__).values(
                    name=f"u{uuid.uuid4().hex[:6]}", train_opt_out=True)
                    .returning(User.__table__.c.id)).scalar_one()
            turn_id = conn.execute(insert(Turn.__table__).values(
                uid=uuid.uuid4(), user_id=uid,
                request_messages=fields.pop("request_messages", []), status="ok")
                .returning(Turn.__table__.c.id)).scalar_one()
            judgment_id = conn.execute(insert(Judgment.__table__).values(
                turn_id=turn_id, prompt_version="v1")
                .returning(Judgment.__table__.c.id)).scalar_one()
            response = fields.pop("response_ids", [5, 6])
            row = dict(turn_id=turn_id, judgment_id=judgment_id, user_id=uid,
                       prompt_ids=fields.pop("prompt_ids", [1, 3, 4]), response_ids=response,
                       rollout_logprobs=fields.pop("rollout_logprobs", [-1.0] * len(response)),
                       reward=fields.pop("reward", 1), weight_version=fields.pop("weight_version",
                                                                                 "0"))
            row.update(fields)
            sample_id: int = conn.execute(insert(Sample.__table__).values(**row)
                                          .returning(Sample.__table__.c.id)).scalar_one()
        return sample_id

    return make


@pytest.fixture
def sample_state(db: Engine) -> Callable[[], dict[int, tuple[int | None, str | None]]]:
    """`sample_state() -> {sample id: (trained_step, skipped_reason)}`."""

    def read() -> dict[int, tuple[int | None, str | None]]:
        t = Sample.__table__
        with db.connect() as conn:
            rows = conn.execute(select(t.c.id, t.c.trained_step, t.c.skipped_reason)).all()
        return {r.id: (r.trained_step, r.skipped_reason) for r in rows}

    return read
