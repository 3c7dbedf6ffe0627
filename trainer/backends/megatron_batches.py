"""How a Batch is spread over the megatron backend's ranks, and logprobs from split logits.

Data parallel: replica r of dp takes the contiguous samples [r·B/dp, (r+1)·B/dp) and cuts them
into micro batches (`Batch.micro_batches`, which trims trailing padding). A replica left
without samples (B < dp) runs one fully masked row so its collectives stay in step.
Pipeline parallel: stages exchange activations of one fixed shape, so every micro batch is
padded to [micro_batch_size, L] with masked rows / columns.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import Tensor

from trainer.data import Batch


def _take(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows [lo, hi) of a batch (every per-sample field sliced)."""
    return replace(batch, **{f.name: getattr(batch, f.name)[lo:hi] for f in fields(batch)
                             if getattr(batch, f.name) is not None})


def _pad(micro: Batch, rows: int, length: int) -> Batch:
    """Pad a micro batch to [rows, length] with masked-out rows/columns (pipeline shapes)."""
    b, seq = micro.input_ids.shape
    extra_rows, extra_cols = rows - b, length - seq

    def grow(t: Tensor, cols: int) -> Tensor:
        t = torch.nn.functional.pad(t, (0, cols)) if t.dim() == 2 else t
        return torch.cat([t, torch.zeros((extra_rows, *t.shape[1:]), dtype=t.dtype)])

    return replace(
        micro,
        sample_ids=list(micro.sample_ids) + [-1] * extra_rows,
        input_ids=grow(micro.input_ids, extra_cols),
        attention_mask=grow(micro.attention_mask, extra_cols),
        loss_mask=grow(micro.loss_mask, extra_cols),
        rollout_logp=grow(micro.rollout_logp, extra_cols),
        teacher_logp=grow(micro.teacher_logp, extra_cols),
        reward=grow(micro.reward, 0),
        has_reward=grow(micro.has_reward, 0),
        has_teacher=grow(micro.has_teacher, 0),
        outcome=grow(micro.outcome, 0),
        has_outcome=grow(micro.has_outcome, 0),
        baseline=grow(micro.baseline, 0),
        staleness=list(micro.staleness) + [0] * extra_rows,
        # Padding rows at temperature 1: a zero would turn their (masked) logits into inf.
        temperature=None if micro.temperature is None else torch.cat(
            [micro.temperature, torch.ones(extra_rows, dtype=micro.temperature.dtype)]),
        constrained=None if micro.constrained is None else grow(micro.constrained, 0),
    )


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """`[b, L, V/tp]` vocab-parallel logits → `[b, L-1]` logprobs of the next tokens.

    Same grid as trainer.loss.gather_logprobs; −CE is logp. The CE kernel works in place,
    hence the clone.
    """
    from megatron.core import tensor_parallel

    shifted = logits[:, :-1].float().clone()
    loss: Tensor = -tensor_parallel.vocab_parallel_cross_entropy(
        shifted, input_ids[:, 1:].contiguous())
    return loss


def replica_micro_batches(
    batch: Batch, dp: int, rank: int, micro_size: int, fixed_shape: bool
) -> list[Batch]:
    """Data-parallel replica `rank`'s micro batches (see the module docstring)."""
    lo, hi = rank * batch.size // dp, (rank + 1) * batch.size // dp
    if hi > lo:
        micros = _take(batch, lo, hi).micro_batches(micro_size)
    else:
        dummy = _take(batch, 0, 1)
        micros = [replace(dummy, loss_mask=torch.zeros_like(dummy.loss_mask),
                          has_reward=torch.zeros_like(dummy.has_reward),
                          has_teacher=torch.zeros_like(dummy.has_teacher),
                          has_outcome=torch.zeros_like(dummy.has_outcome),
                          constrained=None)]
    if fixed_shape:
        micros = [_pad(m, micro_size, batch.input_ids.shape[1]) for m in micros]
    return micros
