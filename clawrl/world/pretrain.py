"""Pretrain the tiny world model: `clawrl tinyworld build DIR [--small] [--seed N] [--minutes M]`.

Builds, reproducibly from a seed and on CPU, a byte-level BPE tokenizer trained on the
synthetic corpus (clawrl/world/corpus.py), a Qwen2-style model (clawrl/world/model.py sizes:
"small" ~1.8M parameters for the full build, "test" for `--small`) trained with the loss on
assistant tokens only, and DIR/report.json: what it learned (answer accuracy on held-out
questions, base style rates, hint following, judge and hint-extraction accuracy).

Cached: DIR/tinyworld.json is written last and records the build key (config + corpus code
hash); a build with the same key is skipped. The build writes into DIR.tmp and renames it
into place, so a reader never sees half a model. The full build takes ~10 minutes on 2
cores; `--ci` ~5 minutes (what `clawrl eval --small` learns with); `--small` ~30-60 s
(plumbing tests). `--minutes` caps training time (stopping early makes the
weights depend on the machine's speed; report.json says so).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from clawrl.world.corpus import TEMPLATE_DIR, Message, iter_examples, render_chatml
from clawrl.world.town import World

MARKER = "tinyworld.json"
REPORT = "report.json"


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the weights (part of the cache key)."""

    seed: int = 0
    size: str = "small"  # clawrl.world.model.SIZES, then overridden by hidden_size below
    hidden_size: int = 128  # 0 = keep the size's; 128 x 4 layers ~1.1M parameters
    vocab_size: int = 768
    tokenizer_examples: int = 4000
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1600
    lr: float = 3e-3
    warmup: int = 30
    eval_cases: int = 96


FULL = BuildConfig()
# CI-sized: the same model trained half as long (~5 min on 2 cores). A judge good enough for
# `clawrl eval --small` to show learning (report.json: PRM ~0.9 on corpus phrasings).
CI = replace(FULL, steps=800, eval_cases=48)
# Test-sized: seconds. Loadable and plumbed like the others, but it has not learned to judge.
SMALL = BuildConfig(size="test", hidden_size=0, tokenizer_examples=1500, steps=60, lr=5e-3,
                    eval_cases=12)


@dataclass(frozen=True)
class ToolsConfig:
    """The tool-call model (`clawrl tinyworld build DIR --tools`): the full build trained
    further on its own corpus mixed with tool-call episodes (clawrl/world/tools.py), saved
    with the compact tools chat template. Longer rows: an episode is 250-450 tokens."""

    seed: int = 0
    # Share of examples that are tool-call episodes. At 0.5 the model read one template blind
    # ("Tell me about X's pet." and "... X's work." alike: p(`job`) 0.81 at the attribute);
    # at 0.75 a forced lookup names the right attribute at p 0.999 (docs/eval.md).
    tool_share: float = 0.75
    seq_len: int = 512
    batch_size: int = 16
    # 600 steps left the model reading questions loosely: the right attribute of a forced
    # lookup got p 0.88 on average, so a sampled lookup missed about one in eight, and the
    # tool-call track's success stopped short of 0.9; 1200 gave p 0.95 (docs/eval.md).
    steps: int = 1200
    lr: float = 1e-3
    warmup: int = 20
    eval_episodes: int = 64


TOOLS_BUILD = ToolsConfig()


class TrainConfig(Protocol):
    """What the training loop (`train_model`) reads of a build's config: BuildConfig,
    ToolsConfig, and the SWE model's (clawrl/swemodel/build.py)."""

    @property
    def seed(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def warmup(self) -> int: ...


# Bump when the tool episodes, the tools or their template change meaning.
TOOLS_VERSION = 1


# Bump when the corpus or training changes meaning: a cached build with another version is
# rebuilt. (Not a hash of the code, so unrelated edits do not throw away a 10-minute build.)
CORPUS_VERSION = 3


def build_key(config: BuildConfig | ToolsConfig) -> str:
    """Hash of the config, the corpus version and the judge templates the corpus renders
    (a tools build: its config, `TOOLS_VERSION` and the key of the full build it starts
    from)."""
    if isinstance(config, ToolsConfig):
        return hashlib.sha256(json.dumps([asdict(config), TOOLS_VERSION, build_key(FULL)],
                                         sort_keys=True).encode()).hexdigest()[:16]
    h = hashlib.sha256(json.dumps([asdict(config), CORPUS_VERSION], sort_keys=True).encode())
    for path in sorted(TEMPLATE_DIR.glob("*_v1.txt")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


# Builds shipped with the package (clawrl/world/prebuilt/<name>/, made by `clawrl tinyworld
# build`): a first `clawrl up` copies the one whose key matches instead of pretraining.
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"


def prebuilt(config: BuildConfig | ToolsConfig) -> Path | None:
    """The shipped build of exactly `config` (same key), if there is one."""
    if not PREBUILT_DIR.is_dir():
        return None
    return next((d for d in sorted(PREBUILT_DIR.iterdir()) if is_built(d, config)), None)


def is_built(directory: Path, config: BuildConfig | ToolsConfig) -> bool:
    marker = directory / MARKER
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text())["key"] == build_key(config))
    except (ValueError, KeyError):
        return False


