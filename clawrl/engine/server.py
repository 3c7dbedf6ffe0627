"""HTTP routes of the embedded engine and `clawrl engine` (the subset of SGLang's server we use).

Run: `clawrl engine --model DIR [--host 127.0.0.1] [--port 30000] [--served-model-name NAME]`
(or `python -m clawrl.engine ...`). Routes, fields and shapes follow SGLang 0.5.x's
`srt/entrypoints/http_server.py`; docs/engine-protocol.md lists them.

Keys work as SGLang's: `--api-key` (default `$CLAWRL_ENGINE__API_KEY`, which `clawrl up`
generates) is required on every route but the health checks; the control
routes (weights, LoRA adapters, pause, abort, cache) take `--admin-api-key` instead
when it is given.
Without keys every route is open, so bind such an engine to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from clawrl.engine import chat
from clawrl.engine.lora import LoRAError
from clawrl.engine.metrics import engine_registry
from clawrl.engine.protocol import (
    ChatCompletionRequest,
    EngineError,
    GenerateRequest,
    check_bias_ids,
    describe,
    engine_failure,
    error_response,
    parse_json,
    sampling_from_dict,
    sse_error,
)
from clawrl.engine.runtime import Engine, WeightUpdateError, resolve_dtype
from clawrl.engine.scheduler import Sequence

# As SGLang's `decide_request_auth`: only health probes are open (/v1/models lists adapters).
_OPEN_ROUTES = {"/health", "/health_generate"}
# SGLang's admin routes (`@auth_level(AuthLevel.ADMIN_OPTIONAL)`): they change what is served.
CONTROL_ROUTES = frozenset({"/update_weights_from_disk", "/update_weight_version",
                            "/pause_generation", "/continue_generation", "/flush_cache",
                            "/abort_request", "/load_lora_adapter", "/unload_lora_adapter"})


def create_app(engine: Engine, *, api_key: str | None = None,
               admin_api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="clawrl engine", lifespan=lifespan)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.message, exc.status)

    if api_key or admin_api_key:
        app.add_middleware(_BearerAuth, api_key=api_key, admin_api_key=admin_api_key)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = parse_json(await request.body())
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise EngineError(describe(exc)) from exc
        for flag in ("input", "output"):
            if request.headers.get(f"x-sglext-return-{flag}-ids") == "1":
                setattr(req, f"return_{flag}_ids_in_sglext", True)
        seq = chat.prepare(engine, req, req.rid)
        await engine.check_adapter(seq.lora_name)
        await engine.constrain(seq)
        if req.stream:
            return StreamingResponse(chat.stream(engine, req, seq, request.is_disconnected),
                                     media_type="text/event-stream")
        return JSONResponse(await chat.complete(engine, req, seq, request.is_disconnected))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        base = engine.served_model_name
        cards = [{"id": base, "object": "model", "created": created, "owned_by": "sglang",
                  "root": base, "max_model_len": engine.context_len}]
        # SGLang lists loaded adapters after the base (`ModelCard` with `parent`).
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "sglang",
                   "root": path, "parent": base, "max_model_len": None}
                  for name, path in engine.adapters.listing().items()]
        return {"object": "list", "data": cards}

    @app.api_route("/generate", methods=["POST", "PUT"], response_model=None)
    async def generate(request: Request) -> Response:
        body = parse_json(await request.body())
        try:
            req = GenerateRequest.model_validate(body)
        except ValidationError as exc:
            raise EngineError(describe(exc)) from exc
        seqs, batched = _generate_seqs(engine, req)
        for name in {s.lora_name for s in seqs}:
            await engine.check_adapter(name)
        for seq in seqs:  # one matcher each (xgrammar caches the compiled grammar)
            await engine.constrain(seq)
        started = time.monotonic()
        if req.stream:
            if batched:
                raise EngineError("streaming a batch of prompts is not supported")
            return StreamingResponse(
                _generate_stream(engine, req, seqs[0], started, request.is_disconnected),
                media_type="text/event-stream")
        done = await asyncio.gather(*(engine.run(s, request.is_disconnected) for s in seqs))
        for seq in done:
            if (failure := engine_failure(seq.finish)) is not None:
                raise failure
        out = [_generate_body(engine, req, s, started) for s in done]
        return JSONResponse(out if batched else out[0])

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = parse_json(await request.body())
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str) or not path:
            return _update_result(False, "model_path (a model directory) is required")
        try:
            await engine.update_weights_from_disk(
                path, None if version is None else str(version),
                abort_all_requests=bool(body.get("abort_all_requests", False)))
        except WeightUpdateError as exc:
            return _update_result(False, str(exc))
        return _update_result(True, "Succeeded to update model weights.")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = parse_json(await request.body())
        if body.get("new_version") is None:
            raise EngineError("new_version is required")
        if body.get("abort_all_requests", True):
            engine.abort(None, abort_all=True)
        engine.scheduler.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {body['new_version']}"}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = parse_json(await request.body())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return _lora_result(engine, "lora_name and lora_path (strings) are required")
        try:
            await engine.adapters.load(name, path, pinned=bool(body.get("pinned", False)))
        except LoRAError as exc:
            return _lora_result(engine, str(exc))
        return _lora_result(engine)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = parse_json(await request.body())
        name = body.get("lora_name")
        if not isinstance(name, str):
            return _lora_result(engine, "lora_name must be provided to unload LoRA adapter")
        try:
            await engine.adapters.unload(name)
        except LoRAError as exc:
            return _lora_result(engine, str(exc))
        return _lora_result(engine)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        body = parse_json(await request.body() or b"{}")
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(f"mode must be 'abort', 'retract' or 'in_place', not {mode!r}")
        await engine.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        running, waiting = engine.scheduler.in_flight()
        if running or waiting:
            return PlainTextResponse("Cache not flushed: requests are running or queued.",
                                     status_code=400)
        await asyncio.wrap_future(engine.scheduler.call(engine.scheduler.prefix_cache.clear))
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = parse_json(await request.body())
        engine.abort(body.get("rid"), abort_all=bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    registry = engine_registry(engine)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        # Busy (weight update or pause) is 503 like SGLang's blocked probe; it is not dead.
        return Response(status_code=503 if engine.updating or engine.paused else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.updating or engine.paused:
            return Response(status_code=503)
        probe = Sequence(rid=f"HEALTH_CHECK_{time.time_ns()}",
                         input_ids=[next(iter(engine.eos_ids), 0)],
                         params=sampling_from_dict({"max_new_tokens": 1}))
        try:
            await asyncio.wait_for(engine.run(probe), timeout=20)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    return app


class _BearerAuth:
    """SGLang's key check as pure ASGI middleware (BaseHTTPMiddleware would hide client
    disconnects from streams): a control route wants the admin key when there is one, else
    the API key; any other route but the open ones wants the API key when there is one."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in _OPEN_ROUTES:
            wanted = self.api_key
            if path in CONTROL_ROUTES and self.admin_api_key is not None:
                wanted = self.admin_api_key
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"").removeprefix(b"Bearer ").strip()
            if wanted is not None and not hmac.compare_digest(given, wanted):
                await error_response("invalid API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _lora_result(engine: Engine, error: str | None = None) -> JSONResponse:
    """SGLang's `LoRAUpdateOutput`: 200 on success, 400 with `error_message` otherwise."""
    return JSONResponse({"success": error is None, "error_message": error or "",
                         "loaded_adapters": engine.adapters.listing()},
                        status_code=200 if error is None else 400)


def _update_result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, "num_paused_requests": 0},
                        status_code=200 if success else 400)


