"""A stand-in engine for `clawrl bench proxy`: SGLang's chat completions shape, no model.

    python -m clawrl.bench.fake_engine --port 30999

Answers `/v1/chat/completions` like SGLang does for the proxy (docs/engine-protocol.md §1.2): token ids
(`prompt_token_ids`/`response_token_ids`, or the final `sglext` chunk when streaming),
`logprobs.content`, `metadata.weight_version`, usage. `/model_info` and `/health` answer
too. How long a reply takes is set at run time with `POST /bench/config
{"tokens": 200, "reply_s": 2.0, "slots": 8}`: the tokens are spread evenly over `reply_s`
(streamed as one chunk each), and `reply_s = 0` answers at once; `slots` > 0 serves at most
that many requests at a time, the others wait in arrival order (an engine's batch slots;
0: no limit). `{"token_s": 0.005}` instead makes each reply as long as its request's
`max_tokens` (else `tokens`) at that many seconds per token: long generations take longer
(a bounded batch with per-token time). `CLAWRL_BENCH_SLOTS` and `CLAWRL_BENCH_CONTEXT` set
the slots and a context length at start; `/model_info` reports them as
`max_running_requests` and `context_length` (as the embedded engine reports its context).
`GET /bench/stats` counts the chat requests that reached it. `{"tool_command": "ls"}` makes it an agent (`clawrl bench env`, the env
pool's tests): a non-streamed request with tools whose last message is not a tool result is
answered with one call `run({"command": "ls"})`, one after a tool result with text (`""`:
off); `{"tool_name": "run_tests"}` calls that tool instead (the SWE track's, which ignores the
command). For benchmarks and for tests that need an engine taking a fixed time per request (fair
share, faults); tests of what the proxy answers use the real embedded engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CONFIG: dict[str, float] = {"tokens": 16, "reply_s": 0.0, "slots": 0, "token_s": 0.0,
                            "context": 0}
_SLOTS: list[asyncio.Semaphore | None] = [None]  # set by /bench/config
STATS = {"chat_requests": 0}
PROMPT_IDS = list(range(1, 33))
WEIGHT_VERSION = "0"
TOOL_COMMAND = [""]  # set by /bench/config {"tool_command": ...}
TOOL_NAME = ["run"]  # set by /bench/config {"tool_name": ...}


def _logprob(token: int) -> dict[str, Any]:
    return {"token": "x", "bytes": [120], "logprob": -0.5, "top_logprobs": []}


async def chat(request: Request) -> Response:
    body = await request.json()
    STATS["chat_requests"] += 1
    slots = _SLOTS[0]
    if slots is None:
        return await _chat(body)
    await slots.acquire()  # waiters are woken in arrival order
    try:
        response = await _chat(body)
    except BaseException:
        slots.release()
        raise
    if not isinstance(response, StreamingResponse):
        slots.release()
        return response
    response.body_iterator = _releasing(response.body_iterator, slots)
    return response


async def _releasing(chunks: AsyncIterable[Any], slots: asyncio.Semaphore
                     ) -> AsyncIterator[Any]:
    """A stream that holds its slot until it ends (or the client leaves)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        slots.release()


def _reply_tokens(body: dict[str, Any]) -> tuple[int, float]:
    """How many tokens the reply has and how long it takes in all."""
    if CONFIG["token_s"] > 0:
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        tokens = asked if isinstance(asked, int) and asked > 0 else int(CONFIG["tokens"])
        return tokens, tokens * CONFIG["token_s"]
    return int(CONFIG["tokens"]), CONFIG["reply_s"]


