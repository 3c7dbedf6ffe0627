"""Validation of the OpenAI chat completion request: what the proxy accepts, and bounds.

The proxy forwards the client's JSON body to the engine and stores it in the turn log, so
what it accepts is an allow-list: the OpenAI fields the engines support (plus SGLang's
`top_k`), each with a bounded size. Anything else is a 400 naming the field — in particular
overrides that would make the stored conversation differ from what the model saw
(`input_ids`, `chat_template`, `chat_template_kwargs`, `continue_final_message`) and knobs
that make generation unbounded (`ignore_eos`, `min_tokens`). Every parsed JSON value
(the body, and a tool call's `arguments` string) is depth-limited (`check_depth`), and
`max_tokens` is capped at the model's context length (proxy/chat.py).

Sampling parameters are bounded as the OpenAI API bounds them (`temperature` [0, 2], `top_p`
(0, 1], penalties [-2, 2], `logit_bias` values [-100, 100] on at most 300 token ids) plus
SGLang's `top_k` (-1 or >= 1): a reply drawn from a distribution far from the model's is
neither useful to the user nor trainable. What the engine applied is stored with the turn
(proxy/sampling.py), and the trainer skips what it cannot correct for.
"""

from __future__ import annotations

import itertools
import re
import uuid
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from clawrl.base.errors import BadRequest

Role = Literal["system", "developer", "user", "assistant", "tool"]

# How deep any JSON a client sends may nest (objects and arrays); tool schemas need ~10.
MAX_JSON_DEPTH = 64
MAX_STOP = 4
MAX_STOP_CHARS = 512
# The request's parameters (everything but messages and tools), serialised, at most.
MAX_PARAMS_BYTES = 64 * 1024
_INT64 = 2**63 - 1
MAX_LOGIT_BIAS = 300
# `n`: choices per request, each its own engine request and turn (proxy/choices.py).
MAX_CHOICES = 8
# Fields the proxy accepts and stores but never sends to the engine (proxy/upstream.py).
RECORDED_ONLY = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                 "verbosity", "modalities")
# `reasoning_effort` as the engines take it (low, medium, high; None: not sent).
ENGINE_EFFORT: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low",
                                        "medium": "medium", "high": "high", "xhigh": "high"}
# Sampling bounds, shared with the Responses API (proxy/responses.py).
Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
_TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
_Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
LogitBias = Annotated[dict[_TokenId, _Bias], Field(max_length=MAX_LOGIT_BIAS)]

