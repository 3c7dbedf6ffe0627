"""`POST /v1/chat/completions` as a bare ASGI endpoint: the proxy's hot path.

Every chat request pays for whatever sits between uvicorn and the handler, so this route
bypasses FastAPI's middleware, dependency and exception-handler layers (`ProxyApp` in
proxy/app.py sends it here directly, wrapped only in the metrics middleware) and speaks
ASGI itself: headers read once from the scope, the body read from `receive`, the reply
sent as raw messages. What it answers is unchanged: OpenAI-shaped error bodies with the
same statuses (`ClawrlError.body()`), the same turn ids and session headers.

The endpoint does no database work of its own: the key lookup is cached (proxy/auth.py)
and the turn is handed to the background writer (proxy/store.py) after the reply is sent
or, for a stream, when it ends. Anything rejected before the engine is called is not
stored at all. A client that disconnects cancels the engine call (closing the engine
request, so the engine stops generating) and its turn is stored as 'client_disconnected'.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import orjson
from starlette.datastructures import State
from starlette.types import Message, Receive, Scope, Send

from clawrl.base.errors import (
    BadRequest,
    ClawrlError,
    PayloadTooLarge,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.auth import Principal
from proxy.limits import Lease, estimate_tokens, used_tokens
from proxy.openai_types import ChatCompletionRequest, parse_chat_request, parse_outcome_header
from proxy.records import TurnRecord
from proxy.sessions import MAX_SESSION_ID, explicit_session_id
from proxy.sse import DONE, StreamCollector, relay
from proxy.upstream import adapter_missing, client_view, engine_body, parse_reply

log = logging.getLogger("clawrl.proxy")
T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_WANTED = frozenset({b"authorization", b"content-length", b"x-turn-type", b"x-session-id",
                     b"x-session-done", b"x-session-outcome"})
_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"


class ClientGone(Exception):
    """The client disconnected while the engine was still working on its request."""


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` (the engine call, or a whole relayed stream), but cancel it as soon as
    the client disconnects, raising ClientGone.

    After the body is read, the ASGI `receive` only answers `http.disconnect` (or, once
    the response is complete, the same), so `work` must not send the final message."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `limit` bytes."""
    too_large = PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _raw_headers(headers: dict[str, str], content_type: bytes,
                 length: int | None) -> list[tuple[bytes, bytes]]:
    raw = [(b"content-type", content_type)]
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    raw.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    return raw


