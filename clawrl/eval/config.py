"""What one `clawrl eval` run is: its settings (`EvalConfig`), methods and targets, and the
trainer/judge settings each method's stack gets (`stack_env`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from clawrl.world.recipe import TINYWORLD_RECIPE, TOOLS_RECIPE, tinyworld_recipe

METHODS = ("combine", "rl", "opd", "none")
# `--personal`: `combine` with one LoRA adapter per user (trainer/personal.py), against the
# shared model. Each user's adapter trains on `batch_size` of that user's own samples, as
# `clawrl up --personal` trains it.
PERSONAL = "personal"
ALL_METHODS = (*METHODS, PERSONAL)
PERSONAL_PREFS = ("lowercase", "uppercase")
# `--track toolcall` (clawrl/eval/agents.py): an agent's episodes instead of people; the
# methods say where the reward comes from (all train with `rl`): name -> outcome weight.
TRACKS = ("chat", "toolcall")
TRACK_METHODS = {"outcome+process": 0.5, "outcome": 1.0, "process": 0.0}
TOOLCALL_METHODS = (*TRACK_METHODS, "none")
# `--attack`: the product as it ships, and with its defences against one user off.
ATTACK_METHODS = ("defended", "undefended")
# The trainer's fair-share caps off (docs/trainer.md "Fair share"): one batch of
# `batch_size` drawn round robin (stack_env adds MAX_BATCH_SIZE = the batch), no window.
NO_FAIR_SHARE = {"CLAWRL_TRAINER__USER_BATCH_SHARE": "1", "CLAWRL_TRAINER__USER_QUOTA": "1",
                 "CLAWRL_TRAINER__USER_WINDOW_BATCHES": "0"}
# The trainer's settings that bound one user's influence, turned off for `undefended`: the
# fair share, each user weighing the same in the loss, each user's own reward baseline.
UNDEFENDED_TRAINER: dict[str, str] = {**NO_FAIR_SHARE, "CLAWRL_TRAINER__LOSS_SHARE": "token",
                                      "CLAWRL_TRAINER__REWARD_BASELINE": "none"}
# The product's share of a version, said explicitly to the trainer (its defaults), for
# `defended` and the real-model eval's people: a quota of half a batch per user waiting, a
# quarter while the others have fewer, at most two batches. Their rounds chat until every
# user waiting has a quota (`version_quota`): the trainer's batch is then full (a version
# of `--attack` holds what the plain eval's holds of each honest user).
PRODUCT_SHARE = {"CLAWRL_TRAINER__USER_BATCH_SHARE": "0.25",
                 "CLAWRL_TRAINER__USER_QUOTA": "0.5"}
PRODUCT_MAX_BATCH = 2  # × batch_size
# The tool-call track trains as `clawrl up` trains the tool-call model (trainer/config.py
# TOOLS_RECIPE): its learning rate and the batch-mean baseline.
TOOLCALL_LR = float(TOOLS_RECIPE["lr"])
TOOLCALL_BASELINE = str(TOOLS_RECIPE["reward_baseline"])
SMALL_ROUNDS = 4  # `--small`: a CI-sized run
SMALL_BATCH = 32  # `--small` has one user: half the chat per version
PARTIAL_AFTER_S = 45
# Every other method trains full batches only, however long a machine takes to chat them:
# at 45 s a slower CPU (2026-12-05) trained `--personal` versions of 6-25 samples instead of
# 64, so a "version" meant less data there than on a fast one. This is a safety valve for a
# round whose chat ended short (under the round's own timeout).
FULL_BATCH_WAIT_S = 600
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
    # `model` is the tiny world's default dir in the state dir (no --model): built there, and
    # kept at the current build (clawrl/eval/stack.py `ensure_model`).
    default_model: bool = False
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
    # The tiny world's recipe, what `clawrl up` trains it with (trainer/config.py). Measured
    # (docs/eval.md): at 32 samples per version, lr 3e-4 is too slow (0.6-0.75 at v8), 6e-4
    # just reaches 0.9 at v8, 8e-4 by v4-v8 (seed-dependent) with answer accuracy down 4-6
    # points by v8 on some seeds; 64 samples per version at 8e-4 reach 0.9 by v4-v6 on three
    # seeds within 3 points of accuracy (a less noisy step, at about 1.5x the chat per round).
    lr: float = float(TINYWORLD_RECIPE["lr"])
    # `personal`: the adapters' learning rate (docs/eval.md "One adapter per user").
    adapter_lr: float = float(TINYWORLD_RECIPE["adapter_lr"])
    # The KL to the base and the trainer's `ptx_coef` (trainer/ptx.py, the tiny world's
    # corpus mixed into every step; 0: none). None: each method's recipe (trainer/config.py
    # `tinyworld_recipe`): the shared model's for the shared methods, personal mode's for
    # `personal` (KL 0.2, no corpus term), the tool-call model's on the tool-call track (no
    # corpus term: with it, 0.25, success peaked at 0.73 where runs without reach 0.84-0.89,
    # docs/eval.md). A number: that, for every method.
    kl_coef: float | None = None
    ptx_coef: float | None = None
    # The trainer's `replay_coef` (trainer/data.py `replay_batch`): the samples the judge
    # rated +1 replayed in every step; 0: none.
    replay_coef: float = 0.0
    # The trainer's `reward_baseline`; None: the trainer's default (batch_mean for personal
    # adapters; for the shared model user_mean, or none for a batch of one user).
    reward_baseline: str | None = None
    # The trainer's optimizer steps per version (`mini_batches`). On the tool-call track 4
    # (of 16 samples each) made it worse: peaks of 0.78 / 0.84, then 0.53-0.56 by v8
    # (docs/eval.md), so every track takes one.
    mini_batches: int = 1
    # `--track toolcall`: training episodes per question (GRPO's group; 1: each its own).
    group: int = 1
    # `--track toolcall`: which questions the probe asks. `heldout` (the figure reported):
    # phrasings of facts never trained on. `train`: held-in questions, a dev check to tune
    # settings on without reading the held-out set (other episodes than training's, by seed).
    probe_split: str = "heldout"
    batch_size: int = int(TINYWORLD_RECIPE["batch_size"])
    round_timeout_s: float = 900.0
    # Train full batches only (FULL_BATCH_WAIT_S) except under `opd`; False (`--small`, the
    # CI-sized run): a partial batch after PARTIAL_AFTER_S, so a slow machine stays quick.
    full_batches: bool = True
    engine_threads: int = 1
    # Keep each method's database (its URL in <out>/<method>/database.txt) to query with SQL.
    keep_db: bool = False
    # Connect to a running stack instead of starting one per method.
    proxy_url: str | None = None
    engine_url: str | None = None
    # What the simulated users say: the pool people wrote apart from the corpus and the
    # judge's training set (`people`), the tiny world's phrasings (`corpus`) or the judge
    # issue's user (`issue`).
    followups: str = "people"
    # Judge with the frozen judge model on an engine of its own (`clawrl judge serve`), as
    # `clawrl up` does; False: the policy judges itself.
    judge_engine: bool = True
    # Where the judge model is pulled and merged, once for every run: the user's state dir
    # (None: the run's own `out`).
    judge_state_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # `chat`: simulated people; `toolcall`: an agent on the tool-call track.
    track: str = "chat"
    # `--attack` (clawrl/eval/attack.py): the honest users beside one adversary, with the
    # product's defences (`defended`) and without them (`undefended`).
    attack: bool = False
    # A real pretrained model (`--model smollm2-135m`, clawrl/eval/everyday.py): people asking
    # everyday questions; the trainer takes the model's own recipe (recipe.json and the
    # trainer's defaults) except what the command line set (in `extra_env`).
    everyday: bool = False


def product_share(batch: int) -> dict[str, str]:
    """The trainer's settings for the product's share of a version (`PRODUCT_SHARE`, at most
    `PRODUCT_MAX_BATCH` batches), without the per-hour window: it bounds a user over an hour,
    and an eval's versions take minutes, each simulated user standing for a crowd."""
    return {**PRODUCT_SHARE, "CLAWRL_TRAINER__MAX_BATCH_SIZE": str(PRODUCT_MAX_BATCH * batch),
            "CLAWRL_TRAINER__USER_WINDOW_BATCHES": "0"}


