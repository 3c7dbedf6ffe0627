"""Streaming relay: engine SSE chunks to the client as they arrive, and the reply collected.

Each engine chunk is forwarded the moment it is read (true incremental SSE), minus what
only the proxy asked for (logprobs the client did not request, the final `sglext` ids
chunk). On the way the reply is collected for the turn log: content, reasoning, tool calls
(merged from their deltas), finish reason, per-token logprobs and the exact prompt/response
token ids from the `sglext` chunk.

Endings: `[DONE]` -> status 'ok'; an engine error chunk, a broken or timed-out connection,
or a stream that ends before a finish reason -> one final OpenAI-shaped error event and
status 'engine_error'; the client going away -> the upstream request is closed at once
(so the engine stops generating) and the turn is 'client_disconnected'.

What the client reads is a `Renderer`'s: `ChatRenderer` forwards the chunks themselves
(`chat.completion.chunk`); proxy/responses.py renders the same chunks as Responses API
events. Either way the relay yields the stream's final piece as `Last`, so the caller can
hold it back until the turn is stored (`durability = "sync"`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import httpx
import orjson

from clawrl.base.errors import ClawrlError, UpstreamError
from proxy.upstream import ChatStream, EngineReply, translate

DONE = b"data: [DONE]\n\n"


@dataclass
class StreamCollector:
    """The reply as it accumulates from `chat.completion.chunk` deltas (choice 0)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    weight_version: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    def add(self, chunk: dict[str, Any]) -> None:
        sglext = chunk.get("sglext")
        if sglext:
            self.prompt_ids = sglext.get("input_ids") or self.prompt_ids
            outputs = sglext.get("output_ids")
            if outputs:
                self.response_ids = outputs[0]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        version = (chunk.get("metadata") or {}).get("weight_version")
        if version is not None:
            self.weight_version = str(version)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) == 0:
                self._add_choice(choice)

    def reply(self) -> EngineReply:
        """The reply so far, in the shape a whole (non-streamed) reply has."""
        return EngineReply(message=self.message(), finish_reason=self.finish_reason,
                           prompt_ids=self.prompt_ids, response_ids=self.response_ids,
                           logprobs=self.logprobs or None, weight_version=self.weight_version,
                           usage=self.usage)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("reasoning_content"):
            self.reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or []:
            entry = self.tool_calls.setdefault(int(call.get("index") or 0), {
                "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if call.get("id"):
                entry["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name") and not entry["function"]["name"]:
                entry["function"]["name"] = function["name"]
            if function.get("arguments"):
                entry["function"]["arguments"] += function["arguments"]
        for token in (choice.get("logprobs") or {}).get("content") or []:
            self.logprobs.append(float(token["logprob"]))
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message


async def iter_data(response: ChatStream) -> AsyncIterator[list[bytes]]:
    """The `data` payloads of server-sent events as soon as their blocks are complete,
    grouped by the network read that completed them (so a burst is relayed in one send)."""
    buffer = b""
    async for piece in response.aiter_bytes():
        buffer += piece.replace(b"\r\n", b"\n")
        if b"\n\n" not in buffer:
            continue
        *blocks, buffer = buffer.split(b"\n\n")
        group = []
        for block in blocks:
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n")
                    if line.startswith(b"data:")]
            if data:
                group.append(b"\n".join(data))
        if group:
            yield group


def error_event(error: ClawrlError) -> bytes:
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


def _engine_error(chunk: dict[str, Any]) -> ClawrlError | None:
    if chunk.get("object") == "error":
        return UpstreamError(f"The engine failed mid-stream: {chunk.get('message')}")
    inner = chunk.get("error")
    if inner:
        message = inner.get("message") if isinstance(inner, dict) else inner
        return UpstreamError(f"The engine failed mid-stream: {message}")
    return None


def client_chunk(chunk: dict[str, Any], *, wants_logprobs: bool,
                 model: str | None = None) -> bytes | None:
    """The SSE event to forward for an engine chunk, or None when it is proxy-only;
    `model`: the id the client reads in place of the engine's name."""
    if chunk.pop("sglext", None) is not None and not chunk.get("choices") \
            and not chunk.get("usage"):
        return None
    if model is not None and "model" in chunk:
        chunk["model"] = model
    if not wants_logprobs:
        for choice in chunk.get("choices") or []:
            choice["logprobs"] = None
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class Collector(Protocol):
    """What collects a streamed reply for the turn log: chat chunks (`StreamCollector`), or
    another engine route's (proxy/completions.py)."""

    finish_reason: str | None

    def add(self, chunk: dict[str, Any]) -> None: ...

    def reply(self) -> EngineReply: ...


Finish = Callable[[Any, str, str | None], None]


class Last(bytes):
    """The final piece of a relayed stream (chat's `[DONE]`): once it is sent the reply is
    complete, so a caller may wait for the turn to be stored before sending it."""


class Renderer(Protocol):
    """What the client reads of a stream: a start, one piece per engine chunk, an end."""

    def start(self) -> bytes:
        """Sent before the first engine chunk (b"": nothing)."""
        ...

    def chunk(self, chunk: dict[str, Any]) -> bytes | None:
        """The piece for one engine chunk (already added to the collector), or None."""
        ...

    def end(self, collector: Any, failure: ClawrlError | None) -> bytes:
        """The closing piece: the reply is complete (`failure` None) or failed."""
        ...


@dataclass
class ChatRenderer:
    """The chat completions stream: the engine's chunks, minus what only the proxy asked
    for, then `[DONE]` (after one error event when the stream failed)."""

    wants_logprobs: bool = False
    model: str | None = None

    def start(self) -> bytes:
        return b""

    def chunk(self, chunk: dict[str, Any]) -> bytes | None:
        return client_chunk(chunk, wants_logprobs=self.wants_logprobs, model=self.model)

    def end(self, collector: StreamCollector, failure: ClawrlError | None) -> bytes:
        return DONE if failure is None else error_event(failure) + DONE


async def relay(upstream: ChatStream, *, render: Renderer, finish: Finish,
                collector: Collector | None = None) -> AsyncIterator[bytes]:
    """Forward an open engine stream as `render` shapes it; the last piece is a `Last`;
    `finish(collector, status, error)` runs exactly once (`collector`: chat chunks')."""
    collector = collector if collector is not None else StreamCollector()
    status, error = "client_disconnected", None
    try:
        first = render.start()
        if first:
            yield first
        failure: ClawrlError | None = None
        try:
            async for group in iter_data(upstream):
                out, done = [], False
                for data in group:
                    if data.strip() == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        chunk = None
                    if not isinstance(chunk, dict):
                        failure = UpstreamError("The engine sent an unreadable stream chunk.")
                        break
                    failure = _engine_error(chunk)
                    if failure is not None:
                        break
                    collector.add(chunk)
                    piece = render.chunk(chunk)
                    if piece is not None:
                        out.append(piece)
                if out:
                    yield b"".join(out)
                if done or failure is not None:
                    break
        except httpx.HTTPError as exc:
            failure = translate(exc)
        if failure is None and collector.finish_reason is None:
            failure = UpstreamError("The engine ended the stream before the reply finished.")
        if failure is not None:
            status, error = "engine_error", failure.message
        else:
            status = "ok"
        yield Last(render.end(collector, failure))
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        finish(collector, status, error)
