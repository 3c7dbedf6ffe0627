"""The database schema of record (SQLAlchemy 2 models) and engine factories.

Postgres only: JSONB, arrays, `FOR UPDATE SKIP LOCKED`, `LISTEN/NOTIFY`. Alembic revisions
in `migrations/versions/` are written to match these models; `tests/test_migrations.py`
proves "upgrade from empty == models" and a downgrade/upgrade round trip.

Tables and who writes them:
- users, api_keys                      proxy (CLI / admin API)
- sessions, turns, feedback            proxy (turn log, session inference, session outcomes)
- dead_letters                         proxy (records the turn writer could not store)
- jobs                                 proxy enqueues (same transaction as the turn), judge claims
- judgments                            judge (reward, every raw vote, hint, teacher logprobs)
- samples                              judge writes one per judged, trainable turn; trainer claims
- training_steps, policy_versions      trainer
- adapter_versions                     trainer in personal mode (every saved user adapter)
- user_adapters                        whoever publishes per-user LoRA adapters (the trainer);
                                       the proxy reads it to pick a user's adapter
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    func,
    text,
)
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

IntArray = ARRAY(Integer)
FloatArray = ARRAY(Double)


def _now() -> Any:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    created_at: Mapped[dt.datetime] = _now()
    # Opted out of training: turns are logged but never judged or trained.
    train_opt_out: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # Opted out of logging: requests are served and nothing about them is stored.
    log_opt_out: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    # Public lookup prefix (the first characters of the secret); the rest is only hashed.
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(Text)
    name: Mapped[str | None] = mapped_column(Text)
    # Requests per minute; NULL means the proxy default, 0 means unlimited.
    rate_limit_rpm: Mapped[int | None] = mapped_column(Integer)
    # Fair share (proxy/limits.py), NULL: the proxy default, 0: unlimited. Requests in
    # flight at once, and prompt + completion tokens per minute.
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    rate_limit_tpm: Mapped[int | None] = mapped_column(Integer)
    # What the key may do beyond chatting: 'verifier' sets session outcomes (migration 0011).
    scopes: Mapped[list[str]] = mapped_column(ARRAY(Text), server_default=text("'{}'::text[]"))
    created_at: Mapped[dt.datetime] = _now()
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class ChatSession(Base):
    __tablename__ = "sessions"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    # The client's `X-Session-Id`, when it sent one.
    external_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _now()
    last_turn_at: Mapped[dt.datetime] = _now()
    # Set by `X-Session-Done` or the session timeout.
    closed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # Set by `X-Session-Done` only: the client ended the session, so it stays closed (a later
    # request naming it is stored closed, continuing nothing; proxy/sessions.py). A session
    # closed by the timeout is reopened by its next request.
    done_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # A verifier's outcome in [-1, 1] (`POST /v1/sessions/{id}/outcome` or the
    # `X-Session-Outcome` header; the last one wins), mixed by the trainer into the reward
    # of every sample of the session it claims afterwards (docs/trainer.md).
    outcome: Mapped[float | None] = mapped_column(Double)
    outcome_source: Mapped[str | None] = mapped_column(String(16))  # 'api' or 'header'
    outcome_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL"))
    outcome_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_sessions_user_external", "user_id", "external_id", unique=True,
              postgresql_where=text("external_id IS NOT NULL")),
    )


class Turn(Base):
    """One proxied chat completion request and what the engine answered.

    `state`: 'open' (waiting for what comes next), 'continued' (next_state attached),
    'closed' (timed out or session done, never continued). Side turns are stored with
    kind='side' and are never continued, judged or trained.
    """

    __tablename__ = "turns"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # Generated by the proxy when the request arrives; makes journal replay idempotent
    # and is returned to the client as the `X-Clawrl-Turn-Id` header.
    uid: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), unique=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    api_key_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_keys.id", ondelete="SET NULL"))
    session_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    index_in_session: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    kind: Mapped[str] = mapped_column(String(16), server_default=text("'main'"))
    # 'header' (the client's X-Turn-Type), the side-call rule that matched
    # (proxy/turnkinds.py), or NULL: a main turn by default.
    kind_reason: Mapped[str | None] = mapped_column(String(32))
    request_messages: Mapped[Any] = mapped_column(JSONB)
    # Nullable JSONB columns store Python None as SQL NULL (`none_as_null`), never JSON null.
    tools: Mapped[Any | None] = mapped_column(JSONB(none_as_null=True))
    params: Mapped[Any] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    # The sampling distribution the reply was drawn from, as the engine applied it
    # (the request's parameters over the model's defaults); NULL on turns before 0011.
    sampling: Mapped[Any | None] = mapped_column(JSONB(none_as_null=True))
    response_message: Mapped[Any | None] = mapped_column(JSONB(none_as_null=True))
    # The choices of one request with `n` > 1 (migration 0013): each is its own turn, with the
    # request's group id and its choice index; NULL for a single reply. A group baseline can
    # compare the rewards of the replies sampled for one prompt.
    group_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    group_index: Mapped[int | None] = mapped_column(SmallInteger)
    prompt_ids: Mapped[list[int] | None] = mapped_column(IntArray)
    response_ids: Mapped[list[int] | None] = mapped_column(IntArray)
    response_logprobs: Mapped[list[float] | None] = mapped_column(FloatArray)
    weight_version: Mapped[str | None] = mapped_column(Text)
    # The user's LoRA adapter that served the turn (its engine name and version); NULL: base.
    adapter: Mapped[str | None] = mapped_column(Text)
    adapter_version: Mapped[int | None] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float | None] = mapped_column(Double)
    created_at: Mapped[dt.datetime] = _now()
    # sha256 of the canonical "request messages + assistant reply" (see proxy/sessions.py).
    context_fingerprint: Mapped[bytes | None] = mapped_column()
    # The same without the context an agent appends after the request's opening message and
    # never replays (NULL when nothing follows it; proxy/sessions.py).
    conversation_fingerprint: Mapped[bytes | None] = mapped_column()
    state: Mapped[str] = mapped_column(String(16), server_default=text("'open'"))
    # Messages that followed this turn (user message, tool results), attached by the
    # request that continued it, in the same transaction that recorded that request.
    next_state: Mapped[Any | None] = mapped_column(JSONB(none_as_null=True))
    next_turn_id: Mapped[int | None] = mapped_column(BigInteger)
    next_state_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_turns_user_fingerprint", "user_id", "context_fingerprint",
              postgresql_where=text("state = 'open'")),
        Index("ix_turns_user_conversation", "user_id", "conversation_fingerprint",
              postgresql_where=text("state = 'open' AND conversation_fingerprint IS NOT NULL")),
        Index("ix_turns_user_created", "user_id", "created_at"),
        Index("ix_turns_open_created", "created_at", postgresql_where=text("state = 'open'")),
        # The console's filters (migration 0005): a version's turns newest first, a time range.
        Index("ix_turns_version_id", "weight_version", "id"),
        Index("ix_turns_created_at", "created_at"),
        Index("ix_turns_group_id", "group_id", postgresql_where=text("group_id IS NOT NULL")),
    )


class Feedback(Base):
    """Explicit feedback (`POST /v1/feedback`): thumbs up/down and optional text."""

    __tablename__ = "feedback"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    turn_id: Mapped[int] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    rating: Mapped[int | None] = mapped_column(SmallInteger)  # +1 / -1
    text: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _now()


class DeadLetter(Base):
    """A record the turn writer could not store: its raw JSON and the error, kept for an admin.

    One bad record never stops the writer (proxy/store.py); it lands here instead, visible in
    SQL and counted in /metrics (`clawrl_dead_letters_total`).
    """

    __tablename__ = "dead_letters"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))  # what the record was: 'turn', 'feedback', …
    payload: Mapped[str] = mapped_column(Text)  # the record as the writer held it, JSON text
    error: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _now()


class Job(Base):
    """A unit of background work (kind 'judge' for now).

    Claimable when status is 'queued' or 'running' and `available_at <= now()`:
    for a queued job `available_at` is when it may run (backoff), for a running job it is
    its lease deadline, so an expired lease makes the job claimable again by itself and one
    partial index serves the claim query.
    """

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    turn_id: Mapped[int | None] = mapped_column(
        ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    # Whose turn the job serves (claims are fair across users); NULL: no user.
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    payload: Mapped[Any] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    status: Mapped[str] = mapped_column(String(16), server_default=text("'queued'"))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(Integer, server_default=text("5"))
    available_at: Mapped[dt.datetime] = _now()
    locked_by: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _now()
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_jobs_claimable", "kind", "available_at", "id",
              postgresql_where=text("status IN ('queued', 'running')")),
        # The fair claim (clawrl/base/jobs.py): each user's claimable jobs, oldest first.
        Index("ix_jobs_claimable_owner", "kind", text("coalesce(user_id, 0)"), "available_at",
              "id", postgresql_where=text("status IN ('queued', 'running')")),
    )


class Judgment(Base):
    """The judge's verdict on one turn: reward by majority vote, every raw vote, hint."""

    __tablename__ = "judgments"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    turn_id: Mapped[int] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    prompt_version: Mapped[str] = mapped_column(Text)
    judge_model: Mapped[str | None] = mapped_column(Text)
    # +1 / -1 / 0, or NULL for an abstention (tie or no parseable vote). Never 0 for "unknown".
    reward: Mapped[int | None] = mapped_column(SmallInteger)
    # [{"text": raw, "score": parsed or null}, ...]
    votes: Mapped[Any] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    hint: Mapped[str | None] = mapped_column(Text)
    hint_votes: Mapped[Any] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    # Aligned one-to-one with turns.response_ids; NULL when there is no accepted hint.
    teacher_logprobs: Mapped[list[float] | None] = mapped_column(FloatArray)
    # Why something is missing (e.g. "skipped: empty response", "teacher: prompt too long").
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = _now()


