"""Typed settings for every clawrl process (pydantic-settings).

Environment variables use the `CLAWRL_` prefix and `__` for nesting, e.g.
`CLAWRL_DATABASE__URL=postgresql://...`, `CLAWRL_PROXY__PORT=8000`,
`CLAWRL_ENGINE__URL=http://127.0.0.1:30000`. Settings are built by `load_settings()`,
never at import time; each process passes only its own sub-config to the functions it calls.
Judge and trainer settings live in `judge/config.py` and `trainer/config.py` and follow the
same conventions (`CLAWRL_JUDGE__…`, `CLAWRL_TRAINER__…`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class DatabaseSettings(BaseModel):
    # None means: start an embedded Postgres with its data under `<state_dir>/pg`.
    url: SecretStr | None = None
    pool_size: int = 10


class EngineSettings(BaseModel):
    """Where the serving engine (SGLang or `clawrl engine`) listens."""

    url: str = "http://127.0.0.1:30000"
    api_key: SecretStr | None = None
    connect_timeout_s: float = 5.0
    # Generation can be slow on CPU; a request taking longer is answered 504.
    read_timeout_s: float = 300.0
    max_connections: int = 1024


class ProxySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: SecretStr | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # Default per-key limit; a key can override it. 0 disables the limit.
    rate_limit_rpm: int = 600
    # Fair share (proxy/limits.py), per key unless the key sets its own; 0 disables.
    # Requests of one key in flight at once: past it, 429 at once rather than a queue
    # at the engine in front of other keys. Unset: a quarter of what the engine runs at
    # once when it says (`max_running_requests`), else 8 (a quarter of the embedded
    # engine's batch of 32): four keys at their limit still leave the batch to others.
    max_concurrent: int | None = None
    # Prompt + completion tokens per minute (admitted on an estimate, corrected by what
    # the engine reports it used).
    rate_limit_tpm: int = 1_000_000
    # Turns with no continuation for this long are closed (kept, never trained).
    session_timeout_s: float = 1800.0
    # Agent frameworks rewrite the system prompt per request; leave it out of fingerprints.
    fingerprint_system: bool = False
    # Attach a request's next state to the turn it continues, and enqueue that turn's judge
    # job, as the request arrives rather than once its own reply is stored (proxy/store.py).
    judge_on_arrival: bool = True
    # Turns wait here when Postgres is unreachable and are replayed in order later.
    journal_path: Path | None = None
    # "group": every served turn is committed to Postgres or in an fsynced journal segment
    # within ~100 ms of its reply (group commit; a kill -9 loses at most those turns).
    # "sync": the reply's final byte waits for that commit or fsync (nothing read is lost).
    durability: Literal["group", "sync"] = "group"
    # Turns served but not yet stored: past this many, queued turns spill to the journal
    # and /readyz answers 503.
    turn_backlog_max: int = 10_000
    # The model id clients see; unset: the engine's name (a path shown as its last folder).
    served_model_name: str | None = None
    # Other names that reach the served model (`{"gpt-4o-mini": "default"}`), for apps that
    # hard-code one; any name neither served nor aliased is a 404 `model_not_found`.
    model_aliases: dict[str, str] = {}
    # `max_tokens` above this is refused; unset: the engine's context length (/model_info).
    max_context_tokens: int | None = None
    # Engine fairness before the body and the engine (proxy/app.py, proxy/prompt_size.py).
    # A request body must arrive within this long (else 408 and the connection closed).
    body_timeout_s: float = 30.0
    # Routes without an API or admin key (the console's sign-in, health): each body at
    # most this big, and at most this many such bytes buffered at once in total (503).
    max_unauth_body_bytes: int = 64 * 1024
    max_unauth_buffered_bytes: int = 8 * 1024 * 1024
    # The served model's tokenizer.json (or its folder), for counting prompt tokens before
    # the engine sees them; unset: the engine's `tokenizer_path` / `model_path` from
    # /model_info when this machine can read it (the embedded engine, or a shared disk).
    tokenizer_path: Path | None = None
    # With no tokenizer: the most UTF-8 bytes one token is assumed to cover (prompt tokens
    # >= text bytes / this). With one, its longest token's length is used instead.
    max_token_bytes: int = 32


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CLAWRL_", env_nested_delimiter="__", extra="ignore"
    )

    state_dir: Path = Field(default=Path(".clawrl"))
    database: DatabaseSettings = DatabaseSettings()
    engine: EngineSettings = EngineSettings()
    proxy: ProxySettings = ProxySettings()

    def journal_file(self) -> Path:
        """The journal's directory of segments (proxy/journal.py)."""
        return self.proxy.journal_path or self.state_dir / "journal"


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment, with keyword overrides taking precedence."""
    return Settings(**overrides)  # type: ignore[arg-type]
