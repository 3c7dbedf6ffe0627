"""`clawrl eval`: measure that the whole loop learns, with simulated users over HTTP.

    clawrl eval [--model DIR | --small] [--methods combine,rl,opd,none] [--rounds 8]
                [--prefs lowercase,brief] [--seeds 0,1,2] [--out runs/eval-...]

For each method, on the same seeds: start a fresh stack (Postgres database, embedded engine
serving the pretrained tiny world model, proxy, and — except for `none` — the judge engine
with the frozen judge model (`--no-judge-engine`: the policy judges itself), the judge worker
and the trainer with that method), create one user and API key per simulated user, then
repeat for `--rounds` rounds: the users chat (clawrl/world/simulate.py: questions,
corrections of their hidden preference, praise; in words from `--followups`, by default the
pool people wrote apart from the corpus and the judge's training set) until the judge has produced a full training batch; the trainer trains
it and publishes the next weight version (one version per round; the trainer is told to
train full batches, or a partial one after 45 s
when the users stop producing signal); then every user probes held-out prompts as side turns. Round 0 is
the base model; `none` chats `--sessions` sessions per user per round and never trains.
Each user holds `--parallel` conversations at once (a chat app has many users; the engine
batches their requests), each with its own seeded RNG.

`--seeds` repeats the whole run per seed (users, questions, phrasings, trainer seed), each
seed's stacks under `<out>/seed-N/`.

Output in `--out`: results.json (every probe with the served version's training stats,
the settings and the target summary), a table on stdout
(round x method x user: satisfaction, with weight version and task accuracy; the mean over
seeds), curve.png (satisfaction per round, one line per method and preference, the band
spanning the seeds), and the targets of the evaluation issue per method and seed: the first
round each preference reaches 0.9, and how far answer accuracy fell below the base model's.

The model defaults to `<state_dir>/models/tinyworld` (built with `clawrl tinyworld build`
when missing); `--small` is a CI-sized run: the CI-sized build (`tinyworld build --ci`,
`<state_dir>/models/tinyworld-ci`), `combine` against `none`, one lowercase-loving user, 4
rounds, 32 samples per version, corpus follow-ups and the policy judging itself. Postgres: `CLAWRL_DATABASE__URL`
(a fresh database per method is created on that server), else an embedded server per method.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from clawrl.base.signals import sigterm_as_interrupt
from clawrl.cli.stack import is_model_name
from clawrl.eval.attack import attack_summary
from clawrl.eval.config import (
    ALL_METHODS,
    ATTACK_METHODS,
    METHODS,
    PERSONAL,
    PERSONAL_PREFS,
    SMALL_BATCH,
    SMALL_ROUNDS,
    TOOLCALL_BASELINE,
    TOOLCALL_LR,
    TOOLCALL_METHODS,
    TRACKS,
    EvalConfig,
    method_recipe,
)
from clawrl.eval.everyday import DEFAULT_PREFS as EVERYDAY_DEFAULT_PREFS
from clawrl.eval.everyday import EVERYDAY_BATCH
from clawrl.eval.everyday import PREFS as EVERYDAY_PREFS
from clawrl.eval.report import plot_curve, print_table, print_targets, targets
from clawrl.world.recipe import PERSONAL_RECIPE, TINYWORLD_RECIPE
from clawrl.world.simulate import phrasings
from clawrl.world.town import PREFERENCES


def is_real_model(model: Path) -> bool:
    """`--model smollm2-135m` (a name `clawrl models pull` makes, no folder here) or a model
    folder that is not a tiny world build: people asking everyday questions
    (clawrl/eval/everyday.py) instead of the tiny world's users."""
    if is_model_name(model):
        return True
    return (model / "config.json").is_file() and not (model / "tinyworld.json").is_file()


