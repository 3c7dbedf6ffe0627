"""`clawrl bench adapters`: per-user LoRA adapters in the engine, against full weights.

    clawrl bench adapters [--model DIR] [--rounds 5] [--adapters 1,10,100] [--threads 1]
                          [--concurrency 16] [--new-tokens 32] [--quick]

One real `clawrl engine` serves the model (default: the tiny world model `clawrl up` serves)
with `--max-loaded-loras` above the largest adapter count, so nothing is evicted; this
process trains with `TorchBackend` as the trainers do. Adapters are the personal trainer's:
rank 16, alpha 32 on every attention and MLP projection (trainer/config.py `LoraSettings`),
written by `TorchBackend.save_adapter` (PEFT folder + optimizer state).

1. Tokens/s. A wave is `--concurrency` /generate requests sent at once, each a 16-token
   prompt and `--new-tokens` sampled tokens (`ignore_eos`); tokens/s = tokens generated /
   the wave's wall time (prefill included). First the base model alone: `--rounds` waves
   before any adapter was ever loaded (no LoRA hook exists yet). Then, for each N of
   `--adapters`, adapters are loaded until N are resident (new users' adapters: peft's
   initialisation, `fresh_adapter`; the engine does the same arithmetic whatever their
   values) and each round runs a wave whose requests go round robin over the N adapters
   (one batch mixes min(N, concurrency) adapters; successive waves walk through all N)
   next to a wave of base-model requests on the same engine, alternating which goes first.
   Reported: median tokens/s of each and the median of the per-round ratios to base.
2. Memory per resident adapter: the engine process's RSS growth across the adapter loads
   (the waves in between excluded) divided by the adapters loaded, next to what an adapter
   is: its A and B tensors' bytes (what the engine keeps, float32) and its safetensors file.
3. Publish to serving, with the largest N resident, adapter and full weights alternately in
   each round (alternating which goes first). The adapter: one LoRA train step (untimed),
   then, timed, `save_adapter`, `/load_lora_adapter` (trainer/personal.py `load_adapter`)
   and the first 1-token /generate naming it returning; the previous version is unloaded
   after (untimed), as `publish_adapter` does. Full weights: one train step of the whole
   model (untimed), then `save_checkpoint`, `publish_version` (`/update_weights_from_disk`
   + read-back) and the first 1-token /generate returning. Meanwhile a probe client sends
   1-token base-model /generate requests back to back; the pause is the longest probe
   overlapping the load and first request minus the median probe (clawrl/bench/trainer.py's swap
   pause). Reported: medians of each part, and full weights / adapter as the median of the
   per-round ratios (end to end) and the ratio of the median pauses. The shared model's
   adapter version (trainer/policy_adapter.py) is timed beside them the same way: the
   trainer's `save_checkpoint` of the LoRA backend (the adapter folder with its optimizer
   and RNG state, marker last), `/load_lora_adapter` as `policy-vN`, the first request
   naming it; the version before the previous is unloaded after (untimed), as the shared
   trainer does (the `policy_versions` UPDATE that names it is not timed).

Figures are medians over rounds, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import httpx
import psutil
import torch

from clawrl.base.engine_client import policy_adapter_name
from clawrl.base.settings import EngineSettings
from clawrl.bench.trainer import EngineStartError, Prober, engine_process, synthetic_batch
from clawrl.world.pretrain import PREBUILT_DIR
from trainer.adapters import AdapterPublishError, load_adapter, unload_adapter
from trainer.backends.torch import TorchBackend
from trainer.checkpoint import save_checkpoint
from trainer.config import LoraSettings, TrainerSettings
from trainer.policy_adapter import ensure_loaded
from trainer.publish import PublishError, publish_version

PROG = "clawrl bench adapters"
PROMPT_LEN = 16
WEIGHTS = "adapter_model.safetensors"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        print(f"{PROG}: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=PREBUILT_DIR / "tinyworld",
                   help="model dir (default: the tiny world model)")
    p.add_argument("--rounds", type=int, help="rounds per figure (default 5; --quick: 1)")
    p.add_argument("--adapters", help="resident adapter counts (default 1,10,100; --quick: 1,4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, engine and trainer")
    p.add_argument("--concurrency", type=int, help="requests per wave (default 16; --quick: 4)")
    p.add_argument("--new-tokens", type=int, help="tokens per request (default 32; --quick: 8)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a test")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("rounds", 5, 1), ("concurrency", 16, 4), ("new_tokens", 32, 8),
                              ("adapters", "1,10,100", "1,4")):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    for name in ("rounds", "threads", "concurrency", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        counts = [int(c) for c in args.adapters.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        p.error(f"--adapters takes positive integers separated by commas, not {args.adapters!r}")
    args.adapters = sorted(set(counts))
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a model directory (no config.json)")
    return args


def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# -- tokens/s -----------------------------------------------------------------------------------
async def wave(client: httpx.AsyncClient, prompts: list[list[int]],
               loras: list[str | None], new_tokens: int) -> float:
    """Send one request per prompt at once; tokens generated per second of wall time."""

    async def one(ids: list[int], lora: str | None) -> int:
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new_tokens, "ignore_eos": True}}
        if lora is not None:
            body["lora_path"] = lora
        resp = await client.post("/generate", json=body)
        resp.raise_for_status()
        return int(resp.json()["meta_info"]["completion_tokens"])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p, x) for p, x in zip(prompts, loras, strict=True))))
    return tokens / (time.perf_counter() - t0)


async def base_alone(url: str, prompts: list[list[int]], rounds: int, new_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await wave(client, prompts, [None] * len(prompts), new_tokens)  # warm-up
        return statistics.median([await wave(client, prompts, [None] * len(prompts), new_tokens)
                                  for _ in range(rounds)])


async def with_adapters(url: str, prompts: list[list[int]], names: list[str], rounds: int,
                        new_tokens: int) -> dict[str, float]:
    """Waves spread round robin over `names` against base waves, alternating the order."""
    turn = itertools.cycle(names)
    mixed: list[float] = []
    base: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await wave(client, prompts, [next(turn) for _ in prompts], new_tokens)  # warm-up
        for i in range(rounds):
            runs: list[tuple[list[float], list[str | None]]] = [
                (mixed, [next(turn) for _ in prompts]), (base, [None] * len(prompts))]
            for out, loras in runs[:: 1 - 2 * (i % 2)]:
                out.append(await wave(client, prompts, loras, new_tokens))
    return {"adapters_tok_s": statistics.median(mixed), "base_tok_s": statistics.median(base),
            "ratio": statistics.median(m / b for m, b in zip(mixed, base, strict=True))}


def adapter_size(folder: Path) -> tuple[int, int]:
    """(bytes of the A and B tensors, bytes of the safetensors file) of a PEFT folder."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / WEIGHTS))
    return (sum(t.numel() * t.element_size() for t in tensors.values()),
            (folder / WEIGHTS).stat().st_size)


