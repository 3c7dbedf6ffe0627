"""torchrun entry point of the megatron backend: one process per GPU (or CPU rank).

Train (every rank runs the same command; rank 0 runs the trainer loop of `clawrl train`,
the others follow it — see megatron.py):

    torchrun --nproc-per-node 8 -m trainer.backends.megatron_run --tp 4 --pp 1 [train args]

Check (parity and layout; used by the tests and deploy/gpu-check.sh): load a model, compute
logprobs of a batch, run optimizer steps on it, optionally export / save / resume, and write
the figures as JSON on rank 0:

    torchrun --nproc-per-node 2 -m trainer.backends.megatron_run check --model DIR \\
        --tp 2 --out result.json [--batch batch.pt] [--steps 1] [--export DIR] \\
        [--save-state DIR] [--load-state DIR --reference BASE_DIR] [--parity]

`--parity` (pp 1) first compares the full-vocabulary logits of the batch with Hugging Face
transformers' on the same weights (rank 0, same device) and adds `logits_max_abs_diff`,
`logits_max_abs` and `argmax_agree` (over the batch's real tokens) to the JSON.

`--batch` is a `torch.save`d `{"batch": Batch, "settings": dict}`; without it a
deterministic synthetic batch is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer.config import TrainerSettings
from trainer.data import Batch, SampleRow, collate


def synthetic_batch(vocab: int, samples: int, seq: int, seed: int = 0) -> Batch:
    """A reproducible batch: varied prompt/response lengths, rewards, some teacher logprobs."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(samples):
        p_len = max(2, seq // 3 + i % 5)
        r_len = max(2, seq - p_len - (i % 4))
        prompt = torch.randint(0, vocab, (p_len,), generator=gen).tolist()
        response = torch.randint(0, vocab, (r_len,), generator=gen).tolist()
        rollout = (-3 * torch.rand(r_len, generator=gen)).tolist()
        teacher = (-3 * torch.rand(r_len, generator=gen)).tolist() if i % 2 else None
        rows.append(SampleRow(i, prompt, response, rollout, teacher, (1, -1, None, 1)[i % 4], 0))
    return collate(rows, 0)


def _check_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="megatron_run check", description=__doc__)
    ap.add_argument("--model", type=Path, required=True, help="HF model folder")
    ap.add_argument("--reference", type=Path, help="KL reference model (default: --model)")
    ap.add_argument("--out", type=Path, required=True, help="JSON result (rank 0)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--batch", type=Path, help="torch.save'd {'batch', 'settings'}")
    ap.add_argument("--samples", type=int, default=8, help="synthetic batch size")
    ap.add_argument("--seq", type=int, default=32, help="synthetic sequence length")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--export", type=Path, help="export HF weights here after the steps")
    ap.add_argument("--save-state", type=Path, help="save the distributed checkpoint here")
    ap.add_argument("--load-state", type=Path, help="resume from this distributed checkpoint")
    ap.add_argument("--parity", action="store_true",
                    help="compare the logits with Hugging Face transformers' first (pp 1)")
    args = ap.parse_args(argv)
    if args.parity and args.pp != 1:  # every rank parses: all of them stop here
        ap.error("--parity needs --pp 1 (a pipeline stage holds only its own layers)")
    return args


def hf_parity(backend: Any, model_dir: Path, batch: Batch) -> dict[str, float]:
    """Megatron's logits against Hugging Face transformers' on the batch's real tokens
    (attention mask), both in float32 on the backend's device."""
    from transformers import AutoModelForCausalLM

    ours = backend.logits(batch.input_ids)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf = hf.to(backend.device).eval()
    with torch.no_grad():
        theirs = hf(input_ids=batch.input_ids.to(backend.device),
                    attention_mask=batch.attention_mask.to(backend.device)).logits.float().cpu()
    del hf
    real = batch.attention_mask.bool()
    return {"logits_max_abs_diff": float((ours - theirs)[real].abs().max()),
            "logits_max_abs": float(theirs[real].abs().max()),
            "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1))[real].float().mean())}


def check_main(argv: list[str]) -> int:
    """Leader: run the check and write JSON. Followers: follow."""
    from trainer.backends.megatron import MegatronBackend

    args = _check_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        MegatronBackend(None).follow()
        return 0
    if not (args.model / "config.json").is_file():
        raise FileNotFoundError(f"{args.model} is not a Hugging Face model folder (no config.json)")
    if args.batch:
        saved = torch.load(args.batch, weights_only=False)
        batch, settings = saved["batch"], dict(saved.get("settings", {}))
    else:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(str(args.model)).vocab_size
        batch, settings = synthetic_batch(vocab, args.samples, args.seq), {}
    cfg = TrainerSettings(**{**settings, "backend": "megatron", "dtype": args.dtype})
    cfg = cfg.model_copy(update={"tp": args.tp, "pp": args.pp})
    backend = MegatronBackend(cfg)
    result: dict[str, Any] = {"world": backend.world, "tp": args.tp, "pp": args.pp}
    try:
        started = time.perf_counter()
        backend.load(args.model, args.reference)
        result["load_s"] = time.perf_counter() - started
        if args.parity:
            started = time.perf_counter()
            result.update(hf_parity(backend, args.model, batch))
            result["parity_s"] = time.perf_counter() - started
        if args.load_state:
            backend.load_state(args.load_state)
        result["logprobs"] = backend.compute_logprobs(batch).tolist()
        result["steps"] = []
        tokens = int(batch.attention_mask.sum())
        for i in range(args.steps):
            stats = backend.train_step(batch)
            result["steps"].append(vars(stats))
            print(f"step {i + 1}: {stats.status} loss {stats.loss} grad_norm {stats.grad_norm} "
                  f"{tokens / stats.seconds:,.0f} tokens/s", flush=True)
        if args.export:
            started = time.perf_counter()
            backend.export(args.export)
            result["export_s"] = time.perf_counter() - started
        if args.save_state:
            backend.save_state(args.save_state)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        args.out.write_text(json.dumps(result))
        print(f"megatron check: {result['error']}", file=sys.stderr)
        backend.close()
        return 1
    backend.close()
    args.out.write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Every rank: `check` or train; a bad model, layout or checkpoint is one line, exit 1."""
    from trainer.backends.megatron_mapping import UnsupportedModelError
    from trainer.export import CheckpointError

    try:
        return _dispatch(sys.argv[1:] if argv is None else argv)
    except (UnsupportedModelError, CheckpointError, ValueError, OSError) as exc:
        rank = os.environ.get("RANK", "0")
        print(f"megatron_run (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 1


def _dispatch(args: list[str]) -> int:
    if args[:1] == ["check"]:
        return check_main(args[1:])
    if int(os.environ.get("RANK", "0")) != 0:
        from trainer.backends.megatron import MegatronBackend

        MegatronBackend(None).follow()
        return 0
    from trainer import train

    if "--backend" not in args:
        args = ["--backend", "megatron", *args]
    code: int = train.main(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
