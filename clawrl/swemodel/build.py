"""Build the SWE track's tiny coding model: `clawrl swemodel build DIR [--small] [--seed N]`.

From a seed, on CPU: the corpus (clawrl/swemodel/corpus.py: scripted agents on the generator's
held-in tasks, played against the real environment), a byte-level BPE tokenizer trained on it,
a Qwen2-style model (the tiny world's, clawrl/world/model.py) trained on it with the loss on
the agents' replies only (the tiny world's loop, clawrl/world/pretrain.py `train_model`),
saved with the tool-call track's compact tools template (clawrl/world/tools.py
`TOOLS_CHAT_TEMPLATE`: one line per tool), and DIR/report.json: what it does in episodes on
held-out and held-in tasks it never saw, sampled at temperature 1 as `clawrl env swe` samples.

Cached like the tiny world's builds: DIR/swemodel.json is written last with the build key; a
build with the same key is skipped. The full build took 41 minutes on 2 shared cores
(docs/results/2026-12-07-swe-model.md); `--small` a minute (plumbing tests).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from clawrl.envs.swe.env import TOOLS
from clawrl.swemodel.corpus import PLANS, Episode, iter_shuffled, play_many
from clawrl.world.tools import TOOLS_CHAT_TEMPLATE, render_template, render_tool_chat

MARKER = "swemodel.json"
REPORT = "report.json"
# Bump when the corpus, the tools or the training change meaning.
VERSION = 1
# Corpus episodes draw train-split tasks from this seed on: `clawrl env swe --split train`
# (seeds 0, 1, ...) then runs tasks the model never saw, of the same template/kind pairs.
FIRST_SEED = 100_000


@dataclass(frozen=True)
class SweConfig:
    """Everything that determines the weights (the cache key)."""

    seed: int = 0
    episodes: int = 2000  # distinct corpus episodes, trained over in reshuffled epochs
    vocab_size: int = 2048  # a 2 KB module is ~800 tokens at 2048 (~900 at 1024)
    hidden_size: int = 128
    layers: int = 4
    context: int = 3072  # max_position_embeddings: prompts past seq_len degrade, not fail
    seq_len: int = 2048  # an episode is 400-1800 tokens
    batch_size: int = 4  # rows of seq_len: ~10 episodes a step
    steps: int = 500
    lr: float = 2e-3
    warmup: int = 30
    eval_episodes: int = 16  # per split, at the end of the build
    eval_steps: int = 8


FULL = SweConfig()
SMALL = SweConfig(episodes=48, vocab_size=512, hidden_size=32, layers=2, seq_len=1024,
                  context=2048, batch_size=2, steps=6, warmup=2, eval_episodes=2,
                  eval_steps=2)


def build_key(config: SweConfig) -> str:
    return hashlib.sha256(json.dumps([asdict(config), VERSION], sort_keys=True)
                          .encode()).hexdigest()[:16]


def is_built(directory: Path, config: SweConfig) -> bool:
    try:
        return bool(json.loads((directory / MARKER).read_text())["key"] == build_key(config))
    except (OSError, ValueError, KeyError):
        return False


def corpus_stats(episodes: list[Episode]) -> dict[str, Any]:
    """How many of each plan, and the share that succeeded (the hidden tests pass)."""
    plans: dict[str, list[float]] = {}
    for e in episodes:
        plans.setdefault(e.plan, []).append(e.outcome)
    return {"episodes": len(episodes),
            "success": round(sum(e.outcome > 0 for e in episodes) / max(1, len(episodes)), 3),
            "plans": {p: {"episodes": len(o), "success": round(sum(x > 0 for x in o) / len(o), 3)}
                      for p, o in sorted(plans.items())}}


def new_model(config: SweConfig, vocab_size: int) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    from clawrl.world.model import model_config

    torch.manual_seed(config.seed)
    cfg = model_config("small", vocab_size)
    cfg.hidden_size, cfg.intermediate_size = config.hidden_size, 4 * config.hidden_size
    cfg.num_hidden_layers = config.layers
    if getattr(cfg, "layer_types", None):  # one per layer (newer transformers check it)
        cfg.layer_types = [cfg.layer_types[0]] * config.layers
    cfg.head_dim = config.hidden_size // cfg.num_attention_heads
    cfg.max_position_embeddings = config.context
    return Qwen2ForCausalLM(cfg)


def build(directory: Path, config: SweConfig = FULL, max_seconds: float | None = None,
          log: Callable[[str], None] = print, threads: int = 1) -> Path:
    """Build the SWE model into `directory` (skipped when this exact build is there)."""
    import torch

    from clawrl.world.model import train_tokenizer
    from clawrl.world.pretrain import train_model

    if is_built(directory, config):
        log(f"{directory}: already built (key {build_key(config)}), skipping")
        return directory
    torch.set_num_threads(threads)
    t0 = time.monotonic()
    seeds = list(range(FIRST_SEED, FIRST_SEED + config.episodes))
    episodes = asyncio.run(play_many(seeds, config.seed))
    stats = corpus_stats(episodes) | {"seconds": round(time.monotonic() - t0, 1)}
    log(f"corpus: {json.dumps(stats)}")
    rendered = [render_tool_chat(e.messages, TOOLS) for e in episodes]
    tokenizer = train_tokenizer([text for text, _ in rendered], config.vocab_size)
    model = new_model(config, tokenizer.get_vocab_size())
    by_episode = {id(e): r for e, r in zip(episodes, rendered, strict=True)}
    examples: Iterator[tuple[str, list[tuple[int, int]]]] = (
        by_episode[id(e)] for e in iter_shuffled(episodes, config.seed))
    model, info = train_model(None, tokenizer, config, max_seconds, log, model=model,
                              rendered=examples)
    log("playing episodes with it ...")
    report = {"config": asdict(config), "corpus": stats, "training": info,
              "episodes": {split: evaluate(model, tokenizer, split, config)
                           for split in ("heldout", "train")}}
    install(directory, model, tokenizer, report, config)
    log(json.dumps({split: {k: v for k, v in r.items() if k != "example"}
                    for split, r in report["episodes"].items()}))
    log(f"built {directory} in {time.monotonic() - t0:.0f}s")
    return directory


def install(directory: Path, model: Any, tokenizer: Any, report: dict[str, Any],
            config: SweConfig) -> None:
    """The model directory, through a sibling temp folder renamed into place; the marker
    last. Its recipe.json is the tool-call model's (clawrl/world/recipe.py): the trainer's
    settings for a tiny agent, without the tiny world's corpus term."""
    from clawrl.world.model import save_model_dir
    from clawrl.world.recipe import RECIPE_FILE, tinyworld_recipe

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(tmp, model, tokenizer, template=TOOLS_CHAT_TEMPLATE)
    (tmp / REPORT).write_text(json.dumps(report, indent=2))
    (tmp / RECIPE_FILE).write_text(json.dumps({"train": tinyworld_recipe(tools=True)},
                                              indent=1) + "\n")
    (tmp / MARKER).write_text(json.dumps({"key": build_key(config), "config": asdict(config),
                                          "plans": PLANS}))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def evaluate(model: Any, tokenizer: Any, split: str, config: SweConfig) -> dict[str, Any]:
    """`eval_episodes` episodes of `split` (seeds 0, 1, …: never in the corpus) played by the
    model at temperature 1, replies parsed by the engine's own parser."""
    return asyncio.run(_evaluate(model, tokenizer, split, config))