class Sample(Base):
    """A judged turn ready for training (written by the judge, claimed by the trainer)."""

    __tablename__ = "samples"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    turn_id: Mapped[int] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"), index=True)
    judgment_id: Mapped[int] = mapped_column(ForeignKey("judgments.id", ondelete="CASCADE"))
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    prompt_ids: Mapped[list[int]] = mapped_column(IntArray)
    response_ids: Mapped[list[int]] = mapped_column(IntArray)
    rollout_logprobs: Mapped[list[float]] = mapped_column(FloatArray)
    weight_version: Mapped[str | None] = mapped_column(Text)
    reward: Mapped[int | None] = mapped_column(SmallInteger)
    teacher_logprobs: Mapped[list[float] | None] = mapped_column(FloatArray)
    created_at: Mapped[dt.datetime] = _now()
    # Set in the same transaction that records the training step that used the sample.
    trained_step: Mapped[int | None] = mapped_column(Integer)
    # Set instead when the trainer skips it (e.g. "stale", "too long").
    skipped_reason: Mapped[str | None] = mapped_column(Text)
    # The session outcome the trainer mixed into this sample's reward (set with
    # trained_step; NULL when the session had none when the sample was claimed).
    outcome: Mapped[float | None] = mapped_column(Double)

    __table_args__ = (
        Index("ix_samples_ready", "id",
              postgresql_where=text("trained_step IS NULL AND skipped_reason IS NULL")),
        # The trainer's fair claim (trainer/data.py): each user's ready samples, oldest first.
        Index("ix_samples_ready_user", "user_id", "id",
              postgresql_where=text("trained_step IS NULL AND skipped_reason IS NULL")),
        # A step's samples: a user's share of what was trained (window cap, view, /metrics).
        Index("ix_samples_trained_step", "trained_step",
              postgresql_where=text("trained_step IS NOT NULL")),
    )


