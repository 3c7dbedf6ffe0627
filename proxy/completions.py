"""`POST /v1/completions`: OpenAI's legacy text completions, served by the engine's `/generate`.

A completion continues raw text: no chat template. The engine's native `/generate` takes the
prompt as text and returns the exact token ids of prompt and reply with the reply's
logprobs (`return_prompt_token_ids`, `return_logprob`), on SGLang and `clawrl engine` alike,
so a completion is logged and trainable as a chat turn is. It goes the chat path
(`CompletionsEndpoint` is proxy/chat.py's endpoint with another parse, engine request and
reply): the same auth, model names, fair share, size checks and turn record. The turn's
`request_messages` hold the prompt as one user message (what the judge reads), its
`params` the request's fields with `api: "completions"`; its `prompt_ids` are the prompt's
own tokens, never a template's.

Accepted: one prompt (a string, or a list of one string), `max_tokens` (OpenAI's default 16),
`temperature`, `top_p`, `stop`, `seed`, `user`, `logprobs` (0-5 alternatives per token),
penalties and `logit_bias` (as on chat), `stream` and `stream_options.include_usage`.
Refused with a 400 naming the field: several prompts or token-id prompts, `echo`, `suffix`,
`best_of` > 1 and `n` > 1.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clawrl.base.errors import BadRequest, ClawrlError
from proxy.chat import ChatEndpoint, ChatTurn
from proxy.openai_types import (
    ChatCompletionRequest,
    LogitBias,
    Penalty,
    StreamOptions,
    Temperature,
    TopP,
    describe_error,
    load_body,
    validate_chat_body,
)
from proxy.sampling import engine_fields
from proxy.sse import DONE, error_event
from proxy.upstream import EngineReply

COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
_INT64 = 2**63 - 1
# Completion fields sent on as chat fields (the same validation and sampling record).
_CHAT_FIELDS = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "user",
                "presence_penalty", "frequency_penalty", "logit_bias", "stream",
                "stream_options")
_FINISH = {"stop": "stop", "length": "length"}


class CompletionRequest(BaseModel):
    """The accepted fields of a completions request (anything else is a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, max_length=256)
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-_INT64 - 1, le=_INT64)
    user: str | None = Field(default=None, max_length=256)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    best_of: int | None = Field(default=None, ge=1, le=1)
    echo: Literal[False] | None = None
    suffix: Literal[""] | None = None


def _refused(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="unsupported_value")


def to_chat(request: CompletionRequest) -> dict[str, Any]:
    """The chat-shaped body a completion is checked and logged as: the prompt as one user
    message, the fields chat shares."""
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise _refused("Unsupported value for 'prompt': one prompt per request (send the "
                           "others as requests of their own).", "prompt")
        prompt = prompt[0]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    for name in _CHAT_FIELDS:
        value = getattr(request, name)
        if value is not None:
            body[name] = value.model_dump(exclude_none=True) if name == "stream_options" \
                else value
    body["max_tokens"] = request.max_tokens or DEFAULT_MAX_TOKENS
    if request.logprobs is not None:
        body["logprobs"], body["top_logprobs"] = True, request.logprobs
    return body


def parse_completion_request(raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest,
                                                  CompletionRequest]:
    body = {k: v for k, v in load_body(raw).items() if v is not None}
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param, code = describe_error(exc)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and any(isinstance(p, int | list) for p in prompt):
            message, param, code = ("Unsupported value for 'prompt': a prompt of token ids "
                                    "(the proxy logs the prompt as text; send it as a "
                                    "string)."), "prompt", "unsupported_value"
        raise BadRequest(message, code=code, param=param) from exc
    chat = to_chat(request)
    return chat, validate_chat_body(chat), request


def generate_request(turn: ChatTurn, adapter: str | None) -> dict[str, Any]:
    """The engine's `/generate` body for a completion turn: its text, every sampling
    parameter explicit (proxy/sampling.py), the exact ids and logprobs asked for."""
    body, chat = turn.body, turn.chat
    params: dict[str, Any] = {"max_new_tokens": body["max_tokens"]}
    if turn.sampling is not None:
        params.update(engine_fields(turn.sampling))
    if body.get("stop") is not None:
        params["stop"] = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    if body.get("logit_bias"):
        params["logit_bias"] = body["logit_bias"]
    out: dict[str, Any] = {
        "text": body["messages"][0]["content"], "sampling_params": params,
        "return_logprob": True, "return_text_in_logprobs": True,
        "top_logprobs_num": chat.top_logprobs or 0, "return_prompt_token_ids": True,
        "stream": bool(chat.stream)}
    if adapter is not None:
        out["lora_path"] = adapter
    return out


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _FINISH.get(str(kind), str(kind)) if kind is not None else None


