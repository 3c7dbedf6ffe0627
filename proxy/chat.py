"""`POST /v1/chat/completions` as a bare ASGI endpoint: the proxy's hot path.

Every chat request pays for whatever sits between uvicorn and the handler, so this route
bypasses FastAPI's middleware, dependency and exception-handler layers (`ProxyApp` in
proxy/app.py sends it here directly, wrapped only in the metrics middleware) and speaks
ASGI itself: headers read once from the scope, the body read from `receive`, the reply
sent as raw messages. What it answers is unchanged: OpenAI-shaped error bodies with the
same statuses (`ClawrlError.body()`), the same turn ids and session headers.

`POST /v1/responses` (proxy/responses.py) is this same endpoint with another `parse`: the
Responses request becomes a chat body, and a `ReplyShape` renders the engine's chat reply
(whole, or its stream) as Responses objects and events. Everything between (auth, fair
share, sessions, the engine call, the turn log) is shared.

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
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import anyio
import orjson
from starlette.datastructures import State
from starlette.types import Message, Receive, Scope, Send

from clawrl.base.errors import (
    BadRequest,
    ClawrlError,
    Forbidden,
    PayloadTooLarge,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.auth import VERIFIER, Principal, require_scope
from proxy.choices import (
    ChoiceRenderer,
    MergedStream,
    choice_body,
    gather_all,
    merge_choices,
    merge_relays,
)
from proxy.limits import DEFAULT_COMPLETION_ESTIMATE, Lease, estimate_tokens, used_tokens
from proxy.openai_types import ChatCompletionRequest, parse_chat_request, parse_outcome_header
from proxy.prompt_size import PromptText, prompt_text, refusal, too_long
from proxy.records import TurnRecord
from proxy.sampling import applied_sampling
from proxy.sessions import MAX_SESSION_ID, explicit_session_id
from proxy.sse import ChatRenderer, Collector, Last, Renderer, StreamCollector, relay
from proxy.upstream import (
    CHAT_PATH,
    ChatStream,
    EngineReply,
    adapter_missing,
    client_view,
    engine_body,
    parse_reply,
)

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


class BodyTimeout(ClawrlError):
    """The request body did not arrive in time (a client holding back its last bytes)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


# An error answered before the body is read leaves the connection open: uvicorn discards
# a request's remaining body once its response is complete (nothing is buffered), and the
# client reads its answer (a client still writing to a connection closed under it gets a
# reset instead) — a 413 for a declared size, a small body with a bad key. But a caller
# without a valid key who declared more than this, and any body that did not arrive in
# time, gets `Connection: close`: nobody unauthenticated holds a connection open by
# trickling a large body, and a late body is never waited for again.
DISCARD_BYTES = 64 * 1024


def early_answer_headers(exc: ClawrlError, declared: str | None,
                         read: bool) -> dict[str, str]:
    """The headers of an error answered before the body was read in full (DISCARD_BYTES)."""
    large = declared is not None and declared.isdigit() and int(declared) > DISCARD_BYTES
    unknown = isinstance(exc, (Unauthorized, Forbidden)) and large
    if read or not (unknown or isinstance(exc, BodyTimeout)):
        return exc.headers
    return {**exc.headers, "Connection": "close"}


def check_declared(declared: str | None, limit: int) -> None:
    """413 at once when the declared `Content-Length` exceeds `limit` (nothing read)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")


async def read_body(receive: Receive, declared: str | None, limit: int, *,
                    deadline: float | None = None,
                    reserve: Callable[[int], None] | None = None) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `limit` bytes, or 408 when
    it is not all there by `deadline` (the event loop's clock). `reserve(n)` is told of the
    bytes before they are buffered (the declared length at once, else each chunk) and may
    refuse them by raising."""
    check_declared(declared, limit)
    sized = declared is not None and declared.isdigit()
    if reserve is not None and sized:
        reserve(int(declared))  # type: ignore[arg-type]
    chunks, size = [], 0
    try:
        async with asyncio.timeout_at(deadline):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    raise ClientGone()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
                if reserve is not None and not sized:
                    reserve(len(chunk))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyTimeout(f"The request body did not arrive within the time allowed "
                          f"({size} bytes received).") from None


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