# -- publish to serving -------------------------------------------------------------------------
def first_reply(url: str, lora: str | None) -> None:
    body: dict[str, Any] = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    if lora is not None:
        body["lora_path"] = lora
    httpx.post(url + "/generate", json=body, timeout=600).raise_for_status()


def publish_rounds(url: str, model: Path, work: Path, rounds: int) -> dict[str, list[float]]:
    """Per round: save, load, first-request and end-to-end seconds and the probe pause, for
    the adapter (`a_*`) and for full weights (`f_*`)."""
    engine = EngineSettings(url=url)
    lora = TorchBackend(TrainerSettings(batch_size=2, micro_batch_size=2, kl_coef=0.0,
                                        device="cpu", lora=LoraSettings(enabled=True)))
    lora.load(model)
    lora.fresh_adapter(0)
    full = TorchBackend(TrainerSettings(batch_size=2, micro_batch_size=2, kl_coef=0.0,
                                        device="cpu"))
    full.load(model)
    batch = synthetic_batch(full, 2, 32)
    out: dict[str, list[float]] = {}

    def timed(prefix: str, save: Callable[[], Path], load: Callable[[Path], object],
              lora_name: str | None) -> None:
        with Prober(url) as probe:
            time.sleep(0.5)  # baseline probes
            t0 = time.perf_counter()
            saved = save()
            t1 = time.perf_counter()
            load(saved)
            t2 = time.perf_counter()
            first_reply(url, lora_name)
            t3 = time.perf_counter()
            time.sleep(0.3)
        for key, value in (("save", t1 - t0), ("load", t2 - t1), ("first", t3 - t2),
                           ("e2e", t3 - t0), ("pause", probe.pause(t1, t3))):
            out.setdefault(f"{prefix}_{key}", []).append(value)

    def save_lora(folder: Path) -> Path:
        lora.save_adapter(folder)
        return folder

    previous: str | None = None
    for n in range(1, rounds + 1):
        name, shared = f"bench-v{n}", policy_adapter_name(n)
        lora.train_step(batch)
        full.train_step(batch)
        sides: list[tuple[str, Callable[[], Path], Callable[[Path], object], str | None]] = [
            ("a", partial(save_lora, work / "adapters" / f"v{n}"),
             partial(load_adapter, engine, name), name),
            # The shared model's version as the shared trainer writes and publishes it:
            # the version folder (adapter + trainer_state + RNG, marker last), then loaded.
            ("s", partial(save_checkpoint, lora, work / "shared", n, model),
             partial(ensure_loaded, engine, shared), shared),
            ("f", partial(save_checkpoint, full, work / "weights", n, model),
             partial(publish_version, engine, version=n), None)]
        for prefix, save, load, lora_name in sides[n % 3:] + sides[:n % 3]:
            timed(prefix, save, load, lora_name)
        if previous is not None:  # as publish_adapter does, once the new one serves
            unload_adapter(engine, previous)
        if n > 2:  # as publish_adapter_version does: the previous version stays loaded
            unload_adapter(engine, policy_adapter_name(n - 2))
        previous = name
    return out