# --- data --------------------------------------------------------------------------------


def encode(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated messages and a 0/1 loss mask (assistant tokens)."""
    return encode_rendered(tokenizer, *render_chatml(messages))


def encode_rendered(tokenizer: Any, text: str,
                    spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Token ids of `text` and a 0/1 loss mask: 1 on tokens starting inside a span."""
    enc = tokenizer.encode(text)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    return list(enc.ids), mask


def iter_batches(world: World | None, tokenizer: Any, config: TrainConfig,
                 stats: dict[str, int],
                 rendered: Iterator[tuple[str, list[tuple[int, int]]]] | None = None,
                 ) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
    """Rows of whole examples packed first-fit into `seq_len` tokens, `batch_size` rows each.

    Examples share a row without an attention barrier (each starts with `<|im_start|>`, and
    the model learns to read from the latest one); an example longer than a row is dropped.
    `rendered`: (text, loss spans) examples to pack instead of the corpus's.
    """
    if rendered is None:
        assert world is not None, "the world's corpus, or `rendered` examples"
        rendered = (render_chatml(m) for _, m in iter_examples(world, config.seed))
    carry: list[tuple[list[int], list[int]]] = []
    while True:
        ids: list[list[int]] = [[] for _ in range(config.batch_size)]
        masks: list[list[int]] = [[] for _ in range(config.batch_size)]
        misses = 0
        while misses < 8:
            ex_ids, ex_mask = carry.pop() if carry else encode_rendered(tokenizer,
                                                                         *next(rendered))
            if len(ex_ids) > config.seq_len:
                stats["dropped"] = stats.get("dropped", 0) + 1
                continue
            row = next((i for i, r in enumerate(ids)
                        if len(r) + len(ex_ids) <= config.seq_len), None)
            if row is None:
                carry.append((ex_ids, ex_mask))
                misses += 1
                continue
            ids[row] += ex_ids
            masks[row] += ex_mask
            stats["examples"] = stats.get("examples", 0) + 1
        yield ids, masks


def to_tensors(ids: list[list[int]], masks: list[list[int]], seq_len: int,
               pad_id: int) -> dict[str, Any]:
    """input_ids / attention_mask / labels [B, T]; labels are NOT shifted (HF shifts them)."""
    import torch

    def pad(rows: list[list[int]], value: int) -> Any:
        return torch.tensor([r + [value] * (seq_len - len(r)) for r in rows])

    input_ids = pad(ids, pad_id)
    labels = torch.where(pad(masks, 0).bool(), input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": input_ids, "attention_mask": pad([[1] * len(r) for r in ids], 0),
            "labels": labels}


# --- build -------------------------------------------------------------------------------


def train_world_tokenizer(world: World, config: BuildConfig) -> Any:
    from clawrl.world.model import IM_END, IM_START, train_tokenizer

    examples = iter_examples(world, config.seed + 10_000)
    texts = []
    for _ in range(config.tokenizer_examples):
        messages = next(examples)[1]
        texts += [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
    return train_tokenizer(texts, config.vocab_size)


def lr_at(step: int, config: TrainConfig, time_progress: float = 0.0) -> float:
    """Linear warmup, then cosine decay to 10% of the peak.

    Progress is the larger of step progress and time progress (elapsed / time cap), so a
    build that hits its time cap still ends with an annealed learning rate.
    """
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = max((step - config.warmup) / max(1, config.steps - config.warmup), time_progress)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def new_model(config: BuildConfig, tokenizer: Any) -> Any:
    """A randomly initialised model of `config`'s size (seeded)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from clawrl.world.model import model_config

    torch.manual_seed(config.seed)
    model_cfg = model_config(config.size, tokenizer.get_vocab_size())
    if config.hidden_size:
        model_cfg.hidden_size = config.hidden_size
        model_cfg.intermediate_size = 4 * config.hidden_size
        model_cfg.head_dim = config.hidden_size // model_cfg.num_attention_heads
    return Qwen2ForCausalLM(model_cfg)


def train_model(world: World | None, tokenizer: Any, config: TrainConfig,
                max_seconds: float | None, log: Callable[[str], None], model: Any = None,
                rendered: Iterator[tuple[str, list[tuple[int, int]]]] | None = None,
                ) -> tuple[Any, dict[str, Any]]:
    """Train `model` (default: a new one of `config`'s size) on the corpus (or `rendered`)."""
    import torch

    from clawrl.world.model import ENDOFTEXT

    if model is None:
        assert isinstance(config, BuildConfig)
        model = new_model(config, tokenizer)
    torch.manual_seed(config.seed)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=config.lr, betas=(0.9, 0.95))
    pad_id = tokenizer.token_to_id(ENDOFTEXT)
    stats: dict[str, int] = {}
    batches = iter_batches(world, tokenizer, config, stats, rendered)
    log(f"model: {params / 1e6:.2f}M parameters, {config.steps} steps of "
        f"{config.batch_size}x{config.seq_len} tokens")
    model.train()
    start = time.monotonic()
    tokens = 0
    losses: list[float] = []
    step = 0
    for step in range(config.steps):
        batch = to_tensors(*next(batches), config.seq_len, pad_id)
        time_progress = (time.monotonic() - start) / max_seconds if max_seconds else 0.0
        lr = lr_at(step, config, time_progress)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(batch["attention_mask"].sum())
        elapsed = time.monotonic() - start
        if step % 10 == 0 or step == config.steps - 1:
            eta = elapsed / (step + 1) * (config.steps - step - 1)
            log(f"step {step + 1}/{config.steps} loss {sum(losses[-10:]) / len(losses[-10:]):.3f}"
                f" lr {lr:.1e} {tokens / elapsed:,.0f} tok/s"
                f" elapsed {elapsed:.0f}s eta {eta:.0f}s")
        if max_seconds and elapsed > max_seconds and step < config.steps - 1:
            log(f"time cap reached after {step + 1} steps; stopping early")
            break
    model.eval()
    info = {"parameters": params, "steps_done": step + 1, "tokens": tokens,
            "seconds": round(time.monotonic() - start, 1), "final_loss": round(
                sum(losses[-20:]) / len(losses[-20:]), 4),
            "stopped_early": step + 1 < config.steps, **stats}
    return model, info


def build(directory: Path, config: BuildConfig, max_seconds: float | None = None,
          log: Callable[[str], None] = print, threads: int = 1,
          use_prebuilt: bool = True) -> Path:
    """Build the tiny world model into `directory` (skipped when already built; copied when
    the package ships this exact build and `use_prebuilt`)."""
    import torch

    from clawrl.world.report import evaluate_model

    if is_built(directory, config):
        log(f"{directory}: already built (key {build_key(config)}), skipping")
        return directory
    if use_prebuilt and max_seconds is None and copy_shipped(directory, config, log):
        return directory
    # One thread by default: on a shared, oversubscribed CPU a second OpenMP thread spends
    # its share spinning at barriers (measured: 1 thread ~1.7x faster at load 10 on 2 cores).
    torch.set_num_threads(threads)
    world = World.build(config.seed)
    t0 = time.monotonic()
    tokenizer = train_world_tokenizer(world, config)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.monotonic() - t0:.1f}s")
    model, info = train_model(world, tokenizer, config, max_seconds, log)
    log("evaluating what it learned ...")
    report = {"config": asdict(config), "training": info,
              **evaluate_model(model, tokenizer, world, config.eval_cases, config.seed)}
    install(directory, model, tokenizer, report, {"config": asdict(config)}, config)
    log(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
    log(f"built {directory}")
    return directory


def install(directory: Path, model: Any, tokenizer: Any, report: dict[str, Any],
            marker: dict[str, Any], config: BuildConfig | ToolsConfig,
            template: str | None = None) -> None:
    """Write the model, `report` and the build marker (`marker` plus the key of `config`,
    written last) into `directory`, through a sibling temp folder renamed into place."""
    from clawrl.world.model import CHAT_TEMPLATE, save_model_dir
    from clawrl.world.recipe import write_recipe

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(tmp, model, tokenizer, template=template or CHAT_TEMPLATE)
    (tmp / REPORT).write_text(json.dumps(report, indent=2))
    tools = marker.get("tools")
    write_recipe(tmp, int(marker["config"]["seed"]),
                 float(tools["tool_share"]) if tools else 0.0)
    (tmp / MARKER).write_text(json.dumps({"key": build_key(config), **marker}))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def copy_shipped(directory: Path, config: BuildConfig | ToolsConfig,
                 log: Callable[[str], None]) -> bool:
    """Copy the package's build of exactly `config` into `directory`, if it ships one."""
    shipped = prebuilt(config)
    if shipped is None:
        return False
    # The same build, shipped in the package: copied, not retrained (seconds, not minutes).
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shipped, tmp)
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    log(f"{directory}: copied the shipped build {shipped.name} (key {build_key(config)})")
    return True


def tool_mix(world: World, config: ToolsConfig) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """The tools build's examples, rendered: tool episodes (`tool_share`) among the corpus's."""
    from clawrl.world.tools import render_tool_chat, tool_episode

    rng = random.Random(f"tools-{config.seed}")
    corpus = iter_examples(world, config.seed + 20_000)
    while True:
        if rng.random() < config.tool_share:
            yield render_tool_chat(tool_episode(world, rng))
        else:
            yield render_chatml(next(corpus)[1])


def build_tools(directory: Path, config: ToolsConfig = TOOLS_BUILD,
                max_seconds: float | None = None, log: Callable[[str], None] = print,
                threads: int = 1, use_prebuilt: bool = True) -> Path:
    """Build the tool-call model into `directory`: the full build (shipped, or built beside
    it), trained further on `tool_mix`; cached and shipped like the others."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

    from clawrl.world.report import evaluate_tools
    from clawrl.world.tools import TOOLS_CHAT_TEMPLATE

    if is_built(directory, config):
        log(f"{directory}: already built (key {build_key(config)}), skipping")
        return directory
    if use_prebuilt and max_seconds is None and copy_shipped(directory, config, log):
        return directory
    base = prebuilt(FULL) or build(directory.with_name(directory.name + ".base"), FULL, log=log,
                                   threads=threads)
    torch.set_num_threads(threads)
    world = World.build(FULL.seed)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    model = Qwen2ForCausalLM.from_pretrained(str(base))
    log(f"tools: training {base} further on tool episodes ({config.tool_share:.0%})")
    model, info = train_model(world, tokenizer, config, max_seconds, log, model=model,
                              rendered=tool_mix(world, config))
    log("evaluating its tool use ...")
    report = {"config": asdict(config), "base_key": build_key(FULL), "training": info,
              "tools": evaluate_tools(model, tokenizer, world, config.eval_episodes,
                                      config.seed)}
    install(directory, model, tokenizer, report,
            {"config": asdict(FULL), "tools": asdict(config)}, config, TOOLS_CHAT_TEMPLATE)
    log(json.dumps(report["tools"], indent=1))
    log(f"built {directory}")
    return directory


def build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="clawrl tinyworld build",
                                     description="pretrain the tiny world model (cached)")
    parser.add_argument("dir", type=Path)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="the test-sized model (seconds)")
    size.add_argument("--ci", action="store_true",
                      help="the CI-sized model (~5 min; what `clawrl eval --small` uses)")
    size.add_argument("--tools", action="store_true",
                      help="the tool-call model: the full build trained further on tool "
                           "episodes (about 16 min on 2 cores with --threads 2; `clawrl eval --track "
                           "toolcall`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=None,
                        help="cap on training time (default: run all steps)")
    parser.add_argument("--steps", type=int, default=None, help="override the step count")
    parser.add_argument("--force", action="store_true",
                        help="pretrain even if cached or shipped prebuilt")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (2 is faster on an idle 2-core machine)")
    args = parser.parse_args(argv)
    config: BuildConfig | ToolsConfig = (
        replace(TOOLS_BUILD, seed=args.seed) if args.tools else
        replace(SMALL if args.small else CI if args.ci else FULL, seed=args.seed))
    if args.steps is not None:
        if args.steps < 1:
            print("clawrl tinyworld build: --steps must be >= 1", file=sys.stderr)
            return 2
        config = replace(config, steps=args.steps)
    if args.force:
        (args.dir / MARKER).unlink(missing_ok=True)
    seconds = None if args.minutes is None else args.minutes * 60
    try:
        if isinstance(config, ToolsConfig):
            build_tools(args.dir, config, seconds, threads=max(1, args.threads),
                        use_prebuilt=not args.force)
        else:
            build(args.dir, config, seconds, threads=max(1, args.threads),
                  use_prebuilt=not args.force)
    except OSError as exc:
        print(f"clawrl tinyworld build: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    return 0
