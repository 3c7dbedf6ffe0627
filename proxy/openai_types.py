"""Validation of the OpenAI chat completion request (the part the proxy relies on).

The proxy forwards the client's JSON body to the engine as it came, so these models only
*check* it: messages present and well formed, known roles, field types. Unknown fields are
allowed here and pass through to the engine untouched.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from proxy.errors import BadRequest

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class StreamOptions(_Open):
    include_usage: bool | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: str = "function"
    function: FunctionDef


class ChatCompletionRequest(_Open):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


_BRANCH_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _describe(exc: ValidationError) -> str:
    """One readable line for the first validation error, naming the parameter."""
    err = exc.errors()[0]
    # Drop pydantic's union-branch labels ("str", "list[ContentPart]", ...) from the path.
    path = ".".join(str(p) for p in err["loc"] if str(p) not in _BRANCH_LABELS
                    and "[" not in str(p))
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"'{path}' is a required property"
    if err["type"] == "too_short" and path == "messages":
        return "'messages' must contain at least one message"
    return f"Invalid value for '{path}': {msg}" if path else msg


def parse_chat_request(raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The raw JSON object (to forward) and its validated view, or BadRequest."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The request body is not valid JSON: {exc}",
                         code="invalid_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(_describe(exc)) from exc
    return body, request


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
    try:
        return FeedbackRequest.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise BadRequest("The request body is not valid JSON.", code="invalid_json") from exc
        raise BadRequest(_describe(exc)) from exc
