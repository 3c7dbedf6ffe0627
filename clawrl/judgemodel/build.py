"""`clawrl judge build`: LoRA fine-tuning of SmolLM2-135M-Instruct into the judge.

Every judged turn of `clawrl/judgemodel/synth.py`'s training set gives one example per
prompt the worker sends at the judge model's prompt version (`model.prompts`): v2, its PRM
prompt -> `\\boxed{..}` and its hint prompt -> the canonical hint in `[HINT] … [/HINT]` or
`[NO_HINT]`; v3, one combined prompt -> both; v4 (shipped), the same with the bare score
first. The loss is on the answer tokens (and the closing `<|im_end|>`), each example weighted
equally, with the tokens that carry a decision weighted `decisive` times: the score, the
token after `[` that tells a hint from `[NO_HINT]`, and the tokens that tell which hint it is
(`decisive_chars`).

What makes it learn (docs/judge.md): the answer starts with the score (prompt v4), the loss
weighs each deciding token `decisive` (30) times the others, and the learning rate is high
enough (1e-3, batches of 4) for the score to break away from its prior after a few hundred
steps; before that, for about two epochs, the score sits at the prior on every turn. With the
score behind a `\\boxed{` (v2, v3), lower rates, or weights of 4, builds learned the format
and the hints' words but never the score.

Why it fits a CPU in minutes:
- LoRA sits on the top `layers` decoder layers only, and the layers below never change: their
  output for every example is computed once (no gradient) and kept in memory, and each epoch
  runs only the top layers on it (`inputs_embeds`).
- Rows are left-padded, so every answer ends at the right edge and only the last
  `max answer length + 1` positions are sent through the 49k-word output layer
  (`logits_to_keep`); the prompt positions never are.
- Batches are made of examples of similar length (little padding).
The adapter is written to `clawrl/judgemodel/adapter/` (shipped in the repo).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from clawrl.judgemodel.model import (
    ADAPTER_DIR,
    BASE_MODEL,
    CHAT_TEMPLATE,
    PROMPT_VERSION,
    base_dir,
    prompts,
)
from clawrl.judgemodel.synth import (
    NEW_HINTS,
    OBJECTION_HINT,
    WRITTEN_SHARE,
    agent_set,
    training_set,
)
from clawrl.world.town import FACT_HINT, HINTS


@dataclass(frozen=True)
class BuildConfig:
    turns: int = 2000  # judged turns (one example each)
    seed: int = 0
    epochs: int = 4
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 20
    rank: int = 16
    alpha: int = 32
    layers: int = 6  # LoRA on the top `layers` of 30 decoder layers
    decisive: float = 30.0  # weight of each token that carries a decision
    threads: int = 1  # 2 threads on 2 busy cores ran 4x slower (OpenMP spinning)
    prompt_version: str = PROMPT_VERSION  # the judge prompts trained on (judge/templates/)
    # Share of the follow-ups from the hand-written lines (synth.py `WRITTEN_SHARE`); 0: the
    # phrasing lists alone, as every build before 2026-12-05.
    written_share: float = WRITTEN_SHARE


@dataclass(frozen=True)
class AgentStage:
    """The second stage (`clawrl judge build --agent-stage`): the built adapter trained further
    on agent steps (clawrl/judgemodel/synth.py `agent_set`: tool results, tool errors, the
    user asking for tools) mixed with a replay of the first stage's own turns, so what it
    learned about people stays."""

    agent_turns: int = 1000
    replay_turns: int = 600  # drawn from the first stage's training set
    epochs: int = 3
    lr: float = 5e-4
    seed: int = 0


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BOX = "\\boxed{"
# The hints the judge is taught to write (clawrl/judgemodel/synth.py): the tiny world's
# canonical style hints, the judge-side ones for the preferences beyond them, and the fixed
# heads of the fact, language and objection hints.
_CANONICAL = (tuple(wordings[0] for wordings in HINTS.values())
              + tuple(h.split("{")[0] for h in NEW_HINTS.values())
              + (FACT_HINT.split("{")[0], OBJECTION_HINT.split("{")[0]))

Row = tuple[list[int], int, list[int]]  # ids, answer tokens at the end, decisive indices


def staged_figures(built: dict[str, Any], stage: dict[str, Any]) -> dict[str, Any]:
    """build.json after an agent stage on an adapter whose build.json is `built`: its figures,
    this stage's as `agent_stage`, and the stages run before on it (a stage run again) under
    `earlier_agent_stages`, oldest first."""
    rest = {k: v for k, v in built.items() if k not in ("agent_stage", "earlier_agent_stages")}
    earlier = [*built.get("earlier_agent_stages", []),
               *([built["agent_stage"]] if "agent_stage" in built else [])]
    return {**rest, "agent_stage": stage, **({"earlier_agent_stages": earlier} if earlier else {})}


def decisive_chars(answer: str) -> list[int]:
    """Where the decisions are in an answer: the score (after `\\boxed{`, or the answer's
    first character when it starts with the score), the first letter after the `[` that
    opens `[HINT]` / `[NO_HINT]`, and in a hint the characters that tell which hint it is
    (its first, and each where it parts from a canonical hint it begins like)."""
    at = []
    if _BOX in answer:
        at.append(answer.index(_BOX) + len(_BOX))
    elif answer[:1] in ("-", "+") or answer[:1].isdigit():
        at.append(0)
    marks = [i for i in (answer.find("[HINT]"), answer.find("[NO_HINT]")) if i >= 0]
    if marks:
        at.append(min(marks) + 1)
    if "[HINT] " in answer:
        start = answer.index("[HINT] ") + len("[HINT] ")
        hint = answer[start:].split(" [/HINT]")[0]
        at.append(start)
        for other in _CANONICAL:
            shared = len(os.path.commonprefix([hint, other]))
            if 0 < shared < len(hint):
                at.append(start + shared)
    return sorted(set(at))


def encode(tokenizer: Any, prompt: str, answer: str) -> Row:
    """Token ids of the chat (one user message, then the answer and `<|im_end|>`), the
    number of answer tokens at its end, which carry the loss, and the indices among those of
    the tokens holding the decisions."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    tail = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ends = [len(tokenizer.decode(tail[:k + 1])) for k in range(len(tail))]
    decisive = [next(k for k, end in enumerate(ends) if end > at)
                for at in decisive_chars(answer)]
    return list(ids) + list(tail), len(tail), decisive