async def _chat(body: dict[str, Any]) -> Response:
    tokens, reply_s = _reply_tokens(body)
    response_ids = [100 + i % 50 for i in range(tokens)]
    created = int(time.time())
    if not body.get("stream"):
        if reply_s > 0:
            await asyncio.sleep(reply_s)
        message: dict[str, Any] = {"role": "assistant", "content": "x" * tokens}
        messages = body.get("messages") or [{}]
        if TOOL_COMMAND[0] and body.get("tools") and messages[-1].get("role") != "tool":
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call-{created}", "type": "function", "function": {
                    "name": TOOL_NAME[0],
                    "arguments": json.dumps({"command": TOOL_COMMAND[0]})}}]}
        return JSONResponse({
            "id": "chatcmpl-bench", "object": "chat.completion", "created": created,
            "model": body.get("model", "bench"),
            "choices": [{"index": 0,
                         "finish_reason": "tool_calls" if "tool_calls" in message else "stop",
                         "message": message,
                         "logprobs": {"content": [_logprob(t) for t in response_ids]},
                         "prompt_token_ids": PROMPT_IDS, "response_token_ids": response_ids}],
            "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": tokens,
                      "total_tokens": len(PROMPT_IDS) + tokens},
            "metadata": {"weight_version": WEIGHT_VERSION}})
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_stream(body, response_ids, created, include_usage, reply_s),
                             media_type="text/event-stream")


async def _stream(body: dict[str, Any], response_ids: list[int], created: int,
                  include_usage: bool, reply_s: float) -> AsyncIterator[bytes]:
    gap = reply_s / max(1, len(response_ids))
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": created,
            "model": body.get("model", "bench")}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                  "finish_reason": None}])
    start = time.monotonic()
    for i, token in enumerate(response_ids):
        if gap > 0:  # pace against the clock, so the reply takes reply_s in total
            await asyncio.sleep(max(0.0, start + (i + 1) * gap - time.monotonic()))
        yield event([{"index": 0, "delta": {"content": "x"},
                      "logprobs": {"content": [_logprob(token)]}, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
    yield event([], sglext={"input_ids": PROMPT_IDS, "output_ids": [response_ids]})
    if include_usage:
        n = len(response_ids)
        yield event([], usage={"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n,
                               "total_tokens": len(PROMPT_IDS) + n})
    yield b"data: [DONE]\n\n"


async def configure(request: Request) -> Response:
    body = await request.json()
    CONFIG.update({k: float(v) for k, v in body.items() if k in CONFIG})
    TOOL_COMMAND[0] = str(body.get("tool_command", TOOL_COMMAND[0]))
    TOOL_NAME[0] = str(body.get("tool_name", TOOL_NAME[0]))
    _SLOTS[0] = asyncio.Semaphore(int(CONFIG["slots"])) if CONFIG["slots"] > 0 else None
    return JSONResponse(CONFIG)


async def model_info(request: Request) -> Response:
    info: dict[str, Any] = {"model_path": "bench", "served_model_name": "bench",
                            "weight_version": WEIGHT_VERSION, "is_generation": True}
    if CONFIG["slots"] > 0:
        info["max_running_requests"] = int(CONFIG["slots"])
    if CONFIG["context"] > 0:
        info["context_length"] = int(CONFIG["context"])
    return JSONResponse(info)


async def stats(request: Request) -> Response:
    return JSONResponse(STATS)


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": "bench", "object": "model", "created": 0, "owned_by": "clawrl"}]})


async def health(request: Request) -> Response:
    return Response(status_code=200)


app = Starlette(routes=[
    Route("/v1/chat/completions", chat, methods=["POST"]),
    Route("/bench/config", configure, methods=["POST"]),
    Route("/model_info", model_info), Route("/v1/models", models), Route("/health", health),
    Route("/bench/stats", stats),
])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m clawrl.bench.fake_engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30999)
    args = p.parse_args(argv)
    CONFIG["slots"] = float(os.environ.get("CLAWRL_BENCH_SLOTS", "0") or 0)
    CONFIG["context"] = float(os.environ.get("CLAWRL_BENCH_CONTEXT", "0") or 0)
    if CONFIG["slots"] > 0:  # bound to the server's loop at first use
        _SLOTS[0] = asyncio.Semaphore(int(CONFIG["slots"]))
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