# -- the run ------------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> None:
    biggest = args.adapters[-1]
    flags = ("--max-loaded-loras", str(biggest + 2))
    with engine_process(args.model, args.threads, work / "engine.log", *flags) as (url, pid):
        rng = random.Random(0)
        vocab = int(json.loads((args.model / "config.json").read_text())["vocab_size"])
        prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
                   for _ in range(args.concurrency)]
        shape = f"{args.concurrency} requests x {args.new_tokens} tokens"
        base = asyncio.run(base_alone(url, prompts, args.rounds, args.new_tokens))
        print(f"tokens/s, base model alone: {base:,.1f} ({shape}, no adapter loaded)", flush=True)

        maker = TorchBackend(TrainerSettings(device="cpu", kl_coef=0.0,
                                             lora=LoraSettings(enabled=True)))
        maker.load(args.model)
        engine = EngineSettings(url=url)
        names: list[str] = []
        grown = 0
        for count in args.adapters:
            before = rss_bytes(pid)
            for i in range(len(names), count):
                folder = work / "resident" / f"a{i}"
                maker.fresh_adapter(i)
                maker.save_adapter(folder)
                load_adapter(engine, f"user{i}", folder)
                names.append(f"user{i}")
            grown += rss_bytes(pid) - before
            t = asyncio.run(with_adapters(url, prompts, names, args.rounds, args.new_tokens))
            print(f"tokens/s, {count} adapter{'s' * (count > 1)} resident: "
                  f"{t['adapters_tok_s']:,.1f} with requests round robin over them, base "
                  f"requests {t['base_tok_s']:,.1f}: ratio {t['ratio']:.3f} to base (base "
                  f"alone {base:,.1f})", flush=True)
        tensors, file = adapter_size(work / "resident" / "a0")
        print(f"memory per resident adapter: {grown / biggest / 2**20:.3f} MB engine RSS "
              f"({biggest} loaded: +{grown / 2**20:.1f} MB); tensors {tensors / 2**20:.3f} MB, "
              f"safetensors file {file / 2**20:.3f} MB", flush=True)
        del maker

        p = publish_rounds(url, args.model, work, args.rounds)

    def ms(key: str) -> float:
        return 1e3 * statistics.median(p[key])

    print(f"publish to serving, adapter ({biggest} resident): save {ms('a_save'):.0f} ms  load "
          f"{ms('a_load'):.0f} ms  first request {ms('a_first'):.0f} ms  end to end "
          f"{ms('a_e2e'):.0f} ms  pause {ms('a_pause'):.0f} ms (max "
          f"{1e3 * max(p['a_pause']):.0f})")
    print(f"publish to serving, shared-model adapter version: save {ms('s_save'):.0f} ms  "
          f"load {ms('s_load'):.0f} ms  first request {ms('s_first'):.0f} ms  end to end "
          f"{ms('s_e2e'):.0f} ms  pause {ms('s_pause'):.0f} ms (max "
          f"{1e3 * max(p['s_pause']):.0f})")
    print(f"publish to serving, full weights: save {ms('f_save'):.0f} ms  update "
          f"{ms('f_load'):.0f} ms  first request {ms('f_first'):.0f} ms  end to end "
          f"{ms('f_e2e'):.0f} ms  pause {ms('f_pause'):.0f} ms (max "
          f"{1e3 * max(p['f_pause']):.0f})")
    e2e = statistics.median(f / a for f, a in zip(p["f_e2e"], p["a_e2e"], strict=True))
    pause = f"{ms('f_pause') / ms('a_pause'):.1f}x" if ms("a_pause") > 0 else \
        "n/a (the adapter caused no measurable pause)"
    print(f"full weights / adapter: end to end {e2e:.1f}x, pause {pause}")
    e2e = statistics.median(f / a for f, a in zip(p["f_e2e"], p["s_e2e"], strict=True))
    pause = f"{ms('f_pause') / ms('s_pause'):.1f}x" if ms("s_pause") > 0 else \
        "n/a (the adapter caused no measurable pause)"
    print(f"full weights / shared-model adapter version: end to end {e2e:.1f}x, pause {pause}")


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    print(f"model {args.model}  threads {args.threads}  rounds {args.rounds}  adapters "
          f"{','.join(map(str, args.adapters))} (rank {LoraSettings().r}, alpha "
          f"{LoraSettings().alpha})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="clawrl-bench-adapters-"))
    try:
        run(args, work)
    except EngineStartError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except (AdapterPublishError, PublishError, httpx.HTTPError) as exc:  # the engine failed
        print(f"{PROG}: the engine failed: {(str(exc) or repr(exc)).splitlines()[0]}",
              file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