def generate_reply(data: dict[str, Any]) -> EngineReply:
    """The turn log's view of a `/generate` reply (whole, or a stream's latest chunk)."""
    meta = data.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    usage = {"prompt_tokens": meta.get("prompt_tokens"),
             "completion_tokens": meta.get("completion_tokens")}
    return EngineReply(
        message={"role": "assistant", "content": str(data.get("text") or "")},
        finish_reason=finish_reason(meta), prompt_ids=data.get("prompt_token_ids"),
        response_ids=data.get("output_ids"),
        logprobs=[float(t[0]) for t in triples] if triples is not None else None,
        weight_version=None if meta.get("weight_version") is None
        else str(meta["weight_version"]),
        usage={k: v for k, v in usage.items() if isinstance(v, int)})


def client_logprobs(meta: dict[str, Any], start: int, offset: int) -> dict[str, Any]:
    """OpenAI's completion logprobs for the reply's tokens from `start` on, their text
    starting at character `offset` of the reply."""
    triples = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [])[start:]
    tokens = [str(t[2] or "") for t in triples]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [float(t[0]) for t in triples],
            "top_logprobs": [{str(alt[2] or ""): float(alt[0]) for alt in row or []}
                             for row in tops] if tops else None,
            "text_offset": offsets}


@dataclass
class GenerateCollector:
    """A streamed `/generate` reply for the turn log: each chunk is cumulative (SGLang's
    default), so the latest chunk is the reply so far."""

    latest: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        self.latest = chunk
        self.finish_reason = finish_reason(chunk.get("meta_info") or {})

    def reply(self) -> EngineReply:
        return generate_reply(self.latest)


def usage_of(reply: EngineReply) -> dict[str, int]:
    prompt = len(reply.prompt_ids) if reply.prompt_ids is not None \
        else int(reply.usage.get("prompt_tokens") or 0)
    completion = len(reply.response_ids) if reply.response_ids is not None \
        else int(reply.usage.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass
class CompletionsShape:
    """The client's view: a `text_completion` object, or its stream of chunks."""

    logprobs: bool = False
    include_usage: bool = False

    def head(self, turn: ChatTurn) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.UUID(turn.uid).hex}", "object": "text_completion",
                "created": int(time.time()), "model": turn.served_model}

    def whole(self, turn: ChatTurn, data: dict[str, Any], reply: EngineReply) -> bytes:
        meta = data.get("meta_info") or {}
        choice = {"text": reply.message["content"], "index": 0,
                  "logprobs": client_logprobs(meta, 0, 0) if self.logprobs else None,
                  "finish_reason": reply.finish_reason}
        return orjson.dumps({**self.head(turn), "choices": [choice], "usage": usage_of(reply)})

    def renderer(self, turn: ChatTurn) -> CompletionsRenderer:
        return CompletionsRenderer(self, self.head(turn))


@dataclass
class CompletionsRenderer:
    """Completion chunks from `/generate`'s cumulative ones: each new piece of text (with
    its tokens' logprobs), then the usage when asked, then `[DONE]`."""

    shape: CompletionsShape
    head: dict[str, Any]
    text: str = ""
    tokens: int = 0

    def start(self) -> bytes:
        return b""

    def chunk(self, chunk: dict[str, Any]) -> bytes | None:
        meta = chunk.get("meta_info") or {}
        text, reason = str(chunk.get("text") or ""), finish_reason(meta)
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        if not delta and reason is None:
            return None
        logprobs = (client_logprobs(meta, self.tokens, len(self.text))
                    if self.shape.logprobs else None)
        self.text, self.tokens = self.text + delta, len(meta.get("output_token_logprobs") or ())
        choice = {"text": delta, "index": 0, "logprobs": logprobs, "finish_reason": reason}
        return b"data: " + orjson.dumps({**self.head, "choices": [choice]}) + b"\n\n"

    def end(self, collector: GenerateCollector, failure: ClawrlError | None) -> bytes:
        if failure is not None:
            return error_event(failure) + DONE
        usage = b""
        if self.shape.include_usage:
            usage = b"data: " + orjson.dumps({**self.head, "choices": [],
                                              "usage": usage_of(collector.reply())}) + b"\n\n"
        return usage + DONE


class CompletionsEndpoint(ChatEndpoint):
    """`POST /v1/completions`: the chat endpoint with a completion's parse, the engine's
    `/generate` request and reply, and the completion shape."""

    engine_path = GENERATE_PATH

    def parse(self, raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest,
                                         CompletionsShape, dict[str, Any]]:
        body, chat, request = parse_completion_request(raw)
        usage = bool(request.stream_options and request.stream_options.include_usage)
        return body, chat, CompletionsShape(request.logprobs is not None, usage), \
            {"api": "completions"}

    def tokens_field(self, chat: ChatCompletionRequest) -> str:
        return "max_tokens"

    def engine_request(self, turn: ChatTurn, adapter: str | None) -> dict[str, Any]:
        return generate_request(turn, adapter)

    def read_reply(self, data: dict[str, Any]) -> EngineReply:
        return generate_reply(data)

    def new_collector(self) -> GenerateCollector:
        return GenerateCollector()
