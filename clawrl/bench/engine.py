"""`clawrl bench engine`: the embedded engine's decode speed and its prefix cache, on
SmolLM2-135M-Instruct (the real model `clawrl models pull smollm2-135m` makes), against
llama.cpp on the same model and cores.

    clawrl bench engine [--model DIR] [--threads N] [--reps 3] [--prefix-tokens 4096]
                        [--suffix-tokens 32] [--new-tokens 64] [--prefix-cache-mb 1024]
                        [--anchor-python PY | --no-anchor]

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
3. The anchor: llama.cpp (pip's `cyllama`, a prebuilt wheel of llama.cpp b9190, no compile;
   clawrl/bench/llama_anchor.py drives it in a child process under `--anchor-python`) on
   the same model, the same thread count, the same prompt token ids, the same number of
   greedy new tokens, the same clock (first token to last), interleaved with the engine
   repetition by repetition; the ratio is the median of the paired per-repetition ratios.
   Two files: the float32 GGUF of the very weights the engine runs (the shipped Q4_1 file
   dequantized, as `models pull` does, written once to .clawrl/bench-cache/), and the
   shipped Q4_1 file itself (llama.cpp reads ~4.5 bits a weight where float32 reads 32).
   Concurrent requests are one sequence each in one llama_decode batch per step, as
   llama.cpp's server batches them. Also timed: llama.cpp's prefill of the same
   `--prefix-tokens` prompt (float32). And always the memory-bandwidth ceiling of float32
   batch-1 decode: every step reads every weight once, so tokens/s can be at most (bytes
   copied per second by torch) / (bytes of weights) (a rough one: caches hold part of it).
Without the anchor installed the bench says, in one line, how to install it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import torch

from clawrl.bench.args import OneLineParser
from clawrl.engine.prefix_cache import PrefixCache
from clawrl.engine.pretrained import DONE_MARKER, gguf_path, pull_model
from clawrl.engine.runtime import load_model
from clawrl.engine.scheduler import SamplingParams, Scheduler, Sequence

PROG = "clawrl bench engine"
CACHE_DIR = Path(".clawrl") / "bench-cache" / "smollm2-135m"
F32_GGUF = CACHE_DIR.with_name("smollm2-135m-f32.gguf")
ANCHOR_PACKAGE = "cyllama==0.2.18"
ANCHOR_SCRIPT = Path(__file__).with_name("llama_anchor.py")
PROMPT_TOKENS = 16


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


def decode_rate(scheduler: Scheduler, prompts: list[list[int]],
                new_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy decode of every prompt at once: tokens/s after the first tokens, and the ids."""
    seqs = [Sequence(rid=f"d{i}", input_ids=list(ids),
                     params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                           ignore_eos=True)) for i, ids in enumerate(prompts)]
    seconds = run_timed(scheduler, seqs)
    return sum(len(s.output_ids) - 1 for s in seqs) / seconds, [s.output_ids for s in seqs]


def random_prompts(n: int, length: int, rng: torch.Generator, vocab: int) -> list[list[int]]:
    return [torch.randint(100, vocab, (length,), generator=rng).tolist() for _ in range(n)]


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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


def install_hint(python: str) -> str:
    return (f"llama.cpp is not installed for {python}: `pip install {ANCHOR_PACKAGE}` (a "
            "prebuilt wheel, no compile) into it, or into a virtualenv of its own and pass "
            "--anchor-python VENV/bin/python; --no-anchor skips it")


def f32_gguf(src: Path, out: Path) -> Path:
    """`src` (a quantized GGUF) with every tensor dequantized to float32, the same metadata:
    the weights `models pull` gives the engine, in llama.cpp's format. Written once."""
    if out.is_file():
        return out
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data.reshape([int(d) for d in reversed(tensor.shape)]),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