class ReplyShape(Protocol):
    """What the client reads: a whole reply's body, or a stream's events."""

    def whole(self, turn: ChatTurn, data: dict[str, Any], reply: EngineReply) -> bytes:
        """The body of a whole reply (`data`: the engine's chat response)."""
        ...

    def renderer(self, turn: ChatTurn) -> Renderer:
        """The renderer of a streamed reply (proxy/sse.py)."""
        ...


@dataclass
class ChatShape:
    """The chat completions API: the engine's own reply, minus what the proxy asked for."""

    wants_logprobs: bool = False

    def whole(self, turn: ChatTurn, data: dict[str, Any], reply: EngineReply) -> bytes:
        data["model"] = turn.served_model
        return orjson.dumps(client_view(data, wants_logprobs=self.wants_logprobs))

    def renderer(self, turn: ChatTurn) -> Renderer:
        return ChatRenderer(self.wants_logprobs, turn.served_model)


class ChatEndpoint:
    """The ASGI app for `POST /v1/chat/completions`; reads the running app's state (set
    by its lifespan: upstream, writer, authenticator) per request. A subclass serves
    another API over the same path by overriding `parse` (proxy/responses.py)."""

    def __init__(self, state: State) -> None:
        self.state = state

    def parse(self, raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest, ReplyShape,
                                         dict[str, Any]]:
        """The chat body to send, its validated view, how the reply is shaped for the
        client, and extra parameters to log with the turn; or BadRequest."""
        body, chat = parse_chat_request(raw)
        return body, chat, ChatShape(bool(chat.logprobs)), {}

    # The engine route this API is served by, and how its request and reply are made and
    # read (proxy/completions.py serves `/v1/completions` by the engine's `/generate`).
    engine_path = CHAT_PATH

    def engine_request(self, turn: ChatTurn, adapter: str | None) -> dict[str, Any]:
        """The engine body for `turn` (with the user's adapter, or the base model: None)."""
        return engine_body(turn.body, stream=bool(turn.chat.stream), adapter=adapter,
                           sampling=turn.sampling, model=turn.engine_model)

    def read_reply(self, data: dict[str, Any]) -> EngineReply:
        return parse_reply(data)

    def new_collector(self) -> Collector:
        """What collects a streamed reply for the turn log (proxy/sse.py)."""
        return StreamCollector()

    def tokens_field(self, chat: ChatCompletionRequest) -> str:
        """The request field that asked for `chat.requested_tokens` (named in a 400)."""
        return "max_completion_tokens" if chat.max_completion_tokens else "max_tokens"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = read = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = True
            await send(message)

        async def reading() -> Message:
            nonlocal read
            message = await receive()
            read = read or not message.get("more_body", False)
            return message

        try:
            await self._chat(scope, reading, tracked)
        except ClawrlError as exc:
            if started:
                raise
            # Answered before the body was read (a bad key, too large, too slow): the rest
            # is never buffered, and a large rest never read (the connection is closed).
            declared = next((v.decode("latin-1") for k, v in scope["headers"]
                             if k == b"content-length"), None)
            await send_json(send, exc.status, orjson.dumps(exc.body()),
                            early_answer_headers(exc, declared, read))
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
        # The declared size and the key from the headers, before a byte of the body is
        # read; then the body, within the size limit and the read timeout.
        deadline = asyncio.get_running_loop().time() + settings.body_timeout_s
        check_declared(headers.get(b"content-length"), settings.max_body_bytes)
        auth = headers.get(b"authorization")
        principal = await state.authenticator.authenticate(
            {"authorization": auth} if auth is not None else {})
        raw = await read_body(receive, headers.get(b"content-length"), settings.max_body_bytes,
                              deadline=deadline)
        body, chat, shape, extra = self.parse(raw)
        context = settings.max_context_tokens or state.upstream.context_length
        if context and chat.requested_tokens and chat.requested_tokens > context:
            name = self.tokens_field(chat)
            raise BadRequest(f"Invalid value for '{name}': {chat.requested_tokens} exceeds the "
                             f"model's context length of {context} tokens.", param=name)
        kind = (headers.get(b"x-turn-type") or "main").strip().lower() or "main"
        if kind not in ("main", "side"):
            raise BadRequest("The X-Turn-Type header must be 'main' or 'side'.")
        session_ext = (headers.get(b"x-session-id") or "").strip() or None
        if session_ext is not None and len(session_ext) > MAX_SESSION_ID:
            raise BadRequest(f"The X-Session-Id header is longer than {MAX_SESSION_ID} chars.")
        outcome = parse_outcome_header(headers.get(b"x-session-outcome"))
        if outcome is not None:  # a reward: refused whole, before the engine sees anything
            require_scope(principal, VERIFIER, "set a session outcome (X-Session-Outcome)")
        served = await state.models.resolve(body.get("model"))  # or 404 model_not_found
        body["model"] = body.get("model") or "default"
        sampling = applied_sampling(body, state.upstream.sampling_defaults)
        # The prompt's size before the engine sees it (proxy/prompt_size.py): its bytes
        # alone may show that it cannot fit, else its tokens, when it might not.
        prompt, requested = prompt_text(body), chat.requested_tokens
        counted = None
        if context:
            bound = state.sizer.bound(prompt)
            if too_long(bound, requested, context):
                raise refusal(bound, requested, context)
            counted = await self._count_prompt(principal, len(raw), prompt, requested, context)
        # Fair share last, once the request is known to be valid: a slot among the key's
        # requests in flight and its estimated tokens (corrected when the reply ends).
        if counted is not None:
            estimate = counted + (requested or DEFAULT_COMPLETION_ESTIMATE)
        else:
            prompt_bytes = prompt.nbytes if not context else min(prompt.nbytes, 4 * context)
            estimate = estimate_tokens(prompt_bytes, requested)
        n = chat.n or 1  # each choice costs what one reply costs
        lease = state.authenticator.limits.admit(principal, estimate * n)
        turn = ChatTurn(principal, body, chat, lease, began, {}, shape, sampling=sampling,
                        served_model=served, engine_model=state.models.engine_model())
        turn.record = None if principal.log_opt_out else new_record(
            principal, body, kind, session_ext, headers, outcome, uid=turn.uid, extra=extra)
        if turn.record is not None:
            turn.record.sampling = sampling
            state.writer.attach_early(turn.record)  # the judge reads the follow-up meanwhile
            turn.out["X-Clawrl-Turn-Id"] = turn.record.uid
            if session_ext is not None:
                turn.out["X-Clawrl-Session-Id"] = str(
                    explicit_session_id(principal.user_id, session_ext))
        try:
            if n > 1 and chat.stream:
                await self._serve_choice_streams(receive, send, choice_turns(turn, n))
            elif n > 1:
                await self._serve_choices(receive, send, choice_turns(turn, n))
            elif chat.stream:
                await self._serve_stream(receive, send, turn)
            else:
                await self._serve_json(receive, send, turn)
        finally:
            lease.release()

    async def _count_prompt(self, principal: Principal, raw_bytes: int, prompt: PromptText,
                            requested: int | None, context: int) -> int | None:
        """The prompt's tokens by the model's tokenizer (bounded, off the event loop) when
        it might not fit, else None. Refused when it cannot fit, and the key's tokens per
        minute charged what was counted; a key with no slot free is refused first."""
        sizer, limits = self.state.sizer, self.state.authenticator.limits
        if sizer.tokenizer is None or not sizer.may_exceed(raw_bytes, context):
            return None
        limits.check_room(principal)
        counted: int = await sizer.count(prompt, context - requested + 1 if requested
                                         else context)
        if too_long(counted, requested, context):
            limits.charge(principal, counted)
            raise refusal(counted, requested, context)
        return counted

    async def _serve_json(self, receive: Receive, send: Send, turn: ChatTurn) -> None:
        """A whole reply: one engine call, the turn logged, the JSON sent."""
        upstream = self.state.upstream
        data = await self._call_engine(receive, turn, functools.partial(
            upstream.chat, path=self.engine_path))
        reply = self.read_reply(data)
        self._finish(turn, reply, "ok")
        content = turn.shape.whole(turn, data, reply)
        await self._durable(turn)
        await send_json(send, 200, content, turn.out)

    async def _serve_stream(self, receive: Receive, send: Send, turn: ChatTurn) -> None:
        """A streamed reply: the engine's chunks relayed as they come; the turn is logged
        when the relay ends (or the client leaves)."""
        stream = await self._call_engine(receive, turn, functools.partial(
            self.state.upstream.open_chat_stream, path=self.engine_path))
        finished = False

        def finish(collector: Collector, status: str, error: str | None) -> None:
            nonlocal finished
            finished = True
            self._finish(turn, collector.reply(), status, error)

        turn.out.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        start = {"type": "http.response.start", "status": 200,
                 "headers": _raw_headers(turn.out, _SSE, None)}
        pieces = relay(stream, render=turn.shape.renderer(turn), finish=finish,
                       collector=self.new_collector())
        durable = (functools.partial(self._durable, turn)
                   if self._sync_durability(turn) else None)
        try:
            await until_disconnect(receive, _forward(start, pieces, send, durable))
        except ClientGone:
            return  # the relay closed the engine request and logged the turn
        finally:
            if not finished:  # cut off before the relay started
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                self._log(turn, "client_disconnected",
                          "The client left before the reply started.")
        await send({"type": "http.response.body", "body": b""})

    async def _call_engine(self, receive: Receive, turn: ChatTurn,
                           call: Callable[[dict[str, Any]], Awaitable[T]]) -> T:
        """The engine call (`call`: a whole reply or a stream), cancelled when the client
        leaves. A client that leaves or an engine that fails is logged as the turn's status."""
        return (await self._call_engines(receive, [turn], call))[0]

    async def _call_engines(self, receive: Receive, turns: list[ChatTurn],
                            call: Callable[[dict[str, Any]], Awaitable[T]]) -> list[T]:
        """`_call_engine` for every turn at once (a request's choices: proxy/choices.py)."""
        try:
            return await until_disconnect(receive, gather_all(
                [self._engine_call(turn, call) for turn in turns]))
        except ClientGone:
            for turn in turns:
                self._log(turn, "client_disconnected",
                          "The client left before the reply was ready.")
            raise
        except (UpstreamError, UpstreamTimeout) as exc:
            # The engine was called: keep the failed turns (never trained), tell their ids.
            for turn in turns:
                self._log(turn, "engine_error", exc.message)
            exc.headers.update(turns[0].out)
            raise

    async def _engine_call(self, turn: ChatTurn,
                           call: Callable[[dict[str, Any]], Awaitable[T]]) -> T:
        """One engine call for the user's adapter; when that adapter is not in the engine
        (restarted, unloaded before the table caught up), the base model, as for a user
        without one."""
        adapter = turn.principal.serving_adapter
        try:
            return await call(self.engine_request(turn, adapter))
        except BadRequest as exc:
            if adapter is None or not adapter_missing(exc, adapter):
                raise
            log.warning("adapter %s not loaded in the engine; serving the base model",
                        adapter, extra={"action": "adapter_fallback", "adapter": adapter})
            if turn.record is not None:
                turn.record.adapter = turn.record.adapter_version = None
            return await call(self.engine_request(turn, None))

    async def _serve_choices(self, receive: Receive, send: Send,
                             turns: list[ChatTurn]) -> None:
        """`n` > 1 (proxy/choices.py): one engine call per choice at once, each choice its
        own turn, one reply with every choice."""
        datas = await self._call_engines(receive, turns, self.state.upstream.chat)
        replies = [self.read_reply(data) for data in datas]
        used = [self._finish(turn, reply, "ok", settle=False)
                for turn, reply in zip(turns, replies, strict=True)]
        counted = [u for u in used if u is not None]
        turns[0].lease.release(sum(counted) if counted else None)
        first = turns[0]
        content = first.shape.whole(first, merge_choices(datas), replies[0])
        for turn in turns:
            await self._durable(turn)
        await send_json(send, 200, content, first.out)

    async def _serve_choice_streams(self, receive: Receive, send: Send,
                                    turns: list[ChatTurn]) -> None:
        """`n` > 1, streamed (proxy/choices.py `merge_relays`): every choice's engine stream
        at once, interleaved; each choice's turn logged when its stream ends."""
        opened: list[ChatStream] = []

        async def open_stream(body: dict[str, Any]) -> ChatStream:
            stream: ChatStream = await self.state.upstream.open_chat_stream(
                body, path=self.engine_path)
            opened.append(stream)
            return stream

        try:
            streams = await self._call_engines(receive, turns, open_stream)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for stream in opened:  # those that opened before one failed
                    await stream.aclose()
            raise
        used: dict[int, int | None] = {}

        def finisher(index: int) -> Callable[[Collector, str, str | None], None]:
            def finish(collector: Collector, status: str, error: str | None) -> None:
                used[index] = self._finish(turns[index], collector.reply(), status, error,
                                           settle=False)
            return finish

        first, merged = turns[0], MergedStream(len(turns))
        first.out.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        start = {"type": "http.response.start", "status": 200,
                 "headers": _raw_headers(first.out, _SSE, None)}
        pieces = merge_relays([
            relay(stream, render=ChoiceRenderer(turn.shape.renderer(turn), i, merged),
                  finish=finisher(i), collector=self.new_collector())
            for i, (turn, stream) in enumerate(zip(turns, streams, strict=True))], merged)

        async def durable() -> None:
            for turn in turns:
                await self._durable(turn)

        try:
            await until_disconnect(receive, _forward(
                start, pieces, send, durable if self._sync_durability(first) else None))
        except ClientGone:
            return
        finally:
            counted = [u for u in used.values() if u is not None]
            first.lease.release(sum(counted) if counted else None)
        await send({"type": "http.response.body", "body": b""})

    def _finish(self, turn: ChatTurn, reply: EngineReply, status: str,
                error: str | None = None, *, settle: bool = True) -> int | None:
        """The reply is known (whole, or the stream ended): record it, count its tokens,
        settle the key's token estimate (unless the caller settles it: `settle`), log the
        turn. Returns the tokens the reply used (None: the engine did not say)."""
        if turn.record is not None:
            record = turn.record
            record.response_message = reply.message
            record.finish_reason = reply.finish_reason
            record.prompt_ids, record.response_ids = reply.prompt_ids, reply.response_ids
            record.response_logprobs = reply.logprobs
            record.weight_version = turn.principal.policy_label(record.adapter) or \
                reply.weight_version or self.state.upstream.weight_version
        self.state.metrics.count_tokens(len(reply.prompt_ids or ()),
                                        len(reply.response_ids or ()))
        used = used_tokens(reply.prompt_ids, reply.response_ids, reply.usage)
        if settle:
            turn.lease.release(used)
        self._log(turn, status, error)
        return used

    def _log(self, turn: ChatTurn, status: str, error: str | None = None) -> None:
        if turn.record is None:  # opted out of logging
            return
        turn.record.status, turn.record.error = status, error
        turn.record.latency_ms = (time.perf_counter() - turn.began) * 1000.0
        self.state.writer.submit(turn.record)
        self.state.metrics.turns.labels(status).inc()

    def _sync_durability(self, turn: ChatTurn) -> bool:
        # durability = "sync": the reply's final byte waits until the turn is committed
        # or journaled (fsynced), so a reply read in full is never lost (proxy/store.py).
        return turn.record is not None and self.state.settings.proxy.durability == "sync"

    async def _durable(self, turn: ChatTurn) -> None:
        if turn.record is not None and self._sync_durability(turn):
            await self.state.writer.durable(turn.record.uid)


