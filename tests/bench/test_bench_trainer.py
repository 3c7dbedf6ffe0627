"""`clawrl bench trainer --phases step`: the real training step runs end to end with the
settings the trainer would use (the model's recipe), on samples of the lengths asked for;
bad arguments are one line. The gate phase times its probe both ways. Figures are only printed, never
asserted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from oneline import one_line_exit

from clawrl.bench.trainer import main, step_samples, step_settings

RECIPE = {"gate_probe": "probe.jsonl", "train": {"lora": {"enabled": True}, "adapter_lr": 2e-4}}


@pytest.fixture()
def recipe_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with the recipe `clawrl models pull` writes for SmolLM2."""
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "recipe.json").write_text(json.dumps(RECIPE))
    return out


def test_the_step_uses_the_models_recipe(recipe_model: Path) -> None:
    adapter = step_settings(recipe_model, 16, 4, lora=True)
    assert adapter.lora.enabled and adapter.adapter_lr == 2e-4 and adapter.kl_coef > 0
    assert (adapter.batch_size, adapter.micro_batch_size, adapter.device) == (16, 4, "cpu")
    full = step_settings(recipe_model, 16, 4, lora=False)
    assert not full.lora.enabled and full.lr == 2e-5


def test_step_samples_have_the_lengths_asked_for() -> None:
    rows = step_samples(16, 200, 128, 1000)
    assert len(rows) == 16 and {r.reward for r in rows} == {1, -1}
    assert all(150 <= len(r.prompt_ids) <= 250 and 96 <= len(r.response_ids) <= 160
               for r in rows)
    assert len(set(map(len, (r.prompt_ids for r in rows)))) > 1  # not all one length
    assert rows == step_samples(16, 200, 128, 1000)  # a fixed seed


def test_step_phase_prints_every_figure(recipe_model: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--phases", "step", "--step-model", str(recipe_model), "--batch", "4",
                 "--micro", "2", "--prompt-tokens", "16", "--reply-tokens", "8",
                 "--step-rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "recipe {'lora': {'enabled': True}, 'adapter_lr': 0.0002}" in out
    for name in ("adapter", "full weights"):
        found = re.search(rf"step \[{name}, [\d.]+M trainable\]: [\d.]+ s per step of (\d+) "
                          r"tokens \((\d+) padded\): \d+ tokens/s", out)
        assert found, out
        assert 4 * 18 <= int(found[1]) <= int(found[2])
    assert out.count("all-matmul ceiling") == 2
    assert "full weights / adapter, seconds per step:" in out
    assert "throughput:" not in out and "swap [" not in out  # other phases not asked for


def test_gate_phase_times_the_probe_both_ways(recipe_model: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (recipe_model / "gate-probe.jsonl").write_text(
        json.dumps({"question": "What is the capital of Italy?", "answers": ["Rome"]}) + "\n"
        + json.dumps({"question": "How do I boil an egg?", "topic": ["egg", "water"]}) + "\n")
    assert main(["--phases", "gate", "--step-model", str(recipe_model),
                 "--step-rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 questions (1 facts)  medians of 2" in out
    assert re.search(r"gate: settled [\d.]+ s per probe \([\d.]+ tokens per question\)  "
                     r"whole replies [\d.]+ s \([\d.]+ tokens\)  transformers generate "
                     r"[\d.]+ s \([\d.]+ tokens\)", out), out
    assert re.search(r"gate: settled / whole [\d.]+  settled / generate [\d.]+  same "
                     r"verdicts as whole: yes  as generate: [012] of 2", out), out
    (recipe_model / "gate-probe.jsonl").unlink()
    assert main(["--phases", "gate", "--step-model", str(recipe_model)]) == 1
    assert "has no gate-probe.jsonl" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--phases", "step,nope"], "--phases takes throughput, swap, step, gate separated by commas"),
    (["--phases", ","], "--phases takes throughput, swap, step, gate separated by commas"),
    (["--step-rounds", "0"], "--step-rounds must be at least 1"),
    (["--reply-tokens", "0"], "--reply-tokens must be at least 1"),
    (["--seq", "1"], "--seq must be at least 2"),
    (["--step-model", "/nonexistent"], "--step-model /nonexistent is not a model directory"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_bad_arguments_are_one_line(args: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_exit(main, args, capsys)
    assert err.startswith(f"clawrl bench trainer: {message}"), err