def _generate_seqs(engine: Engine, req: GenerateRequest) -> tuple[list[Sequence], bool]:
    """One Sequence per prompt; `batched` when the request gave a list of prompts."""
    if (req.text is None) == (req.input_ids is None):
        raise EngineError("Either text or input_ids should be provided (exactly one).")
    prompts: list[list[int]]
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [engine.encode(t) for t in texts]
    else:
        ids = req.input_ids or []
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batched else [list(ids)]  # type: ignore[arg-type]
    params = sampling_from_dict(req.sampling_params)
    check_bias_ids(params, engine.vocab_size)
    lora_names = req.lora_names(len(prompts))
    seqs = []
    for i, ids in enumerate(prompts):
        if any(not 0 <= t < engine.vocab_size for t in ids):
            raise EngineError(f"input_ids must be in [0, {engine.vocab_size})")
        chat.check_context(engine, len(ids), params.max_new_tokens)
        start = req.logprob_start_len
        if start >= len(ids):
            raise EngineError(f"logprob_start_len ({start}) must be smaller than the input "
                              f"length ({len(ids)})")
        # -1 means "output tokens only": SGLang then reports just the last prompt position.
        rid = req.rid if not batched else f"{req.rid or 'gen'}-{i}"
        seqs.append(Sequence(
            rid=rid or f"{time.time_ns():x}", input_ids=ids,
            params=dataclasses.replace(params, stop=list(params.stop),
                                       stop_token_ids=list(params.stop_token_ids)),
            return_logprob=req.return_logprob,
            logprob_start_len=len(ids) - 1 if start < 0 else start,
            top_logprobs_num=req.top_logprobs_num, lora_name=lora_names[i]))
    return seqs, batched


def _triples(engine: Engine, req: GenerateRequest, lps: list[float | None],
             ids: list[int]) -> list[list[Any]]:
    return [[lp, t, engine.token_text(t) if req.return_text_in_logprobs else None]
            for lp, t in zip(lps, ids, strict=True)]


