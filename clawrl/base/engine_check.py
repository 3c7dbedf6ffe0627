"""Does the engine return what clawrl needs? One probe per need, asked once at start.

    await check_engine(client, PROXY_NEEDS)   # raises EngineIncompatible with one line

The proxy, judge and trainer each call this with the needs they have, before serving. Every
need is checked on a real answer of the engine (one token, greedy); a missing field fails with
the field's name and the SGLang release that added it (docs/engine-protocol.md §1.5), because
an engine without it would store turns without ids or versions and nothing would ever train.
An engine that cannot be reached is not refused here (the callers wait for it as before);
only an engine that answers without the field is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from clawrl.base.engine_client import (
    EngineClient,
    EngineClientError,
    EngineTimeout,
    EngineUnavailable,
)

Need = Literal["chat_ids", "stream_ids", "weight_version", "teacher_logprobs"]

PROXY_NEEDS: tuple[Need, ...] = ("chat_ids", "stream_ids", "weight_version")
JUDGE_NEEDS: tuple[Need, ...] = ("chat_ids", "teacher_logprobs")
TRAINER_NEEDS: tuple[Need, ...] = ("weight_version",)

_PROBE: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 1, "temperature": 0, "logprobs": True}


class EngineIncompatible(Exception):
    """The engine answers without a field clawrl needs; the message is one line."""


def _missing(route: str, field: str, since: str) -> EngineIncompatible:
    return EngineIncompatible(f"the engine's {route} answer has no {field} "
                              f"(SGLang {since} or later has it; deploy/sglang.sh pins one)")


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) for i in value)


async def _chat_ids(client: EngineClient) -> None:
    data = await client.chat({**_PROBE, "return_token_ids": True})
    choice = (data.get("choices") or [{}])[0]
    route = "/v1/chat/completions"
    if not _int_list(choice.get("prompt_token_ids")):
        raise _missing(route, "choices[0].prompt_token_ids (return_token_ids)", "0.5.18")
    if not _int_list(choice.get("response_token_ids")):
        raise _missing(route, "choices[0].response_token_ids (return_token_ids)", "0.5.18")
    if not (choice.get("logprobs") or {}).get("content"):
        raise _missing(route, "choices[0].logprobs.content (logprobs)", "0.5.0")
    if (data.get("metadata") or {}).get("weight_version") is None:
        raise _missing(route, "metadata.weight_version", "0.5.4")


async def _stream_ids(client: EngineClient) -> None:
    sglext: dict[str, Any] = {}
    logprobs = False
    async for chunk in client.chat_stream({**_PROBE, "return_input_ids_in_sglext": True,
                                           "return_output_ids_in_sglext": True}):
        sglext.update(chunk.get("sglext") or {})
        for choice in chunk.get("choices") or []:
            logprobs = logprobs or bool((choice.get("logprobs") or {}).get("content"))
    route = "streamed /v1/chat/completions"
    if not _int_list(sglext.get("input_ids")):
        raise _missing(route, "sglext.input_ids (return_input_ids_in_sglext)", "0.5.20")
    outputs = sglext.get("output_ids")
    if not (isinstance(outputs, list) and outputs and _int_list(outputs[0])):
        raise _missing(route, "sglext.output_ids (return_output_ids_in_sglext)", "0.5.20")
    if not logprobs:
        raise _missing(route, "choices[0].logprobs.content in its chunks (logprobs)", "0.5.0")


async def _weight_version(client: EngineClient) -> None:
    if (await client.model_info()).get("weight_version") is None:
        raise _missing("/model_info", "weight_version", "0.5.4")


async def _teacher_logprobs(client: EngineClient) -> None:
    data = await client.chat({**_PROBE, "return_token_ids": True})
    prompt = (data.get("choices") or [{}])[0].get("prompt_token_ids")
    if not _int_list(prompt):
        raise _missing("/v1/chat/completions", "choices[0].prompt_token_ids", "0.5.18")
    # The judge's own request shape: prompt + response, scored from the prompt's last token.
    out = await client.generate(input_ids=[*prompt, prompt[-1]],
                                sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                logprob_start_len=len(prompt) - 1)
    entries = out["meta_info"].get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) != 2 or entries[1][0] is None:
        raise _missing("/generate", "meta_info.input_token_logprobs from logprob_start_len",
                       "0.5.0")


_CHECKS = {"chat_ids": _chat_ids, "stream_ids": _stream_ids, "weight_version": _weight_version,
           "teacher_logprobs": _teacher_logprobs}


async def check_engine(client: EngineClient, needs: Iterable[Need]) -> bool:
    """True when every need is met, False when the engine cannot be reached or does not
    answer in time (not judged: an engine busy with a stack's first requests is not an
    incompatible one); raises EngineIncompatible (one line) when it answers without what is
    needed."""
    try:
        for need in dict.fromkeys(needs):
            await _CHECKS[need](client)
    except (EngineUnavailable, EngineTimeout):
        return False
    except EngineClientError as exc:
        raise EngineIncompatible(f"the engine refused clawrl's {need} probe: "
                                 f"{exc.message}") from exc
    return True


def check_at_start(client: EngineClient, needs: Iterable[Need]) -> str | None:
    """What a process's `main` calls once before it starts, with the client it would use
    (closed here): None when the engine has what `needs` asks for (or cannot be reached, or
    answer, yet: the process waits for it as before), else the one line to print before
    exiting."""
    import asyncio

    async def run() -> None:
        async with client:
            await check_engine(client, needs)

    try:
        asyncio.run(run())
    except EngineIncompatible as exc:
        return f"the engine at {client.base_url} is not compatible: {exc}"
    return None
