"""Judge worker settings (`CLAWRL_JUDGE__…`), on top of the shared database/engine settings.

Examples: `CLAWRL_JUDGE__VOTES=5`, `CLAWRL_JUDGE__BACKEND=openai`,
`CLAWRL_JUDGE__OPENAI__BASE_URL=https://api.example.com/v1`, `CLAWRL_JUDGE__OPENAI__API_KEY=…`,
`CLAWRL_JUDGE__OPENAI__MODEL=judge-large`, `CLAWRL_JUDGE__TEACHER_URL=http://teacher:30000`,
`CLAWRL_JUDGE__URL=http://127.0.0.1:30001` (a judge engine, e.g. the one `clawrl up` starts).
Built by `load_judge_settings()`, never at import time.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from clawrl.base.settings import Settings
from judge.prompts import DEFAULT_VERSION


class OpenAIBackendSettings(BaseModel):
    """Any OpenAI-compatible endpoint (a hosted API or an SGLang judge server)."""

    base_url: str | None = None  # e.g. https://api.openai.com/v1 (the part before /chat/...)
    api_key: SecretStr | None = None
    model: str | None = None


class JudgeSettings(BaseModel):
    # PRM votes and hint votes per turn, sampled in parallel.
    votes: int = Field(default=3, ge=1)
    hint_votes: int = Field(default=3, ge=0)
    temperature: float = Field(default=0.6, ge=0.0)
    # 'sample': each PRM vote is a sampled completion; 'logprob': one greedy completion with
    # its top alternatives, the votes drawn from its distribution over scores (judge/prm.py).
    prm_mode: Literal["sample", "logprob"] = "sample"
    # The hint votes' temperature; None: `temperature`. 0 with hint_votes=1 is one greedy hint.
    hint_temperature: float | None = Field(default=None, ge=0.0)
    max_tokens: int = Field(default=64, ge=1)
    # Jobs one worker process handles at once.
    concurrency: int = Field(default=4, ge=1)
    # A claimed job is leased this long; a killed worker's jobs come back after it.
    lease_s: float = Field(default=120.0, gt=0)
    # Attempts before a job is recorded as failed (the job row's own max_attempts also caps).
    max_attempts: int = Field(default=5, ge=1)
    backoff_base_s: float = Field(default=2.0, gt=0)
    backoff_max_s: float = Field(default=300.0, gt=0)
    # Fallback poll when no NOTIFY arrives (also picks up expired leases and backoffs).
    poll_interval_s: float = Field(default=1.0, gt=0)
    # 'policy': the serving engine at CLAWRL_ENGINE__URL, or the judge engine at `url` when
    # set; 'openai': `openai` below.
    backend: Literal["policy", "openai"] = "policy"
    # A judge engine of its own (SGLang protocol, one frozen judge model; `clawrl up` starts
    # one): PRM and hint votes go there. Teacher logprobs stay on the policy engine.
    url: str | None = None
    # The judge engine's API key; default: the policy engine's (CLAWRL_ENGINE__API_KEY).
    api_key: SecretStr | None = None
    openai: OpenAIBackendSettings = OpenAIBackendSettings()
    # Concurrent requests this worker sends to the judge backend.
    backend_concurrency: int = Field(default=8, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=120.0, gt=0)
    # Teacher engine for hint logprobs; None means the policy engine (self-distillation).
    teacher_url: str | None = None
    teacher_timeout_s: float = Field(default=120.0, gt=0)
    teacher_enabled: bool = True
    prompt_version: str = DEFAULT_VERSION
    # A hint shorter than this (characters inside the markers) is rejected as trivial.
    min_hint_chars: int = Field(default=10, ge=1)

    @model_validator(mode="after")
    def _openai_complete(self) -> JudgeSettings:
        if self.backend == "openai" and not (self.openai.base_url and self.openai.model):
            raise ValueError("judge backend 'openai' needs CLAWRL_JUDGE__OPENAI__BASE_URL "
                             "and CLAWRL_JUDGE__OPENAI__MODEL")
        return self


# How the judge worker talks to the shipped judge model (`clawrl judge serve`, started by
# `clawrl up`; clawrl/judgemodel/): the prompts it was trained on (v5: one prompt, answered
# with the score first and then the hint; an agent's step shown above what came back), the
# PRM votes drawn from that greedy answer's distribution over its first token, the same
# answer as the one hint vote (docs/judge.md).
JUDGE_MODEL_SETTINGS: dict[str, object] = {
    "prompt_version": "v5", "prm_mode": "logprob", "hint_votes": 1, "hint_temperature": 0.0}


def judge_model_env() -> dict[str, str]:
    """`JUDGE_MODEL_SETTINGS` as the environment of a judge worker process."""
    return {f"CLAWRL_JUDGE__{k.upper()}": str(v) for k, v in JUDGE_MODEL_SETTINGS.items()}


class JudgeProcessSettings(Settings):
    """What a judge worker process reads: database, engine, judge."""

    model_config = SettingsConfigDict(
        env_prefix="CLAWRL_", env_nested_delimiter="__", extra="ignore"
    )

    judge: JudgeSettings = JudgeSettings()


def load_judge_settings(**overrides: object) -> JudgeProcessSettings:
    """Build judge settings from the environment, keyword overrides taking precedence."""
    return JudgeProcessSettings(**overrides)  # type: ignore[arg-type]


def describe_settings_error(exc: ValidationError) -> str:
    """One readable line for the CLI: `judge.votes: Input should be ...` (first error)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "settings"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"