@dataclass
class ChatTurn:
    """One chat request on its way through: who asked, what, the key's fair-share lease,
    the response headers, how the reply is shaped, the turn's id and the turn being logged
    (None: the user opted out of logging)."""

    principal: Principal
    body: dict[str, Any]
    chat: ChatCompletionRequest
    lease: Lease
    began: float
    out: dict[str, str]
    shape: ReplyShape
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    record: TurnRecord | None = None
    # The distribution the engine samples with, every parameter explicit (proxy/sampling.py).
    sampling: dict[str, Any] | None = None
    # The model id the client reads in the reply, and the name the engine is sent
    # (proxy/models.py).
    served_model: str = "default"
    engine_model: str | None = None


def new_record(principal: Principal, body: dict[str, Any], kind: str, session_ext: str | None,
               headers: dict[bytes, str], outcome: float | None, *, uid: str | None = None,
               extra: dict[str, Any] | None = None) -> TurnRecord:
    """The turn as the request makes it known; the reply's fields are filled in later.
    `extra`: parameters logged with the turn that the engine never sees."""
    params = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    return TurnRecord(
        uid=uid or str(uuid.uuid4()), user_id=principal.user_id, api_key_id=principal.key_id,
        request_messages=body["messages"], tools=body.get("tools"),
        params={**params, **(extra or {})},
        kind=kind, kind_reason="header" if (headers.get(b"x-turn-type") or "").strip() else None,
        session_external_id=session_ext,
        session_done=(headers.get(b"x-session-done") or "").strip().lower() in _TRUE,
        session_outcome=outcome, train_opt_out=principal.train_opt_out,
        adapter=principal.serving_adapter, adapter_version=principal.adapter_version)


