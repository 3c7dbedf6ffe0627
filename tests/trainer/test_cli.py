"""`clawrl train` / `clawrl versions` on bad input: one readable line, non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import insert
from sqlalchemy.engine import Engine

from clawrl.base.db import PolicyVersion


def clawrl(*args: str, db_url: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_STATE_DIR": str(state),
           "CLAWRL_ENGINE__URL": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "clawrl.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_train_without_a_model_says_how_to_get_one(db_url: str, tmp_path: Path) -> None:
    out = clawrl("train", "--model", str(tmp_path / "nope"), db_url=db_url, state=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"clawrl train: no model at {tmp_path / 'nope'} (build it with `clawrl tinyworld "
        "build` or pass --model DIR)"]


def test_versions_commands_refuse_bad_requests(db_url: str, db: Engine, tmp_path: Path) -> None:
    out = clawrl("versions", "rollback", "7", db_url=db_url, state=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip() == "clawrl versions: no version 7 (see `clawrl versions list`)"

    # A version whose folder was damaged: refused before the engine is asked.
    folder = tmp_path / "weights" / "v000003"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with db.begin() as conn:
        conn.execute(insert(PolicyVersion.__table__).values(
            version=3, step=3, path=str(folder), status="published"))
    out = clawrl("versions", "rollback", "3", db_url=db_url, state=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().startswith("clawrl versions: rollback to v3 refused, engine "
                                         "unchanged:")
    assert "no completion marker" in out.stderr

    out = clawrl("versions", "rollback", "-1", db_url=db_url, state=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip() == "clawrl versions: no version -1 (versions count up from 0)"
    out = clawrl("versions", "rollback", "0", db_url=db_url, state=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "clawrl versions: rollback to v0 needs the base model; none at "
        f"{tmp_path / 'models' / 'tinyworld'} (set --model or CLAWRL_TRAINER__MODEL)")

    out = clawrl("versions", "prune", "--keep", "0", db_url=db_url, state=tmp_path)
    assert out.returncode == 1 and "--keep must be at least 1" in out.stderr

    out = clawrl("versions", "list", db_url=db_url, state=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:4] == ["3", "3", "published", "0"]
    assert "bad (" in lines[1] and "engine unreachable" in lines[-1]


PREBUILT_CI = Path(__file__).resolve().parents[2] / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"


def test_the_tiny_world_trains_with_its_recipe_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clawrl up`'s trainer on the tiny world model uses what `clawrl eval` measured it
    learning with (its recipe.json); the environment and flags win; any other model keeps
    the defaults."""
    from clawrl.world.recipe import TINYWORLD_RECIPE
    from trainer.config import TrainerSettings
    from trainer.train import build_parser, resolve_settings

    for name in [k for k in os.environ if k.startswith("CLAWRL_TRAINER__")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    tiny = build_parser().parse_args(["--model", str(PREBUILT_CI)])
    got = resolve_settings(tiny).trainer
    assert (got.lr, got.kl_coef, got.batch_size) == (
        TINYWORLD_RECIPE["lr"], TINYWORLD_RECIPE["kl_coef"], TINYWORLD_RECIPE["batch_size"])
    assert TINYWORLD_RECIPE["lr"] != TrainerSettings().lr  # the recipe is not the default
    # The world's own corpus keeps its facts while it learns (trainer/ptx.py).
    assert got.ptx_coef == TINYWORLD_RECIPE["ptx_coef"] > TrainerSettings().ptx_coef == 0
    assert got.ptx_data == PREBUILT_CI / "ptx.jsonl"

    monkeypatch.setenv("CLAWRL_TRAINER__LR", "3e-5")
    got = resolve_settings(tiny).trainer
    assert (got.lr, got.kl_coef, got.batch_size) == (
        3e-5, TINYWORLD_RECIPE["kl_coef"], TINYWORLD_RECIPE["batch_size"])

    other = tmp_path / "other-model"  # a Hugging Face directory that is not the tiny world
    other.mkdir()
    (other / "config.json").write_text("{}")
    got = resolve_settings(build_parser().parse_args(["--model", str(other)])).trainer
    defaults = TrainerSettings()
    assert (got.lr, got.kl_coef, got.batch_size) == (3e-5, defaults.kl_coef,
                                                     defaults.batch_size)
    assert (got.ptx_coef, got.ptx_data) == (0, None)


def test_personal_adapters_train_with_their_own_recipe_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What personal mode was measured with (docs/eval.md "One adapter per user") is its
    default, whether personal mode comes from the flag or the environment: the batch-mean
    baseline, and on the tiny world a KL of 0.2 instead of the corpus term. The shared model
    compares each user's rewards with their own mean (one user alone: the raw reward) and keeps
    its own recipe; an explicit setting wins."""
    from clawrl.world.recipe import PERSONAL_RECIPE, TINYWORLD_RECIPE
    from trainer.train import build_parser, resolve_settings

    for name in [k for k in os.environ if k.startswith("CLAWRL_TRAINER__")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    model = ["--model", str(PREBUILT_CI)]
    shared = resolve_settings(build_parser().parse_args(model)).trainer
    assert (shared.baseline, shared.kl_coef, shared.ptx_coef) == (
        "user_mean", TINYWORLD_RECIPE["kl_coef"], TINYWORLD_RECIPE["ptx_coef"])
    # ... for a batch of several users; one user's batch keeps the raw reward
    assert (shared.baseline_for(2), shared.baseline_for(1)) == ("user_mean", "none")
    flag = resolve_settings(build_parser().parse_args([*model, "--personal"])).trainer
    assert (flag.baseline, flag.kl_coef, flag.ptx_coef, flag.ptx_data) == (
        "batch_mean", PERSONAL_RECIPE["kl_coef"], 0, None)
    assert flag.lr == shared.lr and flag.adapter_lr == TINYWORLD_RECIPE["adapter_lr"]
    monkeypatch.setenv("CLAWRL_TRAINER__PERSONAL", "true")
    plain = build_parser().parse_args(model)
    got = resolve_settings(plain).trainer
    assert (got.baseline, got.kl_coef, got.ptx_coef) == ("batch_mean", 0.2, 0)
    monkeypatch.setenv("CLAWRL_TRAINER__REWARD_BASELINE", "none")
    monkeypatch.setenv("CLAWRL_TRAINER__KL_COEF", "0.05")
    got = resolve_settings(plain).trainer
    assert (got.baseline, got.kl_coef, got.ptx_coef) == ("none", 0.05, 0)


def test_the_tiny_world_learns_its_own_corpus_as_ptx_data_unless_given_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ptx_coef > 0 on the tiny world with no ptx_data: the world's chat corpus its build
    wrote beside the weights (named by its recipe.json); a file given is kept; off (0),
    none."""
    from trainer.train import build_parser, resolve_settings

    for name in [k for k in os.environ if k.startswith("CLAWRL_TRAINER__")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("CLAWRL_TRAINER__PTX_COEF", "0")
    tiny = build_parser().parse_args(["--model", str(PREBUILT_CI)])
    assert resolve_settings(tiny).trainer.ptx_data is None
    monkeypatch.setenv("CLAWRL_TRAINER__PTX_COEF", "0.5")
    got = resolve_settings(tiny).trainer.ptx_data
    assert got == PREBUILT_CI / "ptx.jsonl"
    assert len(got.read_text().splitlines()) == 4000
    monkeypatch.setenv("CLAWRL_TRAINER__PTX_DATA", str(tmp_path / "mine.jsonl"))
    assert resolve_settings(tiny).trainer.ptx_data == tmp_path / "mine.jsonl"
    # The tool-call model's recipe has no corpus term (its corpus is what agents unlearn).
    from clawrl.world.recipe import TOOLS_RECIPE
    from trainer.config import model_recipe

    assert "ptx_coef" in model_recipe(PREBUILT_CI)
    assert "ptx_coef" not in model_recipe(PREBUILT_CI.parent / "tinyworld-tools")
    # ... and trains at the tool-call track's learning rate with its baseline, not the chat
    # model's 8e-4 (at which the agent's tool calls fell apart).
    tools = model_recipe(PREBUILT_CI.parent / "tinyworld-tools")
    assert tools["lr"] == TOOLS_RECIPE["lr"] < model_recipe(PREBUILT_CI)["lr"]
    assert tools["reward_baseline"] == "batch_mean"
    monkeypatch.delenv("CLAWRL_TRAINER__PTX_DATA")
    agent = resolve_settings(build_parser().parse_args(
        ["--model", str(PREBUILT_CI.parent / "tinyworld-tools")])).trainer
    assert (agent.lr, agent.reward_baseline, agent.ptx_coef) == (TOOLS_RECIPE["lr"], "batch_mean", 0.5)
    assert agent.ptx_data == PREBUILT_CI.parent / "tinyworld-tools" / "ptx.jsonl"


def test_a_pulled_model_learns_as_an_adapter_unless_told_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`clawrl models pull` writes a recipe.json that trains a real model as a LoRA adapter
    (published with /load_lora_adapter, trainer/policy_adapter.py); a recipe an earlier pull
    wrote is brought up to date, one the user wrote is left alone; the environment wins, and
    megatron (full weights only) trains full weights; the tiny world keeps full weights."""
    from clawrl.engine.pretrained import PULLED_RECIPE, write_recipe
    from trainer.train import build_parser, resolve_settings

    for name in [k for k in os.environ if k.startswith("CLAWRL_TRAINER__")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    model = tmp_path / "pulled"
    model.mkdir()
    (model / "config.json").write_text("{}")
    write_recipe(model)
    assert json.loads((model / "recipe.json").read_text()) == PULLED_RECIPE
    args = build_parser().parse_args(["--model", str(model)])
    got = resolve_settings(args).trainer
    assert got.lora.enabled and got.lora.r == 16 and got.adapter_lr == 1e-3
    assert got.gate_probe == model / "gate-probe.jsonl" and got.gate_probe.is_file()

    # Earlier pulls' recipes (the facts-only probe, then with the adapter): brought up to date.
    for earlier in ({"gate_probe": "probe.jsonl"},
                    {"gate_probe": "probe.jsonl", "train": {"lora": {"enabled": True},
                                                            "adapter_lr": 2e-4}},
                    {"gate_probe": "gate-probe.jsonl", "train": {"lora": {"enabled": True},
                                                                 "adapter_lr": 2e-4}}):
        (model / "recipe.json").write_text(json.dumps(earlier))
        write_recipe(model)
        assert json.loads((model / "recipe.json").read_text()) == PULLED_RECIPE
    # The probe lost from a current pull: written again.
    (model / "gate-probe.jsonl").unlink()
    write_recipe(model)
    assert (model / "gate-probe.jsonl").is_file()
    # A recipe the user wrote: untouched.
    mine = {"gate_probe": "probe.jsonl", "train": {"lr": 1e-5}}
    (model / "recipe.json").write_text(json.dumps(mine))
    write_recipe(model)
    assert json.loads((model / "recipe.json").read_text()) == mine
    (model / "recipe.json").write_text(json.dumps(PULLED_RECIPE))

    monkeypatch.setenv("CLAWRL_TRAINER__LORA__ENABLED", "false")
    assert not resolve_settings(args).trainer.lora.enabled
    monkeypatch.delenv("CLAWRL_TRAINER__LORA__ENABLED")
    megatron = build_parser().parse_args(["--model", str(model), "--backend", "megatron"])
    assert not resolve_settings(megatron).trainer.lora.enabled
    tiny = resolve_settings(build_parser().parse_args(["--model", str(PREBUILT_CI)])).trainer
    assert not tiny.lora.enabled


def test_threads_are_the_users_choice_or_half_the_cores(
        db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clawrl.cli.stack import share_cores

    env: dict[str, str] = {}
    share_cores(env)
    assert env["CLAWRL_TRAINER__THREADS"] == str(max(1, (os.cpu_count() or 2) // 2))
    mine = {"CLAWRL_TRAINER__THREADS": "3"}
    share_cores(mine)
    assert mine == {"CLAWRL_TRAINER__THREADS": "3"}
    monkeypatch.setenv("CLAWRL_TRAINER__THREADS", "-1")
    out = clawrl("train", "--model", str(tmp_path), db_url=db_url, state=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("clawrl train: ")
    assert len(out.stderr.strip().splitlines()) == 1
