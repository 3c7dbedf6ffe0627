"""Trainer settings (`CLAWRL_TRAINER__…`), in the style of `clawrl/base/settings.py`.

    CLAWRL_TRAINER__METHOD=combine CLAWRL_TRAINER__LR=5e-5 CLAWRL_TRAINER__BATCH_SIZE=16 clawrl train

`load_settings()` builds the whole process settings (state dir, database, engine, trainer);
functions below the entry point receive only `TrainerSettings` (or a part of it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from clawrl.base.settings import Settings as ProxyProcessSettings
from trainer.shares import ShareRule

Method = Literal["rl", "opd", "combine"]


class LoraSettings(BaseModel):
    """Optional LoRA (peft). Adapters are merged on export: the engine gets a plain model."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"])


# A model directory may say how it trains: `recipe.json` beside its weights, written by
# whoever built it (the tiny world's build writes one, clawrl/world/recipe.py):
#     {"train": {setting: value, …},      what the trainer uses unless it was set
#      "personal": {setting: value, …},   over "train", for personal mode's adapters
#      "ptx_data": "ptx.jsonl",           the corpus term's data, relative to the directory
#      "gate_probe": "probe.jsonl"}       the gate's capability probe (trainer/gate.py)
# The trainer reads it as data; it never imports whoever wrote it.
RECIPE_FILE = "recipe.json"


def model_recipe(model_dir: Path, *, personal: bool = False) -> dict[str, object]:
    """The training settings a model directory comes with (its recipe.json), else none."""
    path = model_dir / RECIPE_FILE
    if not path.is_file():
        return {}
    recipe = json.loads(path.read_text())
    settings: dict[str, object] = dict(recipe.get("train", {}))
    if personal:
        settings |= recipe.get("personal", {})
    for name in ("ptx_data", "gate_probe"):  # files beside the weights
        if recipe.get(name):  # ptx_data is used when ptx_coef > 0, from the recipe or set
            settings[name] = model_dir / recipe[name]
    return settings


