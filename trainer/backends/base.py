"""What a training backend must do, and the loss code every backend shares.

A backend owns the model and optimizer; the loop in `trainer/train.py` owns everything else
(claiming samples, checkpoint folders, the database, publishing). The contract:

    load(model_dir, reference_dir=None)  trainable weights from model_dir (the base model, or a
                                         version folder when resuming); frozen KL reference
                                         from reference_dir (default model_dir)
    limits -> ModelLimits                vocabulary size and context length (sample validation)
    compute_logprobs(batch) -> [B, T]    no-grad logprobs of batch.input_ids on the target grid
    train_step(batch) -> StepStats       one optimizer step over the whole batch (micro batches,
                                         gradient accumulation, clipping); a NaN/inf loss or
                                         gradient leaves weights and optimizer untouched and
                                         returns status 'skipped'
    export(out_dir)                      plain HF model files (safetensors + config.json);
                                         LoRA merged
    save_state(state_dir) / load_state(state_dir)
                                         optimizer (+ LoRA adapters): what resuming needs beyond
                                         the exported weights

Both the torch and megatron backends build their per-micro-batch loss with `micro_batch_loss`
below, so they compute the same objective from the same `Batch`.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from trainer.config import TrainerSettings
from trainer.data import Batch, ModelLimits
from trainer.loss import LossTerms, compute_advantages, policy_loss
from trainer.ptx import PtxExample


class BackendError(Exception):
    """The backend cannot train this model or layout (the message says why, in one line)."""


@dataclass
class StepStats:
    status: str  # 'ok' | 'skipped'
    num_samples: int
    num_tokens: int
    seconds: float
    loss: float | None = None
    pg_loss: float | None = None
    kl: float | None = None
    entropy: float | None = None
    ratio_mean: float | None = None
    clip_frac: float | None = None
    abs_log_ratio_max: float | None = None
    grad_norm: float | None = None
    reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_metrics(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "extra"} \
            | self.extra


class Backend(Protocol):
    @property
    def limits(self) -> ModelLimits: ...

    def load(self, model_dir: Path, reference_dir: Path | None = None) -> None: ...

    def compute_logprobs(self, batch: Batch) -> Tensor: ...

    def train_step(self, batch: Batch, replay: list[PtxExample] | None = None) -> StepStats: ...

    def export(self, out_dir: Path) -> None: ...

    def save_state(self, state_dir: Path) -> None: ...

    def load_state(self, state_dir: Path) -> None: ...


def signal_mask(cfg: TrainerSettings, batch: Batch) -> Tensor:
    """Loss mask `[B, T]`: response tokens of samples that carry a signal under cfg.method."""
    _, has_signal = compute_advantages(
        method=cfg.method, w_rl=cfg.w_rl, w_opd=cfg.w_opd, reward=batch.reward,
        has_reward=batch.has_reward, teacher_logp=batch.teacher_logp,
        has_teacher=batch.has_teacher, rollout_logp=batch.rollout_logp,
        outcome=batch.outcome, has_outcome=batch.has_outcome, w_outcome=cfg.outcome_weight,
        constrained=batch.constrained)
    return batch.loss_mask * has_signal.unsqueeze(-1).to(batch.loss_mask.dtype)


def micro_batch_loss(
    cfg: TrainerSettings,
    micro: Batch,
    logp_new: Tensor,
    num_tokens: int,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    logp_plain: Tensor | None = None,
) -> LossTerms:
    """The loss of one micro batch, scaled so micro losses sum to the batch token mean.

    logp_new / logp_ref / entropy: `[b, T]` on the micro batch's target grid (same device as
    `micro`'s tensors), each at its sample's temperature (`trainer.loss.temper`). num_tokens:
    signal tokens in the whole batch (see `signal_mask`). logp_plain: the current policy's
    logprobs at T = 1, needed when a tempered sample carries teacher logprobs (the teacher
    scores at T = 1; `student_logprobs`).

    A constrained sample (`micro.constrained`) was drawn from the grammar's masked distribution,
    not from the policy: both its student logprobs (against its teacher, that distribution) and
    its behaviour logprobs (in the ratio) are the current policy's own, detached — ratio 1.
    """
    student = (student_logprobs(micro, logp_plain) if cfg.method in ("opd", "combine")
               else micro.rollout_logp)
    behaviour = micro.rollout_logp
    forced = constrained(micro)
    if forced is not None:
        own = logp_new.detach()
        student = torch.where(forced.unsqueeze(-1), own, student)
        behaviour = torch.where(forced.unsqueeze(-1), own, behaviour)
    advantages, has_signal = compute_advantages(
        method=cfg.method, w_rl=cfg.w_rl, w_opd=cfg.w_opd, reward=micro.reward,
        has_reward=micro.has_reward, teacher_logp=micro.teacher_logp,
        has_teacher=micro.has_teacher, rollout_logp=student,
        outcome=micro.outcome, has_outcome=micro.has_outcome, w_outcome=cfg.outcome_weight,
        baseline=micro.baseline, constrained=forced,
        constrained_adv_max=cfg.constrained_adv_max)
    mask = micro.loss_mask * has_signal.unsqueeze(-1).to(micro.loss_mask.dtype)
    return policy_loss(
        logp_new=logp_new, rollout_logp=behaviour, advantages=advantages, mask=mask,
        num_tokens=num_tokens, eps_low=cfg.eps_low, eps_high=cfg.eps_high, logp_ref=logp_ref,
        kl_coef=cfg.kl_coef, entropy=entropy, entropy_coef=cfg.entropy_coef)


def tempered(batch: Batch) -> Tensor | None:
    """`[B]` bool: the samples drawn at a temperature other than 1 (None: none)."""
    if batch.temperature is None:
        return None
    mask = batch.temperature != 1.0
    return mask if bool(mask.any()) else None


def constrained(batch: Batch) -> Tensor | None:
    """`[B]` bool: the samples drawn under a grammar, distilled toward it (None: none)."""
    if batch.constrained is None:
        return None
    mask = batch.constrained.bool()
    return mask if bool(mask.any()) else None


def hinted(batch: Batch) -> Tensor:
    """`[B]` bool: the samples whose teacher the judge scored with a hint, at T = 1 (not a
    constrained sample's: its teacher is at the sample's own T)."""
    forced = constrained(batch)
    has = batch.has_teacher.bool()
    return has if forced is None else has & ~forced.to(has.device)


def needs_plain_logprobs(cfg: TrainerSettings, batch: Batch) -> bool:
    """Whether the distillation term needs the policy's T = 1 logprobs for this batch."""
    mask = tempered(batch)
    return (mask is not None and cfg.method in ("opd", "combine")
            and bool((mask & hinted(batch).to(mask.device)).any()))


def student_logprobs(batch: Batch, logp_plain: Tensor | None) -> Tensor:
    """The student's logprobs `[B, T]` that the teacher's (scored at T = 1) are compared with:
    the rollout logprobs of a sample drawn at T = 1 (the behaviour policy's own), and for a
    tempered one — whose rollout logprobs are at its T — the current policy's at T = 1
    (`logp_plain`, detached)."""
    mask = tempered(batch)
    if mask is None:
        return batch.rollout_logp
    if logp_plain is None:
        if bool((mask & hinted(batch).to(mask.device)).any()):
            raise ValueError("tempered samples with teacher logprobs need logp_plain")
        return batch.rollout_logp
    return torch.where(mask.unsqueeze(-1), logp_plain.detach(), batch.rollout_logp)


BACKENDS = {
    "torch": ("trainer.backends.torch", "TorchBackend"),
    "megatron": ("trainer.backends.megatron", "MegatronBackend"),
}


def make_backend(cfg: TrainerSettings) -> Backend:
    """Instantiate the configured backend (imported lazily: megatron is optional)."""
    module, name = BACKENDS[cfg.backend]
    backend: Backend = getattr(importlib.import_module(module), name)(cfg)
    return backend
