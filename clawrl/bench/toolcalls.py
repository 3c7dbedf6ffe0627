"""`clawrl bench toolcalls`: whether a model calls a tool on its own (`tool_choice: "auto"`)
under the sampling the engine serves it with, on SmolLM2-135M-Instruct by default.

    clawrl bench toolcalls [--model DIR] [--adapter DIR] [--threads N] [--samples 20]
                           [--max-tokens 64] [--temperature T] [--request FILE[:LINE] ...]
                           [--template FILE ...]

The engine (clawrl/engine/runtime.py) runs in this process, as `clawrl engine` runs it,
without HTTP in between. Without `--model`, the model is pulled once into
.clawrl/bench-cache/smollm2-135m. `--adapter DIR`: a trained version of a model that learns as a
LoRA adapter (a `weights/vNNNNNN/` folder, trainer/policy_adapter.py), merged into `--model`
in a temporary folder, so the figures are those of the version the engine serves. Prompts: "What's the weather in Paris?" with a
`get_weather` tool, "List the files in my home directory." with an `exec` tool, and each
`--request`: a chat-completions body an agent sent (a JSON object, or one line of a JSONL
file of bodies or of `{"body": …}` records such as tests/proxy/data/openclaw-2026.9.6.jsonl).

Each prompt is rendered as the engine renders it (`engine`: the model's template, or for a
template that cannot render tools clawrl/engine/tools.py's Hermes format) and with each
`--template`: a file whose text, with `{tools}` replaced by the offered tools as one JSON
list, goes before the request's own system prompt (a model card's function-calling prompt,
say). For each prompt and rendering:

1. `P(open)`: the exact probability, under the engine's sampling (generation_config's
   temperature / top_p / top_k, or `--temperature`), that the reply opens with
   `<tool_call>` as the tokenizer writes it, teacher-forced; and `first`: the probability
   that its first token is any token `<tool_call>` can start with (an upper bound on an
   opening call, however tokenized: 0 means no seed ever opens a call). `T=1`: P(open) from
   the model's raw distribution.
2. `calls`: of `--samples` replies (seeds 0, 1, …, `--max-tokens` each), how many hold a call
   to an offered tool that the engine's parser reads (clawrl/engine/chat.py
   `parse_tool_calls`: `<tool_call>` JSON, one object or a list), and how many hold a
   `<tool_call>` tag that does not parse into one (the first few are printed); the seeds of
   the first calls, which reproduce them through the proxy (it passes `seed`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from clawrl.bench.engine import CACHE_DIR, model_bench_parser
from clawrl.engine.chat import (
    TOOL_OPEN,
    normalise_message,
    parse_tool_calls,
    prepare,
    prompt_ids,
    visible_text,
)
from clawrl.engine.protocol import ChatCompletionRequest
from clawrl.engine.runtime import Engine
from clawrl.engine.scheduler import SamplingParams, is_greedy, sampling_distribution
from clawrl.engine.tools import render_tool_messages

PROG = "clawrl bench toolcalls"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {
        "type": "string", "description": "The city name"}}, "required": ["city"]}}}
EXEC = {"type": "function", "function": {
    "name": "exec", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {
        "type": "string", "description": "The shell command to run"}}, "required": ["command"]}}}
PROMPTS: dict[str, dict[str, Any]] = {
    "weather": {"messages": [{"role": "user", "content": "What's the weather in Paris?"}],
                "tools": [WEATHER]},
    "files": {"messages": [{"role": "user", "content": "List the files in my home directory."}],
              "tools": [EXEC]},
}


def read_request(spec: str) -> tuple[str, dict[str, Any]]:
    """`FILE` (a JSON body) or `FILE:LINE` (1-based line of a JSONL file) -> (name, body)."""
    path, line = spec, ""
    head, _, tail = spec.rpartition(":")
    if head and tail.isdigit():
        path, line = head, tail
    text = Path(path).read_text()
    raw = json.loads(text.splitlines()[int(line) - 1] if line else text)
    body: dict[str, Any] = raw.get("body", raw)
    if not body.get("tools"):
        raise SystemExit(f"{spec}: the request offers no tools")
    return f"{Path(path).stem}:{line}" if line else Path(path).stem, body


def template_ids(engine: Engine, body: dict[str, Any], template: str) -> list[int]:
    """The request rendered with `template` (its `{tools}` the offered tools as one JSON
    list) before the request's own system prompt; tool history as the engine renders it."""
    messages = render_tool_messages(
        [normalise_message(i, m) for i, m in enumerate(body["messages"])], None)
    block = template.replace("{tools}", json.dumps(body["tools"], ensure_ascii=False))
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": f"{block}\n\n{messages[0]['content']}"}
    else:
        messages.insert(0, {"role": "system", "content": block})
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    return engine.encode(str(text))


def opening(engine: Engine, ids: list[int], params: SamplingParams,
            starts: list[int]) -> tuple[float, float, float]:
    """(P(open) under `params`, P(first token can start `<tool_call>`), P(open) at T=1)."""
    opener = engine.encode(TOOL_OPEN)
    with torch.no_grad():
        logits = engine.scheduler.model(input_ids=torch.tensor([ids + opener])).logits[0]
    steps = logits[len(ids) - 1:-1].float()
    engine_p, raw_p, first = 1.0, 1.0, 0.0
    for i, token in enumerate(opener):
        if is_greedy(params):
            dist = torch.nn.functional.one_hot(steps[i].argmax(), steps.shape[-1]).float()
        else:
            dist = sampling_distribution(steps[i], params)
            dist = dist / dist.sum()
        if i == 0:
            first = float(dist[starts].sum())
        engine_p *= float(dist[token])
        raw_p *= float(torch.softmax(steps[i], -1)[token])
    return engine_p, first, raw_p