def _generate_body(engine: Engine, req: GenerateRequest, seq: Sequence,
                   started: float) -> dict[str, Any]:
    n = len(seq.output_ids)
    spans = seq.weight_spans
    meta: dict[str, Any] = {
        "id": seq.rid, "finish_reason": seq.finish, "prompt_tokens": len(seq.input_ids),
        "completion_tokens": n, "cached_tokens": seq.cached_tokens,
        "weight_version": spans[-1]["version"] if spans else engine.weight_version,
        "e2e_latency": time.monotonic() - started,
    }
    if len(spans) > 1:
        meta["weight_versions"] = spans
    if req.return_logprob:
        start = seq.logprob_start_len
        meta["input_token_logprobs"] = _triples(engine, req, seq.input_logprobs,
                                                seq.input_ids[start:])
        meta["output_token_logprobs"] = _triples(engine, req, list(seq.output_logprobs[:n]),
                                                 seq.output_ids[:n])
        meta["output_token_logprobs_length"] = n
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if row is None else [[lp, t, None] for lp, t in row] for row in seq.input_top]
            meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in row]
                                           for row in seq.output_top[:n]]
    body = {"text": chat.visible_text(engine, seq, final=seq.finish is not None),
            "output_ids": list(seq.output_ids[:n]), "meta_info": meta}
    if req.return_prompt_token_ids:
        body["prompt_token_ids"] = list(seq.input_ids)
    return body


async def _generate_stream(engine: Engine, req: GenerateRequest, seq: Sequence,
                           started: float, disconnected: chat.Disconnected
                           ) -> AsyncIterator[str]:
    """SGLang's default (non-incremental) stream: every chunk is cumulative."""
    async for _ in engine.generate(seq, disconnected):
        if (failure := engine_failure(seq.finish)) is not None:
            yield sse_error(failure)
            break
        yield f"data: {json.dumps(_generate_body(engine, req, seq, started))}\n\n"
    yield "data: [DONE]\n\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="clawrl engine",
                                     description="serve a Hugging Face causal LM with the "
                                                 "subset of SGLang's HTTP API clawrl uses")
    parser.add_argument("--model", "--model-path", dest="model", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16", "auto"],
                        help="weights; auto: bfloat16 where the hardware computes in it "
                             "(CUDA, AVX-512 BF16, AMX), float32 elsewhere")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--speculative-algorithm", choices=["ngram"], default=None,
                        help="ngram: a lone greedy request drafts tokens from what the engine "
                             "wrote before and checks them in one forward pass (SGLang's flag)")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--prefix-cache-mb", type=float, default=1024,
                        help="memory for the KV of cached prompt prefixes (a request sharing "
                             "a prefix with an earlier one skips its prefill); 0 disables")
    parser.add_argument("--max-loaded-loras", type=int, default=None,
                        help="LoRA adapters resident at once; the least recently used "
                             "unpinned one is evicted past it (default: no bound)")
    parser.add_argument("--api-key", default=os.environ.get("CLAWRL_ENGINE__API_KEY") or None,
                        help="key for every route but health (default $CLAWRL_ENGINE__API_KEY)")
    parser.add_argument("--admin-api-key", default=None,
                        help="key for the control routes instead of --api-key")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"clawrl engine: {args.model} is not a Hugging Face model directory "
              "(no config.json)", file=sys.stderr)
        return 1
    if args.speculative_num_draft_tokens < 1:
        print("clawrl engine: --speculative-num-draft-tokens must be at least 1",
              file=sys.stderr)
        return 1
    if args.prefix_cache_mb < 0:
        print("clawrl engine: --prefix-cache-mb must be 0 (off) or more", file=sys.stderr)
        return 1
    if args.max_loaded_loras is not None and args.max_loaded_loras < 1:
        print("clawrl engine: --max-loaded-loras must be at least 1", file=sys.stderr)
        return 1
    import torch
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        engine = Engine(str(args.model), served_model_name=args.served_model_name,
                        weight_version=args.weight_version, device=device,
                        dtype=resolve_dtype(args.dtype, device), max_batch=args.max_batch,
                        max_loaded_loras=args.max_loaded_loras,
                        prefix_cache_mb=args.prefix_cache_mb,
                        speculative_draft_tokens=(args.speculative_num_draft_tokens
                                                  if args.speculative_algorithm else 0))
    except Exception as exc:  # a model that cannot load: one line, non-zero exit
        print(f"clawrl engine: cannot load {args.model}: {exc}", file=sys.stderr)
        return 1
    app = create_app(engine, api_key=args.api_key, admin_api_key=args.admin_api_key)
    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"clawrl engine: serving {args.model} on http://{args.host}:{args.port} "
          f"({device}, {dtype}, weight_version {engine.weight_version})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=5)
    return 0
