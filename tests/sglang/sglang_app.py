"""SGLang's own HTTP serving code (the release deploy/sglang-contract.txt pins), over a stand-in
scheduler, for the contract tests in this folder.

    python tests/sglang/sglang_app.py --model DIR --scheduler URL --port P [--weight-version V]

What runs is SGLang's: its route functions from `sglang.srt.entrypoints.http_server`
(`/v1/chat/completions`, `/generate` with its request-schema check, `/update_weights_from_disk`,
`/model_info`), `OpenAIServingChat` (chat template, tool-call parser, response and stream
building), and its `TokenizerManager` (request normalisation, tokenisation, request state,
`_handle_batch_output`, which builds `meta_info`, and the response wait loop).

What stands in is only the part that needs a GPU: the scheduler + detokenizer processes behind
SGLang's ZMQ sockets. `_dispatch_to_scheduler` receives the tokenized request SGLang would send
over ZMQ, has `clawrl engine` at `--scheduler` compute the tokens (native `/generate` with the same
input ids and sampling parameters, greedy in the tests) and hands the results back token by token
as SGLang's own `BatchStrOutput` messages, the way its detokenizer does; a weight update is
forwarded to the same engine and answered with SGLang's `UpdateWeightFromDiskReqOutput`.

Runs in its own process (tests start it with subprocess) so that SGLang's import-time patches to
transformers never reach the test process.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.machinery
import importlib.util
import logging
import sys
import types
import warnings
from array import array
from typing import Any

import httpx


class _Missing:
    """What a name from the torchvision stand-in is: importable, unusable."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def _stand_in_torchvision() -> None:
    """SGLang's config package imports torchvision for image models (InternVL) at import time;
    PyPI's torchvision fails to import beside the CPU torch build. The chat text path never
    uses it, so an importable placeholder is enough. transformers is asked first, so it keeps
    seeing torchvision as absent."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the placeholder exists
    import_utils.is_torchvision_v2_available()

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []

        def getattr_(attr: str, _name: str = name) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Missing(f"{_name}.{attr}")

        mod.__getattr__ = getattr_  # type: ignore[method-assign]
        return mod

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
             "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
    for name in names:
        sys.modules[name] = module(name)


def build_app(model: str, scheduler_url: str, weight_version: str,
              tool_call_parser: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _stand_in_torchvision()
        import sglang.srt.entrypoints.http_server as hs
        from fastapi import FastAPI
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.managers import io_struct
        from sglang.srt.managers.schedule_batch import (
            FINISH_LENGTH,
            FINISH_MATCHED_STR,
            FINISH_MATCHED_TOKEN,
        )
        from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
        from sglang.srt.parser.template_manager import TemplateManager
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

    engine = httpx.AsyncClient(base_url=scheduler_url, timeout=120.0)

    class StandInSchedulerTokenizerManager(TokenizerManager):
        """SGLang's TokenizerManager with the scheduler's side of its ZMQ sockets replaced."""

        def init_ipc_channels(self, port_args: Any) -> None:
            self.tasks: set[asyncio.Task[None]] = set()

        def auto_create_handle_loop(self) -> None:
            """No receive loop: the stand-in scheduler calls `_handle_batch_output` itself."""

        def _dispatch_to_scheduler(self, obj: Any) -> None:
            if isinstance(obj, io_struct.TokenizedGenerateReqInput):
                job = self._run_generate(obj)
            elif isinstance(obj, io_struct.UpdateWeightFromDiskReqInput):
                job = self._run_update(obj)
            else:
                raise NotImplementedError(f"stand-in scheduler: {type(obj).__name__}")
            task = asyncio.get_running_loop().create_task(job)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        async def _run_update(self, obj: Any) -> None:
            reply = await engine.post("/update_weights_from_disk", json={
                "model_path": obj.model_path, "weight_version": obj.weight_version})
            body = reply.json()
            self.model_update_result.set_result(io_struct.UpdateWeightFromDiskReqOutput(
                success=bool(body.get("success")), message=str(body.get("message", "")),
                num_paused_requests=0, rid=obj.rid))

        async def _run_generate(self, obj: Any) -> None:
            sp = obj.sampling_params
            params: dict[str, Any] = {"max_new_tokens": sp.max_new_tokens,
                                      "temperature": sp.temperature, "top_p": sp.top_p}
            if 0 < sp.top_k < 1 << 30:  # SGLang turns temperature 0 into top_k=1
                params["top_k"] = sp.top_k
            if sp.stop_token_ids:
                params["stop_token_ids"] = sorted(sp.stop_token_ids)
            if sp.stop_strs:
                params["stop"] = list(sp.stop_strs)
            for key in ("json_schema", "regex", "ebnf", "structural_tag"):  # SGLang's grammar
                if getattr(sp, key, None) is not None:
                    params[key] = getattr(sp, key)
            reply = await engine.post("/generate", json={
                "input_ids": list(obj.input_ids), "sampling_params": params,
                "return_logprob": True, "logprob_start_len": obj.logprob_start_len})
            reply.raise_for_status()
            out = reply.json()
            await self._emit(obj, out)

        async def _emit(self, obj: Any, out: dict[str, Any]) -> None:
            """Hand the engine's result back as the detokenizer does: one BatchStrOutput per
            new token (the last one carries the finish reason), then the input logprobs."""
            meta = out["meta_info"]
            ids: list[int] = list(out["output_ids"])
            out_lps = meta.get("output_token_logprobs") or []
            in_lps = meta.get("input_token_logprobs") or []
            finish = _finish_reason(meta["finish_reason"])
            steps = max(len(ids), 1)
            for step in range(steps):
                last = step == steps - 1
                delta = ids[step:step + 1]
                text = (self.tokenizer.decode(ids[:step + 1]) if delta else "")
                before = self.tokenizer.decode(ids[:step]) if step else ""
                if last:
                    text = out["text"]  # the engine's own stop-trimmed text
                first = step == 0
                lps = out_lps[step:step + 1] if delta else []
                await self._handle_batch_output(io_struct.BatchStrOutput(
                    rids=[obj.rid], finished_reasons=[finish if last else None],
                    output_strs=[text[len(before):] if text.startswith(before) else text],
                    output_ids=[array("l", delta)],
                    prompt_tokens=[len(obj.input_ids)], completion_tokens=[step + len(delta)],
                    reasoning_tokens=[0], cached_tokens=[0],
                    input_token_logprobs_val=[[e[0] for e in in_lps]] if first else [None],
                    input_token_logprobs_idx=[[e[1] for e in in_lps]] if first else [None],
                    output_token_logprobs_val=[[e[0] for e in lps]],
                    output_token_logprobs_idx=[[e[1] for e in lps]],
                    input_top_logprobs_val=None, input_top_logprobs_idx=None,
                    output_top_logprobs_val=None, output_top_logprobs_idx=None,
                    input_token_ids_logprobs_val=None, input_token_ids_logprobs_idx=None,
                    output_token_ids_logprobs_val=None, output_token_ids_logprobs_idx=None,
                    output_token_entropy_val=None, output_token_sampling_mask=None,
                    output_hidden_states=None, routed_experts=None, indexer_topk=None,
                    placeholder_tokens_idx=None, placeholder_tokens_val=None,
                    retraction_counts=[0]))
                await asyncio.sleep(0)

    def _finish_reason(reason: dict[str, Any]) -> dict[str, Any]:
        """The engine's finish reason as SGLang's scheduler writes it (its own classes)."""
        if reason.get("type") == "length":
            return FINISH_LENGTH(length=int(reason.get("length", 0))).to_json()
        matched = reason.get("matched")
        if isinstance(matched, int):
            return FINISH_MATCHED_TOKEN(matched=matched).to_json()
        return FINISH_MATCHED_STR(matched=str(matched)).to_json()

    server_args = ServerArgs(model_path=model, device="cpu", tool_call_parser=tool_call_parser,
                             weight_version=weight_version)
    publish(server_args, role="tokenizer")
    manager = StandInSchedulerTokenizerManager(server_args, None)
    manager.server_status = ServerStatus.Up
    templates = TemplateManager()
    templates.initialize_templates(tokenizer_manager=manager, model_path=model)
    hs.set_global_state(hs._GlobalState(tokenizer_manager=manager, template_manager=templates,
                                        scheduler_info={}))

    app = FastAPI()
    app.router.route_class = hs.ORJSONRoute
    app.state.openai_serving_chat = OpenAIServingChat(manager, templates)
    # SGLang's own route functions, as http_server.py registers them.
    app.add_api_route("/v1/chat/completions", hs.openai_v1_chat_completions, methods=["POST"],
                      dependencies=[hs.Depends(hs.validate_json_request)])
    app.add_api_route("/generate", hs.generate_request, methods=["POST", "PUT"],
                      response_class=hs.SGLangORJSONResponse)
    app.add_api_route("/update_weights_from_disk", hs.update_weights_from_disk,
                      methods=["POST"])
    app.add_api_route("/model_info", hs.model_info, methods=["GET"])

    @app.get("/health")
    async def health() -> dict[str, str]:  # SGLang's runs a 1-token generate; plain here
        return {}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--scheduler", required=True, help="clawrl engine base URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--tool-call-parser", default="qwen")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    app = build_app(args.model, args.scheduler, args.weight_version, args.tool_call_parser)
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
