"""`clawrl eval`: measure that the whole loop learns, with simulated users over HTTP.

    clawrl eval [--model DIR | --small] [--methods combine,rl,opd,none] [--rounds 8]
                [--prefs lowercase,brief] [--seeds 0,1,2] [--out runs/eval-...]

For each method, on the same seeds: start a fresh stack (Postgres database, embedded engine
serving the pretrained tiny world model, proxy, judge worker, and — except for `none` — the
trainer with that method), create one user and API key per simulated user, then repeat for
`--rounds` rounds: the users chat (trainer/simulate.py: questions, corrections of their hidden
preference, praise) until the judge has produced a full training batch; the trainer trains
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
rounds, 32 samples per version. Postgres: `CLAWRL_DATABASE__URL`
(a fresh database per method is created on that server), else an embedded server per method.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainer.world import EVAL_PREFERENCES, World

METHODS = ("combine", "rl", "opd", "none")
SMALL_ROUNDS = 4  # `--small`: a CI-sized run
SMALL_BATCH = 32  # `--small` has one user: half the chat per version
PARTIAL_AFTER_S = 45
# The evaluation's targets: satisfaction on held-out prompts >= TARGET_SATISFIED within the
# rounds run, for at least TARGET_PREFS preferences, while answer accuracy never falls more
# than TARGET_ACCURACY_DROP below the base model's.
TARGET_SATISFIED = 0.9
TARGET_PREFS = 2
TARGET_ACCURACY_DROP = 0.05
# Label of the rows measured on an already running stack (`--proxy-url`): whatever it trains.
CONNECTED = "connected"


@dataclass
class EvalConfig:
    model: Path
    out: Path
    methods: tuple[str, ...] = METHODS
    prefs: tuple[str, ...] = ("lowercase", "brief")
    users_per_pref: int = 1
    rounds: int = 8
    sessions: int = 8  # chat sessions per user per round for `none` (which never trains)
    parallel: int = 4  # concurrent chat sessions per user
    # Cap on waves of `parallel` sessions per user per round while a batch fills. A policy
    # that already satisfies its users earns few corrections (for `opd`: few hints), so a
    # batch may not fill; the trainer then trains what it has after MAX_WAIT_S (partial).
    max_chats: int = 4  # per 32 samples of the batch
    probes: int = 64
    seed: int = 0
    seeds: tuple[int, ...] = ()  # several seeds: the whole run once per seed (default: `seed`)
    world_seed: int = 0
    # Measured on the tiny world model (README, "See it learn"): at 32 samples per version,
    # lr 3e-4 is too slow (0.6-0.75 at v8), 6e-4 just reaches 0.9 at v8, 8e-4 by v4-v8
    # (seed-dependent) with answer accuracy down 4-6 points by v8 on some seeds; 64 samples
    # per version at 8e-4 reach 0.9 by v4-v6 on three seeds within 3 points of accuracy
    # (a less noisy step, at about 1.5x the chat per round).
    lr: float = 8e-4
    kl_coef: float = 0.05
    batch_size: int = 64
    round_timeout_s: float = 900.0
    engine_threads: int = 1
    # Keep each method's database (its URL in <out>/<method>/database.txt) to query with SQL.
    keep_db: bool = False
    # Connect to a running stack instead of starting one per method.
    proxy_url: str | None = None
    engine_url: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def stack_env(config: EvalConfig, method: str) -> dict[str, str]:
    """Trainer and judge settings of one method's stack (the same for every method but the
    method). The judge works on as many turns at once as the users hold conversations, so
    the engine batches its votes with the users' requests."""
    return {"CLAWRL_JUDGE__CONCURRENCY": str(max(4, config.parallel * len(config.prefs)
                                                 * config.users_per_pref)),"CLAWRL_TRAINER__METHOD": method, "CLAWRL_TRAINER__LR": str(config.lr),
            "CLAWRL_TRAINER__KL_COEF": str(config.kl_coef),
            "CLAWRL_TRAINER__BATCH_SIZE": str(config.batch_size),
            "CLAWRL_TRAINER__MICRO_BATCH_SIZE": str(min(8, config.batch_size)),
            # Full batches, normally: the eval chats until one is ready (one version per
            # round); a batch that cannot fill (a policy that earns few corrections gives
            # `opd` few hints) is trained PARTIAL_AFTER_S after its first sample arrived,
            # about the time `max_chats` waves of chat take.
            "CLAWRL_TRAINER__MAX_WAIT_S": str(PARTIAL_AFTER_S), "CLAWRL_TRAINER__POLL_S": "0.5",
            "CLAWRL_TRAINER__SEED": str(config.seed)}