def version_quota(config: EvalConfig, method: str) -> int:
    """The most samples of one user a version of `method`'s stack takes while others wait
    (the trainer's quota, ⌊USER_QUOTA · batch_size⌋): `--attack`'s and the real-model
    eval's rounds chat until every user with samples waiting has this many, when the
    trainer's batch is full (trainer/shares.py `full_size`)."""
    quota = float(stack_env(config, method)["CLAWRL_TRAINER__USER_QUOTA"])
    return max(1, int(quota * config.batch_size + 1e-9))


def trainer_method(method: str) -> str:
    """The trainer's `--method` for an eval method (`personal` trains with `combine`, the
    agent track's methods with `rl`)."""
    if method == PERSONAL or method in ATTACK_METHODS:
        return "combine"
    return "rl" if method in TRACK_METHODS else method


def method_recipe(config: EvalConfig, method: str) -> dict[str, float]:
    """The KL and corpus-term weights a method trains with: the run's where it set them, else
    the tiny world's recipe for the method's kind of model and mode (always said explicitly
    to the trainer, so a run's settings are its own whatever the model directory holds)."""
    recipe = tinyworld_recipe(tools=config.track == "toolcall", personal=method == PERSONAL)
    return {"kl_coef": float(recipe["kl_coef"] if config.kl_coef is None else config.kl_coef),
            "ptx_coef": float(recipe.get("ptx_coef", 0.0) if config.ptx_coef is None
                              else config.ptx_coef)}