def choice_turns(turn: ChatTurn, n: int) -> list[ChatTurn]:
    """The `n` turns of a request's choices: the first is `turn` itself (its uid, its
    response headers); each has its own body and record, in one group."""
    group = str(uuid.uuid4())
    turns = []
    for index in range(n):
        body = choice_body(turn.body, index)
        choice = turn if index == 0 else replace(turn, uid=str(uuid.uuid4()), out={})
        choice.body = body
        if turn.record is not None:
            params = dict(turn.record.params)
            if "seed" in body:
                params["seed"] = body["seed"]
            choice.record = replace(turn.record, uid=choice.uid, params=params,
                                    group_id=group, group_index=index)
        turns.append(choice)
    if turn.record is not None:
        turn.out["X-Clawrl-Turn-Ids"] = ",".join(t.uid for t in turns)
    return turns


async def _forward(start: Message, pieces: AsyncIterator[bytes], send: Send,
                   durable: Callable[[], Awaitable[None]] | None = None) -> None:
    """Send the response start, then each relayed piece as it comes; the relay is always
    closed at the end (so a client that disconnects closes the engine request now, not at
    garbage collection). With `durable`, the final piece (`Last`: chat's `[DONE]`) waits:
    the relay is closed first (which logs the turn), then `durable()` until the turn is
    stored."""
    closer = getattr(pieces, "aclose", None)
    try:
        await send(start)
        async for piece in pieces:
            if isinstance(piece, Last) and durable is not None:
                if closer is not None:
                    await closer()
                await durable()
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    finally:
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()
