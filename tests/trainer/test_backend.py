"""The torch backend on the tiny model: steps, NaN safety, accumulation, export, LoRA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from trainer.backends.torch import TorchBackend
from trainer.config import LoraSettings, TrainerSettings
from trainer.data import Batch, SampleRow, collate
from trainer.export import CheckpointError, verify_version, write_version


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def backend(model_dir: Path, **kw: object) -> TorchBackend:
    cfg = TrainerSettings(**({"batch_size": 4, "micro_batch_size": 4, "kl_coef": 0.0,
                              "lr": 1e-3, "device": "cpu"} | kw))  # type: ignore[arg-type]
    b = TorchBackend(cfg)
    b.load(model_dir)
    return b


def on_policy_batch(b: TorchBackend, rewards: list[int | None]) -> Batch:
    """Samples whose rollout logprobs are the model's own (what the engine would report)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, r in enumerate(rewards):
        ids = torch.randint(3, b.limits.vocab_size, (5 + i + 3,), generator=gen).tolist()
        rows.append(SampleRow(i, ids[:5], ids[5:], [0.0] * (i + 3), None, r, 0))
    batch = collate(rows, 0)
    batch.rollout_logp = b.compute_logprobs(batch) * batch.loss_mask
    return batch


def params(b: TorchBackend) -> dict[str, torch.Tensor]:
    assert b.model is not None
    return {k: v.detach().clone() for k, v in b.model.state_dict().items()}


def test_first_step_ratio_is_one_and_weights_move(tiny_model_dir: Path) -> None:
    b = backend(tiny_model_dir)
    batch = on_policy_batch(b, [1, -1, 1, 0])
    before = params(b)
    stats = b.train_step(batch)
    assert stats.status == "ok"
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.abs_log_ratio_max is not None and stats.abs_log_ratio_max < 1e-4
    assert stats.clip_frac == 0.0
    assert stats.num_tokens == batch.num_tokens
    after = params(b)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_nonfinite_loss_skips_the_step_and_touches_nothing(tiny_model_dir: Path) -> None:
    b = backend(tiny_model_dir)
    assert b.train_step(on_policy_batch(b, [1, -1])).status == "ok"
    before, opt_before = params(b), copy.deepcopy(b.optimizer.state_dict())  # type: ignore[union-attr]
    poisoned = on_policy_batch(b, [1, -1])
    poisoned.rollout_logp[0, 4] = float("-inf")  # a response token: ratio = exp(+inf)
    stats = b.train_step(poisoned)
    assert stats.status == "skipped" and "non-finite" in (stats.reason or "")
    after = params(b)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt_after = b.optimizer.state_dict()  # type: ignore[union-attr]
    for pid, st in opt_before["state"].items():
        assert int(opt_after["state"][pid]["step"]) == int(st["step"])
        assert torch.equal(opt_after["state"][pid]["exp_avg"], st["exp_avg"])