class TrainingStep(Base):
    __tablename__ = "training_steps"

    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int | None] = mapped_column(Integer)
    # 'ok', or 'skipped' (NaN/inf loss or gradients: weights untouched)
    status: Mapped[str] = mapped_column(String(16))
    num_samples: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Double)
    reward_mean: Mapped[float | None] = mapped_column(Double)
    staleness_mean: Mapped[float | None] = mapped_column(Double)
    skipped_stale: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    tokens_per_s: Mapped[float | None] = mapped_column(Double)
    metrics: Mapped[Any] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = _now()
    # Personal mode: the user whose adapter this step trained; NULL: the shared model.
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))

    __table_args__ = (
        Index("ix_training_steps_created_at", "created_at"),
    )


class ConsoleSession(Base):
    """A signed-in console session: only sha256 of its cookie is stored, so signing out
    holds in every proxy process and across restarts."""

    __tablename__ = "console_sessions"

    token_hash: Mapped[str] = mapped_column(Text, primary_key=True)
    created_at: Mapped[dt.datetime] = _now()
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class PolicyVersion(Base):
    """A weight version: saved checkpoint, then published to the engine."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int | None] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    # 'saved', 'published', 'failed', 'retired', 'rejected' (by the gate: never served)
    status: Mapped[str] = mapped_column(String(16))
    num_samples: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    loss: Mapped[float | None] = mapped_column(Double)
    reward_mean: Mapped[float | None] = mapped_column(Double)
    stats: Mapped[Any] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = _now()
    published_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    # The engine's name of this version's LoRA adapter (`policy-v{N}`), set when it is
    # published, when the shared model learns as an adapter on the frozen base
    # (trainer/policy_adapter.py); NULL: a full-weight version. The proxy serves users
    # without an adapter of their own the newest published version's adapter.
    adapter: Mapped[str | None] = mapped_column(Text)


class UserAdapter(Base):
    """The LoRA adapter a user's requests are served with (docs/proxy.md, "Personal adapters").

    The publisher writes the adapter's folder, loads it into the engine under `name`
    (`/load_lora_adapter`), then sets `name`, `version`, `path` and `loaded = true` in one
    UPDATE; the proxy sends that user's requests with `lora_path: name` while `loaded` is
    true, and serves the base model otherwise.
    """

    __tablename__ = "user_adapters"

    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"),
                                         primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    loaded: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    updated_at: Mapped[dt.datetime] = _now()


class AdapterVersion(Base):
    """One saved version of a user's personal LoRA adapter (docs/trainer.md, "Personal
    adapters"): its folder, 'saved' -> 'published' (loaded into the engine and named in
    `user_adapters`) or 'retired' (rolled back past, or pruned)."""

    __tablename__ = "adapter_versions"

    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"),
                                         primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int | None] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    num_samples: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    loss: Mapped[float | None] = mapped_column(Double)
    reward_mean: Mapped[float | None] = mapped_column(Double)
    stats: Mapped[Any] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[dt.datetime] = _now()
    published_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


def sync_url(url: str) -> str:
    """Normalise any Postgres URL to SQLAlchemy's psycopg 3 driver."""
    u = make_url(url)
    return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL as plain libpq understands it (for psycopg.connect / psql)."""
    u = make_url(url)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


def create_engine(url: str, **kw: Any) -> Engine:
    """A sync engine. Statement parameters (message text) never appear in errors or logs."""
    kw.setdefault("hide_parameters", True)
    return sa_create_engine(sync_url(url), pool_pre_ping=True, **kw)


def create_async(url: str, **kw: Any) -> AsyncEngine:
    """An async engine; like `create_engine`, errors and logs carry no parameters."""
    kw.setdefault("hide_parameters", True)
    return create_async_engine(sync_url(url), pool_pre_ping=True, **kw)
