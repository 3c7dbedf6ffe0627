"""The gate before serving: every new version answers a held-out capability probe before it
is published, and is not served when it lost more than a bound against the base model.

Learning a person's style moves the whole model, and what it knows moves with it: a loop that
made SmolLM2 brief also turned its factual answers to nonsense while every reward said it was
doing well. The gate is the check nobody has to remember. A probe is a JSONL file of short
questions with the answers that count as right (`{"question": "…", "answers": ["Rome"]}`),
written apart from anything trained on; a model directory names its own in recipe.json
(`"gate_probe"`, trainer/config.py), or `CLAWRL_TRAINER__GATE_PROBE` names one.

Each version is asked every question greedily, as a chat with the model's own template, and
scored by word match (any accepted answer, any case). The base model's score is measured once
at start; a version whose score falls more than `gate_max_drop` (a fraction of the questions)
below it is rejected: its row in policy_versions says 'rejected' with the figures, the engine
keeps serving the version before, and the trainer goes back to that version's weights with a
smaller learning rate (trainer/train.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


class ProbeError(ValueError):
    """The probe file cannot be used; one readable line says where and why."""


@dataclass(frozen=True)
class ProbeItem:
    question: str
    answers: tuple[str, ...]


@dataclass
class GateResult:
    base: float  # fraction right, the base model
    candidate: float  # fraction right, the new version
    max_drop: float
    questions: int
    newly_wrong: list[str]  # questions the base answered and the version does not

    @property
    def passed(self) -> bool:
        return self.base - self.candidate <= self.max_drop + 1e-9

    def as_stats(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def load_probe(path: Path) -> list[ProbeItem]:
    items = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ProbeError(f"gate probe {path}: {exc.strerror or exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answers = row["question"], row["answers"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ProbeError(f"gate probe {path}:{n}: expected "
                             '{"question": "...", "answers": ["..."]}') from exc
        if not (isinstance(question, str) and question.strip() and isinstance(answers, list)
                and answers and all(isinstance(a, str) and a.strip() for a in answers)):
            raise ProbeError(f"gate probe {path}:{n}: a question and at least one answer")
        items.append(ProbeItem(question, tuple(answers)))
    if not items:
        raise ProbeError(f"gate probe {path}: no questions")
    return items


def is_right(reply: str, answers: tuple[str, ...]) -> bool:
    """Any accepted answer as whole words, in any case."""
    text = reply.lower()
    # Not inside a longer word or number ("Romeo" is not "Rome", "18.0" is not "0").
    return any(re.search(rf"(?<![\w.]){re.escape(a.lower())}(?![\w])", text) for a in answers)


@torch.no_grad()
def answer_all(model: Any, tokenizer: Any, items: list[ProbeItem],
               max_new_tokens: int = 32) -> list[str]:
    """Each question asked greedily as a one-message chat, all in one left-padded batch
    (one generate call: a probe costs about one reply's time, not one per question)."""
    texts = [str(tokenizer.apply_chat_template([{"role": "user", "content": item.question}],
                                               add_generation_prompt=True, tokenize=False))
             for item in items]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    was_training = model.training
    model.eval()
    try:
        out = model.generate(input_ids=input_ids.to(model.device),
                             attention_mask=attention.to(model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


class Gate:
    """The probe and the base model's answers to it (`measure_base` once, at start)."""

    def __init__(self, items: list[ProbeItem], max_drop: float, tokenizer: Any) -> None:
        self.items, self.max_drop, self.tokenizer = items, max_drop, tokenizer
        self.base_right: list[bool] | None = None

    def _right(self, model: Any) -> list[bool]:
        replies = answer_all(model, self.tokenizer, self.items)
        return [is_right(r, item.answers) for r, item in zip(replies, self.items, strict=True)]

    def measure_base(self, model: Any) -> float:
        self.base_right = self._right(model)
        return sum(self.base_right) / len(self.items)

    def check(self, model: Any) -> GateResult:
        assert self.base_right is not None, "measure_base first"
        right = self._right(model)
        n = len(self.items)
        return GateResult(
            base=sum(self.base_right) / n, candidate=sum(right) / n, max_drop=self.max_drop,
            questions=n, newly_wrong=[item.question for item, was, now in
                                      zip(self.items, self.base_right, right, strict=True)
                                      if was and not now])