def batches(rows: list[Row], size: int, rng: random.Random) -> list[list[Row]]:
    """Batches of similar length, in random order."""
    rows = sorted(rows, key=lambda r: len(r[0]))
    out = [rows[i:i + size] for i in range(0, len(rows), size)]
    rng.shuffle(out)
    return out


def collate(batch: list[Row], pad_id: int, decisive: float = 1.0) -> dict[str, torch.Tensor]:
    """Left-padded ids [B, T], mask [B, T], positions [B, T], and for the last K positions
    labels [B, K-1] (-100 outside the answers) and loss weights [B, K-1] (each row's sum
    to 1; its decisive tokens `decisive` times the others)."""
    width = max(len(ids) for ids, _, _ in batch)
    keep = max(n for _, n, _ in batch) + 1
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), keep - 1), -100, dtype=torch.long)
    weights = torch.zeros((len(batch), keep - 1))
    for b, (row, n, d) in enumerate(batch):
        ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
        labels[b, keep - 1 - n:] = torch.tensor(row[-n:])
        weights[b, keep - 1 - n:] = 1.0
        for k in d:
            weights[b, keep - 1 - n + k] = decisive
        weights[b] /= weights[b].sum()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
            "labels": labels, "weights": weights, "keep": torch.tensor(keep)}


def answer_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Weighted cross-entropy of the answer tokens, averaged over rows. logits[:, j] (of the
    last K positions) predicts the token after it, so logits[:, :-1] line up with labels.
    With `hidden` in the batch (the lower layers' output) only the top layers run."""
    keep = int(batch["keep"])
    inputs = ({"inputs_embeds": batch["hidden"]} if "hidden" in batch
              else {"input_ids": batch["input_ids"]})
    out = model(**inputs, attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], logits_to_keep=keep, use_cache=False)
    logits = out.logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch["labels"].reshape(-1), ignore_index=-100,
                                           reduction="none").view(batch["labels"].shape)
    return (ce * batch["weights"]).sum() / ce.shape[0]