def parse_args(argv: list[str]) -> EvalConfig:
    from clawrl.base.settings import load_settings

    p = argparse.ArgumentParser(prog="clawrl eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model dir (default <state_dir>/models/tinyworld)")
    p.add_argument("--small", action="store_true",
                   help="a CI-sized run: the CI-sized model (<state_dir>/models/tinyworld-ci, "
                        "~5 min to build once), and unless given: --methods combine,none "
                        f"--prefs lowercase --rounds {SMALL_ROUNDS}")
    p.add_argument("--methods", default=None,
                   help=f"default {','.join(METHODS)} (--personal: combine,personal,none)")
    p.add_argument("--prefs", default=None,
                   help="hidden preferences, one simulated user each "
                        f"({', '.join(PREFERENCES)}; default lowercase,brief; --personal: "
                        f"{','.join(PERSONAL_PREFS)})")
    p.add_argument("--track", choices=TRACKS, default="chat",
                   help="chat: simulated people (the default); toolcall: an agent answering "
                        "tiny-world questions with lookup/answer tools through the proxy, "
                        "judged step by step and verified at the end (the tool-call model, "
                        "<state_dir>/models/tinyworld-tools; --methods "
                        f"{','.join(TOOLCALL_METHODS)})")
    p.add_argument("--personal", action="store_true",
                   help="users with conflicting preferences: the shared model (combine) "
                        "against one LoRA adapter per user (personal) and no training")
    p.add_argument("--attack", action="store_true",
                   help="honest users (--prefs) beside one adversary who uses every lever a "
                        "user key has to teach everyone garbled text; the product as it ships "
                        "(defended) against its defences off (undefended); default 10 rounds")
    p.add_argument("--users-per-pref", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of chat -> train -> probe (default 8)")
    p.add_argument("--parallel", type=int, default=4,
                   help="concurrent chat sessions per simulated user")
    p.add_argument("--sessions", type=int, default=8,
                   help="chat sessions per user per round for `none` (trained methods chat "
                        "until a full batch is ready)")
    p.add_argument("--probes", type=int, default=64, help="held-out prompts per user per probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None,
                   help="run everything once per seed, e.g. 0,1,2 (overrides --seed)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"trainer learning rate (default {EvalConfig.lr}; --track toolcall: "
                        f"{TOOLCALL_LR})")
    p.add_argument("--adapter-lr", type=float, default=EvalConfig.adapter_lr,
                   help="--personal: the per-user adapters' learning rate")
    p.add_argument("--kl-coef", type=float, default=None,
                   help="the KL to the base model, for every method (default: each method's "
                        f"recipe, clawrl/world/recipe.py: {TINYWORLD_RECIPE['kl_coef']}, "
                        f"--personal's adapters {PERSONAL_RECIPE['kl_coef']})")
    p.add_argument("--ptx-coef", type=float, default=None,
                   help="weight of the tiny world's own corpus mixed into every step, for "
                        "every method (the trainer's ptx_coef, trainer/ptx.py; default: each "
                        f"method's recipe, {TINYWORLD_RECIPE['ptx_coef']}, --personal's "
                        f"adapters and --track toolcall 0); 0: none")
    p.add_argument("--replay-coef", type=float, default=EvalConfig.replay_coef,
                   help="weight of the accepted samples replayed in every step (the trainer's "
                        "replay_coef, trainer/data.py replay_batch); 0: none")
    p.add_argument("--mini-batches", type=int, default=EvalConfig.mini_batches,
                   help="optimizer steps per version, each on a slice of the batch (the "
                        "trainer's mini_batches)")
    p.add_argument("--reward-baseline", choices=("none", "batch_mean", "group_mean",
                                                  "user_mean"),
                   default=None,
                   help="subtract the batch's mean reward from each sample's, or (group_mean) "
                        "that of the samples of its task (the trainer's reward_baseline; "
                        "default: the trainer's, batch_mean for --personal's adapters, for the "
                        "shared model user_mean (none for a batch of one user); --track "
                        f"toolcall: {TOOLCALL_BASELINE})")
    p.add_argument("--group", type=int, default=EvalConfig.group,
                   help="--track toolcall: training episodes per question (each wave runs "
                        "every question this many times; with --reward-baseline group_mean "
                        "they are compared with each other)")
    p.add_argument("--probe-split", choices=("heldout", "train"), default="heldout",
                   help="--track toolcall: probe held-out questions (the default, the figure "
                        "to report) or held-in ones (a dev check to tune settings on)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"samples per version, per user with --personal (default "
                        f"{EvalConfig.batch_size}; {SMALL_BATCH} with --small)")
    p.add_argument("--round-timeout", type=float, default=900.0)
    p.add_argument("--keep-db", action="store_true",
                   help="keep each method's database (URL in <out>/<method>/database.txt) "
                        "to look at turns, judgments and hints with SQL afterwards")
    p.add_argument("--followups", choices=("corpus", "people", "issue"), default=None,
                   help="what the simulated users say: the tiny world's phrasings, a pool "
                        "people wrote apart from the corpus and the judge's training set "
                        "(the default), or the judge issue's user (\"thanks, perfect.\" / "
                        "\"please answer in lowercase only, no capital letters.\"; --prefs "
                        "lowercase); --small: corpus")
    p.add_argument("--judge-engine", action=argparse.BooleanOptionalAction, default=None,
                   help="judge with the frozen judge model on its own engine, as clawrl up "
                        "does (the default); --no-judge-engine: the policy model judges "
                        "itself (the --small default: the CI-sized run starts one engine "
                        "less)")
    p.add_argument("--out", type=Path, default=None, help="output dir (default runs/eval-TIME)")
    p.add_argument("--proxy-url", help="connect to a running stack's proxy (with --engine-url "
                   "and CLAWRL_DATABASE__URL) instead of starting one per method")
    p.add_argument("--engine-url", help="the running stack's engine (to read weight versions)")
    args = p.parse_args(argv)
    toolcall = args.track == "toolcall"
    if toolcall and (args.small or args.personal or args.prefs or args.followups):
        raise SystemExit("clawrl eval: --track toolcall takes none of --small, --personal, "
                         "--prefs, --followups")
    everyday = args.model is not None and is_real_model(args.model)
    extra_env: dict[str, str] = {}
    if everyday:
        if toolcall or args.small or args.personal or args.attack or args.followups:
            raise SystemExit("clawrl eval: a real model (--model NAME) takes none of --track "
                             "toolcall, --small, --personal, --attack, --followups")
        # The model's own recipe, except what the command line says.
        for flag, name in (("lr", "LR"), ("kl_coef", "KL_COEF"), ("ptx_coef", "PTX_COEF"),
                           ("reward_baseline", "REWARD_BASELINE")):
            if getattr(args, flag) is not None:
                extra_env[f"CLAWRL_TRAINER__{name}"] = str(getattr(args, flag))
        if args.mini_batches != EvalConfig.mini_batches:
            extra_env["CLAWRL_TRAINER__MINI_BATCHES"] = str(args.mini_batches)
        args.methods = args.methods or "combine,none"
        args.prefs = args.prefs or ",".join(EVERYDAY_DEFAULT_PREFS)
        args.rounds = 10 if args.rounds is None else args.rounds
        args.batch_size = args.batch_size or EVERYDAY_BATCH
        args.followups = "people"
    if args.lr is None:
        args.lr = TOOLCALL_LR if toolcall else EvalConfig.lr
    if args.reward_baseline is None and toolcall:
        args.reward_baseline = TOOLCALL_BASELINE
    if not (toolcall or everyday) and args.probe_split != "heldout":
        raise SystemExit("clawrl eval: --probe-split is for --track toolcall")
    if toolcall and args.proxy_url:
        raise SystemExit("clawrl eval: --track toolcall starts its own stacks (no --proxy-url)")
    if args.attack and (toolcall or args.personal or args.proxy_url):
        raise SystemExit("clawrl eval: --attack runs its own methods (defended, undefended) "
                         "on stacks of its own, on the chat track")
    if args.attack:
        args.methods = args.methods or ",".join(ATTACK_METHODS)
        args.rounds = 10 if args.rounds is None else args.rounds
    if args.methods is None:
        args.methods = (",".join(TOOLCALL_METHODS) if toolcall else
                        "combine,none" if args.small else
                        f"combine,{PERSONAL},none" if args.personal else ",".join(METHODS))
    if args.prefs is None:  # (the judge issue's user only ever asks for lowercase)
        args.prefs = ("lowercase" if args.small or args.followups == "issue" else
                      ",".join(PERSONAL_PREFS) if args.personal else "lowercase,brief")
    if args.followups is None:
        args.followups = "corpus" if args.small else "people"
    if args.judge_engine is None:
        args.judge_engine = not args.small
    if args.rounds is None:
        args.rounds = SMALL_ROUNDS if args.small else 8
    if args.batch_size is None:
        args.batch_size = SMALL_BATCH if args.small else EvalConfig.batch_size
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    prefs = tuple(x.strip() for x in args.prefs.split(",") if x.strip())
    known = TOOLCALL_METHODS if toolcall else ATTACK_METHODS if args.attack else ALL_METHODS
    bad = [m for m in methods if m not in known] + [
        x for x in prefs if x not in (EVERYDAY_PREFS if everyday else PREFERENCES)]
    if bad or not methods or not prefs:
        raise SystemExit(f"clawrl eval: unknown or missing method/preference: {bad or 'none'}")
    says = phrasings(args.followups)
    for pref in () if everyday else prefs:
        try:
            says.correction(pref, random.Random(0))
        except (ValueError, KeyError):
            raise SystemExit(f"clawrl eval: --followups {args.followups} has no corrections "
                             f"for {pref!r}") from None
    try:
        seeds = tuple(int(x) for x in (args.seeds or str(args.seed)).split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"clawrl eval: --seeds takes integers like 0,1,2, not {args.seeds!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"clawrl eval: --seeds needs distinct integers, got {args.seeds!r}")
    if args.proxy_url and len(seeds) > 1:
        raise SystemExit("clawrl eval: --seeds needs a stack per seed; a running stack "
                         "(--proxy-url) is measured once")
    if bool(args.proxy_url) != bool(args.engine_url):
        raise SystemExit("clawrl eval: --proxy-url and --engine-url go together")
    if min(args.rounds, args.sessions, args.probes, args.users_per_pref, args.batch_size,
           args.parallel, args.mini_batches, args.group) < 1:
        raise SystemExit("clawrl eval: --rounds, --sessions, --parallel, --probes, "
                         "--users-per-pref, --batch-size, --mini-batches and --group must be "
                         ">= 1")
    if min(args.kl_coef or 0, args.ptx_coef or 0, args.replay_coef) < 0:
        raise SystemExit("clawrl eval: --kl-coef, --ptx-coef and --replay-coef must be >= 0")
    state = load_settings().state_dir
    if everyday and is_model_name(args.model):
        args.model = state / "models" / str(args.model)
    model = args.model or state / "models" / ("tinyworld-tools" if toolcall else
                                              "tinyworld-ci" if args.small else "tinyworld")
    out = args.out or Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    return EvalConfig(model=model, default_model=args.model is None, out=out, methods=methods,
                      prefs=prefs,
                      users_per_pref=args.users_per_pref, rounds=args.rounds,
                      sessions=args.sessions, parallel=args.parallel, probes=args.probes,
                      seed=seeds[0], seeds=seeds,
                      lr=args.lr, adapter_lr=args.adapter_lr, kl_coef=args.kl_coef,
                      ptx_coef=args.ptx_coef, replay_coef=args.replay_coef,
                      reward_baseline=args.reward_baseline,
                      mini_batches=args.mini_batches, group=args.group,
                      probe_split=args.probe_split,
                      batch_size=args.batch_size, full_batches=not args.small,
                      round_timeout_s=args.round_timeout, proxy_url=args.proxy_url,
                      keep_db=args.keep_db, followups=args.followups,
                      engine_url=args.engine_url, judge_engine=args.judge_engine,
                      judge_state_dir=state,
                      extra_env={"SMALL": "1"} if args.small else extra_env,
                      track=args.track, attack=args.attack, everyday=everyday)


def main(argv: list[str]) -> int:
    from clawrl.eval.stack import StackError, ensure_model

    try:
        config = parse_args(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        return int(exc.code or 0)
    config.out.mkdir(parents=True, exist_ok=True)
    try:
        ensure_model(config.model, small=bool(config.extra_env.pop("SMALL", "")),
                     tools=config.track == "toolcall", default=config.default_model,
                     everyday=config.everyday)
    except (OSError, RuntimeError, StackError) as exc:
        print(f"clawrl eval: cannot build the model at {config.model}: {exc}", file=sys.stderr)
        return 1
    # SIGTERM stops like Ctrl-C: the current stack is shut down and partial results written.
    with sigterm_as_interrupt():
        return run_eval(config)


def run_eval(config: EvalConfig) -> int:
    """Every method in turn; writes results after each; prints the table."""
    import openai

    from clawrl.eval.rounds import run_connected
    from clawrl.eval.stack import StackError, run_method

    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        from tqdm import tqdm

        seeds = config.seeds or (config.seed,)
        runs = 1 if config.proxy_url else len(config.methods) * len(seeds)
        with tqdm(total=runs * (config.rounds + 1), unit="probe", file=sys.stderr) as bar:
            def on_round(method: str, rnd: int, new: list[dict[str, Any]]) -> None:
                rows.extend(new)  # kept round by round: a failure later still writes these
                bar.set_postfix_str(f"{method} s{new[0]['seed']} r{rnd} " + " ".join(
                    f"{r['pref']}={r['satisfied']:.2f}" for r in new))
                bar.update(1)

            if config.proxy_url and config.engine_url:
                run_connected(config, on_round)
                _write(config, rows, started)
            for seed in () if config.proxy_url else seeds:
                # one seed: its stacks right under --out; several: each under <out>/seed-N
                run = replace(config, seed=seed, out=config.out / f"seed-{seed}"
                              if len(seeds) > 1 else config.out)
                for method in config.methods:
                    run_method(run, method, on_round)
                    _write(config, rows, started)
    except StackError as exc:
        print(f"clawrl eval: {exc}", file=sys.stderr)
        _write(config, rows, started)
        return 1
    except openai.APIError as exc:  # the proxy refused or failed a simulated user's request
        print(f"clawrl eval: a simulated user's request failed: {exc}; partial results "
              f"written to {config.out}", file=sys.stderr)
        _write(config, rows, started)
        return 1
    except KeyboardInterrupt:
        print("clawrl eval: interrupted; partial results written", file=sys.stderr)
        _write(config, rows, started)
        return 130
    print(print_table(rows))
    print("\n" + print_targets(targets(rows)))
    if config.attack:
        print("\n" + attack_summary(rows))
    print(f"\nresults: {config.out / 'results.json'}  curve: {config.out / 'curve.png'}  "
          f"({(time.monotonic() - started) / 60:.1f} min)")
    return 0


def _write(config: EvalConfig, rows: list[dict[str, Any]], started: float) -> None:
    config.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()}
    settings["recipes"] = {m: method_recipe(config, m) for m in config.methods}
    (config.out / "results.json").write_text(json.dumps(
        {"settings": settings, "minutes": round((time.monotonic() - started) / 60, 2),
         "targets": targets(rows), "probes": rows}, indent=1, default=str))
    if rows:
        plot_curve(rows, config.out / "curve.png")
        summary = f"\n\n{attack_summary(rows)}" if config.attack else ""
        (config.out / "table.txt").write_text(
            f"{print_table(rows)}\n\n{print_targets(targets(rows))}{summary}\n")
