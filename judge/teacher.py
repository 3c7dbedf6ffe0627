"""Teacher logprobs: how likely the served response is once the hint is in the context.

1. Teacher context = the turn's request messages with the hint appended to the last user
   message (judge/prompts.py `teacher_messages`), same tools as the turn.
2. Its token ids come from the engine itself: `/v1/chat/completions` with `max_tokens=1`
   and `return_token_ids` renders the policy's chat template exactly as it did for the turn
   and returns `prompt_token_ids` (no torch or tokenizer here; works on SGLang too).
3. `EngineClient.token_logprobs`: `/generate` with `input_ids = teacher_prompt + response_ids`, `max_new_tokens = 0`,
   `return_logprob`, `logprob_start_len = len(teacher_prompt) - 1`: the last len(response)
   entries of `meta_info.input_token_logprobs` are log p_teacher(response_t | teacher_prompt,
   response_<t), one per recorded response token. (SGLang's first entry from the start
   position is always null — position k is scored by the logits at k-1 — so starting one
   token early is what makes the first response token scored, not len(prompt).)

The teacher's logprobs are at temperature 1, whatever temperature the turn was sampled at:
the engine scores a prompt without sampling, and SGLang's input logprobs are untempered (it
tempers them only when patched). That is also what distillation wants: its fixed point is
the student's logits equal to the teacher's, independent of the temperature the model is
served at. The trainer compares them with the student's logprobs at T = 1 (docs/trainer.md,
"What was sampled is what is trained"), never with a tempered rollout logprob.

The teacher is the live policy engine by default (self-distillation) or a separate engine.
Too long for the model's context → no logprobs, with the reason (not an error).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from clawrl.base.engine_client import (
    EngineBadRequest,
    EngineClient,
    EngineClientError,
    EngineProtocolError,
)
from judge.errors import (
    CONNECT_FAILURES,
    BackendRejected,
    BackendUnavailable,
    BackendUnreachable,
    BadBackendResponse,
    PromptTooLong,
    says_too_long,
)
from judge.prompts import teacher_messages

T = TypeVar("T")

# Engines (SGLang, `clawrl engine`) name the context length in one of these /model_info keys.
_CONTEXT_KEYS = ("context_length", "max_context_length", "max_position_embeddings")


@dataclass(frozen=True)
class TeacherResult:
    logprobs: list[float] | None
    reason: str | None = None


class TeacherEngine:
    """The engine calls the teacher needs (through clawrl.base.engine_client), with the engine's
    errors translated to judge errors here, at one boundary."""

    def __init__(self, client: EngineClient, *, concurrency: int) -> None:
        self.client = client
        self.semaphore = asyncio.Semaphore(concurrency)
        self._context_length: int | None = None

    async def context_length(self) -> int | None:
        """The model's context length from `/model_info`, when the engine reports one."""
        if self._context_length is None:
            info = await self._call(self.client.model_info())
            for key in _CONTEXT_KEYS:
                value = info.get(key)
                if isinstance(value, int) and value > 0:
                    self._context_length = value
                    break
        return self._context_length

    async def prompt_ids(self, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
        body: dict[str, Any] = {"model": "default", "messages": list(messages),
                                "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        if tools:
            body["tools"] = list(tools)
        async with self.semaphore:
            data = await self._call(self.client.chat(body))
        try:
            ids = data["choices"][0]["prompt_token_ids"]
        except (KeyError, IndexError, TypeError) as exc:
            raise BadBackendResponse("teacher: chat response has no prompt_token_ids "
                                     "(does the engine support return_token_ids?)") from exc
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise BadBackendResponse("teacher: prompt_token_ids is not a list of ints")
        return ids

    async def token_logprobs(self, prompt_ids: Sequence[int],
                             response_ids: Sequence[int]) -> list[float]:
        """log p(response_ids[t] | prompt_ids + response_ids[:t]) for every t."""
        async with self.semaphore:
            return await self._call(self.client.token_logprobs(list(prompt_ids),
                                                               list(response_ids)))

    @staticmethod
    async def _call(call: Awaitable[T]) -> T:
        try:
            return await call
        except EngineBadRequest as exc:
            # The engine refuses an over-long input with a 400; that is a property of the
            # turn, not a failure of the job.
            if says_too_long(str(exc)):
                raise PromptTooLong(str(exc)) from exc
            if exc.status == 429:  # rate limited: try again later
                raise BackendUnavailable(f"teacher: {exc}") from exc
            raise BackendRejected(f"teacher: {exc}") from exc
        except EngineProtocolError as exc:
            raise BadBackendResponse(f"teacher: {exc}") from exc
        except EngineClientError as exc:  # unreachable, busy (503), timeout, 5xx
            if isinstance(exc.__cause__, CONNECT_FAILURES):
                raise BackendUnreachable(f"teacher: {exc}") from exc
            raise BackendUnavailable(f"teacher: {exc}") from exc


async def compute_teacher_logprobs(engine: TeacherEngine, *,
                                   request_messages: Sequence[Mapping[str, Any]],
                                   tools: Sequence[Mapping[str, Any]] | None, hint: str,
                                   response_ids: Sequence[int],
                                   prompt_version: str) -> TeacherResult:
    """Teacher logprobs aligned one-to-one with `response_ids`, or None with the reason."""
    if not response_ids:
        return TeacherResult(None, "teacher: empty response")
    try:
        messages = teacher_messages(request_messages, hint, prompt_version)
    except ValueError as exc:
        return TeacherResult(None, f"teacher: {exc}")
    try:
        prompt = await engine.prompt_ids(messages, tools)
        limit = await engine.context_length()
        total = len(prompt) + len(response_ids)
        if limit is not None and total > limit:
            return TeacherResult(None, f"teacher: prompt too long ({len(prompt)} + "
                                       f"{len(response_ids)} tokens > context {limit})")
        return TeacherResult(await engine.token_logprobs(prompt, response_ids))
    except PromptTooLong as exc:
        return TeacherResult(None, f"teacher: prompt too long ({exc})")
