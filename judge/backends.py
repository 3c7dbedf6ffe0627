"""Judge backends: any OpenAI-compatible chat endpoint, or the policy engine itself.

Both speak `POST {base_url}/chat/completions`; the policy engine (SGLang or `clawrl engine`)
is reached at `CLAWRL_ENGINE__URL` + `/v1`. Each backend has its own timeout and a semaphore
bounding its concurrent requests. This module is the one place where httpx errors and HTTP
error statuses of the judge endpoint become judge errors (`raise … from exc`):
no connection at all → BackendUnreachable (an outage: the job is put back uncounted),
timeout / dropped connection / 429 / 5xx → BackendUnavailable (transient), other 4xx →
BackendRejected (permanent) — or PromptTooLong when the 400 says the input is over the
context — and a 200 without a message → BadBackendResponse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from clawrl.base.settings import EngineSettings
from judge.config import JudgeSettings
from judge.errors import (
    CONNECT_FAILURES,
    BackendRejected,
    BackendUnavailable,
    BackendUnreachable,
    BadBackendResponse,
    PromptTooLong,
    says_too_long,
)
from judge.parse import storable

# The model name sent to (and stored for) a judge engine at CLAWRL_JUDGE__URL.
JUDGE_ENGINE_MODEL = "judge"


@dataclass(frozen=True)
class Completion:
    text: str
    # The judge as stored in judgments.judge_model: the API's model name, or
    # `policy@<weight_version>` when the policy engine judged (its version changes).
    label: str
    # With `top_logprobs`: each generated token and its most likely alternatives, as
    # OpenAI's `choices[0].logprobs.content` ([] when the endpoint returned none).
    tokens: list[dict[str, Any]] | None = None


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if not isinstance(body, dict):
        return str(body)[:300]
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))[:300]
    return str(err or body.get("message") or body)[:300]


async def post_json(client: httpx.AsyncClient, url: str, body: Mapping[str, Any], *,
                    what: str, headers: Mapping[str, str] | None = None) -> Any:
    """POST JSON and return the decoded body, translating every failure to a judge error."""
    try:
        response = await client.post(url, json=dict(body), headers=dict(headers or {}))
    except CONNECT_FAILURES as exc:
        raise BackendUnreachable(f"{what}: cannot connect to {url}: {exc}") from exc
    except httpx.TimeoutException as exc:
        raise BackendUnavailable(f"{what}: timed out ({url})") from exc
    except httpx.TransportError as exc:
        raise BackendUnavailable(f"{what}: cannot reach {url}: {exc}") from exc
    if response.status_code == 429 or response.status_code >= 500:
        raise BackendUnavailable(
            f"{what}: HTTP {response.status_code}: {_error_message(response)}")
    if response.status_code >= 400:
        message = f"{what}: HTTP {response.status_code}: {_error_message(response)}"
        if response.status_code == 400 and says_too_long(message):
            raise PromptTooLong(message)
        raise BackendRejected(message)
    try:
        return response.json()
    except ValueError as exc:
        raise BadBackendResponse(f"{what}: response is not JSON") from exc


class ChatBackend:
    """One OpenAI-compatible chat endpoint with its own concurrency limit."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, *, model: str | None,
                 api_key: str | None, concurrency: int) -> None:
        self.client = client
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model  # None: the policy engine (serves one model; the name is ignored)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.semaphore = asyncio.Semaphore(concurrency)

    async def complete(self, messages: Sequence[Mapping[str, Any]], *, temperature: float,
                       max_tokens: int, top_logprobs: int = 0) -> Completion:
        body: dict[str, Any] = {"model": self.model or "default", "messages": list(messages),
                                "temperature": temperature, "max_tokens": max_tokens,
                                "n": 1, "stream": False}
        if top_logprobs:
            body |= {"logprobs": True, "top_logprobs": top_logprobs}
        async with self.semaphore:
            data = await post_json(self.client, self.url, body, what="judge",
                                   headers=self.headers)
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise BadBackendResponse("judge: response has no choices[0].message") from exc
        text = message.get("content") if isinstance(message, dict) else None
        metadata = data.get("metadata") if isinstance(data, dict) else None
        version = metadata.get("weight_version") if isinstance(metadata, dict) else None
        if self.model is not None:
            label = self.model
        else:
            label = "policy" if version is None else f"policy@{version}"
        tokens = None
        if top_logprobs:
            logprobs = data["choices"][0].get("logprobs")
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            tokens = [t for t in content if isinstance(t, dict)] if isinstance(content, list) else []
        return Completion(text=storable(text) if isinstance(text, str) else "", label=label,
                          tokens=tokens)


def http_client(timeout_s: float, connect_timeout_s: float, *, max_connections: int,
                transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
        limits=httpx.Limits(max_connections=max_connections),
        transport=transport,
    )


def build_judge_backend(settings: JudgeSettings, engine: EngineSettings,
                        client: httpx.AsyncClient) -> ChatBackend:
    """The configured judge: an OpenAI-compatible API, the judge engine at `settings.url`,
    or (default) the policy engine."""
    if settings.backend == "openai":
        assert settings.openai.base_url is not None  # checked by JudgeSettings
        key = settings.openai.api_key
        return ChatBackend(client, settings.openai.base_url, model=settings.openai.model,
                           api_key=key.get_secret_value() if key else None,
                           concurrency=settings.backend_concurrency)
    key = engine.api_key
    if settings.url is not None:  # the judge engine: one frozen model
        judge_key = settings.api_key or key  # `clawrl up` gives both engines one key
        return ChatBackend(client, settings.url.rstrip("/") + "/v1", model=JUDGE_ENGINE_MODEL,
                           api_key=judge_key.get_secret_value() if judge_key else None,
                           concurrency=settings.backend_concurrency)
    return ChatBackend(client, engine.url.rstrip("/") + "/v1", model=None,
                       api_key=key.get_secret_value() if key else None,
                       concurrency=settings.backend_concurrency)