class TrainerSettings(BaseModel):
    # What to learn from: `rl` = judged reward only, `opd` = hindsight-hint teacher only,
    # `combine` = both (docs/trainer.md). A sample without the chosen signal is never trained.
    method: Method = "combine"
    w_rl: float = 1.0
    w_opd: float = 1.0
    # Session outcomes (docs/trainer.md, "Outcome rewards"): a sample's reward is
    # w_o · outcome + (1 − w_o) · process reward (either alone where only it is present;
    # the process reward only under rl / combine). 0 ignores outcomes.
    outcome_weight: float = Field(default=0.5, ge=0, le=1)
    # > 0: a sample whose session has no outcome yet waits up to this long after it was
    # written (agents whose verifier reports at the end); 0: train it at once.
    outcome_wait_s: float = Field(default=0.0, ge=0)
    # A baseline subtracted from each sample's reward (trainer/loss.py `reward_baseline`):
    # `batch_mean`, the mean reward of the batch's samples that have one, so a batch of
    # mostly +1 pushes toward what did better than the rest rather than on everything
    # sampled; `none`, the raw reward (what the shared chat recipe was measured with).
    # `group_mean`: the mean over the batch's samples of the same task (the first user
    # message of their conversation) where there are two or more, else the batch's mean:
    # for agents that run several episodes per task (GRPO's groups). `user_mean`: the mean
    # over the batch's samples of the same user where there are two or more, else the
    # batch's mean: a user who praises every reply teaches nothing by it.
    # Unset: `batch_mean` in personal mode (its adapters kept answer accuracy with it,
    # docs/eval.md "One adapter per user"); in the shared model `user_mean` for a batch of
    # several users (one user who praises everything then steers nothing through the
    # reward: docs/trainer.md "A reward baseline") and `none` for one user's batch.
    reward_baseline: Literal["none", "batch_mean", "group_mean", "user_mean"] | None = None
    # How a batch's tokens weigh in the loss (trainer/data.py `share_by_user`). `user`: each
    # user of the batch weighs the same, their tokens' mean taken apart and the users' means
    # averaged — one user's long replies (or a crowd of one key's sessions within its fair
    # share) do not thin out what the others' samples teach; with one user it is the token
    # mean. `token`: every response token of the batch weighs the same.
    loss_share: Literal["user", "token"] = "user"
    # TINYWORLD.md: lr 3e-4 collapses the tiny model; stay at or below 1e-4 with a KL term.
    lr: float = Field(default=2e-5, gt=0, le=1e-3)
    # LoRA adapters' learning rate (`lora.enabled`, personal mode); None: `lr`. An adapter
    # starts at B = 0 and moves only its low-rank factors, so it usually wants a larger step
    # than full weights (docs/eval.md "One adapter per user").
    adapter_lr: float | None = Field(default=None, gt=0, le=1e-2)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps_low: float = Field(default=0.2, ge=0, lt=1)
    eps_high: float = Field(default=0.28, ge=0)
    # k3 KL to the frozen base model; 0 disables it (and skips the reference forward pass).
    kl_coef: float = Field(default=0.02, ge=0)
    entropy_coef: float = Field(default=0.0, ge=0)
    # The pretraining-data term (trainer/ptx.py, InstructGPT's PPO-ptx): γ times the mean
    # negative log-likelihood of a batch of `ptx_batch_size` examples from `ptx_data` (JSONL of
    # {"messages": [...]} or {"text": ...}) added to every optimizer step; 0 disables it. Unset
    # `ptx_data` with the tiny world: the world's own chat corpus. Torch backend only.
    ptx_coef: float = Field(default=0.0, ge=0)
    ptx_data: Path | None = None
    ptx_batch_size: int = Field(default=16, ge=1)
    # Replaying what was accepted (trainer/data.py `replay_batch`, self-imitation): γ_r times
    # the mean negative log-likelihood of up to `replay_size` earlier trained samples the judge
    # rated +1 (the user took the reply: no correction of style or fact followed), drawn at
    # random from the newest `replay_window` of them — in personal mode the user's own only —
    # added to every optimizer step; 0 disables it. A corpus term in the users' own style:
    # it protects what they accepted, facts included, instead of pulling toward the corpus's
    # mixed styles. Torch backend only.
    replay_coef: float = Field(default=0.0, ge=0)
    replay_size: int = Field(default=16, ge=1)
    replay_window: int = Field(default=256, ge=1)
    grad_clip: float = Field(default=1.0, gt=0)
    # Replies drawn under a grammar (a forced tool call, a JSON schema: trainer/offpolicy.py),
    # trained as distillation toward the masked distribution they were drawn from, with the
    # judge's reward beside it. `own`: in personal mode and on a shared model one user alone
    # may train — a grammar can force any exact text (a schema's `const`), so on a model
    # other users are served it would let one client write into it; `always`; `never`:
    # skipped as 'off_policy: constrained decoding'.
    train_constrained: Literal["never", "own", "always"] = "own"
    # The bound on a constrained token's distillation advantage (nats): the forced
    # `<tool_call>` of a model that never opens with it has log π ≈ −20; at 5 such a token
    # weighs like five +1 rewards, not twenty.
    constrained_adv_max: float = Field(default=5.0, gt=0)

    # Batching: `batch_size` samples per optimizer step, processed `micro_batch_size` at a
    # time with gradient accumulation. A batch closes early, with fewer, once its first
    # sample has waited `max_wait_s` and it holds at least `min_batch_size` (docs/trainer.md,
    # "Versions at a person's pace").
    batch_size: int = Field(default=16, ge=1)
    micro_batch_size: int = Field(default=4, ge=1)
    # A micro batch also holds at most this many padded tokens (its rows × its longest row;
    # one sample at least; torch backend). What the backward keeps grows with them: every
    # layer's activations and the [rows, tokens, vocab] logits with their tempered and
    # log-softmaxed copies. On SmolLM2-135M four samples of an agent's 3–5k-token prompts
    # (OpenClaw's) passed 8.8 GB and the trainer was killed for memory; one at a time
    # (3.1–4.4k tokens) they still took it to 11.5–14.4 GB. 4096 keeps short chats at
    # `micro_batch_size` rows and runs an agent's samples one at a time.
    micro_batch_tokens: int = Field(default=4096, ge=1)
    max_wait_s: float = Field(default=30.0, ge=0)
    min_batch_size: int = Field(default=1, ge=1)
    poll_s: float = Field(default=1.0, gt=0)
    # Optimizer steps per claimed batch (one version): `epochs` passes over the batch, each
    # in `mini_batches` steps on a slice of it, the later steps kept near the sampling policy
    # by the ratio's clip (PPO's epochs × mini-batches). 1 × 1: one step per version. Torch
    # backend only.
    mini_batches: int = Field(default=1, ge=1)
    epochs: int = Field(default=1, ge=1)
    # Samples generated by a policy more than this many versions old are skipped ('stale').
    max_staleness: int = Field(default=4, ge=0)

    # Fair share of the shared model (docs/trainer.md, "Fair share"): no one user steers what
    # everyone is served, and no one user's flood shrinks another's part of a version. Not in
    # personal mode (each adapter learns from its own user only). A version takes up to
    # `user_quota` × `batch_size` samples of every user with samples waiting, drawn round
    # robin, so its batch grows with the users waiting (full at their quotas, up to
    # `max_batch_size`); while others wait, one user's samples are at most as many as the
    # busiest other user's, or `user_batch_share` × `batch_size` when the others have fewer.
    # A user alone may fill `batch_size`. 1, 1 and `max_batch_size` = `batch_size`: one
    # batch drawn round robin, no share per user.
    user_batch_share: float = Field(default=0.25, gt=0, le=1)
    user_quota: float = Field(default=0.5, gt=0, le=1)
    # None: 2 × `batch_size` (four users' quotas at the default).
    max_batch_size: int | None = Field(default=None, ge=1)
    # One user's samples trained into the shared model within the last `user_window_s`
    # seconds are at most `user_window_batches` × `batch_size`: a user who is the only one
    # active cannot fill version after version. Beyond it their samples wait, queued (or are
    # skipped 'stale' if the model moves on meanwhile). 0: no cap per window. Only where more
    # than one user may train: a stack with a single user is that person's own.
    user_window_batches: float = Field(default=4.0, ge=0)
    user_window_s: float = Field(default=3600.0, gt=0)

    backend: Literal["torch", "megatron"] = "torch"
    # megatron backend only: tensor / pipeline parallel sizes (data parallel = world / tp·pp).
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    # Base model (Hugging Face directory). None: `<state_dir>/models/tinyworld`.
    model: Path | None = None
    # Where `v{N:06d}/` checkpoints go. None: `<state_dir>/weights`.
    weights_dir: Path | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # torch's CPU threads for `clawrl train` (0: torch's default, one per core). On a small
    # machine the trainer shares the cores with the engines: `clawrl up` gives it half of
    # them, since two processes each running one thread per core slow each other several
    # times over (the gate's probe: 59 s on one thread against 208 s on two, beside a busy
    # engine on 2 cores).
    threads: int = Field(default=0, ge=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    lora: LoraSettings = LoraSettings()
    # Keep optimizer state in only the newest K checkpoints (weights are kept until prune).
    keep_trainer_states: int = Field(default=2, ge=1)
    # The gate before serving (trainer/gate.py): a JSONL probe of facts with accepted answers
    # and open questions with topic words that every new version answers before it is
    # published; rejected when its facts score falls more than `gate_max_drop` (a fraction of
    # the facts) below the base model's, or its on-topic rate more than `gate_max_topic_drop`.
    # A rejection sends the trainer back to the served version with its learning rate times
    # `gate_backoff`. None: no gate (a model's recipe.json may name its probe).
    gate_probe: Path | None = None
    gate_max_drop: float = Field(default=0.05, ge=0, le=1)
    gate_max_topic_drop: float = Field(default=0.1, ge=0, le=1)
    gate_backoff: float = Field(default=0.5, gt=0, le=1)
    # Personal mode (docs/trainer.md, "Personal adapters"): one LoRA adapter per user, trained
    # on that user's samples only and served to that user; the shared model is not trained.
    # Needs the torch backend; `lora` sets the adapters' rank and target modules.
    personal: bool = False
    # Personal mode: folders kept per user (the served version is never deleted); older ones
    # are deleted and their versions marked 'retired'.
    keep_adapter_versions: int = Field(default=3, ge=1)

    # Publishing to the engine (`/update_weights_from_disk`).
    publish_attempts: int = Field(default=5, ge=1)
    publish_backoff_s: float = Field(default=1.0, ge=0)
    publish_timeout_s: float = Field(default=600.0, gt=0)

    # Metrics: a Prometheus textfile is always written; a /metrics endpoint when a port is set.
    metrics_port: int | None = None
    metrics_textfile: Path | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.micro_batch_size > self.batch_size:
            self.micro_batch_size = self.batch_size
        if (self.mini_batches, self.epochs) != (1, 1) and self.backend != "torch":
            raise ValueError("several optimizer steps per batch (mini_batches, epochs) need "
                             "the torch backend")
        if self.ptx_coef > 0 and self.backend != "torch":
            raise ValueError("the pretraining-data term (ptx_coef > 0) needs the torch backend")
        if self.replay_coef > 0 and self.backend != "torch":
            raise ValueError("replaying accepted samples (replay_coef > 0) needs the torch "
                             "backend")
        if self.user_quota < self.user_batch_share:
            raise ValueError(f"user_quota ({self.user_quota}) is below user_batch_share "
                             f"({self.user_batch_share}): the most of one user's samples in a "
                             "version cannot be less than what one user may always take")
        if self.max_batch_size is not None and self.max_batch_size < self.batch_size:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) is below batch_size "
                             f"({self.batch_size}): a user alone may fill batch_size")
        if self.personal and self.backend != "torch":
            raise ValueError("personal mode (one LoRA adapter per user) needs the torch backend")
        if self.personal and not self.lora.enabled:
            self.lora = self.lora.model_copy(update={"enabled": True})
        return self

    @property
    def share_rule(self) -> ShareRule:
        """The fair share in samples (trainer/shares.py): a user alone fills `batch_size`;
        while others wait, a quota of ⌊user_quota · batch_size⌋ and a floor of
        ⌊user_batch_share · batch_size⌋ (each at least 1); at most `max_batch_size`."""
        return ShareRule(
            batch_size=self.batch_size,
            quota=max(1, math.floor(self.user_quota * self.batch_size + 1e-9)),
            floor=max(1, math.floor(self.user_batch_share * self.batch_size + 1e-9)),
            max_batch=self.max_batch_size or 2 * self.batch_size)

    @property
    def user_window_cap(self) -> int | None:
        """Most samples of one user trained within `user_window_s` (None: no cap)."""
        if self.user_window_batches <= 0:
            return None
        return max(1, math.ceil(self.user_window_batches * self.batch_size - 1e-9))

    @property
    def baseline(self) -> str:
        """The reward baseline in effect for a batch of several users (`reward_baseline`, or
        its default for the mode); `baseline_for` says it for a batch's users."""
        return self.reward_baseline or ("batch_mean" if self.personal else "user_mean")

    def baseline_for(self, users: int) -> str:
        """The reward baseline in effect for a batch of `users` distinct users. Unset, the
        shared model compares each user's rewards with their own mean when a batch holds
        several users, and keeps one user's raw rewards (what the person-pace runs were
        measured with: a new user's first corrections are all −1, and a batch mean would
        take their push away)."""
        if self.reward_baseline is None and not self.personal and users < 2:
            return "none"
        return self.baseline


class Settings(ProxyProcessSettings):
    """Process settings of `clawrl train` / `clawrl versions`: the shared ones + `trainer`."""

    trainer: TrainerSettings = TrainerSettings()

    def model_dir(self) -> Path:
        return self.trainer.model or self.state_dir / "models" / "tinyworld"

    def weights_dir(self) -> Path:
        return self.trainer.weights_dir or self.state_dir / "weights"

    def metrics_textfile(self) -> Path:
        return self.trainer.metrics_textfile or self.state_dir / "metrics" / "trainer.prom"


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment, with keyword overrides taking precedence."""
    return Settings(**overrides)  # type: ignore[arg-type]