class Anchor:
    """llama.cpp in a child process (clawrl/bench/llama_anchor.py): one JSON line each way."""

    def __init__(self, proc: subprocess.Popen[str], build: str, stderr: IO[str]) -> None:
        self.proc, self.build, self.stderr = proc, build, stderr

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp anchor exited: {_tail(self.stderr)}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def decode(self, model: int, prompts: list[list[int]],
               new_tokens: int) -> tuple[float, list[list[int]]]:
        answer = self.ask({"model": model, "prompts": prompts, "new": new_tokens})
        return answer["tokens"] / answer["seconds"], answer["outputs"]

    def prefill(self, model: int, ids: list[int]) -> float:
        return float(self.ask({"model": model, "prefill": ids})["seconds"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _tail(stderr: IO[str]) -> str:
    stderr.flush()
    stderr.seek(0)
    lines = [line.strip() for line in stderr.read().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "no message"


def start_anchor(python: str, threads: int, models: list[Path]) -> Anchor | str:
    """llama.cpp loaded with `models` under `python`, or one line saying why not."""
    try:
        probe = subprocess.run([python, "-c", "import cyllama.llama.llama_cpp"],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return install_hint(python)
    if probe.returncode != 0:
        return install_hint(python)
    stderr = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([python, str(ANCHOR_SCRIPT), str(threads), *map(str, models)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        build = str(json.loads(line)["ready"])
    except (ValueError, KeyError, TypeError):
        proc.kill()
        proc.wait()
        why = _tail(stderr)
        stderr.close()
        return f"llama.cpp did not start under {python}: {why}"
    return Anchor(proc, build, stderr)


def _scheduler(model: Any, cache_mb: float) -> Scheduler:
    scheduler = Scheduler(model, eos_ids=set(), decode=lambda ids: "", weight_version="bench",
                          max_batch=32, prefix_cache=PrefixCache(int(cache_mb * 2**20)))
    scheduler.start()
    return scheduler


def model_bench_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options every benchmark of a real model's decoding starts with (this one and
    `clawrl bench grammar`): the model folder, the threads, the repetitions."""
    parser = OneLineParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"a Hugging Face directory (default: pull to {CACHE_DIR})")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=3)
    return parser


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("threads", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} is not a model directory (no config.json)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = model_bench_parser(PROG, __doc__ or "")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefix-cache-mb", type=float, default=1024)
    parser.add_argument("--anchor-python", default=sys.executable,
                        help=f"a python with {ANCHOR_PACKAGE} installed (default: this one)")
    parser.add_argument("--no-anchor", action="store_true", help="skip llama.cpp")
    args = parser.parse_args(argv)
    check_model_args(parser, args)
    for name, least in (("prefix_tokens", 1), ("suffix_tokens", 1), ("new_tokens", 2)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.prefix_cache_mb <= 0:
        parser.error("--prefix-cache-mb must be positive (the cache-off figure is measured "
                     "anyway)")
    if not args.no_anchor and args.prefix_tokens + args.suffix_tokens > ANCHOR_PREFILL_CTX:
        parser.error(f"--prefix-tokens + --suffix-tokens is at most {ANCHOR_PREFILL_CTX} with "
                     "the anchor (llama.cpp's context); --no-anchor lifts it")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or pull_model("smollm2-135m", CACHE_DIR)
    model = load_model(model_dir, device="cpu", dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    rng = torch.Generator().manual_seed(0)
    print(f"{PROG}: {model_dir}, float32, {args.threads} threads, medians of {args.reps}",
          flush=True)

    anchor: Anchor | None = None
    if not args.no_anchor:
        started = open_anchor(args.anchor_python, args.threads, model_dir)
        if isinstance(started, str):
            print(f"anchor: no llama.cpp figures: {started}", flush=True)
        else:
            anchor = started
            print(f"anchor: llama.cpp {anchor.build} (cyllama), {args.threads} threads, "
                  "files: float32 (the engine's weights), Q4_1 (as shipped)", flush=True)

    cached, plain = _scheduler(model, args.prefix_cache_mb), _scheduler(model, 0)
    try:
        warm = random_prompts(1, PROMPT_TOKENS, rng, vocab)
        decode_rate(plain, warm, 8)
        if anchor is not None:
            for index in range(len(ANCHOR_FILES)):
                anchor.decode(index, warm, 8)
        for n in (1, 8):
            bench_decode(plain, anchor, n, args, rng, vocab)
        bench_prefix(cached, plain, anchor, args, rng, vocab)
    finally:
        cached.stop()
        plain.stop()
        if anchor is not None:
            anchor.close()

    gbps, ceiling = bandwidth_ceiling(model)
    print(f"anchor: torch copies {gbps:.1f} GB/s: float32 batch-1 decode ceiling "
          f"{ceiling:.1f} tokens/s", flush=True)
    return 0


ANCHOR_FILES = ("float32", "Q4_1")
ANCHOR_PREFILL_CTX = 8192  # llama_anchor.PREFILL_CTX


def open_anchor(python: str, threads: int, model_dir: Path) -> Anchor | str:
    marker = model_dir / DONE_MARKER
    if not (marker.is_file() and marker.read_text().startswith("smollm2-135m ")):
        return (f"{model_dir} is not smollm2-135m as `clawrl models pull` writes it (the "
                "anchor runs that model's GGUF file); --no-anchor skips it")
    try:
        shipped = gguf_path("smollm2-135m")
    except Exception as exc:
        return f"no GGUF file: {exc}"
    return start_anchor(python, threads, [f32_gguf(shipped, F32_GGUF), shipped])


def bench_decode(scheduler: Scheduler, anchor: Anchor | None, n: int, args: argparse.Namespace,
                 rng: torch.Generator, vocab: int) -> None:
    """Decode tokens/s at `n` concurrent requests, the engine and llama.cpp interleaved
    (who goes first alternates), the same prompts for both in each repetition."""
    ours: list[float] = []
    theirs: list[list[float]] = [[] for _ in ANCHOR_FILES]
    agree: list[int] = []
    for rep in range(args.reps):
        prompts = random_prompts(n, PROMPT_TOKENS, rng, vocab)
        turns = [-1, *range(len(ANCHOR_FILES))] if anchor is not None else [-1]
        outputs: dict[int, list[list[int]]] = {}
        for who in (turns if rep % 2 == 0 else turns[::-1]):
            if who < 0:
                rate, outputs[who] = decode_rate(scheduler, prompts, args.new_tokens)
                ours.append(rate)
            else:
                assert anchor is not None
                rate, outputs[who] = anchor.decode(who, prompts, args.new_tokens)
                theirs[who].append(rate)
        if anchor is not None:
            agree += [same_prefix(a, b) for a, b in zip(outputs[-1], outputs[0], strict=True)]
    print(f"decode, {n} concurrent: {statistics.median(ours):.1f} tokens/s", flush=True)
    if anchor is None:
        return
    for index, name in enumerate(ANCHOR_FILES):
        ratio = statistics.median(o / t for o, t in zip(ours, theirs[index], strict=True))
        print(f"  llama.cpp {name}, {n} concurrent: {statistics.median(theirs[index]):.1f} "
              f"tokens/s; engine / llama.cpp {ratio:.2f}", flush=True)
    print(f"  greedy tokens the engine and llama.cpp float32 agree on before they first "
          f"differ: median {statistics.median(agree):.0f}, least {min(agree)} of "
          f"{args.new_tokens}", flush=True)


def bench_prefix(cached: Scheduler, plain: Scheduler, anchor: Anchor | None,
                 args: argparse.Namespace, rng: torch.Generator, vocab: int) -> None:
    prefix = torch.randint(100, vocab, (args.prefix_tokens,), generator=rng).tolist()
    firsts, seconds, offs, hits, llama = [], [], [], [], []
    for _ in range(args.reps):
        cached.call(cached.prefix_cache.clear).result()
        firsts.append(_timed(cached, prefix)[0])
        suffix = torch.randint(100, vocab, (args.suffix_tokens,), generator=rng).tolist()
        second, hit = _timed(cached, prefix + suffix)
        seconds.append(second)
        hits.append(hit)
        offs.append(_timed(plain, prefix + suffix)[0])
        if anchor is not None:
            llama.append(anchor.prefill(0, prefix))
    first, second, off = (statistics.median(x) for x in (firsts, seconds, offs))
    print(f"prefill of {args.prefix_tokens} tokens, first: {first:.3f} s", flush=True)
    print(f"second request, prefix + {args.suffix_tokens} tokens, cache on: {second:.3f} s "
          f"({min(hits)} tokens cached); ratio to first {second / first:.3f}", flush=True)
    print(f"second request, cache off: {off:.3f} s", flush=True)
    if llama:
        ratio = statistics.median(f / t for f, t in zip(firsts, llama, strict=True))
        print(f"  llama.cpp float32 prefill of the {args.prefix_tokens} tokens: "
              f"{statistics.median(llama):.3f} s; engine's first / llama.cpp {ratio:.2f}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
