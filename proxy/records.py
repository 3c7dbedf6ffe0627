"""The turn record: everything the proxy logs about one request, as plain data.

Built on the request path, handed to the background writer (proxy/store.py), written to
Postgres by proxy/sessions.py or, while Postgres is unreachable, to the JSONL journal
(proxy/journal.py) — hence plain JSON-compatible fields only.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Postgres text and JSONB cannot hold U+0000, which a model (or a client) can produce.
# It is stored as U+FFFD; the token ids keep exactly what the engine sampled.
_NUL, _REPLACEMENT = "\x00", "\ufffd"


def scrub_nul(value: Any) -> Any:
    """`value` with every U+0000 in its strings (keys too) replaced by U+FFFD."""
    if isinstance(value, str):
        return value.replace(_NUL, _REPLACEMENT) if _NUL in value else value
    if isinstance(value, dict):
        return {scrub_nul(k): scrub_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_nul(v) for v in value]
    return value


@dataclass
class TurnRecord:
    uid: str
    user_id: int
    api_key_id: int | None
    request_messages: list[dict[str, Any]]
    params: dict[str, Any]
    tools: list[Any] | None = None
    kind: str = "main"  # 'main' or 'side'
    # Why a turn is what it is: 'header' (X-Turn-Type), a side-call rule's name
    # (proxy/turnkinds.py) or None (a main turn by default).
    kind_reason: str | None = None
    # From the headers: `X-Session-Id`, `X-Session-Done` and `X-Session-Outcome`.
    session_external_id: str | None = None
    session_done: bool = False
    session_outcome: float | None = None
    train_opt_out: bool = False
    response_message: dict[str, Any] | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    weight_version: str | None = None
    # The user's LoRA adapter that served the turn (name and version); None: the base model.
    adapter: str | None = None
    adapter_version: int | None = None
    # The sampling distribution the reply was drawn from (proxy/sampling.py); None in
    # journal lines written before it was recorded.
    sampling: dict[str, Any] | None = None
    finish_reason: str | None = None
    # The choices of one request with `n` > 1: the request's group id and this choice's
    # index (None for a single reply).
    group_id: str | None = None
    group_index: int | None = None
    status: str = "ok"  # 'ok', 'client_disconnected', 'engine_error'
    error: str | None = None
    latency_ms: float | None = None
    created_at: str = field(
        default_factory=lambda: dt.datetime.now(dt.UTC).isoformat())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnRecord:
        return cls(**data)

    def scrubbed(self) -> TurnRecord:
        """The record as it can be stored: no U+0000 in any text field."""
        return replace(
            self, request_messages=scrub_nul(self.request_messages), tools=scrub_nul(self.tools),
            params=scrub_nul(self.params), response_message=scrub_nul(self.response_message),
            session_external_id=scrub_nul(self.session_external_id), error=scrub_nul(self.error))

    def row(self) -> dict[str, Any]:
        """Column values for the `turns` insert (session columns are added by the caller)."""
        return {
            "uid": uuid.UUID(self.uid), "user_id": self.user_id, "api_key_id": self.api_key_id,
            "kind": self.kind, "kind_reason": self.kind_reason, "request_messages": self.request_messages,
            "tools": self.tools, "params": self.params,
            "response_message": self.response_message, "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids, "response_logprobs": self.response_logprobs,
            "weight_version": self.weight_version, "finish_reason": self.finish_reason,
            "adapter": self.adapter, "adapter_version": self.adapter_version,
            "sampling": self.sampling,
            "group_id": uuid.UUID(self.group_id) if self.group_id else None,
            "group_index": self.group_index,
            "status": self.status, "error": self.error, "latency_ms": self.latency_ms,
            "created_at": dt.datetime.fromisoformat(self.created_at),
        }