def stack_env(config: EvalConfig, method: str) -> dict[str, str]:
    """Trainer and judge settings of one method's stack (the same for every method but the
    method). The judge works on as many turns at once as the users hold conversations, so
    the engine batches its votes with the users' requests."""
    batch = config.batch_size
    if config.everyday:
        return {"CLAWRL_JUDGE__CONCURRENCY": str(max(4, config.parallel * len(config.prefs)
                                                    * config.users_per_pref)),
                "CLAWRL_TRAINER__METHOD": trainer_method(method),
                "CLAWRL_TRAINER__BATCH_SIZE": str(batch),
                "CLAWRL_TRAINER__MICRO_BATCH_SIZE": str(min(4, batch)),
                "CLAWRL_TRAINER__MAX_WAIT_S": str(FULL_BATCH_WAIT_S),
                "CLAWRL_TRAINER__POLL_S": "0.5", "CLAWRL_TRAINER__SEED": str(config.seed),
                # The people are users of one shared model: the product's fair share
                **product_share(batch)}
    recipe = method_recipe(config, method)
    env = {"CLAWRL_JUDGE__CONCURRENCY": str(max(4, config.parallel * len(config.prefs)
                                                * config.users_per_pref)),
           "CLAWRL_TRAINER__METHOD": trainer_method(method), "CLAWRL_TRAINER__LR": str(config.lr),
           "CLAWRL_TRAINER__KL_COEF": str(recipe["kl_coef"]),
           "CLAWRL_TRAINER__PTX_COEF": str(recipe["ptx_coef"]),
           "CLAWRL_TRAINER__REPLAY_COEF": str(config.replay_coef),
           "CLAWRL_TRAINER__BATCH_SIZE": str(batch),
           "CLAWRL_TRAINER__MICRO_BATCH_SIZE": str(min(8, batch)),
           # Full batches: the eval chats until one is ready (one version per round); only
           # `opd`'s batch may not fill (a policy that earns few corrections earns few
           # hints), and it is trained PARTIAL_AFTER_S after its first sample arrived.
           "CLAWRL_TRAINER__MAX_WAIT_S": str(FULL_BATCH_WAIT_S
                                             if config.full_batches and method != "opd"
                                             else PARTIAL_AFTER_S),
           "CLAWRL_TRAINER__POLL_S": "0.5",
           "CLAWRL_TRAINER__SEED": str(config.seed)}
    if not config.attack or method == "undefended":
        # The eval measures learning from its own few simulated users, who chat until a
        # batch is ready: no fair-share caps (docs/trainer.md "Fair share").
        env.update(NO_FAIR_SHARE, CLAWRL_TRAINER__MAX_BATCH_SIZE=str(batch))
    else:
        # `defended`: the product's share of a version, full batches as every method (a
        # version is full once each user waiting has a quota).
        env.update(product_share(batch))
    if config.mini_batches != 1:
        env["CLAWRL_TRAINER__MINI_BATCHES"] = str(config.mini_batches)
    if config.reward_baseline is not None:
        env["CLAWRL_TRAINER__REWARD_BASELINE"] = config.reward_baseline
    if method in TRACK_METHODS:
        env["CLAWRL_TRAINER__OUTCOME_WEIGHT"] = str(TRACK_METHODS[method])
        # A step's sample is written when the next request arrives; its episode's outcome
        # follows at the episode's end: hold samples until then.
        env["CLAWRL_TRAINER__OUTCOME_WAIT_S"] = "120"
        env["CLAWRL_JUDGE__CONCURRENCY"] = str(config.parallel * 2)
    if method == "undefended":
        env.update(UNDEFENDED_TRAINER)
    if config.attack:  # the adversary's conversations are judged beside the honest ones
        env["CLAWRL_JUDGE__CONCURRENCY"] = str(int(env["CLAWRL_JUDGE__CONCURRENCY"]) * 2)
    if method == PERSONAL:
        env["CLAWRL_TRAINER__PERSONAL"] = "true"
        env["CLAWRL_TRAINER__ADAPTER_LR"] = str(config.adapter_lr)
    return env