def test_gradient_accumulation_equals_one_big_batch(tiny_model_dir: Path) -> None:
    big = backend(tiny_model_dir, micro_batch_size=4)
    small = backend(tiny_model_dir, micro_batch_size=1)
    batch = on_policy_batch(big, [1, -1, 1, -1])
    s_big, s_small = big.train_step(batch), small.train_step(batch)
    # Token mean over the whole batch: rewards ±1 on 3, 4, 5, 6 response tokens, ratio 1:
    # loss = −(3 − 4 + 5 − 6) / 18 whether the batch runs as 1 or 4 micro batches.
    assert s_big.loss == pytest.approx(2 / 18) and s_small.loss == pytest.approx(2 / 18)
    assert s_big.grad_norm == pytest.approx(s_small.grad_norm, rel=1e-5)
    a, b = params(big), params(small)
    # Adam normalises each coordinate, so float noise in near-zero gradients shows up at
    # ~lr·1e-3; 1e-5 is far below the lr-sized (1e-3) moves of a real difference.
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_micro_batches_hold_at_most_micro_batch_tokens(tiny_model_dir: Path) -> None:
    """Long samples (an agent's 3–5k-token prompts) are not stacked `micro_batch_size` at a
    time: a micro batch holds at most `micro_batch_tokens` padded tokens, so the logits kept
    for the backward stay bounded (four OpenClaw samples at once got the trainer killed for
    memory), and the step is the same as one big batch's."""
    capped = backend(tiny_model_dir, micro_batch_tokens=24)
    assert capped.model is not None
    shapes: list[list[int]] = []
    capped.model.register_forward_hook(
        lambda _m, args, kwargs, _out: shapes.append(list(kwargs["input_ids"].shape)),
        with_kwargs=True)
    batch = on_policy_batch(capped, [1, -1, 1, -1])  # rows of 8, 9, 10, 11 tokens
    shapes.clear()
    stats = capped.train_step(batch)
    # [8, 9] pads to 2 × 9 = 18 ≤ 24; with 10 it would be 3 × 10 = 30; [10, 11]: 22.
    assert shapes == [[2, 9], [2, 11]]
    assert stats.loss == pytest.approx(2 / 18)


def test_mini_batches_are_that_many_optimizer_steps_the_first_on_policy(
        tiny_model_dir: Path) -> None:
    """mini_batches=2: two steps on halves of the batch. The second sees a policy the first
    moved (ratio off 1) and moves the weights past a one-step run on the first half alone;
    epochs=2 repeats the pass."""
    two = backend(tiny_model_dir, mini_batches=2)
    one = backend(tiny_model_dir)
    batch = on_policy_batch(two, [1, -1, 1, -1])
    first_half = batch.micro_batches(2)[0]
    one.train_step(first_half)
    after_first_half = params(one)
    stats = two.train_step(batch)
    assert stats.status == "ok" and stats.extra == {"updates": 2, "updates_skipped": 0}
    assert stats.num_tokens == batch.num_tokens
    assert stats.abs_log_ratio_max is not None and stats.abs_log_ratio_max > 1e-4
    after = params(two)
    assert any(not torch.allclose(after[k], after_first_half[k], atol=1e-6) for k in after)

    four = backend(tiny_model_dir, mini_batches=2, epochs=2)
    assert four.train_step(on_policy_batch(four, [1, -1, 1, -1])).extra["updates"] == 4


def test_several_steps_per_batch_need_the_torch_backend() -> None:
    with pytest.raises(ValueError, match="torch backend"):
        TrainerSettings(backend="megatron", mini_batches=2)


def test_export_writes_a_loadable_version_and_refuses_overwrite(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    b = backend(tiny_model_dir)
    b.train_step(on_policy_batch(b, [1, -1]))
    path = write_version(tmp_path, 1, b.export, tiny_model_dir)
    assert path.name == "v000001"
    marker = verify_version(path)
    assert "tokenizer.json" in marker["files"]  # type: ignore[operator]
    loaded = AutoModelForCausalLM.from_pretrained(str(path))
    mine = params(b)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, mine[k]), k
    with pytest.raises(CheckpointError, match="never overwritten"):
        write_version(tmp_path, 1, b.export, tiny_model_dir)


def test_corrupt_or_incomplete_folders_are_refused(tiny_model_dir: Path,
                                                  tmp_path: Path) -> None:
    b = backend(tiny_model_dir)
    path = write_version(tmp_path, 2, b.export, tiny_model_dir)
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_version(tmp_path / "v000009")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_version(path)
    weights.write_bytes(b"\xff" * len(data))  # same size, garbage header
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        verify_version(path)
    (path / "clawrl_complete.json").unlink()
    with pytest.raises(CheckpointError, match="no completion marker"):
        verify_version(path)


def test_failed_export_leaves_no_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_version(tmp_path, 3, broken, tiny_model_dir)
    assert list(tmp_path.iterdir()) == []


