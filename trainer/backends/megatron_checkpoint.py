"""Weights in and out of the megatron backend: HF safetensors ⇄ sharded GPTModel, and resume.

- `HFWeights`: a lazy, read-only view of an HF model folder's safetensors (single file or
  sharded with an index), so each rank reads only the tensors its shard needs.
- `gather_hf_state`: the full HF state dict on global rank 0, gathered from tensor-parallel
  shards (all-gather in the TP group) and pipeline stages (gather in the PP group). Only the
  data-parallel replica 0 takes part; the others hold identical weights.
- `save_distributed` / `load_distributed`: model + optimizer state with megatron's
  distributed checkpointing (every rank writes its own shards into one shared folder), plus
  `megatron.json` describing the model shape, so a checkpoint of another model is refused
  with a readable error instead of a tensor-shape traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.backends.megatron_mapping import gather_tp, megatron_to_hf, parallel_dim
from trainer.export import CheckpointError

SHAPE_FILE = "megatron.json"
# Optimizer state saved in the canonical per-parameter layout, so a run can resume under a
# different tensor / pipeline / data parallel layout (slower to save than 'dp_reshardable').
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


class CheckpointMismatchError(CheckpointError):
    """A megatron checkpoint does not fit this model (shape) or layout (tp / pp), or is missing."""


class HFWeights(Mapping[str, Tensor]):
    """Tensors of an HF model folder by name, read from safetensors on first access."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._where = {name: model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
            from safetensors import safe_open

            self._where = {}
            for path in files:
                with safe_open(str(path), framework="pt") as fh:
                    self._where.update({k: path for k in fh.keys()})  # noqa: SIM118

    def __getitem__(self, name: str) -> Tensor:
        from safetensors import safe_open

        if name not in self._where:
            raise KeyError(name)
        with safe_open(str(self._where[name]), framework="pt") as fh:
            tensor: Tensor = fh.get_tensor(name)
            return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def gather_hf_state(model: torch.nn.Module, hf: Any, layer_offset: int) -> dict[str, Tensor]:
    """The full HF state dict of `model` (this rank's GPTModel stage) on global rank 0.

    Collective over the model-parallel group of data-parallel replica 0; other ranks return
    an empty dict (and so does every rank but 0).
    """
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return {}
    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    stage: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        full = param.detach()
        if tp > 1 and parallel_dim(name) is not None:
            shards = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(shards, full.contiguous(), group=tp_group)
            full = gather_tp(name, shards)
        if ps.get_tensor_model_parallel_rank() == 0:
            # clone: the mapping returns views (q/k/v, gate/up) and safetensors refuses
            # tensors that share storage.
            mapped = megatron_to_hf(hf, name, full.cpu(), layer_offset)
            stage.update({k: v.clone() for k, v in mapped.items()})
    if ps.get_tensor_model_parallel_rank() != 0:
        return {}
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stage
    # The PP group of (tp 0, dp 0) holds global rank 0 as its first stage.
    group = ps.get_pipeline_model_parallel_group()
    parts: list[Any] = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else []
    dist.gather_object(stage, parts if dist.get_rank() == 0 else None, dst=0, group=group)
    merged: dict[str, Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def write_hf(state: dict[str, Tensor], hf: Any, out_dir: Path) -> None:
    """HF model files: config.json + safetensors (sharded with an index when large)."""
    from huggingface_hub import save_torch_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    save_torch_state_dict(
        {k: v.contiguous() for k, v in state.items()}, str(out_dir), max_shard_size="5GB"
    )


def model_shape(hf: Any) -> dict[str, Any]:
    return {k: getattr(hf, k, None) for k in SHAPE_KEYS}


def check_shape(state_dir: Path, hf: Any, tp: int, pp: int) -> None:
    """Refuse a megatron checkpoint written for another model or layout (names the differences).

    The optimizer state is saved 'dp_reshardable': it follows a change of data parallel
    size, not of tensor / pipeline parallel size.
    """
    meta_path = state_dir / SHAPE_FILE
    if not meta_path.is_file():
        raise CheckpointMismatchError(
            f"{state_dir} is not a megatron trainer checkpoint (no {SHAPE_FILE})"
        )
    saved = json.loads(meta_path.read_text())["shape"]
    ours = model_shape(hf)
    diffs = [f"{k} {saved.get(k)} vs {ours[k]}" for k in SHAPE_KEYS if saved.get(k) != ours[k]]
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {state_dir} was written for a different model "
            f"(checkpoint vs this model: {'; '.join(diffs)})"
        )
    meta = json.loads(meta_path.read_text())
    if (meta.get("tp"), meta.get("pp")) != (tp, pp):
        raise CheckpointMismatchError(
            f"checkpoint {state_dir} holds optimizer state for tp {meta.get('tp')} × pp "
            f"{meta.get('pp')}, this run is tp {tp} × pp {pp}; resume with the same tp/pp "
            "(data parallel size may change)"
        )


def save_distributed(
    state_dir: Path, model: Any, optimizer: Any, hf: Any, extra: dict[str, Any]
) -> None:
    """Model + optimizer shards of every rank into `state_dir` (collective)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        state_dir.mkdir(parents=True, exist_ok=True)
        (state_dir / SHAPE_FILE).write_text(
            json.dumps({"shape": model_shape(hf), **extra}, indent=1)
        )
    dist.barrier()
    _init_adam_state(optimizer)  # a never-stepped optimizer saves as zeros at step 0
    model_sd = model.module.sharded_state_dict()
    sharded = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=METADATA),
    }
    (state_dir / "dist").mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(state_dir / "dist"))
    dist.barrier()


def load_distributed(
    state_dir: Path, model: Any, optimizer: Any, hf: Any, tp: int, pp: int
) -> dict[str, Any]:
    """Restore model + optimizer from `save_distributed` output; returns its extra info."""
    from megatron.core import dist_checkpointing

    check_shape(state_dir, hf, tp, pp)
    _init_adam_state(optimizer)
    model_sd = model.module.sharded_state_dict()
    sharded = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=METADATA),
    }
    loaded = dist_checkpointing.load(sharded, str(state_dir / "dist"))
    with torch.no_grad():  # megatron copies into leaf parameters (views of its buffers)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    meta: dict[str, Any] = json.loads((state_dir / SHAPE_FILE).read_text())
    return meta


def _init_adam_state(optimizer: Any) -> None:
    """Give a fresh torch Adam state (zeros, step 0) to every parameter that has none.

    Without Transformer Engine / Apex, megatron's DistributedOptimizer.state_dict() reads the
    common `step` from torch Adam's per-parameter state, which a never-stepped optimizer
    does not have yet. Zeros at step 0 are exactly Adam's initial state.
    """
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param.data),
                        "exp_avg_sq": torch.zeros_like(param.data),
                    }
