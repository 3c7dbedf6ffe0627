"""The proxy's calls to the serving engine (SGLang, or `clawrl engine`), and their errors.

Chat requests go to the engine's OpenAI route with the client's body plus the fields that
make the engine return the exact sampled token ids and their logprobs (docs/engine-protocol.md §1.2):
non-streaming `logprobs` + `return_token_ids`; streaming `logprobs` + the `sglext` id
fields, which SGLang sends in one final `choices: []` chunk. What the client did not ask
for is stripped from the answer again (see `client_view` and proxy/sse.py).

Chat requests go over a lean keep-alive pool (proxy/engine_http.py, which raises httpx's
exception types); the rarely used routes over one `httpx.AsyncClient`. This module is the
one boundary where transport and engine HTTP errors become proxy errors:
engine unreachable -> 502, engine too slow -> 504, engine rejects the request (4xx) -> 400
with the engine's own message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import orjson

from clawrl.base.errors import BadRequest, ClawrlError, UpstreamError, UpstreamTimeout
from clawrl.base.settings import EngineSettings
from proxy.engine_http import EnginePool, EngineResponse
from proxy.openai_types import ENGINE_EFFORT, RECORDED_ONLY
from proxy.sampling import engine_fields, parse_defaults

CHAT_PATH = "/v1/chat/completions"
_JSON = {"Content-Type": "application/json"}

# Fields the proxy owns on the way to the engine; a client's value for them is replaced.
_STREAM_ONLY_CONFLICTS = ("return_token_ids", "return_prompt_token_ids", "return_meta_info")


def create_client(settings: EngineSettings,
                  transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The one HTTP client the proxy process uses for the engine (lives in the lifespan)."""
    headers = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    limits = httpx.Limits(max_connections=settings.max_connections,
                          max_keepalive_connections=settings.max_connections)
    timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
    return httpx.AsyncClient(base_url=settings.url, headers=headers, limits=limits,
                             timeout=timeout, transport=transport)


def engine_body(body: dict[str, Any], *, stream: bool, adapter: str | None = None,
                sampling: dict[str, Any] | None = None,
                model: str | None = None) -> dict[str, Any]:
    """The client's body (minus what is only stored: `RECORDED_ONLY`, `reasoning_effort` as
    the engines take it) with the fields that return exact token ids and logprobs, the
    user's LoRA adapter (`lora_path`, SGLang's field) when they have one, and every sampling
    parameter explicit (`sampling`: proxy/sampling.py `applied_sampling`), so the engine's
    own defaults never change the distribution the turn records; `model`: the engine's own
    name for the model, in place of the client's (proxy/models.py).

    `model: "base:adapter"` picks an adapter on SGLang (and `clawrl engine`), so a client's
    model name keeps only what comes before a ':' — the proxy alone chooses adapters, from
    the API key's user, and nobody can name another user's."""
    out = {k: v for k, v in body.items() if k not in RECORDED_ONLY}
    if isinstance(out.get("stream_options"), dict):
        out["stream_options"] = {k: v for k, v in out["stream_options"].items()
                                 if k != "include_obfuscation"}
    if isinstance(out.get("reasoning_effort"), str):
        effort = ENGINE_EFFORT.get(out["reasoning_effort"])
        if effort is None:
            del out["reasoning_effort"]
        else:
            out["reasoning_effort"] = effort
    if sampling is not None:
        out.update(engine_fields(sampling))
    if model is not None:  # the engine's own name (proxy/models.py)
        out["model"] = model
    name = out.get("model")
    if isinstance(name, str) and ":" in name:
        out["model"] = name.split(":", 1)[0] or "default"
    if adapter is not None:
        out["lora_path"] = adapter
    out["logprobs"] = True
    if stream:
        for name in _STREAM_ONLY_CONFLICTS:  # SGLang refuses these when streaming
            out.pop(name, None)
        out["return_input_ids_in_sglext"] = True
        out["return_output_ids_in_sglext"] = True
    else:
        out["return_token_ids"] = True
    return out