def test_lora_trains_adapters_and_exports_the_adapter_or_a_merged_plain_model(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    b = backend(tiny_model_dir, lora=LoraSettings(enabled=True, r=4, alpha=8), kl_coef=0.1)
    batch = on_policy_batch(b, [1, -1, 1])
    for _ in range(3):
        assert b.train_step(batch).status == "ok"
    # The version the engine serves: the adapter alone (a PEFT folder), no tokenizer copies.
    adapter = write_version(tmp_path, 1, b.export, tiny_model_dir)
    assert sorted(p.name for p in adapter.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors",
        "clawrl_complete.json"]
    verify_version(adapter)
    path = write_version(tmp_path, 2, b.export_merged, tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(str(path))
    assert not any("lora" in k for k in merged.state_dict())
    # The merged plain model computes what the adapter model computes.
    with torch.no_grad():
        ids = batch.input_ids[:1]
        want = b.model(input_ids=ids).logits  # type: ignore[misc]
        got = merged(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, got, atol=1e-4)


def test_lora_checkpoint_round_trip_restores_adapters_and_optimizer(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from trainer.checkpoint import load_checkpoint, save_checkpoint

    lora = LoraSettings(enabled=True, r=4, alpha=8)
    a = backend(tiny_model_dir, lora=lora)
    batch = on_policy_batch(a, [1, -1])
    a.train_step(batch)
    path = save_checkpoint(a, tmp_path, 1, tiny_model_dir)
    b = TorchBackend(a.cfg)
    load_checkpoint(b, a.cfg, tiny_model_dir, path)
    with torch.no_grad():
        ids = batch.input_ids[:1]
        assert torch.equal(a.model(input_ids=ids).logits,  # type: ignore[misc]
                           b.model(input_ids=ids).logits)  # type: ignore[misc]
    # Both continue identically: same adapters, same Adam moments.
    a.train_step(batch)
    b.train_step(batch)
    pa, pb = params(a), params(b)
    assert all(torch.allclose(pa[k], pb[k], atol=1e-7) for k in pa)


def test_the_head_runs_only_where_a_token_is_scored(tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step computes the logits from the first scored position on (an agent's long prompt
    carries no loss) and trains exactly as with every position's logits: the same loss, KL,
    entropy and weights after."""
    import trainer.backends.torch as torch_backend

    kw = {"kl_coef": 0.05, "entropy_coef": 0.01, "lora": LoraSettings(enabled=True)}
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, (prompt, reply) in enumerate(((40, 4), (25, 7), (33, 3))):
        ids = torch.randint(3, 700, (prompt + reply,), generator=gen).tolist()
        rows.append(SampleRow(i, ids[:prompt], ids[prompt:], [-1.0] * reply, None,
                              (-1) ** i, 0))
    batch = collate(rows, 0)
    assert torch_backend.first_scored(batch) == 24  # the shortest prompt's last position
    heads: list[int] = []
    real_logits = TorchBackend._logits

    def counted(self: TorchBackend, model: torch.nn.Module, micro: Batch,
                first: int = 0) -> torch.Tensor:
        out = real_logits(self, model, micro, first)
        heads.append(out.shape[1])
        return out

    monkeypatch.setattr(TorchBackend, "_logits", counted)
    torch.manual_seed(0)  # the same fresh adapter for both
    trimmed = backend(tiny_model_dir, **kw)
    got = trimmed.train_step(batch)
    assert heads and set(heads) == {batch.input_ids.shape[1] - 24}
    monkeypatch.setattr(torch_backend, "first_scored", lambda micro: 0)
    torch.manual_seed(0)
    whole = backend(tiny_model_dir, **kw)
    want = whole.train_step(batch)
    assert heads[-1] == batch.input_ids.shape[1]
    for name in ("loss", "pg_loss", "kl", "entropy", "ratio_mean"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-4, abs=1e-6)
    a, b = params(trimmed), params(whole)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