def decoder(model: Any) -> Any:
    """The decoder stack (embeddings, layers, final norm) inside the PEFT-wrapped model."""
    return model.base_model.model.model


@torch.no_grad()
def cache_lower_layers(model: Any, plan: list[dict[str, torch.Tensor]], split: int) -> None:
    """Put the output of decoder layers [0, split) in each batch as `hidden`."""
    inner = decoder(model)
    layers, norm = inner.layers, inner.norm
    inner.layers, inner.norm = layers[:split], torch.nn.Identity()
    try:
        for b in plan:
            b["hidden"] = inner(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                position_ids=b["position_ids"],
                                use_cache=False).last_hidden_state
    finally:
        inner.layers, inner.norm = layers, norm


def build_adapter(state_dir: Path, cfg: BuildConfig, out: Path = ADAPTER_DIR,
                  log: Any = print, stage: AgentStage | None = None) -> dict[str, Any]:
    """Train the LoRA adapter and write it to `out`. Returns figures for the report.

    `stage`: instead of a new adapter, train the one in `out` further on `stage`'s agent steps
    and replayed turns (`cfg` still says how the first stage was built: layers, batch...)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    base = base_dir(state_dir)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT_TEMPLATE
    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    n_layers = model.config.num_hidden_layers
    split = n_layers - cfg.layers
    if stage is None:
        lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0, bias="none",
                          target_modules=list(TARGETS), task_type="CAUSAL_LM",
                          layers_to_transform=list(range(split, n_layers)))
        model = get_peft_model(model, lora)
        examples = training_set(cfg.turns, cfg.seed, cfg.written_share)
        epochs, lr = cfg.epochs, cfg.lr
    else:
        first = json.loads((out / "build.json").read_text())
        model = PeftModel.from_pretrained(model, str(out), is_trainable=True)
        replay = random.Random(f"replay-{stage.seed}").sample(
            training_set(first["config"]["turns"], first["config"]["seed"],
                         first["config"].get("written_share", 0.0)),
            stage.replay_turns)
        examples = agent_set(stage.agent_turns, stage.seed) + replay
        epochs, lr = stage.epochs, stage.lr
    rows = [encode(tokenizer, p, a) for ex in examples
            for p, a in prompts(ex, cfg.prompt_version)]
    rng = random.Random(cfg.seed)
    plan = [collate(b, tokenizer.pad_token_id, cfg.decisive)
            for b in batches(rows, cfg.batch, rng)]
    start = time.monotonic()
    model.eval()
    cache_lower_layers(model, plan, split)
    cache_s = time.monotonic() - start
    log(f"lower {split} layers cached for {len(rows)} examples in {cache_s:.0f} s")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * len(plan)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < cfg.warmup:
            return lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    inner = decoder(model)
    all_layers = inner.layers
    inner.layers = all_layers[split:]  # the top layers only, on the cached hidden states
    model.train()
    losses: list[float] = []
    step = 0
    try:
        for _epoch in range(epochs):
            for b in rng.sample(plan, len(plan)):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                loss = answer_loss(model, b)
                loss.backward()  # type: ignore[no-untyped-call]
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                step += 1
                if step % 20 == 0 or step == total:
                    recent = sum(losses[-20:]) / len(losses[-20:])
                    log(f"step {step}/{total}  loss {recent:.4f}  "
                        f"{time.monotonic() - start:.0f} s")
    finally:
        inner.layers = all_layers
    seconds = time.monotonic() - start
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL  # not a local path
    model.save_pretrained(tmp)
    (tmp / "README.md").unlink(missing_ok=True)  # peft's empty model card
    figures: dict[str, Any] = {
        "examples": len(rows), "steps": total, "train_s": round(seconds, 1),
        "cache_s": round(cache_s, 1),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "config": asdict(cfg)}
    if stage is not None:  # the first stage's figures stay, this one's beside them
        figures = staged_figures(first, {**{k: figures[k] for k in (
            "examples", "steps", "train_s", "cache_s", "final_loss")},
            "config": {**asdict(stage), "prompt_version": cfg.prompt_version}})
    (tmp / "build.json").write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return figures