def translate(exc: httpx.HTTPError) -> ClawrlError:
    """A transport failure talking to the engine, as the proxy error the client gets."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"The engine did not answer in time ({type(exc).__name__}).")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError("The engine is unreachable; try again later.",
                             code="engine_unavailable")
    return UpstreamError(f"Lost the connection to the engine ({type(exc).__name__}).")


def engine_message(content: bytes) -> str:
    """The human-readable message inside an engine error body (SGLang or FastAPI shapes)."""
    try:
        data = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace").strip()[:500] or "no details"
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        for key in ("message", "error", "detail"):
            if isinstance(data.get(key), str):
                return str(data[key])
        if data.get("detail") is not None:
            return json.dumps(data["detail"])[:500]
    return json.dumps(data)[:500]


def adapter_missing(exc: ClawrlError, adapter: str) -> bool:
    """The engine refused a request because `adapter` is not loaded there (SGLang and
    `clawrl engine` both name the adapter in a 400 about "LoRA": never loaded, unloaded,
    LoRA not enabled, or an evicted adapter that could not be reloaded)."""
    return (isinstance(exc, BadRequest) and exc.code == "engine_rejected"
            and "LoRA" in exc.message and adapter in exc.message)


def error_for_status(status: int, content: bytes) -> ClawrlError:
    """An engine HTTP error status as a proxy error; the engine's message is kept."""
    message = engine_message(content)
    if status in (400, 422):
        return BadRequest(message, code="engine_rejected")
    if status == 504:
        return UpstreamTimeout(f"The engine timed out: {message}")
    return UpstreamError(f"The engine failed ({status}): {message}")


@dataclass
class EngineReply:
    """What the turn log needs from one completed chat request."""

    message: dict[str, Any]
    finish_reason: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    logprobs: list[float] | None = None
    weight_version: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)


def parse_reply(data: dict[str, Any]) -> EngineReply:
    """Pull the reply, exact token ids, logprobs and weight version from a chat response."""
    choices = data.get("choices") or [{}]
    choice = choices[0]
    message = dict(choice.get("message") or {"role": "assistant", "content": ""})
    message.setdefault("role", "assistant")
    sglext = data.get("sglext") or {}
    prompt_ids = choice.get("prompt_token_ids") or sglext.get("input_ids")
    response_ids = choice.get("response_token_ids")
    if response_ids is None and sglext.get("output_ids"):
        response_ids = sglext["output_ids"][0]
    content = (choice.get("logprobs") or {}).get("content")
    logprobs = [float(t["logprob"]) for t in content] if content is not None else None
    metadata = data.get("metadata") or {}
    return EngineReply(message=message, finish_reason=choice.get("finish_reason"),
                       prompt_ids=prompt_ids, response_ids=response_ids, logprobs=logprobs,
                       weight_version=_version(metadata.get("weight_version")),
                       usage=data.get("usage") or {})


def client_view(data: dict[str, Any], *, wants_logprobs: bool) -> dict[str, Any]:
    """The engine's response minus what only the proxy asked for."""
    data.pop("sglext", None)
    for choice in data.get("choices") or []:
        for name in ("prompt_token_ids", "response_token_ids", "meta_info"):
            choice.pop(name, None)
        if not wants_logprobs:
            choice["logprobs"] = None
    return data


def _version(value: Any) -> str | None:
    return None if value is None else str(value)


class ChatStream(Protocol):
    """An open streamed engine response (httpx's or proxy/engine_http.py's)."""

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


def create_pool(settings: EngineSettings) -> EnginePool:
    """The lean connection pool for chat requests (proxy/engine_http.py)."""
    headers = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    return EnginePool(settings.url, headers=headers,
                      connect_timeout_s=settings.connect_timeout_s,
                      read_timeout_s=settings.read_timeout_s,
                      max_connections=settings.max_connections)


