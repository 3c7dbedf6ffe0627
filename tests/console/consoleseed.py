"""Rows for the console's tests, written the way the proxy and the judge store them (tests
that need them made by the real stack, engine and all, are in test_console_browser.py)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from proxyharness import libpq


def seed_user(db_url: str, name: str) -> int:
    with psycopg.connect(libpq(db_url), autocommit=True) as conn:
        row = conn.execute("INSERT INTO users (name) VALUES (%s) RETURNING id", [name]).fetchone()
    assert row is not None
    return int(row[0])


def seed_turn(conn: psycopg.Connection[Any], user_id: int, *, version: str | None = "1",
              session: uuid.UUID | None = None, index: int = 0, text: str = "hello",
              reply: str = "hi there", kind: str = "main", next_state: Any = None,
              created_at: str | None = None) -> int:
    if session is not None:
        conn.execute("INSERT INTO sessions (id, user_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                     [session, user_id])
    row = conn.execute(
        "INSERT INTO turns (uid, user_id, session_id, index_in_session, kind, request_messages,"
        " response_message, response_ids, response_logprobs, weight_version, status, state,"
        " next_state, next_state_at, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s,"
        " %s, 'ok', %s, %s, CASE WHEN %s::jsonb IS NULL THEN NULL ELSE now() END,"
        " coalesce(%s::timestamptz, now())) RETURNING id",
        [uuid.uuid4(), user_id, session, index, kind,
         psycopg.types.json.Jsonb([{"role": "user", "content": text}]),
         psycopg.types.json.Jsonb({"role": "assistant", "content": reply}),
         [11, 12, 13], [-0.1, -2.5, -0.01], version,
         "continued" if next_state else "open",
         psycopg.types.json.Jsonb(next_state) if next_state else None,
         psycopg.types.json.Jsonb(next_state) if next_state else None, created_at]).fetchone()
    assert row is not None
    return int(row[0])


def seed_judgment(conn: psycopg.Connection[Any], turn_id: int, reward: int | None, *,
                  hint: str | None = None, teacher: list[float] | None = None,
                  votes: list[dict[str, Any]] | None = None) -> int:
    row = conn.execute(
        "INSERT INTO judgments (turn_id, prompt_version, judge_model, reward, votes, hint,"
        " teacher_logprobs) VALUES (%s, 'v2', 'test-judge', %s, %s, %s, %s) RETURNING id",
        [turn_id, reward, psycopg.types.json.Jsonb(votes or [
            {"text": f"The user moved on. Score: {reward}", "score": reward}]),
         hint, teacher]).fetchone()
    assert row is not None
    return int(row[0])


def db(db_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq(db_url), autocommit=True)