async def send_json(send: Send, status: int, content: bytes,
                    headers: dict[str, str] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": _raw_headers(headers or {}, _JSON, len(content))})
    await send({"type": "http.response.body", "body": content})


class ChatEndpoint:
    """The ASGI app for `POST /v1/chat/completions`; reads the running app's state (set
    by its lifespan: upstream, writer, authenticator) per request."""

    def __init__(self, state: State) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._chat(scope, receive, tracked)
        except ClawrlError as exc:
            if started:
                raise
            await send_json(send, exc.status, orjson.dumps(exc.body()), exc.headers)
        except ClientGone:
            if not started:  # nobody reads it; nginx's "client closed request"
                await send_json(send, 499, b"")
        except Exception:
            log.exception("unhandled error on %s", scope.get("path"), extra={"action": "crash"})
            if started:
                raise
            error = ClawrlError("The proxy failed unexpectedly.")
            await send_json(send, error.status, orjson.dumps(error.body()))

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        began = time.perf_counter()
        state = self.state
        settings = state.settings.proxy
        headers: dict[bytes, str] = {}
        for name, value in scope["headers"]:
            if name in _WANTED and name not in headers:
                headers[name] = value.decode("latin-1")
        # The size limit first (before auth or parsing), then the key, then the body.
        raw = await read_body(receive, headers.get(b"content-length"), settings.max_body_bytes)
        auth = headers.get(b"authorization")
        principal = await state.authenticator.authenticate(
            {"authorization": auth} if auth is not None else {})
        body, chat = parse_chat_request(raw)
        context = settings.max_context_tokens or state.upstream.context_length
        if context and chat.requested_tokens and chat.requested_tokens > context:
            field = "max_completion_tokens" if chat.max_completion_tokens else "max_tokens"
            raise BadRequest(f"Invalid value for '{field}': {chat.requested_tokens} exceeds the "
                             f"model's context length of {context} tokens.", param=field)
        kind = (headers.get(b"x-turn-type") or "main").strip().lower() or "main"
        if kind not in ("main", "side"):
            raise BadRequest("The X-Turn-Type header must be 'main' or 'side'.")
        session_ext = (headers.get(b"x-session-id") or "").strip() or None
        if session_ext is not None and len(session_ext) > MAX_SESSION_ID:
            raise BadRequest(f"The X-Session-Id header is longer than {MAX_SESSION_ID} chars.")
        outcome = parse_outcome_header(headers.get(b"x-session-outcome"))
        if not body.get("model"):
            body["model"] = settings.served_model_name or "default"
        # Fair share last, once the request is known to be valid: a slot among the key's
        # requests in flight and its estimated tokens (corrected when the reply ends).
        prompt_bytes = len(raw) if not context else min(len(raw), 4 * context)
        lease = state.authenticator.limits.admit(
            principal, estimate_tokens(prompt_bytes, chat.requested_tokens))
        try:
            await self._serve(state, receive, send, began, principal, body, chat, headers,
                              kind, session_ext, outcome, lease)
        finally:
            lease.release()

    async def _serve(self, state: State, receive: Receive, send: Send, began: float,
                     principal: Principal, body: dict[str, Any], chat: ChatCompletionRequest,
                     headers: dict[bytes, str], kind: str, session_ext: str | None,
                     outcome: float | None, lease: Lease) -> None:
        uid = str(uuid.uuid4())
        # Users opted out of logging get no turn id: there is no stored turn to refer to.
        out: dict[str, str] = {} if principal.log_opt_out else {"X-Clawrl-Turn-Id": uid}
        if session_ext is not None and not principal.log_opt_out:
            out["X-Clawrl-Session-Id"] = str(explicit_session_id(principal.user_id,
                                                                 session_ext))
        record = None if principal.log_opt_out else TurnRecord(
            uid=uid, user_id=principal.user_id, api_key_id=principal.key_id,
            request_messages=body["messages"], tools=body.get("tools"),
            params={k: v for k, v in body.items() if k not in ("messages", "tools")},
            kind=kind, session_external_id=session_ext,
            session_done=(headers.get(b"x-session-done") or "").strip().lower() in _TRUE,
            session_outcome=outcome,
            train_opt_out=principal.train_opt_out,
            adapter=principal.adapter, adapter_version=principal.adapter_version)
        wants_logprobs = bool(chat.logprobs)

        def log_turn(status: str, error: str | None = None) -> None:
            if record is None:
                return
            record.status, record.error = status, error
            record.latency_ms = (time.perf_counter() - began) * 1000.0
            state.writer.submit(record)
            state.metrics.turns.labels(status).inc()

        upstream = state.upstream
        # durability = "sync": the reply's final byte waits until the turn is committed
        # or journaled (fsynced), so a reply read in full is never lost (proxy/store.py).
        durable: Callable[[], Awaitable[None]] | None = None
        if record is not None and state.settings.proxy.durability == "sync":
            durable = functools.partial(state.writer.durable, record.uid)
        try:
            try:
                if chat.stream:
                    stream = await until_disconnect(receive, upstream.open_chat_stream(
                        engine_body(body, stream=True, adapter=principal.adapter)))
                else:
                    data = await until_disconnect(receive, upstream.chat(
                        engine_body(body, stream=False, adapter=principal.adapter)))
            except BadRequest as exc:
                # The user's adapter is not in the engine (restarted, unloaded before the
                # table caught up): serve the base model, as for a user without one.
                if principal.adapter is None or not adapter_missing(exc, principal.adapter):
                    raise
                log.warning("adapter %s not loaded in the engine; serving the base model",
                            principal.adapter, extra={"action": "adapter_fallback"})
                if record is not None:
                    record.adapter = record.adapter_version = None
                if chat.stream:
                    stream = await until_disconnect(
                        receive, upstream.open_chat_stream(engine_body(body, stream=True)))
                else:
                    data = await until_disconnect(
                        receive, upstream.chat(engine_body(body, stream=False)))
        except ClientGone:
            log_turn("client_disconnected", "The client left before the reply was ready.")
            raise
        except (UpstreamError, UpstreamTimeout) as exc:
            # The engine was called: keep the failed turn (never trained), tell its id.
            log_turn("engine_error", exc.message)
            if record is not None:
                exc.headers.update(out)
            raise

        if not chat.stream:
            reply = parse_reply(data)
            if record is not None:
                record.response_message = reply.message
                record.finish_reason = reply.finish_reason
                record.prompt_ids, record.response_ids = reply.prompt_ids, reply.response_ids
                record.response_logprobs = reply.logprobs
                record.weight_version = reply.weight_version or upstream.weight_version
            state.metrics.count_tokens(len(reply.prompt_ids or ()),
                                       len(reply.response_ids or ()))
            lease.release(used_tokens(reply.prompt_ids, reply.response_ids, reply.usage))
            log_turn("ok")
            content = orjson.dumps(client_view(data, wants_logprobs=wants_logprobs))
            if durable is not None:
                await durable()
            await send_json(send, 200, content, out)
            return

        finished = False

        def finish(collector: StreamCollector, status: str, error: str | None) -> None:
            nonlocal finished
            finished = True
            if record is not None:
                record.response_message = collector.message()
                record.finish_reason = collector.finish_reason
                record.prompt_ids = collector.prompt_ids
                record.response_ids = collector.response_ids
                record.response_logprobs = collector.logprobs or None
                record.weight_version = collector.weight_version or upstream.weight_version
            state.metrics.count_tokens(len(collector.prompt_ids or ()),
                                       len(collector.response_ids or ()))
            lease.release(used_tokens(collector.prompt_ids, collector.response_ids,
                                      collector.usage))
            log_turn(status, error)

        out.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        start = {"type": "http.response.start", "status": 200,
                 "headers": _raw_headers(out, _SSE, None)}
        pieces = relay(stream, wants_logprobs=wants_logprobs, finish=finish)
        try:
            await until_disconnect(receive, _forward(start, pieces, send, durable))
        except ClientGone:
            return  # the relay closed the engine request and logged the turn
        finally:
            if not finished:  # cut off before the relay started
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                log_turn("client_disconnected", "The client left before the reply started.")
        await send({"type": "http.response.body", "body": b""})


async def _forward(start: Message, pieces: AsyncIterator[bytes], send: Send,
                   durable: Callable[[], Awaitable[None]] | None = None) -> None:
    """Send the response start, then each relayed piece as it comes; the relay is always
    closed at the end (so a client that disconnects closes the engine request now, not at
    garbage collection). With `durable`, `[DONE]` waits: the relay is closed first (which
    logs the turn), then `durable()` until the turn is stored."""
    closer = getattr(pieces, "aclose", None)
    try:
        await send(start)
        async for piece in pieces:
            if piece == DONE and durable is not None:
                if closer is not None:
                    await closer()
                await durable()
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    finally:
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()