class Upstream:
    """Calls to the engine: chat requests over the lean `pool` when given (the hot path),
    everything else — and chat too when there is no pool, e.g. a test's injected httpx
    transport — over the process's shared `httpx.AsyncClient`."""

    def __init__(self, client: httpx.AsyncClient, pool: EnginePool | None = None) -> None:
        self.client = client
        self.pool = pool
        # Last version read from /model_info; used for streamed turns, whose chunks carry
        # no weight version on SGLang.
        self.weight_version: str | None = None
        # The model's context length, from /model_info (the embedded engine) or /v1/models
        # (`max_model_len`, SGLang); None until known.
        self.context_length: int | None = None
        # How many requests the engine runs at once, when its /model_info says
        # (`max_running_requests`); the default in-flight limit per key follows it.
        self.max_running_requests: int | None = None
        # The engine's sampling defaults (proxy/sampling.py), from /model_info; None until
        # the poll first reads it (a chat never waits for it: see proxy/sampling.py).
        self.sampling_defaults: dict[str, float] | None = None
        # The engine's own model name (`served_model_name`, else `model_path`), from
        # /model_info; None until read (proxy/models.py).
        self.model_name: str | None = None

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        await self.client.aclose()

    async def chat(self, body: dict[str, Any], path: str = CHAT_PATH) -> dict[str, Any]:
        """A whole reply from the engine's chat route (or `path`: `/generate`)."""
        try:
            if self.pool is not None:
                response = await self.pool.post(path, orjson.dumps(body))
                try:
                    status, content = response.status_code, await response.aread()
                finally:  # a no-op after a complete read; else the connection is dropped
                    await response.aclose()
            else:
                reply = await self.client.post(path, content=orjson.dumps(body), headers=_JSON)
                status, content = reply.status_code, reply.content
        except httpx.HTTPError as exc:
            raise translate(exc) from exc
        if status != 200:
            raise error_for_status(status, content)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError("The engine answered with invalid JSON.") from exc
        if not isinstance(data, dict):
            raise UpstreamError("The engine answered with an unexpected JSON shape.")
        return data

    async def open_chat_stream(self, body: dict[str, Any], path: str = CHAT_PATH) -> ChatStream:
        """Send a streaming request (to the chat route, or `path`); the caller owns (and must
        close) the response."""
        response: EngineResponse | httpx.Response
        try:
            if self.pool is not None:
                response = await self.pool.post(path, orjson.dumps(body))
            else:
                request = self.client.build_request("POST", path,
                                                    content=orjson.dumps(body), headers=_JSON)
                response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise translate(exc) from exc
        if response.status_code != 200:
            try:
                content = await response.aread()
            except httpx.HTTPError as exc:
                raise translate(exc) from exc
            finally:
                await response.aclose()
            raise error_for_status(response.status_code, content)
        return response

    async def model_info(self) -> dict[str, Any]:
        try:
            response = await self.client.get("/model_info")
        except httpx.HTTPError as exc:
            raise translate(exc) from exc
        if response.status_code != 200:
            raise error_for_status(response.status_code, response.content)
        info: dict[str, Any] = response.json()
        self.weight_version = _version(info.get("weight_version"))
        name = info.get("served_model_name") or info.get("model_path")
        if isinstance(name, str) and name:
            self.model_name = name
        self.sampling_defaults = parse_defaults(info.get("preferred_sampling_params"))
        context = info.get("context_length") or info.get("max_model_len")
        if isinstance(context, int) and context > 0:
            self.context_length = context
        elif self.context_length is None:
            await self._context_from_models()
        running = info.get("max_running_requests")
        if isinstance(running, int) and not isinstance(running, bool) and running > 0:
            self.max_running_requests = running
        return info

    async def _context_from_models(self) -> None:
        try:
            response = await self.client.get("/v1/models")
            models = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        first = models[0] if isinstance(models, list) and models else None
        context = first.get("max_model_len") if isinstance(first, dict) else None
        if isinstance(context, int) and context > 0:
            self.context_length = context

    async def health(self) -> str:
        """'ok', 'busy' (503: starting, paused or loading weights) or 'down'."""
        try:
            response = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return "down"
        if response.status_code == 200:
            return "ok"
        return "busy" if response.status_code == 503 else "down"
