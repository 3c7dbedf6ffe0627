"""Request bodies the embedded engine accepts, validated into scheduler inputs, and errors.

Field names and defaults follow SGLang 0.5.x (`srt/managers/io_struct.py` GenerateReqInput,
`srt/entrypoints/openai/protocol.py` ChatCompletionRequest). Unknown top-level fields are
ignored, as SGLang does; unknown `sampling_params` keys are rejected (SGLang >= 0.5.22).
Options SGLang has but this engine does not implement (penalties, n > 1) are refused with
a 400 rather than silently ignored. Structured outputs (`json_schema`, `regex`, `ebnf`,
`structural_tag`; `response_format`, `tool_choice`) are clawrl/engine/grammar.py's.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clawrl.engine.scheduler import SamplingParams

# sampling_params keys SGLang knows; the second set is accepted only at its neutral value.
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_new_tokens", "stop",
                  "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                  "sampling_seed", "spaces_between_special_tokens", "stream_interval", "n",
                  "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                  "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
                  "stop_regex", "custom_params"}
_NEUTRAL = {"n": 1, "min_p": 0.0, "repetition_penalty": 1.0, "stop_regex": None,
            "custom_params": None}
# The structured-output constraints (SGLang: at most one per request).
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


class EngineError(Exception):
    """A request the engine refuses; rendered as an SGLang/OpenAI-shaped error body."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


_TYPES = {400: ("BadRequestError", "invalid_request_error"), 404: ("NotFoundError", "not_found"),
          503: ("ServiceUnavailableError", "service_unavailable"),
          500: ("InternalServerError", "server_error")}


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """Both shapes at once: SGLang's flat ErrorResponse and OpenAI's nested `error`."""
    sglang_type, openai_type = _TYPES.get(status, ("InternalServerError", "server_error"))
    return {"object": "error", "message": message, "type": sglang_type, "param": None,
            "code": status,
            "error": {"message": message, "type": openai_type, "param": None, "code": status}}


def engine_failure(finish: dict[str, Any] | None) -> EngineError | None:
    """The error for a sequence the engine aborted because a model step failed, else None."""
    if finish and finish.get("type") == "abort" and finish.get("status_code"):
        return EngineError(str(finish.get("message")), int(finish["status_code"]))
    return None


def sse_error(err: EngineError) -> str:
    """A streamed error event, as SGLang sends when a request fails mid-stream."""
    return f"data: {json.dumps({'error': error_body(err.message, err.status)['error']})}\n\n"


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


def describe(exc: ValidationError) -> str:
    """One readable line from a pydantic error: `messages.0.role: Input should be ...`."""
    parts = []
    for err in exc.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise EngineError("request body must be a JSON object")
    return body


def sampling_from_dict(raw: dict[str, Any] | None) -> SamplingParams:
    """SGLang `sampling_params` -> SamplingParams (max_new_tokens default 128)."""
    raw = dict(raw or {})
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise EngineError(f"unknown field {unknown[0]!r} in sampling_params")
    for key, neutral in _NEUTRAL.items():
        if key in raw and raw[key] not in (neutral, None):
            raise EngineError(f"sampling_params.{key}={raw[key]!r} is not supported by the "
                              "embedded engine")
    stop = raw.get("stop") or []
    try:
        params = SamplingParams(
            max_new_tokens=int(raw["max_new_tokens"]) if raw.get("max_new_tokens") is not None
            else 128,
            temperature=float(_given(raw, "temperature", 1.0)),
            top_p=float(_given(raw, "top_p", 1.0)),
            top_k=int(_given(raw, "top_k", -1)),
            min_new_tokens=int(raw.get("min_new_tokens") or 0),
            stop=[stop] if isinstance(stop, str) else [str(s) for s in stop],
            stop_token_ids=[int(t) for t in raw.get("stop_token_ids") or []],
            ignore_eos=bool(raw.get("ignore_eos", False)),
            skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
            no_stop_trim=bool(raw.get("no_stop_trim", False)),
            seed=int(raw["sampling_seed"]) if raw.get("sampling_seed") is not None else None,
            grammar=_grammar(raw),
            presence_penalty=float(_given(raw, "presence_penalty", 0.0)),
            frequency_penalty=float(_given(raw, "frequency_penalty", 0.0)),
            logit_bias=_logit_bias(raw.get("logit_bias")),
        )
    except (TypeError, ValueError) as exc:
        raise EngineError(f"invalid sampling_params: {exc}") from exc
    check_sampling(params)
    return params


