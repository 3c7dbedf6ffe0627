"""Async client for the serving engine's native routes (SGLang 0.5.x or `clawrl engine`).

Used by the judge (votes, teacher logprobs) and the trainer (publishing weights). It speaks
only HTTP and never imports torch, so it lives in `proxy/` and both can import it. The proxy's
own OpenAI relay does not go through here (it streams raw bytes); this is for callers that
want parsed results.

Errors: every failure raises a subclass of `EngineClientError`, translated from httpx and
from the engine's HTTP status at one place (`_request`):
- `EngineUnavailable` (cannot connect, connection dropped), `EngineBusy` (503: a weight update
  or pause is running; busy, not dead), `EngineTimeout`;
- `EngineBadRequest` (4xx: the request was refused), `EngineServerError` (5xx);
- `EngineProtocolError` (an answer that does not have the promised shape);
- `WeightUpdateFailed` (`/update_weights_from_disk` answered success=false; old weights serve).

Run nothing: import `EngineClient` and use it as an async context manager:
    async with EngineClient("http://127.0.0.1:30000") as engine:
        lps = await engine.token_logprobs(prompt_ids, response_ids)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Literal

import httpx

from clawrl.base.settings import EngineSettings


class EngineClientError(Exception):
    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class EngineUnavailable(EngineClientError):
    """The engine cannot be reached."""


class EngineBusy(EngineUnavailable):
    """503: a weight update or pause is in progress (or SGLang is overloaded)."""


class EngineTimeout(EngineClientError):
    """The engine did not answer in time."""


class EngineBadRequest(EngineClientError):
    """4xx: the engine refused the request."""


class EngineServerError(EngineClientError):
    """5xx other than 503."""


class EngineProtocolError(EngineClientError):
    """The engine answered 2xx with a body that lacks what the protocol promises."""


class WeightUpdateFailed(EngineClientError):
    """`/update_weights_from_disk` answered success=false; the old weights keep serving."""


def _message(response: httpx.Response) -> str:
    """The error text from an SGLang/OpenAI error body, or the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:500]


