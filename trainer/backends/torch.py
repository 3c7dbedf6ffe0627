"""The `torch` backend: a Hugging Face causal LM on CPU or one GPU, AdamW, optional LoRA.

One `train_step` = zero grads → for each micro batch: forward, our own logprob gathering
(no `labels`: HF would shift them a second time), loss scaled by the batch's token count,
backward → clip the global grad norm → AdamW step. If any micro loss or the grad norm is
NaN/inf, gradients are dropped and neither weights nor optimizer state change.

With LoRA (peft), only adapters train; the KL reference is the same network with adapters
disabled (no second copy), and `export` writes the adapter alone (a PEFT folder the engine
loads beside the base); `export_merged` writes the merged plain model.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trainer.backends.base import (
    BackendError,
    StepStats,
    micro_batch_loss,
    needs_plain_logprobs,
    signal_mask,
)
from trainer.config import TrainerSettings
from trainer.data import Batch, ModelLimits
from trainer.loss import entropy_from_logits, gather_logprobs, temper
from trainer.ptx import PtxBatches, PtxDataError, PtxExample, load_examples, pad_examples

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_FILE = "adapter.pt"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def first_scored(micro: Batch) -> int:
    """The first position whose next token carries loss in some row of `micro` (0: none).
    The logits before it are never read: an agent's turn is a 3–5k-token prompt and a reply
    of a few dozen, and each position's logits are a vocabulary's worth of floats (49,152 on
    SmolLM2), with their tempered and log-softmaxed copies and their gradients."""
    columns = micro.loss_mask.any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else 0


def scored(values: Tensor, first: int) -> Tensor:
    """`[b, T - first]` values of positions `first`… back on the target grid `[b, T]`, zero
    before `first` (where the loss mask is zero in every row)."""
    return torch.nn.functional.pad(values, (first, 0)) if first else values


def _nonfinite(term: str, nll: float) -> str | None:
    """Why a step with this supervised term's NLL must be skipped, or None when it is finite."""
    return None if math.isfinite(nll) else f"non-finite {term} loss ({nll})"


