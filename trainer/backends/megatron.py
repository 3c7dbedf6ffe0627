"""The `megatron` backend: megatron-core GPTModel with tensor / pipeline / data parallelism.

Same contract and same objective as the `torch` backend (see base.py): the loss of every
micro batch is `micro_batch_loss`, so both backends compute the same numbers from the same
`Batch`. What differs is how the work is spread:

- tensor parallel (tp): every weight matrix is split over tp ranks (megatron_mapping.py);
  logits stay split over the vocabulary and logprobs come from megatron's vocab-parallel
  cross entropy (logp = −CE), never materialising a full-vocabulary tensor per rank;
- pipeline parallel (pp): layers are split over pp stages; micro batches are padded to one
  shape because stages exchange activations of a fixed size;
- data parallel (dp = world / (tp·pp)): the batch's samples are split contiguously over dp
  replicas; megatron's DDP and distributed optimizer reduce the gradients.

Loss scaling: megatron runs with `calculate_per_token_loss`, so each micro batch returns
its token *sum* and token count, and `finalize_model_grads` divides the all-reduced gradient
by the global token count — exactly the token mean over the whole batch that the torch
backend computes.

Processes: rank 0 is the leader and runs the normal trainer loop (trainer/train.py); every
public method on the leader first broadcasts the call, and the other ranks (`follow()`)
execute the same method, so all collectives line up. One process (`clawrl train --backend
megatron`) needs no followers. Launch several with deploy/torchrun.sh.
"""

from __future__ import annotations

import atexit
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.backends import megatron_compat as compat
from trainer.backends.base import (
    BackendError,
    StepStats,
    micro_batch_loss,
    needs_plain_logprobs,
    signal_mask,
)
from trainer.backends.megatron_batches import replica_micro_batches, token_logprobs
from trainer.backends.megatron_checkpoint import (
    HFWeights,
    gather_hf_state,
    load_distributed,
    save_distributed,
    write_hf,
)
from trainer.backends.megatron_mapping import (
    UnsupportedModelError,
    build_model,
    check_supported,
    hf_to_megatron,
    transformer_config,
)
from trainer.config import TrainerSettings
from trainer.data import Batch, ModelLimits
from trainer.loss import entropy_from_logits, temper
from trainer.ptx import PtxExample

STATS = ("loss", "pg", "kl", "ent", "ratio", "clip", "tokens")


def layout(cfg: TrainerSettings) -> tuple[int, int]:
    """(tp, pp) from the settings (1, 1 when the settings predate these fields)."""
    return int(getattr(cfg, "tp", 1)), int(getattr(cfg, "pp", 1))


class LayoutError(BackendError, ValueError):
    """tp / pp do not fit the number of processes, or are not positive."""