def _raise_for_status(response: httpx.Response) -> None:
    status = response.status_code
    if status < 400:
        return
    message = f"{response.request.method} {response.request.url.path}: {_message(response)}"
    if status == 503:
        raise EngineBusy(message, status=status)
    if status < 500:
        raise EngineBadRequest(message, status=status)
    raise EngineServerError(message, status=status)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The engine's key, as SGLang's `--api-key` (and `clawrl engine`) expect it."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sync_client(engine: EngineSettings, timeout_s: float,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A blocking client for processes that are not async (the trainer publishing a version,
    `clawrl versions`): the same URL, key and connect timeout as `EngineClient`."""
    key = engine.api_key.get_secret_value() if engine.api_key else None
    return httpx.Client(base_url=engine.url, headers=auth_headers(key),
                        timeout=httpx.Timeout(timeout_s, connect=engine.connect_timeout_s),
                        transport=transport)


class EngineClient:
    """One pooled `httpx.AsyncClient` to an engine base URL (no `/v1` suffix)."""

    def __init__(self, base_url: str, *, api_key: str | None = None,
                 timeout: httpx.Timeout | float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 max_connections: int = 256) -> None:
        headers = auth_headers(api_key)
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport,
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))

    @classmethod
    def from_settings(cls, settings: EngineSettings, **kwargs: Any) -> EngineClient:
        key = settings.api_key.get_secret_value() if settings.api_key else None
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        return cls(settings.url, api_key=key, timeout=timeout,
                   max_connections=settings.max_connections, **kwargs)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- transport ------------------------------------------------------------------------

    async def _request(self, method: str, path: str, *, json_body: Any = None,
                       check: bool = True) -> httpx.Response:
        try:
            response = await self._http.request(method, path, json=json_body)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"{method} {path}: engine timed out ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{method} {path}: cannot reach the engine at "
                                    f"{self.base_url} ({exc!r})") from exc
        if check:
            _raise_for_status(response)
        return response

    async def _json(self, method: str, path: str, json_body: Any = None) -> dict[str, Any]:
        response = await self._request(method, path, json_body=json_body)
        try:
            body = response.json()
        except ValueError as exc:
            raise EngineProtocolError(f"{path}: answer is not JSON: {response.text[:200]!r}"
                                      ) from exc
        if not isinstance(body, dict):
            raise EngineProtocolError(f"{path}: expected a JSON object, got {type(body).__name__}")
        return body

    # ---- generation -----------------------------------------------------------------------

    async def generate(self, *, input_ids: list[int] | None = None, text: str | None = None,
                       sampling_params: dict[str, Any] | None = None,
                       return_logprob: bool = False, logprob_start_len: int = -1,
                       top_logprobs_num: int = 0, rid: str | None = None) -> dict[str, Any]:
        """Native `/generate` (one prompt, non-streaming): `{text, output_ids, meta_info}`."""
        if (input_ids is None) == (text is None):
            raise ValueError("give exactly one of input_ids or text")
        body: dict[str, Any] = {"sampling_params": sampling_params or {},
                                "return_logprob": return_logprob,
                                "logprob_start_len": logprob_start_len,
                                "top_logprobs_num": top_logprobs_num}
        if input_ids is not None:
            body["input_ids"] = input_ids
        else:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        out = await self._json("POST", "/generate", body)
        if "output_ids" not in out or "meta_info" not in out:
            raise EngineProtocolError("/generate: answer lacks output_ids/meta_info")
        return out

    async def token_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprob of each response token given the prompt (teacher scoring, one prefill).

        SGLang scores prompt position i with the logits at i-1 and leaves the first
        requested position empty (`[null, id, null]`), so we start one token early and drop
        that entry. The returned ids are checked against `response_ids` position by position.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if not response_ids:
            return []
        out = await self.generate(input_ids=[*prompt_ids, *response_ids],
                                  sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=len(prompt_ids) - 1)
        entries = out["meta_info"].get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(response_ids) + 1:
            got = len(entries) if isinstance(entries, list) else entries
            raise EngineProtocolError(f"/generate returned {got} input logprobs for "
                                      f"{len(response_ids)} response tokens (+1 expected)")
        values: list[float] = []
        for position, (entry, token) in enumerate(zip(entries[1:], response_ids, strict=True)):
            if entry[0] is None or int(entry[1]) != token:
                raise EngineProtocolError(f"input logprob {position} is {entry}, expected a "
                                          f"logprob for token {token}")
            values.append(float(entry[0]))
        return values

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Non-streaming `/v1/chat/completions` with an OpenAI request body."""
        return await self._json("POST", "/v1/chat/completions", {**body, "stream": False})

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming `/v1/chat/completions`: yields each parsed `data:` chunk until [DONE]."""
        request = self._http.build_request("POST", "/v1/chat/completions",
                                           json={**body, "stream": True})
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"chat stream: engine timed out ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"chat stream: cannot reach {self.base_url} ({exc!r})"
                                    ) from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                _raise_for_status(response)
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk and "choices" not in chunk:
                    raise EngineServerError(f"chat stream: {_message_from(chunk)}")
                yield chunk
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"chat stream: engine timed out ({exc!r})") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"chat stream: connection lost ({exc!r})") from exc
        finally:
            await response.aclose()

    # ---- control --------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        return await self._json("GET", "/model_info")

    async def weight_version(self) -> str:
        version = (await self.model_info()).get("weight_version")
        if version is None:
            raise EngineProtocolError("/model_info has no weight_version")
        return str(version)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | int, *,
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """Load an HF checkpoint dir; in-flight requests drain first, none fail.

        Raises WeightUpdateFailed when the engine refuses (bad path, corrupt or incompatible
        checkpoint); the old weights keep serving then.
        """
        response = await self._request(
            "POST", "/update_weights_from_disk", check=False,
            json_body={"model_path": model_path, "weight_version": str(weight_version),
                       "abort_all_requests": abort_all_requests})
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "success" in body:
            if not body["success"]:
                raise WeightUpdateFailed(str(body.get("message", "")), status=response.status_code)
            return body
        _raise_for_status(response)
        raise EngineProtocolError("/update_weights_from_disk: answer lacks 'success'")

    async def adapters(self) -> set[str]:
        """The LoRA adapters the engine has loaded (`/v1/models` entries with a `parent`)."""
        data = (await self._json("GET", "/v1/models")).get("data") or []
        return {str(m["id"]) for m in data if isinstance(m, dict) and m.get("parent")}

    async def unload_lora_adapter(self, name: str) -> bool:
        """Unload a LoRA adapter (it waits for the requests using it); False when the engine
        does not have it."""
        response = await self._request("POST", "/unload_lora_adapter", check=False,
                                       json_body={"lora_name": name})
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "success" in body:
            if body["success"]:
                return True
            message = str(body.get("error_message", ""))
            if absent_adapter(message):
                return False
            raise EngineBadRequest(f"/unload_lora_adapter {name}: {message}",
                              status=response.status_code)
        _raise_for_status(response)
        raise EngineProtocolError("/unload_lora_adapter: answer lacks 'success'")

    async def pause(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> None:
        await self._json("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True when flushed; False when requests are running (the engine answers 400)."""
        response = await self._request("POST", "/flush_cache", check=False)
        if response.status_code == 400:
            return False
        _raise_for_status(response)
        return True

    async def health(self) -> Literal["ok", "busy"]:
        """"ok" (200) or "busy" (503: updating weights or paused); raises if unreachable."""
        response = await self._request("GET", "/health", check=False)
        if response.status_code == 503:
            return "busy"
        _raise_for_status(response)
        return "ok"


# The shared model's versions, when it learns as a LoRA adapter (trainer/policy_adapter.py),
# are loaded under these names: a new version, a new name, so no request sees a half-swapped
# adapter; the version is read back from the name (clawrl/eval/rounds.py).
POLICY_ADAPTER_PREFIX = "policy-v"


def policy_adapter_name(version: int) -> str:
    return f"{POLICY_ADAPTER_PREFIX}{version}"


def policy_adapter_version(name: str) -> int | None:
    """The shared-model version an adapter name stands for; None: not a shared-model adapter."""
    rest = name.removeprefix(POLICY_ADAPTER_PREFIX)
    return int(rest) if rest != name and rest.isdigit() else None


def absent_adapter(message: str) -> bool:
    """An engine's refusal that only says the adapter is not there (SGLang: "... does not
    exist ...", "... is not loaded"; `clawrl engine` says the same)."""
    lowered = message.lower()
    return "does not exist" in lowered or "not loaded" in lowered


def _message_from(chunk: dict[str, Any]) -> str:
    err = chunk.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)