async def _evaluate(model: Any, tokenizer: Any, split: str, config: SweConfig,
                    ) -> dict[str, Any]:
    from clawrl.engine.chat import parse_tool_calls
    from clawrl.envs.swe.env import SweEnv
    from clawrl.world.report import generate

    envs = [SweEnv(i, split, max_steps=config.eval_steps) for i in range(config.eval_episodes)]
    convos = [list((await env.reset()).messages) for env in envs]
    live = list(range(len(envs)))
    try:
        for _ in range(config.eval_steps):
            live = [i for i in live if _fits(tokenizer, convos[i], config)]
            if not live:
                break
            texts = generate(model, tokenizer, [convos[i] for i in live], 1.0,
                             max_new_tokens=256, batch_size=8,
                             render=lambda m: render_template(m, TOOLS, True))
            for i, text in zip(live, texts, strict=True):
                content, calls = parse_tool_calls(text, TOOLS)
                reply: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    reply["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")}
                                           for c in calls]
                step = await envs[i].step(reply)
                convos[i] += [reply, *step.messages]
            live = [i for i in live if not envs[i].ended_by]
        outcomes = [await env.outcome() for env in envs]
        details = [env.details() for env in envs]
    finally:
        for env in envs:
            await env.close()
    n = len(envs)
    return {"episodes": n, "success": round(sum(o > 0 for o in outcomes) / n, 3),
            "finished": round(sum(d["finished"] for d in details) / n, 3),
            "tested_before_finish": round(sum(d["tested_before_finish"] for d in details) / n, 3),
            "edits": round(sum(d["edits"] for d in details) / n, 2),
            "edit_errors": round(sum(d["edit_errors"] for d in details) / n, 2),
            "solved": sorted(envs[i].task.name for i in range(n) if outcomes[i] > 0),
            "example": convos[0][2:]}


def _fits(tokenizer: Any, messages: list[dict[str, Any]], config: SweConfig) -> bool:
    """Whether the prompt leaves room for a reply in the context (the engine refuses one
    that does not)."""
    prompt = render_template(messages, TOOLS, True)
    return len(tokenizer.encode(prompt).ids) + 256 <= config.context


def build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="clawrl swemodel build",
                                     description="pretrain the SWE track's tiny coding model")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--small", action="store_true", help="the test-sized build (a minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="override the step count")
    parser.add_argument("--minutes", type=float, default=None, help="cap on training time")
    parser.add_argument("--force", action="store_true", help="build even if cached")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (2 is faster on an idle 2-core machine)")
    args = parser.parse_args(argv)
    config = replace(SMALL if args.small else FULL, seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            print("clawrl swemodel build: --steps must be >= 1", file=sys.stderr)
            return 2
        config = replace(config, steps=args.steps)
    if args.force:
        (args.dir / MARKER).unlink(missing_ok=True)
    try:
        build(args.dir, config, None if args.minutes is None else args.minutes * 60,
              threads=max(1, args.threads))
    except OSError as exc:
        print(f"clawrl swemodel build: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """`clawrl swemodel build DIR ...`"""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: clawrl swemodel build DIR [--small] [--seed N] [--steps N] [--threads N]\n"
              "  build  the SWE track's tiny coding model (~30 min; --small a minute)")
        return 0 if argv else 2
    if argv[0] != "build":
        print(f"clawrl swemodel: unknown subcommand {argv[0]!r} (build)", file=sys.stderr)
        return 2
    return build_main(argv[1:])