async def run_rounds(config: EvalConfig, method: str, proxy_url: str, db_url: str,
                     engine_url: str, on_round: Any) -> None:
    """Create the users, then chat / wait for training / probe, round after round; each
    round's probe rows go to `on_round`."""
    from openai import AsyncOpenAI

    from proxy import admin
    from proxy.db import create_async
    from trainer.evalstack import loop_state, wait_judged, wait_published
    from trainer.simulate import SimUser

    world = World.build(config.world_seed)
    probe_prompts = random.Random(f"probes-{config.seed}").sample(
        [q.text for q in world.heldout], min(config.probes, len(world.heldout)))
    db = create_async(db_url)
    users: list[SimUser] = []
    try:
        for i, pref in enumerate(p for p in config.prefs for _ in range(config.users_per_pref)):
            name = f"sim-{i}-{pref}"
            await admin.ensure_user(db, name)
            # Unlimited (rate_limit_rpm=0): one simulated user stands for a crowd; the probes
            # alone are `probes` requests at once, far over a person's per-minute limit.
            key = await admin.create_key(db, name, name="clawrl eval", rate_limit_rpm=0)
            client = AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key=key.secret,
                                 max_retries=2, timeout=600.0)
            users.append(SimUser(name, pref, client, random.Random(f"user-{config.seed}-{i}")))
        started = time.monotonic()
        for rnd in range(config.rounds + 1):
            if rnd > 0 and method == "none":
                for wave in range(-(-config.sessions // config.parallel)):
                    await chat_wave(config, world, users, rnd, wave)
            elif rnd > 0:
                # Chat until a full batch is ready (the trainer only trains full batches),
                # then wait for that version: one published version per round.
                start = (await loop_state(db, method))[2]
                # (about 16 samples per wave of 2 users x 4 sessions: scale with the batch)
                for wave in range(config.max_chats * -(-config.batch_size // 32)):
                    await chat_wave(config, world, users, rnd, wave)
                    await wait_judged(db, method, config.round_timeout_s)
                    _, ready, newest = await loop_state(db, method)
                    if ready >= config.batch_size or newest > start:
                        break
                await wait_published(db, method, engine_url, start, config.round_timeout_s)
            version = await _serving_version(engine_url)
            trained = await _version_stats(db, version)
            results = await asyncio.gather(*(u.probe(world, probe_prompts) for u in users))
            on_round(method, rnd, [
                {"method": method, "seed": config.seed, "round": rnd, "version": version,
                 **trained, "user": user.name, "pref": user.pref,
                 "satisfied": round(res.satisfied, 4), "correct": round(res.correct, 4),
                 "examples": res.replies[:3], "wrong_examples": res.wrong[:5],
                 "elapsed_s": round(time.monotonic() - started, 1)}
                for user, res in zip(users, results, strict=True)])
    finally:
        for user in users:
            await user.client.close()
        await db.dispose()


async def chat_wave(config: EvalConfig, world: World, users: list[Any], rnd: int,
                    wave: int) -> None:
    """`config.parallel` concurrent chat sessions per user, each with its own seeded RNG."""
    await asyncio.gather(*(
        user.chat_session(world, rng=random.Random(f"chat-{config.seed}-{user.name}-{rnd}-"
                                                   f"{wave}-{k}"))
        for user in users for k in range(config.parallel)))


async def _version_stats(db: Any, version: str) -> dict[str, Any]:
    """What the trainer recorded for the served version (empty for the base model)."""
    from sqlalchemy import text

    if not version.isdigit() or version == "0":
        return {}
    async with db.connect() as conn:
        row = (await conn.execute(text(
            "SELECT num_samples, loss, reward_mean FROM policy_versions WHERE version = :v"),
            {"v": int(version)})).first()
    return {} if row is None else {"train_samples": row[0], "train_loss": row[1],
                                   "train_reward_mean": row[2]}


async def _serving_version(engine_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=10.0) as http:
        info = (await http.get(f"{engine_url}/model_info")).json()
    version = info.get("weight_version")
    # The base model serves under the engine's initial label ("default"): call it version 0.
    return "0" if version in (None, "default") else str(version)


def run_connected(config: EvalConfig, on_round: Any) -> None:
    """Measure an already running stack (its own trainer and method) over `--rounds`."""
    from proxy.settings import load_settings

    settings = load_settings()
    if settings.database.url is None or not (config.proxy_url and config.engine_url):
        from trainer.evalstack import StackError

        raise StackError("--proxy-url needs CLAWRL_DATABASE__URL (to create the users' keys)")
    db_url = settings.database.url.get_secret_value()
    proxy_url = config.proxy_url.rstrip("/").removesuffix("/v1")
    asyncio.run(run_rounds(config, CONNECTED, proxy_url, db_url,
                           config.engine_url.rstrip("/"), on_round))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _cell(rows: list[dict[str, Any]], key: str, **match: Any) -> list[Any]:
    return [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]


def print_table(rows: list[dict[str, Any]]) -> str:
    """Satisfaction (and task accuracy) per round, method and user, as plain text: the mean
    over seeds, with the version served (the one version when all seeds served it)."""
    users = sorted({(r["user"], r["pref"]) for r in rows})
    methods = [m for m in (*METHODS, CONNECTED) if any(r["method"] == m for r in rows)]
    cols = [(m, u) for m in methods for u, _ in users]
    seeds = sorted({r.get("seed", 0) for r in rows})
    head = "round  " + "  ".join(f"{m}/{u.split('-', 2)[2]:<10}"[:22].ljust(22) for m, u in cols)
    lines = [f"mean over seeds {','.join(map(str, seeds))}"] if len(seeds) > 1 else []
    lines.append(head)
    for rnd in sorted({r["round"] for r in rows}):
        cells = []
        for m, u in cols:
            cell = {"round": rnd, "method": m, "user": u}
            versions = set(_cell(rows, "version", **cell))
            if not versions:
                cells.append("-".ljust(22))
                continue
            version = versions.pop() if len(versions) == 1 else "*"
            cells.append(f"{_mean(_cell(rows, 'satisfied', **cell)):.2f} (v{version}, acc "
                         f"{_mean(_cell(rows, 'correct', **cell)):.2f})".ljust(22))
        lines.append(f"{rnd:<5}  " + "  ".join(cells))
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation's targets per method and seed, from the probe rows.

    `reached`: per preference, the first round whose satisfaction (mean over that
    preference's users) is >= TARGET_SATISFIED, or None. `accuracy_base` is round 0's mean
    answer accuracy over all users; `worst_accuracy_drop` the largest fall below it in any
    later round, `final_accuracy_drop` the fall at the last round. `met`: at least
    TARGET_PREFS preferences (all of them, when fewer were run) reached the bar and accuracy
    never fell more than TARGET_ACCURACY_DROP. For `none`, `spread` is how far satisfaction
    moved from round 0 at most (it should stay at the base rate).
    """
    out = []
    for method in (*METHODS, CONNECTED):
        for seed in sorted({r.get("seed", 0) for r in rows if r["method"] == method}):
            mine = [r for r in rows if r["method"] == method and r.get("seed", 0) == seed]
            rounds = sorted({r["round"] for r in mine})
            if 0 not in rounds:
                continue
            prefs = sorted({r["pref"] for r in mine})
            sat = {p: {n: _mean(_cell(mine, "satisfied", pref=p, round=n)) for n in rounds}
                   for p in prefs}
            acc = {n: _mean(_cell(mine, "correct", round=n)) for n in rounds}
            reached = {p: next((n for n in rounds if n > 0 and sat[p][n] >= TARGET_SATISFIED),
                               None) for p in prefs}
            drops = [acc[0] - acc[n] for n in rounds if n > 0] or [0.0]
            need = min(TARGET_PREFS, len(prefs))
            row: dict[str, Any] = {
                "method": method, "seed": seed, "rounds": rounds[-1],
                "base": {p: round(sat[p][0], 4) for p in prefs},
                "last": {p: round(sat[p][rounds[-1]], 4) for p in prefs},
                "reached": reached, "accuracy_base": round(acc[0], 4),
                "worst_accuracy_drop": round(max(drops), 4),
                "final_accuracy_drop": round(drops[-1], 4),
                "spread": round(max(abs(sat[p][n] - sat[p][0]) for p in prefs
                                    for n in rounds), 4)}
            row["met"] = (sum(n is not None for n in reached.values()) >= need
                          and row["worst_accuracy_drop"] <= TARGET_ACCURACY_DROP)
            out.append(row)
    return out


def print_targets(summary: list[dict[str, Any]]) -> str:
    """One line per method and seed: when each preference reached the bar, accuracy."""
    lines = [f"targets: satisfaction >= {TARGET_SATISFIED} for {TARGET_PREFS} preferences, "
             f"accuracy never more than {TARGET_ACCURACY_DROP * 100:.0f} points below base"]
    for t in summary:
        if t["method"] == "none":
            detail = (", ".join(f"{p} {t['base'][p]:.2f}" for p in t["base"])
                      + f" at round 0; moved at most {t['spread']:.2f}")
        else:
            detail = ", ".join(
                f"{p} {t['base'][p]:.2f}->{t['last'][p]:.2f} "
                + (f"(>= {TARGET_SATISFIED} at round {n})" if n is not None else "(not reached)")
                for p, n in t["reached"].items())
            detail += "  " + ("MET" if t["met"] else "not met")
        lines.append(
            f"  {t['method']:<9} seed {t['seed']}: {detail}; accuracy {t['accuracy_base']:.2f} "
            f"at round 0, worst {-t['worst_accuracy_drop'] * 100:+.1f} pts, "
            f"last {-t['final_accuracy_drop'] * 100:+.1f} pts")
    return "\n".join(lines)


def plot_curve(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per preference (satisfaction per round and method), and one of the answers'
    task accuracy (mean over users) per round and method. With several seeds: the mean
    line and a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefs = sorted({r["pref"] for r in rows})
    seeds = sorted({r.get("seed", 0) for r in rows})
    panels = [(f"preference: {p}", "held-out replies satisfying it", "satisfied", p)
              for p in prefs] + [("answer accuracy (all users)", "held-out answers correct",
                                  "correct", None)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, key, pref) in zip(axes[0], panels, strict=True):
        for method in (*METHODS, CONNECTED):
            # per round: the value of each seed (mean over that seed's matching users)
            pts: dict[int, list[float]] = {}
            for seed in seeds:
                mine = [r for r in rows if r["method"] == method and r.get("seed", 0) == seed
                        and pref in (None, r["pref"])]
                for n in sorted({r["round"] for r in mine}):
                    pts.setdefault(n, []).append(_mean(_cell(mine, key, round=n)))
            if pts:
                xs = sorted(pts)
                (line,) = ax.plot(xs, [_mean(pts[x]) for x in xs], marker="o", label=method)
                if len(seeds) > 1:
                    ax.fill_between(xs, [min(pts[x]) for x in xs], [max(pts[x]) for x in xs],
                                    color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(title + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else ""))
        ax.set_xlabel("round (one published version per round when training)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str]) -> EvalConfig:
    from proxy.settings import load_settings

    p = argparse.ArgumentParser(prog="clawrl eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model dir (default <state_dir>/models/tinyworld)")
    p.add_argument("--small", action="store_true",
                   help="a CI-sized run: the CI-sized model (<state_dir>/models/tinyworld-ci, "
                        "~5 min to build once), and unless given: --methods combine,none "
                        f"--prefs lowercase --rounds {SMALL_ROUNDS}")
    p.add_argument("--methods", default=None, help=f"default {','.join(METHODS)}")
    p.add_argument("--prefs", default=None,
                   help="hidden preferences, one simulated user each "
                        f"({', '.join(EVAL_PREFERENCES)}; default lowercase,brief)")
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
    p.add_argument("--lr", type=float, default=EvalConfig.lr, help="trainer learning rate")
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"samples per version (default {EvalConfig.batch_size}; "
                        f"{SMALL_BATCH} with --small)")
    p.add_argument("--round-timeout", type=float, default=900.0)
    p.add_argument("--keep-db", action="store_true",
                   help="keep each method's database (URL in <out>/<method>/database.txt) "
                        "to look at turns, judgments and hints with SQL afterwards")
    p.add_argument("--out", type=Path, default=None, help="output dir (default runs/eval-TIME)")
    p.add_argument("--proxy-url", help="connect to a running stack's proxy (with --engine-url "
                   "and CLAWRL_DATABASE__URL) instead of starting one per method")
    p.add_argument("--engine-url", help="the running stack's engine (to read weight versions)")
    args = p.parse_args(argv)
    if args.methods is None:
        args.methods = "combine,none" if args.small else ",".join(METHODS)
    if args.prefs is None:
        args.prefs = "lowercase" if args.small else "lowercase,brief"
    if args.rounds is None:
        args.rounds = SMALL_ROUNDS if args.small else 8
    if args.batch_size is None:
        args.batch_size = SMALL_BATCH if args.small else EvalConfig.batch_size
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    prefs = tuple(x.strip() for x in args.prefs.split(",") if x.strip())
    bad = [m for m in methods if m not in METHODS] + [x for x in prefs
                                                     if x not in EVAL_PREFERENCES]
    if bad or not methods or not prefs:
        raise SystemExit(f"clawrl eval: unknown or missing method/preference: {bad or 'none'}")
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
           args.parallel) < 1:
        raise SystemExit("clawrl eval: --rounds, --sessions, --parallel, --probes, "
                         "--users-per-pref and --batch-size must be >= 1")
    state = load_settings().state_dir
    model = args.model or state / "models" / ("tinyworld-ci" if args.small else "tinyworld")
    out = args.out or Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    return EvalConfig(model=model, out=out, methods=methods, prefs=prefs,
                      users_per_pref=args.users_per_pref, rounds=args.rounds,
                      sessions=args.sessions, parallel=args.parallel, probes=args.probes,
                      seed=seeds[0], seeds=seeds,
                      lr=args.lr, kl_coef=args.kl_coef, batch_size=args.batch_size,
                      round_timeout_s=args.round_timeout, proxy_url=args.proxy_url,
                      keep_db=args.keep_db,
                      engine_url=args.engine_url,
                      extra_env={"SMALL": "1"} if args.small else {})


def main(argv: list[str]) -> int:
    from trainer.evalstack import ensure_model

    try:
        config = parse_args(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        return int(exc.code or 0)
    config.out.mkdir(parents=True, exist_ok=True)
    try:
        ensure_model(config.model, small=bool(config.extra_env.pop("SMALL", "")))
    except (OSError, RuntimeError) as exc:
        print(f"clawrl eval: cannot build the model at {config.model}: {exc}", file=sys.stderr)
        return 1
    # SIGTERM stops like Ctrl-C: the current stack is shut down and partial results written.
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        return run_eval(config)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_eval(config: EvalConfig) -> int:
    """Every method in turn; writes results after each; prints the table."""
    import openai

    from trainer.evalstack import StackError, run_method

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
    print(f"\nresults: {config.out / 'results.json'}  curve: {config.out / 'curve.png'}  "
          f"({(time.monotonic() - started) / 60:.1f} min)")
    return 0


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _write(config: EvalConfig, rows: list[dict[str, Any]], started: float) -> None:
    config.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()}
    (config.out / "results.json").write_text(json.dumps(
        {"settings": settings, "minutes": round((time.monotonic() - started) / 60, 2),
         "targets": targets(rows), "probes": rows}, indent=1, default=str))
    if rows:
        plot_curve(rows, config.out / "curve.png")
        (config.out / "table.txt").write_text(
            f"{print_table(rows)}\n\n{print_targets(targets(rows))}\n")