class TorchBackend:
    def __init__(self, cfg: TrainerSettings) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._limits: ModelLimits | None = None
        self.ptx: PtxBatches | None = None

    # -- loading -----------------------------------------------------------------------------
    def load(self, model_dir: Path, reference_dir: Path | None = None) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype)
        conf = model.config
        self._limits = ModelLimits(
            vocab_size=int(conf.vocab_size),
            max_context=int(getattr(conf, "max_position_embeddings", 0) or 2**31))
        if self.cfg.lora.enabled:
            from peft import LoraConfig, get_peft_model

            lc = self.cfg.lora
            with warnings.catch_warnings():
                # peft 0.21 reads a property transformers 5 deprecated; harmless.
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                        category=FutureWarning)
                model = get_peft_model(model, LoraConfig(
                    r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                    target_modules=lc.target_modules, task_type="CAUSAL_LM"))
        elif self.cfg.kl_coef > 0:
            ref_dir = reference_dir or model_dir
            reference: Any = (copy.deepcopy(model) if ref_dir == model_dir else
                              AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=self.dtype))
            self.reference = reference.to(self.device).eval().requires_grad_(False)
        self.model = model.to(self.device)
        self._new_optimizer()
        if self.cfg.ptx_coef > 0 and self.ptx is None:
            self.ptx = self._load_ptx(reference_dir or model_dir)

    def _load_ptx(self, model_dir: Path) -> PtxBatches:
        from transformers import AutoTokenizer

        if self.cfg.ptx_data is None:
            raise BackendError("ptx_coef > 0 needs ptx_data: a JSONL file of "
                               '{"messages": [...]} or {"text": ...} lines')
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        try:
            examples = load_examples(self.cfg.ptx_data, tokenizer,
                                     min(self.limits.max_context, 2048))
        except PtxDataError as exc:
            raise BackendError(str(exc)) from exc
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return PtxBatches(examples, self.cfg.ptx_batch_size, self.cfg.seed, pad_id=int(pad))

    @property
    def lr(self) -> float:
        """The optimizer's learning rate: the adapter's under LoRA when it has its own."""
        if self.cfg.lora.enabled and self.cfg.adapter_lr is not None:
            return self.cfg.adapter_lr
        return self.cfg.lr

    def _new_optimizer(self) -> None:
        params = [p for p in self._model().parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.lr, betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)

    @property
    def limits(self) -> ModelLimits:
        if self._limits is None:
            raise RuntimeError("backend not loaded")
        return self._limits

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("backend not loaded")
        return self.model

    # -- forward passes ----------------------------------------------------------------------
    def _logits(self, model: torch.nn.Module, micro: Batch, first: int = 0) -> Tensor:
        """The untempered logits `[b, L - first, V]` of positions `first`… (`temper` them for
        the sample's distribution): the model's head only where a next token is scored."""
        out = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask,
                    use_cache=False, logits_to_keep=micro.input_ids.shape[1] - first)
        logits: Tensor = out.logits
        return logits

    def _policy_logprobs(self, model: torch.nn.Module, micro: Batch, first: int = 0) -> Tensor:
        """Logprobs `[b, T]` under each sample's behaviour temperature (0 before `first`)."""
        return scored(gather_logprobs(temper(self._logits(model, micro, first),
                                             micro.temperature),
                                      micro.input_ids[:, first:]), first)

    @torch.no_grad()
    def _reference_logprobs(self, micro: Batch, first: int = 0) -> Tensor | None:
        if self.cfg.kl_coef <= 0:
            return None
        if self.cfg.lora.enabled:
            with self._model().disable_adapter():  # type: ignore[operator]
                return self._policy_logprobs(self._model(), micro, first)
        assert self.reference is not None
        return self._policy_logprobs(self.reference, micro, first)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> Tensor:
        model = self._model()
        was_training = model.training
        model.eval()
        parts = []
        for micro in batch.micro_batches(self.cfg.micro_batch_size, self.cfg.micro_batch_tokens):
            micro = micro.to(self.device)
            lp = self._policy_logprobs(model, micro)
            pad = batch.loss_mask.shape[1] - lp.shape[1]
            parts.append(torch.nn.functional.pad(lp.cpu(), (0, pad)))
        model.train(was_training)
        return torch.cat(parts)

    # -- the step ----------------------------------------------------------------------------
    def train_step(self, batch: Batch, replay: list[PtxExample] | None = None) -> StepStats:
        """One version's training on a claimed batch: `epochs` passes over it, each in
        `mini_batches` optimizer steps on a slice of it (1 and 1: one step on the whole
        batch). After the first step the policy has moved from the one that sampled the
        batch; the ratio and its clip range (trainer/loss.py) bound how far the later steps
        go, as in PPO. A non-finite step is dropped (its gradients, not the earlier steps);
        the version is 'skipped' only when every step was. `replay`: accepted samples
        (trainer/data.py `replay_batch`) whose likelihood every step keeps up, by `replay_coef`."""
        cfg = self.cfg
        replayed = (pad_examples(replay)
                    if replay and cfg.replay_coef > 0 else None)
        if cfg.mini_batches == 1 and cfg.epochs == 1:
            return self._update(batch, replayed)
        started = time.perf_counter()
        parts = batch.micro_batches(-(-batch.size // cfg.mini_batches))
        done = [self._update(part, replayed) for _ in range(cfg.epochs) for part in parts]
        ok = [d for d in done if d.status == "ok"]
        num_tokens = round(float(signal_mask(cfg, batch).sum()))
        if not ok:
            return StepStats(status="skipped", num_samples=batch.size, num_tokens=num_tokens,
                             seconds=time.perf_counter() - started, reason=done[0].reason)
        tokens = sum(d.num_tokens for d in ok) or 1

        def weighted(name: str) -> float | None:
            values = [(getattr(d, name), d.num_tokens) for d in ok]
            if any(v is None for v, _ in values):
                return None
            return float(sum(v * n for v, n in values)) / tokens

        return StepStats(
            status="ok", num_samples=batch.size, num_tokens=num_tokens,
            seconds=time.perf_counter() - started, loss=sum(d.loss or 0.0 for d in ok) / len(ok),
            pg_loss=weighted("pg_loss"), kl=weighted("kl"), entropy=weighted("entropy"),
            ratio_mean=weighted("ratio_mean"), clip_frac=weighted("clip_frac"),
            abs_log_ratio_max=max(d.abs_log_ratio_max or 0.0 for d in ok),
            grad_norm=max(d.grad_norm or 0.0 for d in ok),
            extra={"updates": len(ok), "updates_skipped": len(done) - len(ok)}
            | ({"ptx_nll": sum(d.extra["ptx_nll"] for d in ok) / len(ok)}
               if self.ptx is not None else {})
            | ({"replay_nll": sum(d.extra["replay_nll"] for d in ok) / len(ok)}
               if replayed is not None else {}))

    def _update(self, batch: Batch,
                replayed: tuple[Tensor, Tensor, Tensor] | None = None) -> StepStats:
        """One optimizer step on `batch` (gradient accumulation over its micro batches)."""
        model, opt = self._model(), self.optimizer
        assert opt is not None
        started = time.perf_counter()
        num_tokens = round(float(signal_mask(self.cfg, batch).sum()))
        model.train()
        opt.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "ent": 0.0, "ratio": 0.0, "clip": 0}
        abs_lr_max, bad = 0.0, None
        for micro in batch.micro_batches(self.cfg.micro_batch_size, self.cfg.micro_batch_tokens):
            micro = micro.to(self.device)
            first = first_scored(micro)
            logp_ref = self._reference_logprobs(micro, first)
            raw = self._logits(model, micro, first)
            logits = temper(raw, micro.temperature)
            ids = micro.input_ids[:, first:]
            logp_new = scored(gather_logprobs(logits, ids), first)
            entropy = scored(entropy_from_logits(logits), first) \
                if self.cfg.entropy_coef > 0 else None
            logp_plain = None
            if needs_plain_logprobs(self.cfg, micro):
                with torch.no_grad():
                    logp_plain = scored(gather_logprobs(raw.detach(), ids), first)
            terms = micro_batch_loss(self.cfg, micro, logp_new, num_tokens, logp_ref, entropy,
                                     logp_plain)
            loss_value = float(terms.loss.detach())
            if not math.isfinite(loss_value):
                bad = f"non-finite loss ({loss_value})"
                break
            terms.loss.backward()  # type: ignore[no-untyped-call]
            sums["loss"] += loss_value
            sums["pg"] += terms.pg_sum
            sums["kl"] += terms.kl_sum
            sums["ent"] += terms.entropy_sum
            sums["ratio"] += terms.ratio_sum
            sums["clip"] += terms.clipped_low + terms.clipped_high
            abs_lr_max = max(abs_lr_max, terms.abs_log_ratio_max)
        # The supervised terms, in turn; the first non-finite one ends the step (skipped).
        extra: dict[str, float] = {}
        if bad is None and self.ptx is not None:
            extra["ptx_nll"] = self._nll_backward(model, self.ptx.next(), self.cfg.ptx_coef)
            bad = _nonfinite("ptx", extra["ptx_nll"])
        if bad is None and replayed is not None:
            extra["replay_nll"] = self._nll_backward(model, replayed, self.cfg.replay_coef)
            bad = _nonfinite("replay", extra["replay_nll"])
        grad_norm = None
        if bad is None:
            params = [p for p in model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
            if not math.isfinite(grad_norm):
                bad = f"non-finite gradient norm ({grad_norm})"
        if bad is not None:
            # Drop the gradients; no optimizer step, so weights and Adam moments stay as-is.
            opt.zero_grad(set_to_none=True)
            return StepStats(status="skipped", num_samples=batch.size, num_tokens=num_tokens,
                             seconds=time.perf_counter() - started, reason=bad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = max(num_tokens, 1)
        return StepStats(
            status="ok", num_samples=batch.size, num_tokens=num_tokens,
            seconds=time.perf_counter() - started, loss=sums["loss"], pg_loss=sums["pg"] / n,
            kl=sums["kl"] / n, entropy=sums["ent"] / n if self.cfg.entropy_coef > 0 else None,
            ratio_mean=sums["ratio"] / n, clip_frac=sums["clip"] / n,
            abs_log_ratio_max=abs_lr_max, grad_norm=grad_norm,
            extra=extra)

    def _nll_backward(self, model: torch.nn.Module, tensors: tuple[Tensor, Tensor, Tensor],
                      coef: float) -> float:
        """Accumulate coef · the token-mean NLL of one supervised batch (a ptx batch,
        trainer/ptx.py, or replayed samples) into the gradients, in micro batches; returns
        the batch's mean NLL (NaN, with nothing accumulated further, once it is not finite)."""
        ids, attn, mask = tensors
        total = float(mask.sum()) or 1.0
        nll_sum = 0.0
        step = self.cfg.micro_batch_size
        for start in range(0, ids.shape[0], step):
            part = slice(start, start + step)
            micro_ids, micro_mask = ids[part].to(self.device), mask[part].to(self.device)
            logits = model(input_ids=micro_ids, attention_mask=attn[part].to(self.device),
                           use_cache=False).logits
            nll = -(gather_logprobs(logits, micro_ids) * micro_mask).sum()
            if not math.isfinite(float(nll.detach())):
                return float("nan")
            (coef * nll / total).backward()  # type: ignore[no-untyped-call]
            nll_sum += float(nll.detach())
        return nll_sum / total

    # -- files -------------------------------------------------------------------------------
    def export(self, out_dir: Path) -> None:
        """The version the engine serves: under LoRA the adapter alone, a PEFT folder the
        engine loads beside the frozen base (trainer/policy_adapter.py); else the model."""
        self._model().save_pretrained(str(out_dir))  # type: ignore[operator]

    def export_merged(self, out_dir: Path) -> None:
        """The adapter merged into a copy of the base, as a plain model folder (the live
        model keeps its separate adapters for training)."""
        merged = copy.deepcopy(self._model()).merge_and_unload()  # type: ignore[operator]
        merged.save_pretrained(str(out_dir))

    def save_state(self, state_dir: Path) -> None:
        """The optimizer's state (an adapter's weights are the version folder's own)."""
        assert self.optimizer is not None
        state_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), state_dir / OPTIMIZER_FILE)

    # -- personal adapters (trainer/personal.py): one LoRA at a time in the live model ---------
    def fresh_adapter(self, seed: int) -> None:
        """A new user's adapter: LoRA re-initialised as peft does (B = 0, so the model is the
        base model), from `seed`, with a fresh optimizer."""
        model = self._model()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            for module in model.modules():
                reset = getattr(module, "reset_lora_parameters", None)
                if reset is not None and "default" in getattr(module, "lora_A", {}):
                    reset("default", True)
        finally:
            torch.random.set_rng_state(generator_state)
        self._new_optimizer()

    def load_adapter(self, adapter_dir: Path) -> None:
        """A saved adapter (PEFT folder: a user's, or a shared-model version's) and its
        optimizer state into the live model."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(str(adapter_dir / "adapter_model.safetensors"), device="cpu")
        result = set_peft_model_state_dict(self._model(), weights)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter at {adapter_dir} has unknown keys: {unexpected[:3]}")
        self._new_optimizer()
        assert self.optimizer is not None
        state = adapter_dir / "trainer_state" / OPTIMIZER_FILE
        if state.is_file():
            self._load_optimizer(torch.load(state, map_location=self.device))

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        """Saved moments and step counts; the learning rate stays the one configured now
        (AdamW's state would bring back the lr it was saved with)."""
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def save_adapter(self, adapter_dir: Path) -> None:
        """The live adapter as a PEFT folder (what the engine loads) + its optimizer state."""
        assert self.optimizer is not None
        self._model().save_pretrained(str(adapter_dir))  # type: ignore[operator]
        (adapter_dir / "trainer_state").mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), adapter_dir / "trainer_state" / OPTIMIZER_FILE)

    def load_state(self, state_dir: Path) -> None:
        """Optimizer state, and under LoRA the adapter a merged version's state kept (a
        version written before versions were adapter folders)."""
        assert self.optimizer is not None
        if self.cfg.lora.enabled and (state_dir / ADAPTER_FILE).is_file():
            adapters = torch.load(state_dir / ADAPTER_FILE, map_location=self.device)
            missing = self._model().load_state_dict(adapters, strict=False).unexpected_keys
            if missing:
                raise RuntimeError(f"adapter state has unknown keys: {missing[:3]}")
        self._load_optimizer(torch.load(state_dir / OPTIMIZER_FILE, map_location=self.device))
