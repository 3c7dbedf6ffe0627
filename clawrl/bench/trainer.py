"""`clawrl bench trainer`: trainer throughput, swap pause, publish latency, peak RSS, and
the real model's training step.

    clawrl bench trainer [--model DIR] [--rounds 7] [--batch 16] [--seq 256] [--no-big]
                         [--phases throughput,swap,step,gate] [--step-model DIR]
                         [--prompt-tokens 200] [--reply-tokens 128] [--step-rounds 3]
                         [--no-full]

1. Throughput: one `TorchBackend.train_step` against a plain hand-written loop (forward,
   logprob gather, clipped-ratio policy loss, backward, grad clip, AdamW) on a second copy of
   the same model, same batch, same micro batching, interleaved round by round (alternating
   which goes first); median tokens/s of each and the median of the per-round ratios
   (target ≥ 0.9). KL and entropy are off so both do the same arithmetic.
2. Hot swap, for the model given (the tiny one) and a ~50M-parameter model built here with
   random weights: a real `clawrl engine` serves it while a probe client sends 1-token
   /generate requests back to back; the trainer exports v{N} and publishes it. Reported:
   export time, update call time, end-to-end publish latency (export + update + read-back)
   and the swap pause = the longest probe stall during the update minus the median probe.
3. Peak RSS of this (trainer) process during each phase, sampled every 20 ms.
4. `--phases step` (not run by default): `TorchBackend.train_step` on SmolLM2-135M-Instruct
   (`--step-model`, default pulled once into .clawrl/bench-cache/smollm2-135m) with the
   settings the trainer would use: the defaults under the model's recipe.json, which `clawrl
   models pull` writes as `train: {lora: {enabled: true}, adapter_lr: 2e-4}` (rank-16 LoRA
   on every projection; the KL term's reference is the base with the adapter off, one more
   forward without gradients). `--batch` samples of `--prompt-tokens` ± 25% prompt and
   `--reply-tokens` ± 25% reply tokens (random ids, a fixed seed; rewards ±1, on-policy
   rollout logprobs), in micro batches of `--micro`, padded as the trainer pads them.
   Reported per step: seconds, and tokens/s = prompt + reply tokens (unpadded) through
   forward and backward per second. Beside it (unless `--no-full`) the full-weight step
   (LoRA off, lr 2e-5, a frozen reference copy for the KL term), interleaved round by round.
   The anchor: the matmul rate torch reaches here on the step's largest shape (measured in
   every round, median), over the step's matmul FLOPs per token (forward 2 per weight, the
   reference forward 2, backward 2 for the activations' gradients and, full weights only, 2
   for the weights'; attention scores and values added): the tokens/s the step would reach
   if it were all matmul at that rate, and the fraction reached.

5. `--phases gate` (not run by default): the gate before serving (trainer/gate.py) on the
   same model, its shipped probe (`gate-probe.jsonl`: facts and open questions), asked the
   way the trainer asks it — rows leave the batch as their verdict settles — against every
   row decoded to its kind's token limit, and against transformers' own `generate` (every
   row to the open questions' limit, as the gate asked before), interleaved round by round.
   Reported: seconds per probe each way (median), the ratios, the tokens decoded per
   question, and whether every way gave every question the same verdict.

Figures are medians over rounds, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil
import torch

from clawrl.base.settings import EngineSettings
from clawrl.bench.args import OneLineParser
from clawrl.cli.ports import free_port
from trainer.backends.torch import TorchBackend
from trainer.checkpoint import save_checkpoint
from trainer.config import TrainerSettings, model_recipe
from trainer.data import Batch, SampleRow, collate
from trainer.export import copy_tokenizer_files
from trainer.publish import publish_version


@contextmanager
def peak_rss() -> Iterator[dict[str, float]]:
    """Sample this process's RSS in a thread; yields a dict filled with 'peak_mb' on exit."""
    proc, out, stop = psutil.Process(), {"peak_mb": 0.0}, threading.Event()

    def sample() -> None:
        while not stop.is_set():
            out["peak_mb"] = max(out["peak_mb"], proc.memory_info().rss / 2**20)
            stop.wait(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()


def synthetic_batch(backend: TorchBackend, n: int, seq: int, seed: int = 0) -> Batch:
    """n samples of `seq` tokens (a quarter prompt), rewards ±1, on-policy rollout logprobs."""
    gen = torch.Generator().manual_seed(seed)
    prompt = max(1, seq // 4)
    rows = []
    for i in range(n):
        ids = torch.randint(3, backend.limits.vocab_size, (seq,), generator=gen).tolist()
        rows.append(SampleRow(i, ids[:prompt], ids[prompt:], [0.0] * (seq - prompt), None,
                              1 if i % 2 else -1, 0))
    batch = collate(rows, 0)
    batch.rollout_logp = backend.compute_logprobs(batch) * batch.loss_mask
    return batch


class ReferenceLoop:
    """The plainest correct implementation of the same update, for comparison."""

    def __init__(self, model_dir: Path, cfg: TrainerSettings) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)

    def step(self, batch: Batch) -> None:
        self.model.train()
        n = batch.loss_mask.sum()
        for lo in range(0, batch.size, self.cfg.micro_batch_size):
            s = slice(lo, lo + self.cfg.micro_batch_size)
            ids, mask = batch.input_ids[s], batch.loss_mask[s]
            logits = self.model(input_ids=ids, attention_mask=batch.attention_mask[s]).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
                -1, ids[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - batch.rollout_logp[s])
            adv = batch.reward[s, None]
            clipped = ratio.clamp(1 - self.cfg.eps_low, 1 + self.cfg.eps_high)
            loss = -(torch.minimum(ratio * adv, clipped * adv) * mask).sum() / n
            loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def bench_throughput(model_dir: Path, rounds: int, batch_size: int, seq: int,
                     micro: int) -> dict[str, float]:
    cfg = TrainerSettings(batch_size=batch_size, micro_batch_size=micro, kl_coef=0.0,
                          entropy_coef=0.0, lr=1e-5, device="cpu")
    backend = TorchBackend(cfg)
    backend.load(model_dir)
    reference = ReferenceLoop(model_dir, cfg)
    batch = synthetic_batch(backend, batch_size, seq)
    tokens = batch.num_tokens
    ours: list[float] = []
    plain: list[float] = []
    backend.train_step(batch)  # warm-up both
    reference.step(batch)
    for i in range(rounds):
        # Alternate who goes first so a drifting machine load favours neither side.
        for fn, out in ((backend.train_step, ours), (reference.step, plain))[:: 1 - 2 * (i % 2)]:
            t0 = time.perf_counter()
            fn(batch)
            out.append(tokens / (time.perf_counter() - t0))
    mo, mp = statistics.median(ours), statistics.median(plain)
    # Paired per-round ratios: the two runs of a round saw about the same machine load.
    ratio = statistics.median(o / p for o, p in zip(ours, plain, strict=True))
    return {"trainer_tok_s": mo, "reference_tok_s": mp, "ratio": ratio,
            "tokens_per_step": tokens}


def step_samples(n: int, prompt_tokens: int, reply_tokens: int, vocab: int,
                 seed: int = 0) -> list[SampleRow]:
    """n samples of about `prompt_tokens` + `reply_tokens` tokens (each length drawn within
    ±25%), random ids, rewards ±1: the lengths of real chat turns, whose ids cost the same."""
    gen = torch.Generator().manual_seed(seed)

    def around(mean: int) -> int:
        spread = mean // 4
        return mean - spread + int(torch.randint(0, 2 * spread + 1, (1,), generator=gen))

    rows = []
    for i in range(n):
        p, r = around(prompt_tokens), around(reply_tokens)
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        rows.append(SampleRow(i, ids[:p], ids[p:], [0.0] * r, None, 1 if i % 2 else -1, 0))
    return rows


def step_settings(model_dir: Path, batch: int, micro: int, *, lora: bool) -> TrainerSettings:
    """The trainer's settings for this model (defaults under its recipe.json), on the CPU,
    with LoRA on (`lora`; a model whose recipe has none gets the default adapter) or off."""
    recipe = {k: v for k, v in model_recipe(model_dir).items() if k != "gate_probe"}
    cfg = TrainerSettings.model_validate(
        recipe | {"batch_size": batch, "micro_batch_size": micro, "device": "cpu"})
    return cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"enabled": lora})})