async def sample(engine: Engine, body: dict[str, Any], ids: list[int], args: Any
                 ) -> list[tuple[str, list[dict[str, Any]]]]:
    """`args.samples` replies (seeds 0, 1, …) and the calls the engine's parser reads."""
    async def one(seed: int) -> tuple[str, list[dict[str, Any]]]:
        req = ChatCompletionRequest(
            messages=body["messages"], tools=body["tools"], tool_choice="auto", input_ids=ids,
            max_tokens=args.max_tokens, seed=seed, temperature=args.temperature)
        seq = prepare(engine, req, f"bench-{seed}")
        await engine.run(seq)
        text = visible_text(engine, seq, final=True)
        return text, parse_tool_calls(text, body["tools"])[1]

    return list(await asyncio.gather(*(one(s) for s in range(args.samples))))


async def measure(engine: Engine, prompts: dict[str, dict[str, Any]],
                  templates: dict[str, str | None], args: Any) -> None:
    starts = [i for i in range(engine.vocab_size)
              if (piece := engine.token_text(i)) and TOOL_OPEN.startswith(piece)]
    for name, body in prompts.items():
        for rendering, template in templates.items():
            req = ChatCompletionRequest(messages=body["messages"], tools=body["tools"],
                                        temperature=args.temperature)
            ids = prompt_ids(engine, req) if template is None else \
                template_ids(engine, body, template)
            p_open, first, raw = opening(engine, ids, req.sampling(engine.generation_defaults),
                                         starts)
            started = time.perf_counter()
            replies = await sample(engine, body, ids, args)
            called = [seed for seed, (_, calls) in enumerate(replies) if calls]
            unread = [text for text, calls in replies if not calls and TOOL_OPEN in text]
            common, times = Counter(text for text, _ in replies).most_common(1)[0]
            seeds = f" (seeds {', '.join(map(str, called[:5]))})" if called else ""
            print(f"{name} / {rendering}: {len(ids)} prompt tokens; P(open) {p_open:.2g}, "
                  f"first {first:.2g}, T=1 {raw:.2g}; calls {len(called)}/{len(replies)}"
                  f"{seeds}, tags without a call {len(unread)}; "
                  f"{time.perf_counter() - started:.0f} s; most common reply (x{times}): "
                  f"{common[:80]!r}", flush=True)
            for seed in called[:3]:
                print(f"  seed {seed}: {json.dumps(replies[seed][1])[:200]}", flush=True)
            for text in unread[:3]:
                print(f"  unread: {text[text.index(TOOL_OPEN):][:160]!r}", flush=True)


def merge_adapter(model_dir: Path, adapter: Path, out: Path) -> Path:
    """`model_dir` with the PEFT adapter in `adapter` merged in, written to `out` (the base's
    tokenizer, template and generation_config beside it): a plain model directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not (adapter / "adapter_config.json").is_file():
        raise SystemExit(f"--adapter {adapter}: no adapter_config.json (not a PEFT adapter)")
    for path in model_dir.iterdir():  # everything but the weights
        if path.is_file() and path.suffix not in (".safetensors", ".bin", ".gguf"):
            shutil.copy2(path, out / path.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # peft 0.21 calls a transformers API deprecated in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str]) -> int:
    parser = model_bench_parser(PROG, __doc__ or "")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None,
                        help="instead of the model's generation_config")
    parser.add_argument("--request", action="append", default=[], metavar="FILE[:LINE]")
    parser.add_argument("--template", action="append", default=[], type=Path)
    parser.add_argument("--no-builtin", action="store_true", help="only the --request prompts")
    parser.add_argument("--adapter", type=Path, default=None,
                        help="a LoRA version folder to merge into the model first")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from clawrl.engine.pretrained import pull_model

    model_dir = args.model or pull_model("smollm2-135m", CACHE_DIR)
    with tempfile.TemporaryDirectory(prefix="clawrl-toolcalls-") as merged:
        if args.adapter is not None:
            model_dir = merge_adapter(Path(model_dir), args.adapter, Path(merged))
        return run(model_dir, args)


def run(model_dir: Path, args: Any) -> int:
    """Measure every prompt and rendering on the engine serving `model_dir`."""
    engine = Engine(str(model_dir), max_batch=8, prefix_cache_mb=512)
    prompts = {} if args.no_builtin else dict(PROMPTS)
    prompts.update(read_request(spec) for spec in args.request)
    templates: dict[str, str | None] = {"engine": None}
    templates.update((t.stem, t.read_text()) for t in args.template)
    tools = "its template" if engine.renders_tools else "the Hermes format (clawrl/engine/tools.py)"
    sampling = engine.generation_defaults if args.temperature is None else {
        "temperature": args.temperature}
    adapter = f" + {args.adapter}" if args.adapter is not None else ""
    print(f"{PROG}: {args.model or model_dir}{adapter}, tools rendered by {tools}, "
          f"sampling {sampling}, "
          f"{args.samples} samples of {args.max_tokens} tokens", flush=True)
    engine.start()
    try:
        asyncio.run(measure(engine, prompts, templates, args))
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