def _logit_bias(raw: Any) -> dict[int, float] | None:
    """`logit_bias` as OpenAI sends it ({"token id": bias}) -> {id: bias}; None when empty."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise EngineError("logit_bias must be an object of token ids to biases")
    try:
        return {int(k): float(v) for k, v in raw.items()} or None
    except (TypeError, ValueError) as exc:
        raise EngineError(f"logit_bias: token ids and biases must be numbers ({exc})") from exc


def _grammar(raw: dict[str, Any]) -> tuple[str, str] | None:
    """The structured-output constraint in `sampling_params`: at most one, a string."""
    given = [k for k in GRAMMAR_KEYS if raw.get(k) is not None]
    if len(given) > 1:
        raise EngineError("Only one of regex, json_schema, ebnf or structural_tag can be set.")
    if not given:
        return None
    if not isinstance(raw[given[0]], str):
        raise EngineError(f"sampling_params.{given[0]} must be a string")
    return (given[0], raw[given[0]])


def _given(raw: dict[str, Any], key: str, default: float) -> Any:
    """raw[key], or the default when it is missing or null."""
    value = raw.get(key)
    return default if value is None else value


def check_sampling(p: SamplingParams) -> None:
    if p.max_new_tokens < 0:
        raise EngineError("max_new_tokens must be >= 0")
    if p.temperature < 0:
        raise EngineError("temperature must be >= 0")
    if not 0.0 < p.top_p <= 1.0:
        raise EngineError("top_p must be in (0, 1]")
    if p.top_k == 0 or p.top_k < -1:
        raise EngineError("top_k must be -1 (disabled) or >= 1")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise EngineError(f"{name} must be in [-2, 2]")
    if p.logit_bias and any(not -100.0 <= b <= 100.0 for b in p.logit_bias.values()):
        raise EngineError("logit_bias values must be in [-100, 100]")
    if p.logit_bias and min(p.logit_bias) < 0:
        raise EngineError("logit_bias token ids must be >= 0")
    if p.grammar is not None and (p.ignore_eos or p.min_new_tokens):
        # The grammar ends the reply with a stop token; neither may overrule it.
        raise EngineError("ignore_eos and min_new_tokens cannot be used with a structured "
                          "output constraint")


def check_bias_ids(p: SamplingParams, vocab_size: int) -> None:
    """`logit_bias` names token ids of this model's vocabulary only."""
    if p.logit_bias and max(p.logit_bias) >= vocab_size:
        raise EngineError(f"logit_bias token ids must be in [0, {vocab_size})")


class GenerateRequest(BaseModel):
    """`POST /generate` (SGLang GenerateReqInput, the fields this engine implements)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    # SGLang's field: the prompt's token ids as `prompt_token_ids` (the proxy's completions).
    return_prompt_token_ids: bool = False
    stream: bool = False
    rid: str | None = None
    lora_path: str | list[str | None] | None = None  # adapter name(s), one per prompt

    def lora_names(self, n: int) -> list[str | None]:
        """The adapter name for each of the `n` prompts (SGLang `_normalize_lora_paths`)."""
        if self.lora_path is None or isinstance(self.lora_path, str):
            return [self.lora_path or None] * n
        if len(self.lora_path) != n:
            raise EngineError(f"lora_path list length ({len(self.lora_path)}) must match "
                              f"batch size ({n})")
        return [name or None for name in self.lora_path]


def lora_from_model(model: str, served_model_name: str) -> str | None:
    """The adapter in a `model: "base:adapter"` field (SGLang `_parse_model_parameter`)."""
    if ":" not in model or model == served_model_name:
        return None
    if model.startswith(f"{served_model_name}:"):
        adapter = model[len(served_model_name) + 1:]
    else:
        adapter = model.split(":", 1)[1]
    return adapter.strip() or None


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` (OpenAI schema plus SGLang's extensions)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    model: str = "default"
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    continue_final_message: bool = False
    input_ids: list[int] | None = None
    rid: str | None = None
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    lora_path: str | None = None

    def lora_name(self, served_model_name: str) -> str | None:
        """The adapter to use: `model: "base:adapter"` wins over `lora_path` (as in SGLang)."""
        return lora_from_model(self.model, served_model_name) or self.lora_path or None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise EngineError("only n=1 is supported")
        if self.stream and (self.return_token_ids or self.return_prompt_token_ids):
            raise EngineError("return_token_ids is not supported with streaming on "
                              "/v1/chat/completions. Please set stream=false when using "
                              "return_token_ids=true.")
        if self.stream and self.return_meta_info:
            raise EngineError("return_meta_info is not supported with streaming. Please set "
                              "stream=false when using return_meta_info=true.")

    def sampling(self, defaults: dict[str, Any]) -> SamplingParams:
        """OpenAI knobs -> SamplingParams; unset ones fall back to generation_config.

        An unset max_tokens is returned as -1 ("up to the context length"); the caller
        resolves it once the prompt length is known, then calls `check_sampling`.
        """
        stop = self.stop or []
        params = SamplingParams(
            max_new_tokens=(self.max_completion_tokens if self.max_completion_tokens is not None
                            else self.max_tokens if self.max_tokens is not None else -1),
            temperature=self.temperature if self.temperature is not None
            else defaults.get("temperature", 1.0),
            top_p=self.top_p if self.top_p is not None else defaults.get("top_p", 1.0),
            top_k=self.top_k if self.top_k is not None else defaults.get("top_k", -1),
            min_new_tokens=self.min_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=_logit_bias(self.logit_bias),
        )
        return params
