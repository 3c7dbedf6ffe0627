"""Helpers for judge tests: users, continued turns and judge jobs in a real Postgres."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, insert, select, text

from clawrl.base.db import Job, Turn, User
from clawrl.base.jobs import enqueue_stmt, notify_stmt
from proxy.records import scrub_nul


def add_user(db: Engine, *, opt_out: bool = False) -> int:
    with db.begin() as conn:
        return int(conn.execute(insert(User).values(
            name=f"u{uuid.uuid4().hex[:8]}", train_opt_out=opt_out).returning(User.id)
        ).scalar_one())


def turn_values(user_id: int, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "uid": uuid.uuid4(), "user_id": user_id, "kind": "main", "status": "ok",
        "request_messages": [{"role": "user", "content": "What does Ada like?"}],
        "response_message": {"role": "assistant", "content": "Ada likes tea."},
        "prompt_ids": [1, 5, 6, 7, 2, 1, 8], "response_ids": [10, 11, 12, 2],
        "response_logprobs": [-0.5, -1.0, -0.25, -0.1], "weight_version": "default",
        "finish_reason": "stop", "state": "continued",
        "next_state": [{"role": "user", "content": "too long, answer in lowercase"}],
    }
    values.update(overrides)
    return values


def add_turn(db: Engine, user_id: int, *, job: bool = True, **overrides: Any) -> int:
    """A continued turn and (by default) its judge job, in one transaction like the proxy.
    Text is scrubbed of NUL as the proxy does (a random model's reply can hold one)."""
    with db.begin() as conn:
        values = scrub_nul(turn_values(user_id, **overrides))
        turn_id = int(conn.execute(insert(Turn).values(**values)
                                   .returning(Turn.id)).scalar_one())
        if job:
            conn.execute(enqueue_stmt("judge", turn_id))
            conn.execute(notify_stmt("judge"))
    return turn_id


def jobs(db: Engine) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(select(Job).order_by(Job.id)).all())


def rows(db: Engine, sql: str, **params: Any) -> list[Any]:
    with db.connect() as conn:
        return list(conn.execute(text(sql), params).all())


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Poll a condition (a deadline so a broken test fails instead of hanging)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)