def matmul_flops_per_token(model: torch.nn.Module, cfg: TrainerSettings,
                           mean_len: float) -> float:
    """Matmul FLOPs per token of one train_step (see the module docstring, 4). Every Linear
    counts, the output head (tied to the embedding) and LoRA's rank-16 factors included."""
    conf: Any = model.config
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # QKᵀ and AV: 2 × 2 × hidden per attended position, half the positions on average
    attention = 4 * conf.num_hidden_layers * conf.hidden_size * mean_len / 2
    forward = 2 * weights + attention
    passes = 1 + (1 if cfg.kl_coef > 0 else 0) + 1 + (0 if cfg.lora.enabled else 1)
    return float(forward * passes)


def matmul_gflops(m: int, k: int, n: int, reps: int = 5) -> float:
    """float32 GFLOP/s of an [m, k] @ [k, n] matmul on this process's threads (median)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def bench_step(model_dir: Path, rounds: int, batch_size: int, micro: int, prompt_tokens: int,
               reply_tokens: int, full: bool) -> dict[str, dict[str, float]]:
    """The real model's train_step, LoRA (as its recipe says) and full weights, interleaved."""
    kinds = [("adapter", True)] + ([("full weights", False)] if full else [])
    backends: dict[str, TorchBackend] = {}
    for name, lora in kinds:
        backends[name] = TorchBackend(step_settings(model_dir, batch_size, micro, lora=lora))
        backends[name].load(model_dir)
    first = backends["adapter"]
    rows = step_samples(batch_size, prompt_tokens, reply_tokens, first.limits.vocab_size)
    batch = collate(rows, 0)
    batch.rollout_logp = first.compute_logprobs(batch) * batch.loss_mask
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    padded = sum(int(m.input_ids.numel()) for m in batch.micro_batches(micro))
    warm = collate(rows[:micro], 0)
    warm.rollout_logp = batch.rollout_logp[:micro, :warm.loss_mask.shape[1]]
    for backend in backends.values():
        backend.train_step(warm)
    conf: Any = first._model().config
    hidden = int(conf.hidden_size)
    shape = (micro * (tokens // batch_size), hidden,
             int(getattr(conf, "intermediate_size", 4 * hidden)))
    seconds: dict[str, list[float]] = {name: [] for name, _ in kinds}
    rates: list[float] = []
    for i in range(rounds):
        order = kinds if i % 2 == 0 else kinds[::-1]
        rates.append(matmul_gflops(*shape))  # the anchor, in every round: the load drifts
        for name, _ in order:
            t0 = time.perf_counter()
            stats = backends[name].train_step(batch)
            seconds[name].append(time.perf_counter() - t0)
            if stats.status != "ok":
                raise RuntimeError(f"{name} step {stats.status}: {stats.reason}")
    gflops = statistics.median(rates)
    out: dict[str, dict[str, float]] = {}
    for name, _ in kinds:
        backend = backends[name]
        model = backend._model()
        step_s = statistics.median(seconds[name])
        ceiling = gflops * 1e9 / matmul_flops_per_token(model, backend.cfg, tokens / batch_size)
        out[name] = {"step_s": step_s, "tok_s": tokens / step_s, "tokens": tokens,
                     "padded": padded, "gflops": gflops, "ceiling_tok_s": ceiling,
                     "fraction": tokens / step_s / ceiling,
                     "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if full:
        out["full weights"]["ratio"] = statistics.median(
            f / a for f, a in zip(seconds["full weights"], seconds["adapter"], strict=True))
    return out


def build_random_model(out_dir: Path, tokenizer_dir: Path, *, hidden: int = 512,
                       layers: int = 13, ffn: int = 2048, seed: int = 0) -> int:
    """A Qwen2-style model with random weights (~50M parameters by default), the tokenizer
    of `tokenizer_dir`. Returns the parameter count."""
    import json

    from transformers import AutoModelForCausalLM, Qwen2Config

    base = json.loads((tokenizer_dir / "config.json").read_text())
    conf = Qwen2Config(
        vocab_size=base["vocab_size"], hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=base.get("max_position_embeddings", 2048),
        tie_word_embeddings=True, bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"), pad_token_id=base.get("pad_token_id"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(conf)  # type: ignore[no-untyped-call]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    copy_tokenizer_files(tokenizer_dir, out_dir)
    return sum(p.numel() for p in model.parameters())


class EngineStartError(RuntimeError):
    """The engine exited or never became healthy; the message is one line."""


class RunningEngine(NamedTuple):
    url: str
    pid: int


def _last_line(log: Path) -> str:
    """The engine's own one-line answer (`clawrl engine: ...`), else its last log line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if line.strip()]
    own = [line for line in lines if line.startswith("clawrl engine: ")]
    return (own or lines or ["(no output)"])[-1]


@contextmanager
def engine_process(model_dir: Path, threads: int, log: Path,
                   *extra: str) -> Iterator[RunningEngine]:
    """A `clawrl engine` child on a free port (`extra`: more engine flags), healthy; stopped
    on exit. Raises EngineStartError with the engine's last log line."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clawrl.engine", "--model", str(model_dir), "--port",
             str(port), "--threads", str(threads), *extra], stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise EngineStartError(f"the engine exited (code {proc.returncode}): "
                                       f"{_last_line(log)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine was not healthy after 300 s: "
                                       f"{_last_line(log)}")
            time.sleep(0.2)
        yield RunningEngine(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Prober:
    """Sends 1-token /generate requests back to back; records (start, end) of each."""

    def __init__(self, url: str) -> None:
        self.url, self.spans, self._stop = url, [], threading.Event()  # type: ignore[var-annotated]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.post(self.url + "/generate", json={
                    "input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
                self.spans.append((t0, time.perf_counter()))

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def pause(self, start: float, end: float) -> float:
        """The longest probe overlapping [start, end] minus the median of the others: how
        long the engine held base-model requests back then. 0 when none overlapped."""
        outside = [e - s for s, e in self.spans if e < start or s > end]
        during = [e - s for s, e in self.spans if e >= start and s <= end]
        base = statistics.median(outside) if outside else 0.0
        return max(0.0, max(during, default=base) - base)


def bench_swap(model_dir: Path, work: Path, rounds: int, threads: int) -> dict[str, float]:
    cfg = TrainerSettings(batch_size=2, micro_batch_size=2, kl_coef=0.0, device="cpu")
    backend = TorchBackend(cfg)
    backend.load(model_dir)
    batch = synthetic_batch(backend, 2, 32)
    weights = work / "weights"
    work.mkdir(parents=True, exist_ok=True)
    export_s, update_s, e2e_s, pause_s = [], [], [], []
    with engine_process(model_dir, threads, work / "engine.log") as (url, _):
        engine = EngineSettings(url=url)
        for n in range(1, rounds + 1):
            backend.train_step(batch)
            with Prober(url) as probe:
                time.sleep(0.5)  # baseline probes
                t0 = time.perf_counter()
                path = save_checkpoint(backend, weights, n, model_dir)
                t1 = time.perf_counter()
                publish_version(engine, path, n)
                t2 = time.perf_counter()
                time.sleep(0.3)
            export_s.append(t1 - t0)
            update_s.append(t2 - t1)
            e2e_s.append(t2 - t0)
            pause_s.append(probe.pause(t1, t2))
    return {"export_ms": 1e3 * statistics.median(export_s),
            "update_ms": 1e3 * statistics.median(update_s),
            "publish_e2e_ms": 1e3 * statistics.median(e2e_s),
            "swap_pause_ms": 1e3 * statistics.median(pause_s),
            "swap_pause_max_ms": 1e3 * max(pause_s)}


PHASES = ("throughput", "swap", "step", "gate")
PROG = "clawrl bench trainer"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", type=Path, help="model dir (default: a fresh tiny test model)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--no-big", action="store_true", help="skip the ~50M-parameter model")
    p.add_argument("--phases", default="throughput,swap",
                   help=f"which of {','.join(PHASES)} to run (default throughput,swap)")
    p.add_argument("--step-model", type=Path,
                   help="the step and gate phases' model (default: SmolLM2-135M, pulled "
                        "once)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--reply-tokens", type=int, default=128)
    p.add_argument("--step-rounds", type=int, default=3, help="rounds of the step and gate "
                   "phases")
    p.add_argument("--no-full", action="store_true", help="step phase: skip full weights")
    args = p.parse_args(argv)
    for name in ("rounds", "batch", "seq", "micro", "threads", "prompt_tokens",
                 "reply_tokens", "step_rounds"):
        if getattr(args, name) < (2 if name == "seq" else 1):
            p.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'seq' else 1}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases or any(x not in PHASES for x in phases):
        p.error(f"--phases takes {', '.join(PHASES)} separated by commas, not {args.phases!r}")
    args.phases = phases
    for name in ("model", "step_model"):
        path = getattr(args, name)
        if path is not None and not (path / "config.json").is_file():
            p.error(f"--{name.replace('_', '-')} {path} is not a model directory "
                    "(no config.json)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="clawrl-bench-trainer-"))
    ok = True
    try:
        if "throughput" in args.phases or "swap" in args.phases:
            ok = bench_tiny(args, work)
        if "step" in args.phases:
            print_step(args)
        if "gate" in args.phases:
            ok = print_gate(args) and ok
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def bench_tiny(args: argparse.Namespace, work: Path) -> bool:
    model = args.model
    if model is None:
        from clawrl.world.model import init_model_dir

        model = init_model_dir(work / "tiny", seed=0, size="test")
    print(f"model {model}  threads {args.threads}  batch {args.batch}x{args.seq} "
          f"micro {args.micro}  rounds {args.rounds}")
    ok = True
    if "throughput" in args.phases:
        with peak_rss() as rss:
            t = bench_throughput(model, args.rounds, args.batch, args.seq, args.micro)
        print(f"throughput: trainer {t['trainer_tok_s']:,.0f} tok/s  reference "
              f"{t['reference_tok_s']:,.0f} tok/s  ratio {t['ratio']:.3f} (target >= 0.9)  "
              f"peak RSS {rss['peak_mb']:.0f} MB")
        ok = not math.isnan(t["ratio"])
    if "swap" in args.phases:
        models = [("tiny", model)]
        if not args.no_big:
            big = work / "big"
            n = build_random_model(big, model)
            models.append((f"{n / 1e6:.0f}M", big))
        for name, path in models:
            with peak_rss() as rss:
                s = bench_swap(path, work / f"swap-{name}", max(2, args.rounds // 2),
                               args.threads)
            print(f"swap [{name}]: export {s['export_ms']:.0f} ms  update {s['update_ms']:.0f}"
                  f" ms  publish end-to-end {s['publish_e2e_ms']:.0f} ms  swap pause "
                  f"{s['swap_pause_ms']:.0f} ms (max {s['swap_pause_max_ms']:.0f})  "
                  f"trainer peak RSS {rss['peak_mb']:.0f} MB")
    return ok


def real_model(args: argparse.Namespace) -> Path:
    if args.step_model is not None:
        return Path(args.step_model)
    from clawrl.bench.engine import CACHE_DIR
    from clawrl.engine.pretrained import pull_model

    return pull_model("smollm2-135m", CACHE_DIR)


def print_gate(args: argparse.Namespace) -> bool:
    """The gate's probe settled as the trainer asks it, against every reply decoded whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.gate import answer_all, load_probe

    model_dir = real_model(args)
    probe_path = model_dir / "gate-probe.jsonl"
    if not probe_path.is_file():
        print(f"gate: {model_dir} has no gate-probe.jsonl (`clawrl models pull` writes one)")
        return False
    items = load_probe(probe_path)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    print(f"gate: {model_dir}  threads {args.threads}  {len(items)} questions "
          f"({sum(bool(i.answers) for i in items)} facts)  medians of {args.step_rounds}",
          flush=True)
    ways = {"settled": lambda: answer_all(model, tokenizer, items),
            "whole": lambda: answer_all(model, tokenizer, items, settle=False),
            "generate": lambda: hf_generate(model, tokenizer, [i.question for i in items])}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    replies: dict[str, list[str]] = {}
    for r in range(args.step_rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            t0 = time.perf_counter()
            replies[name] = ways[name]()
            seconds[name].append(time.perf_counter() - t0)

    def verdicts(texts: list[str]) -> list[bool]:
        return [i.passes(t) for i, t in zip(items, texts, strict=True)]

    def tokens(texts: list[str]) -> float:
        return statistics.mean(len(tokenizer.encode(t, add_special_tokens=False))
                               for t in texts)

    same = verdicts(replies["settled"]) == verdicts(replies["whole"])
    agree = sum(a == b for a, b in zip(verdicts(replies["settled"]),
                                       verdicts(replies["generate"]), strict=True))
    t = {name: statistics.median(seconds[name]) for name in ways}
    print(f"gate: settled {t['settled']:.1f} s per probe ({tokens(replies['settled']):.1f} "
          f"tokens per question)  whole replies {t['whole']:.1f} s "
          f"({tokens(replies['whole']):.1f} tokens)  transformers generate "
          f"{t['generate']:.1f} s ({tokens(replies['generate']):.1f} tokens)", flush=True)
    print(f"gate: settled / whole {t['settled'] / t['whole']:.2f}  settled / generate "
          f"{t['settled'] / t['generate']:.2f}  same verdicts as whole: "
          f"{'yes' if same else 'NO'}  as generate: {agree} of {len(items)}", flush=True)
    return same


@torch.no_grad()
def hf_generate(model: Any, tokenizer: Any, questions: list[str]) -> list[str]:
    """The anchor: transformers' `generate`, greedy, one left-padded batch, every row to
    OPEN_TOKENS (or its end) — how the gate asked its probe before it settled rows."""
    from trainer.gate import OPEN_TOKENS, chat_prompts

    encoded, pad = chat_prompts(tokenizer, questions)
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=OPEN_TOKENS,
                         do_sample=False, pad_token_id=pad)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def print_step(args: argparse.Namespace) -> None:
    model = real_model(args)
    recipe = {k: v for k, v in model_recipe(model).items() if k != "gate_probe"}
    print(f"step: {model}  threads {args.threads}  batch {args.batch} samples of ~"
          f"{args.prompt_tokens}+{args.reply_tokens} tokens  micro {args.micro}  medians of "
          f"{args.step_rounds}  recipe {recipe or 'none (the default adapter)'}", flush=True)
    with peak_rss() as rss:
        figures = bench_step(model, args.step_rounds, args.batch, args.micro,
                             args.prompt_tokens, args.reply_tokens, not args.no_full)
    for name, f in figures.items():
        print(f"step [{name}, {f['trainable'] / 1e6:.2f}M trainable]: {f['step_s']:.2f} s per "
              f"step of {f['tokens']:.0f} tokens ({f['padded']:.0f} padded): "
              f"{f['tok_s']:.0f} tokens/s", flush=True)
        print(f"  anchor: torch matmul {f['gflops']:.1f} GFLOP/s here: all-matmul ceiling "
              f"{f['ceiling_tok_s']:.0f} tokens/s, reached {f['fraction']:.2f}", flush=True)
    if "full weights" in figures:
        print(f"step: full weights / adapter, seconds per step: "
              f"{figures['full weights']['ratio']:.2f} (median of paired rounds)  "
              f"peak RSS {rss['peak_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    sys.exit(main())