class MegatronBackend:
    """megatron-core trainer; implements trainer.backends.base.Backend."""

    def __init__(self, cfg: TrainerSettings | None = None) -> None:
        compat.init_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        box = [cfg]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)  # followers learn the settings
        try:
            self.cfg: TrainerSettings = self._check_settings(box[0])
            self.tp, self.pp = layout(self.cfg)
            with compat.megatron_context():
                compat.init_model_parallel(self.tp, self.pp)
        except BackendError:
            compat.shutdown_distributed()  # leave nothing half-initialised
            raise
        except ValueError as exc:  # the world size does not fit tp × pp
            compat.shutdown_distributed()
            raise LayoutError(str(exc)) from exc
        self.device = torch.device("cuda", torch.cuda.current_device()) if compat.CUDA \
            else torch.device("cpu")
        # bf16 on a GPU turns on megatron's fused paths; CPU always runs fp32, unfused.
        self.fused = compat.CUDA and self.cfg.dtype == "bfloat16"
        self.hf: Any = None
        self.model: Any = None  # DDP-wrapped GPTModel stage
        self.reference: Any = None
        self.optimizer: Any = None
        self._limits: ModelLimits | None = None
        self.steps = 0
        self._busy = False  # inside a broadcast call (then `close` must not broadcast)
        self._closed = False
        if self.world > 1 and self.is_leader:
            # The trainer loop does not know about followers: release them when we exit.
            atexit.register(self.close)

    @staticmethod
    def _check_settings(cfg: TrainerSettings | None) -> TrainerSettings:
        if cfg is None:
            raise ValueError("MegatronBackend on rank 0 needs the trainer settings")
        tp, pp = layout(cfg)
        if tp < 1 or pp < 1:
            raise LayoutError(f"tp and pp must be >= 1 (got tp {tp}, pp {pp})")
        if cfg.lora.enabled:
            raise UnsupportedModelError(
                "LoRA is not supported by the megatron backend (full fine-tuning only); "
                "use --backend torch for LoRA"
            )
        return cfg

    # -- leader / follower -------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _call(self, name: str, *args: Any) -> Any:
        """Run method `_name` here, after telling the followers to run it too."""
        self._busy = True
        if self.world > 1 and self.is_leader:
            dist.broadcast_object_list([name, args], src=0)
        with compat.megatron_context():
            result = getattr(self, f"_{name}")(*args)
        self._busy = False
        return result

    def follow(self) -> None:
        """Followers: execute the leader's calls until it closes.

        A failure here is the same failure the leader meets (same code, same data); it is
        reported in one line and the process exits non-zero, which stops torchrun.
        """
        while True:
            box: list[Any] = [None, None]
            dist.broadcast_object_list(box, src=0)
            name, args = box
            if name == "close":
                break
            try:
                with compat.megatron_context():
                    getattr(self, f"_{name}")(*args)
            except Exception as exc:
                print(f"megatron rank {self.rank}: {name} failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
                raise SystemExit(1) from exc
        self._closed = True
        compat.shutdown_distributed()

    def close(self) -> None:
        """Release the followers and the process group (idempotent).

        After a failure in the middle of a call the followers are stuck in another
        collective; then nothing is broadcast and torchrun tears the group down.
        """
        if self._closed:
            return
        self._closed = True
        if self.world > 1 and self.is_leader and not self._busy and dist.is_initialized():
            dist.broadcast_object_list(["close", ()], src=0)
        compat.shutdown_distributed()

    # -- public API (base.Backend) -------------------------------------------------------
    @property
    def limits(self) -> ModelLimits:
        if self._limits is None:
            raise RuntimeError("backend not loaded")
        return self._limits

    def load(self, model_dir: Path, reference_dir: Path | None = None) -> None:
        self._call("load", Path(model_dir), Path(reference_dir) if reference_dir else None)

    def compute_logprobs(self, batch: Batch) -> Tensor:
        result: Tensor = self._call("compute_logprobs", batch)
        return result

    def train_step(self, batch: Batch, replay: list[PtxExample] | None = None) -> StepStats:
        # `replay` is refused at config time (replay_coef > 0 needs the torch backend).
        stats: StepStats = self._call("train_step", batch)
        return stats

    def export(self, out_dir: Path) -> None:
        self._call("export", Path(out_dir))

    def logits(self, input_ids: Tensor) -> Tensor:
        """Full-vocabulary logits `[B, L, V]` of `input_ids` (pp 1), on every rank: what
        `megatron_run check --parity` compares with Hugging Face transformers."""
        result: Tensor = self._call("logits", input_ids)
        return result

    def save_state(self, state_dir: Path) -> None:
        self._call("save_state", Path(state_dir))

    def load_state(self, state_dir: Path) -> None:
        self._call("load_state", Path(state_dir))

    # -- building ----------------------------------------------------------------------------
    def _build_stage(self, weights: HFWeights) -> Any:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        model = build_model(self.hf, self.tconfig)
        names = [n for n, _ in model.named_parameters()]
        offset = get_transformer_layer_offset(self.tconfig)
        from megatron.core import parallel_state as ps

        state = hf_to_megatron(
            self.hf, weights, names, offset, self.tp, ps.get_tensor_model_parallel_rank()
        )
        dtype = self.tconfig.params_dtype
        missing = model.load_state_dict(
            {k: v.to(self.device, dtype) for k, v in state.items()}, strict=False
        ).missing_keys
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"megatron parameters left unloaded: {missing[:5]}")
        return model.to(self.device)

    def _load(self, model_dir: Path, reference_dir: Path | None) -> None:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model folder "
                                    "(no config.json)")
        self.hf = AutoConfig.from_pretrained(str(model_dir))
        check_supported(self.hf, self.tp, self.pp)  # before any weight is read
        self._limits = ModelLimits(vocab_size=int(self.hf.vocab_size),
                                   max_context=int(self.hf.max_position_embeddings))
        self.tconfig = transformer_config(self.hf, self.tp, self.pp, fused=self.fused)
        self.tconfig.calculate_per_token_loss = True
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        stage = self._build_stage(HFWeights(model_dir))
        if self.cfg.kl_coef > 0:
            self.reference = self._build_stage(HFWeights(reference_dir or model_dir))
            self.reference.eval().requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True
        )
        self.model = DDP(self.tconfig, ddp_config, stage)
        beta1, beta2 = self.cfg.betas
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                adam_beta1=beta1, adam_beta2=beta2, clip_grad=self.cfg.grad_clip,
                use_distributed_optimizer=True, bf16=self.fused,
                params_dtype=self.tconfig.params_dtype,
            ),
            [self.model],
        )

    # -- forward passes ----------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[Batch]:
        """This data-parallel replica's micro batches, on this rank's device."""
        from megatron.core import parallel_state as ps

        micros = replica_micro_batches(
            batch, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
            self.cfg.micro_batch_size, fixed_shape=self.pp > 1,
        )
        return [m.to(self.device) for m in micros]

    def _run(self, model: Any, micros: list[Any], loss_fn: Any, forward_only: bool) -> list[Any]:
        """megatron's forward(-backward) schedule over `micros`; returns the loss dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Any, stage: Any) -> tuple[Tensor, Any]:
            item = next(data_iterator)
            micro = item[0]
            ids = micro.input_ids
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
            return stage(ids, pos, None), partial(loss_fn, *item)

        first = micros[0][0].input_ids
        out: list[Any] = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micros), model=[model],
            num_microbatches=len(micros), seq_length=first.shape[1],
            micro_batch_size=first.shape[0], forward_only=forward_only,
        )
        return out

    @staticmethod
    def _logprob_loss(micro: Batch, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        logp = token_logprobs(temper(logits, micro.temperature), micro.input_ids).detach()
        return logp.new_zeros(()), {"logp": logp}

    @torch.no_grad()
    def _forward_logprobs(self, model: Any, micros: list[Batch]) -> list[Tensor]:
        """Per-micro-batch logprobs `[b, T]` (valid on the last pipeline stage, else empty)."""
        model.eval()
        out = self._run(model, [(m,) for m in micros], self._logprob_loss, forward_only=True)
        return [o["logp"] for o in out]

    def _compute_logprobs(self, batch: Batch) -> Tensor:
        """[B, T] on every rank: each replica fills its rows, then a sum over replicas."""
        from megatron.core import parallel_state as ps

        full = torch.zeros(batch.loss_mask.shape, dtype=torch.float32, device=self.device)
        micros = self._micro_batches(batch)
        dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        row = r * batch.size // dp
        for micro, logp in zip(micros, self._forward_logprobs(self.model, micros), strict=False):
            n = min(len([s for s in micro.sample_ids if s != -1]), batch.size - row)
            full[row:row + n, : logp.shape[1]] = logp[:n, : full.shape[1]]
            row += n
        if (r + 1) * batch.size // dp == r * batch.size // dp:
            full.zero_()  # a dummy replica contributes nothing
        if not ps.is_pipeline_last_stage():
            full.zero_()
        dist.all_reduce(full, group=ps.get_data_parallel_group())
        if self.pp > 1:
            dist.all_reduce(full, group=ps.get_pipeline_model_parallel_group())
        return full.cpu()

    @torch.no_grad()
    def _logits(self, input_ids: Tensor) -> Tensor:
        from megatron.core import tensor_parallel

        self.model.eval()
        ids = input_ids.to(self.device)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        local = self.model.module(ids, pos, None)  # [B, L, V/tp]: split over the vocabulary
        full: Tensor = tensor_parallel.gather_from_tensor_model_parallel_region(local)
        return full.float().cpu()

    # -- the step ----------------------------------------------------------------------------
    def _train_loss(
        self, micro: Batch, logp_ref: Tensor | None, raw: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        logits = temper(raw, micro.temperature)  # each sample's behaviour distribution
        logp_new = token_logprobs(logits, micro.input_ids)
        entropy = None
        if self.cfg.entropy_coef > 0:
            from megatron.core import tensor_parallel

            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            entropy = entropy_from_logits(full)
        logp_plain = None
        if needs_plain_logprobs(self.cfg, micro):
            with torch.no_grad():
                logp_plain = token_logprobs(raw.detach(), micro.input_ids)
        # num_tokens=1: the token *sum*; megatron divides by the global count (module doc).
        terms = micro_batch_loss(self.cfg, micro, logp_new, 1, logp_ref, entropy, logp_plain)
        tokens = round(float(signal_mask(self.cfg, micro).sum()))
        stats = torch.tensor(
            [float(terms.loss.detach()), terms.pg_sum, terms.kl_sum, terms.entropy_sum,
             terms.ratio_sum, terms.clipped_low + terms.clipped_high, tokens],
            dtype=torch.float64,
        )
        logs = {"stats": stats, "lr_max": torch.tensor(terms.abs_log_ratio_max)}
        return terms.loss, torch.tensor(tokens, dtype=torch.int), logs

    def _train_step(self, batch: Batch) -> StepStats:
        from megatron.core import parallel_state as ps

        started = time.perf_counter()
        micros = self._micro_batches(batch)
        refs: list[Tensor | None] = [None] * len(micros)
        if self.reference is not None:
            refs = list(self._forward_logprobs(self.reference, micros)) or refs
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(self.model, list(zip(micros, refs, strict=True)), self._train_loss,
                        forward_only=False)
        # Sum the per-micro statistics over micro batches, replicas and (zeros elsewhere) stages.
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.device)
        lr_max = torch.zeros((), dtype=torch.float64, device=self.device)
        for o in out:
            sums += o["stats"].to(self.device)
            lr_max = torch.maximum(lr_max, o["lr_max"].to(self.device, torch.float64))
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        dist.all_reduce(lr_max, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        if self.pp > 1:
            dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())
            dist.all_reduce(lr_max, op=dist.ReduceOp.MAX,
                            group=ps.get_pipeline_model_parallel_group())
        s = dict(zip(STATS, sums.tolist(), strict=True))
        tokens = int(s["tokens"])
        n = max(tokens, 1)
        loss = s["loss"] / n
        reason = None if math.isfinite(loss) else f"non-finite loss ({loss})"
        grad_norm = None
        if reason is None:
            # optimizer.step() without the update, so a bad norm can still skip it.
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.clip_grad_norm(self.cfg.grad_clip))
            if not math.isfinite(grad_norm):
                reason = f"non-finite gradient norm ({grad_norm})"
        if reason is not None:
            # Weights and Adam moments untouched; the grad buffers are zeroed next step.
            return StepStats(status="skipped", num_samples=batch.size, num_tokens=tokens,
                             seconds=time.perf_counter() - started, reason=reason)
        self.optimizer.step_with_ready_grads()
        self.steps += 1
        if compat.CUDA:
            torch.cuda.synchronize()
        return StepStats(
            status="ok", num_samples=batch.size, num_tokens=tokens,
            seconds=time.perf_counter() - started, loss=loss, pg_loss=s["pg"] / n,
            kl=s["kl"] / n, entropy=s["ent"] / n if self.cfg.entropy_coef > 0 else None,
            ratio_mean=s["ratio"] / n, clip_frac=s["clip"] / n,
            abs_log_ratio_max=float(lr_max), grad_norm=grad_norm,
            extra={"tp": self.tp, "pp": self.pp, "dp": ps.get_data_parallel_world_size()})

    # -- files -------------------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full HF weights on the leader (followers must be inside `follow()`)."""
        result: dict[str, Tensor] = self._call("hf_state")
        return result

    def _hf_state(self) -> dict[str, Tensor]:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return gather_hf_state(
            self.model.module, self.hf, get_transformer_layer_offset(self.tconfig)
        )

    def _export(self, out_dir: Path) -> None:
        state = self._hf_state()
        if self.is_leader:
            write_hf(state, self.hf, out_dir)

    def _save_state(self, state_dir: Path) -> None:
        save_distributed(state_dir, self.model, self.optimizer, self.hf,
                         {"steps": self.steps, "tp": self.tp, "pp": self.pp})

    def _load_state(self, state_dir: Path) -> None:
        meta = load_distributed(state_dir, self.model, self.optimizer, self.hf, self.tp, self.pp)
        self.steps = int(meta.get("steps", 0))