# Fields an OpenAI client may send back inside an assistant message that mean nothing to
# the engine: dropped (when empty) rather than refused, so resending a reply works.
_DROPPED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call")
# A client library's own bookkeeping inside a message, never part of the conversation: dropped
# whatever it holds. litellm keeps the reply fields it has no place for in
# `provider_specific_fields` (`{"refusal": null}` on our replies) and sends the message back
# with it when an app appends `response.choices[0].message` to its history, as litellm's
# docs tell it to for a tool round trip.
_CLIENT_MESSAGE_FIELDS = ("provider_specific_fields",)
_REFUSED = {
    "input_ids": "the proxy logs the conversation, so the prompt must come from 'messages'",
    "chat_template": "the chat template is the model's own",
    "chat_template_kwargs": "the chat template is the model's own",
    "continue_final_message": "the chat template is the model's own",
    "ignore_eos": "generation must be able to stop",
    "min_tokens": "generation must be able to stop",
}


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed JSON value, counted without recursion; stops counting
    (returning limit + 1) as soon as it passes `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def loads_bounded(raw: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """Parse client JSON: linear time (orjson), no Python recursion, at most `limit` deep.
    Raises ValueError (orjson.JSONDecodeError is one) for invalid or too deeply nested JSON."""
    value = orjson.loads(raw)
    if json_depth(value, limit) > limit:
        raise ValueError(f"JSON nested deeper than {limit} levels")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Strict):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(_Strict):
    name: str = Field(max_length=256)
    arguments: str | dict[str, Any] = ""


class ToolCall(_Strict):
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    index: int | None = None
    function: FunctionCall


class ChatMessage(_Strict):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted and stored; the proxy never pads


class FunctionDef(_Strict):
    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(_Strict):
    model: str | None = Field(default=None, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    user: str | None = Field(default=None, max_length=256)
    # Accepted as the OpenAI API accepts them and stored with the turn (`turns.params`),
    # never sent to the engine (`RECORDED_ONLY`): they mean nothing to a local model.
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16)
    store: bool | None = None
    service_tier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=256)
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = Field(default=None, max_length=1)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, top_k: int | None) -> int | None:
        if top_k == 0:
            raise ValueError("top_k must be -1 (no limit) or at least 1")
        return top_k

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
                             f"characters")
        return stop

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


_BRANCH_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def describe_error(exc: ValidationError, prefix: str = "") -> tuple[str, str | None, str]:
    """One readable line for the first validation error naming the parameter, the
    parameter's path (under `prefix`, for a part of the body validated on its own), and
    the error code."""
    # The most specific error: for a union (`str | list[...]`) the branch that got furthest.
    err = max(exc.errors(), key=lambda e: len(e["loc"]))
    # Drop pydantic's union-branch labels ("str", "list[ContentPart]", ...) from the path.
    path = ".".join([prefix] * bool(prefix) + [
        str(p) for p in err["loc"] if str(p) not in _BRANCH_LABELS
        and "[" not in str(p) and not str(p).startswith("literal")])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        field = str(err["loc"][-1])
        why = _REFUSED.get(field)
        reason = f": {why}" if why else ""
        return (f"Unsupported parameter: '{path}' is not accepted{reason}.", path,
                "unsupported_parameter")
    if err["type"] == "missing":
        return f"'{path}' is a required property", path, "invalid_request"
    if err["type"] == "too_short" and path == "messages":
        return "'messages' must contain at least one message", path, "invalid_request"
    return (f"Invalid value for '{path}': {msg}" if path else msg), path or None, \
        "invalid_request"


def _drop_empty_extras(body: dict[str, Any]) -> None:
    """Remove reply-only fields (`refusal`, ...) that clients send back inside messages, and
    client libraries' own bookkeeping (`provider_specific_fields`)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for message in messages:
        if isinstance(message, dict):
            for name in _DROPPED_MESSAGE_FIELDS:
                if name in message and not message[name]:
                    del message[name]
            for name in _CLIENT_MESSAGE_FIELDS:
                message.pop(name, None)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def bracket_depth(raw: str) -> int:
    """How deep the brackets of JSON-ish text nest (outside string literals), in linear
    time and without parsing: what a recursive parser would have to descend."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", raw))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _check_arguments(request: ChatCompletionRequest) -> None:
    """A tool call's `arguments` string is parsed by the engine (and by session inference):
    it must not nest deeper than any other JSON the proxy accepts, valid JSON or not."""
    for i, message in enumerate(request.messages):
        for j, call in enumerate(message.tool_calls or ()):
            raw = call.function.arguments
            if isinstance(raw, str) and bracket_depth(raw) > MAX_JSON_DEPTH:
                where = f"messages.{i}.tool_calls.{j}.function.arguments"
                raise BadRequest(f"Invalid value for '{where}': JSON nested deeper than "
                                 f"{MAX_JSON_DEPTH} levels.", param=where)


def load_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, at most MAX_JSON_DEPTH deep, or BadRequest."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}",
                         code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequest(f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels.",
                         code="invalid_json")
    return body


def parse_chat_request(raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The raw JSON object (to forward) and its validated view, or BadRequest."""
    body = load_body(raw)
    return body, validate_chat_body(body)


def validate_chat_body(body: dict[str, Any]) -> ChatCompletionRequest:
    """The validated view of a chat body (the client's, or one translated from another
    API), or BadRequest. Drops reply-only fields resent inside messages."""
    _drop_empty_extras(body)
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param, code = describe_error(exc)
        raise BadRequest(message, code=code, param=param) from exc
    _check_arguments(request)
    params = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    if len(orjson.dumps(params)) > MAX_PARAMS_BYTES:
        raise BadRequest(f"The request's parameters (all but 'messages' and 'tools') exceed "
                         f"{MAX_PARAMS_BYTES} bytes.", code="params_too_large")
    return request


class FeedbackRequest(BaseModel):
    """`POST /v1/feedback`: a rating (+1 / -1, or "up" / "down") and/or a comment."""

    model_config = ConfigDict(extra="forbid", strict=True)
    turn_id: uuid.UUID
    rating: Literal[1, -1, "up", "down"] | None = None
    text: str | None = Field(default=None, max_length=10_000)

    @model_validator(mode="after")
    def _something(self) -> FeedbackRequest:
        if self.rating is None and not (self.text or "").strip():
            raise ValueError("give a 'rating' (1 or -1) and/or a non-empty 'text'")
        if self.rating == "up":
            self.rating = 1
        elif self.rating == "down":
            self.rating = -1
        return self


def parse_feedback(raw: bytes) -> FeedbackRequest:
    return _parse_small(FeedbackRequest, raw)


class OutcomeRequest(BaseModel):
    """`POST /v1/sessions/{id}/outcome`: a verifier's outcome for the whole session, a
    number in [-1, 1] (+1 solved, -1 failed; anything between for partial credit)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    outcome: float = Field(ge=-1.0, le=1.0, allow_inf_nan=False)


def parse_outcome(raw: bytes) -> OutcomeRequest:
    return _parse_small(OutcomeRequest, raw)


_Small = TypeVar("_Small", FeedbackRequest, OutcomeRequest)


def _parse_small(model: type[_Small], raw: bytes) -> _Small:
    """A small JSON body (feedback, outcome) or 400 in one readable line."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise BadRequest("The request body is not valid JSON.", code="invalid_json") from exc
        message, param, _ = describe_error(exc)
        raise BadRequest(message, param=param) from exc


_OUTCOME_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def parse_outcome_header(value: str | None) -> float | None:
    """The `X-Session-Outcome` header: None when absent or empty, else a decimal number in
    [-1, 1] (no NaN, no infinity, no `1_0`), or 400."""
    text = (value or "").strip()
    if not text:
        return None
    if len(text) > 32 or not _OUTCOME_RE.fullmatch(text):
        raise BadRequest("The X-Session-Outcome header must be a number in [-1, 1].")
    outcome = float(text)
    if not -1.0 <= outcome <= 1.0:
        raise BadRequest("The X-Session-Outcome header must be a number in [-1, 1].")
    return outcome
