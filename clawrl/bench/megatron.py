"""`clawrl bench megatron`: megatron vs torch backend training throughput, and export time.

    clawrl bench megatron [--model DIR] [--batch 16] [--seq 128] [--rounds 5] [--threads 2]

Both backends load the same model and train on the same synthetic batch in one process, in
interleaved rounds (torch, megatron, megatron, torch, …) so machine noise hits both alike.
Reported: median training tokens/s (all input tokens of the batch per optimizer step) of
each and their ratio, and the median time to export HF safetensors, also per 10M parameters.
Without `--model` a random Qwen2-style model (~5M parameters) is built in a temp folder.
On CPU the figures are for regression tracking only (one rank, fp32, no fused kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="clawrl bench megatron", description=__doc__)
    ap.add_argument("--model", type=Path, help="HF model folder (default: random ~5M model)")
    ap.add_argument("--batch", type=int, default=16, help="samples per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per backend")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    return ap.parse_args(argv)


def random_model(path: Path) -> Path:
    """A random Qwen2-style model: hidden 256, 4 layers, 4 heads (2 KV), vocab 4096."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(str(path))
    return path


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(args: argparse.Namespace, model_dir: Path, scratch: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    from trainer.backends.megatron import MegatronBackend
    from trainer.backends.megatron_run import synthetic_batch
    from trainer.backends.torch import TorchBackend
    from trainer.config import TrainerSettings

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    batch = synthetic_batch(vocab, args.batch, args.seq)
    tokens = int(batch.attention_mask.sum())
    common = dict(lr=1e-5, batch_size=args.batch, micro_batch_size=args.micro_batch,
                  kl_coef=0.0, device="cpu")
    torch_backend = TorchBackend(TrainerSettings(backend="torch", **common))
    megatron = MegatronBackend(TrainerSettings(backend="megatron", **common))
    try:
        torch_backend.load(model_dir)
        megatron.load(model_dir)
        params = sum(t.numel() for t in megatron.hf_state_dict().values())
        backends: dict[str, Any] = {"torch": torch_backend, "megatron": megatron}
        for backend in backends.values():  # warm-up (allocator, first-call overheads)
            backend.train_step(batch)
        times: dict[str, list[float]] = {name: [] for name in backends}
        for r in range(args.rounds):
            order = list(backends) if r % 2 == 0 else list(reversed(backends))
            for name in order:
                times[name].append(_timed(partial(backends[name].train_step, batch)))
        exports: dict[str, list[float]] = {name: [] for name in backends}
        for r in range(3):
            for name, backend in backends.items():
                out = scratch / f"export-{name}-{r}"
                exports[name].append(_timed(partial(backend.export, out)))
    finally:
        megatron.close()
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    export_s = {name: statistics.median(t) for name, t in exports.items()}
    return {
        "model": str(model_dir), "parameters": params, "batch": args.batch, "seq": args.seq,
        "tokens_per_step": tokens, "rounds": args.rounds, "threads": args.threads,
        "tokens_per_s": tps, "ratio_megatron_over_torch": tps["megatron"] / tps["torch"],
        "export_s": export_s,
        "export_s_per_10M_params": {k: v * 1e7 / params for k, v in export_s.items()},
    }


def main(argv: list[str]) -> int:
    args = _args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="clawrl-bench-megatron-") as tmp:
        scratch = Path(tmp)
        model_dir = args.model or random_model(scratch / "model")
        if not (model_dir / "config.json").is_file():
            print(f"clawrl bench megatron: no HF model at {model_dir}", file=sys.stderr)
            return 1
        figures = run(args, model_dir, scratch)
    if args.json:
        print(json.dumps(figures, indent=1))
        return 0
    tps, exp = figures["tokens_per_s"], figures["export_s_per_10M_params"]
    print(f"model {figures['model']} ({figures['parameters'] / 1e6:.1f}M params), batch "
          f"{args.batch}×{args.seq} = {figures['tokens_per_step']} tokens/step, "
          f"{args.rounds} interleaved rounds, {args.threads} threads (CPU: regression only)")
    print(f"{'backend':<10} {'tokens/s':>10} {'export s':>9} {'export s/10M':>13}")
    for name in ("torch", "megatron"):
        print(f"{name:<10} {tps[name]:>10,.0f} {figures['export_s'][name]:>9.3f} "
              f"{exp[name]:>13.3f}")
    print(f"megatron / torch tokens/s: {figures['ratio_megatron_over_torch']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
