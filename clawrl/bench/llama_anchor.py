"""The llama.cpp side of `clawrl bench engine`'s anchor, run as a script by a python that has
pip's `llama-cpp-py-sync` (prebuilt llama.cpp CPU libraries, no compile):

    python clawrl/bench/llama_anchor.py THREADS MODEL.gguf [MODEL.gguf ...]

It imports nothing from clawrl (the anchor lives in its own virtualenv). It loads each model
once, prints `{"ready": ...}`, then answers one JSON line per JSON line read on stdin:

    {"model": 0, "prompts": [[ids], ...], "new": 64}
        greedy decode, every prompt its own sequence in one llama_decode batch per step (as
        llama.cpp's server batches concurrent requests); the prompts are prefilled together,
        each samples its first token, and the clock runs from then to the last step:
        -> {"seconds": s, "tokens": tokens generated after each first, "outputs": [[ids]]}
    {"model": 0, "prefill": [ids]}
        one prompt prefilled from an empty cache, logits of its last token only
        -> {"seconds": s}

Token ids go in and out (the engine and llama.cpp share SmolLM2's vocabulary), so both sides
run the very same prompts; EOS is not special (as the engine's `ignore_eos`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MAX_SEQS = 8
SEQ_CTX = 512  # per sequence, decode runs
PREFILL_CTX = 8192


class Runner:
    def __init__(self, path: str, threads: int) -> None:
        from cyllama.llama import llama_cpp as L

        self.L = L
        model_params = L.LlamaModelParams()
        model_params.n_gpu_layers = 0
        self.model = L.LlamaModel(path, model_params)
        # Two contexts: a batched one for decode (n_ctx is split across sequences) and a
        # long single-sequence one for prefill.
        self.batched = self._context(MAX_SEQS * SEQ_CTX, MAX_SEQS, threads)
        self.long = self._context(PREFILL_CTX, 1, threads)
        chain = L.LlamaSampler(L.LlamaSamplerChainParams())
        chain.add_greedy()
        self.greedy = chain

    def _context(self, n_ctx: int, seqs: int, threads: int) -> Any:
        params = self.L.LlamaContextParams()
        params.n_ctx = n_ctx
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_seq_max = seqs
        params.n_threads = threads
        params.n_threads_batch = threads
        return self.L.LlamaContext(self.model, params)

    def _decode(self, ctx: Any, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.L.LlamaBatch(n_tokens=len(tokens), embd=0, n_seq_max=1)
        for token, pos, seq, logits in tokens:
            batch.add(token, pos, [seq], logits)
        ctx.decode(batch)

    def generate(self, prompts: list[list[int]], new: int) -> dict[str, Any]:
        if not 1 <= len(prompts) <= MAX_SEQS:
            raise ValueError(f"1 to {MAX_SEQS} prompts, not {len(prompts)}")
        ctx = self.batched
        ctx.kv_cache_clear()
        entries = []
        for seq, ids in enumerate(prompts):
            entries += [(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)]
        self._decode(ctx, entries)
        # logits are numbered by batch entry: each prompt's last one
        ends = [sum(len(ids) for ids in prompts[:seq + 1]) - 1 for seq in range(len(prompts))]
        outputs = [[self.greedy.sample(ctx, end)] for end in ends]
        started = time.perf_counter()
        for _ in range(new - 1):
            self._decode(ctx, [(out[-1], len(ids) + len(out) - 1, seq, True)
                               for seq, (ids, out) in enumerate(zip(prompts, outputs,
                                                                    strict=True))])
            for seq, out in enumerate(outputs):
                out.append(self.greedy.sample(ctx, seq))
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "tokens": sum(len(o) - 1 for o in outputs),
                "outputs": outputs}

    def prefill(self, ids: list[int]) -> dict[str, Any]:
        ctx = self.long
        ctx.kv_cache_clear()
        started = time.perf_counter()
        for start in range(0, len(ids), 512):
            chunk = ids[start:start + 512]
            self._decode(ctx, [(t, start + i, 0, start + i == len(ids) - 1)
                               for i, t in enumerate(chunk)])
        self.greedy.sample(ctx, -1)
        return {"seconds": time.perf_counter() - started}


def main(argv: list[str]) -> int:
    threads, paths = int(argv[0]), argv[1:]
    import json as _json
    from importlib import resources

    from cyllama.llama import llama_cpp

    llama_cpp.disable_logging()
    llama_cpp.ggml_backend_load_all()
    runners = [Runner(path, threads) for path in paths]
    build = _json.loads(resources.files("cyllama").joinpath("build_config.json").read_text())
    print(json.dumps({"ready": build["versions"]["llama_cpp_version"]}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        runner = runners[request["model"]]
        if "prefill" in request:
            answer = runner.prefill(request["prefill"])
        else:
            answer = runner.generate(request["prompts"], request["new"])
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
