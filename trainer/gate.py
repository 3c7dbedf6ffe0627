"""The gate before serving: every new version answers a held-out capability probe before it
is published, and is not served when it lost more than a bound against the base model.

Learning a person's style moves the whole model, and what it knows moves with it: a loop that
made SmolLM2 brief also turned its factual answers to nonsense while every reward said it was
doing well. The gate is the check nobody has to remember. A probe is a JSONL file of short
questions with the answers that count as right (`{"question": "…", "answers": ["Rome"]}`),
written apart from anything trained on; a model directory names its own in recipe.json
(`"gate_probe"`, trainer/config.py), or `CLAWRL_TRAINER__GATE_PROBE` names one.

Facts alone miss what people notice first. A style's reward can leave short answers intact
while longer replies drift off the question ("How long should a steak rest?" → "…a standard
10-minute serving of a classic Margherita"): the facts held while the replies to everyday
questions stopped answering them. So a probe also holds open questions, each with the words
any on-topic reply uses (`{"question": "How do I unclog a sink?", "topic": ["drain",
"plunger", …]}`), answered at a reply's length and counted on topic when the reply uses one of
them — the check the simulated people of `clawrl eval` make, on questions of the gate's own.

Each version is asked every question greedily, as a chat with the model's own template: the
facts scored by word match (any accepted answer, any case), the open questions by topic word.
The base model's scores are measured once at start; a version whose fact score falls more
than `gate_max_drop` (a fraction of the questions) below the base's, or whose on-topic rate
falls more than `gate_max_topic_drop`, is rejected: its row in policy_versions says
'rejected' with the figures, the engine keeps serving the version before, and the trainer
goes back to that version's weights with a smaller learning rate (trainer/train.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


class ProbeError(ValueError):
    """The probe file cannot be used; one readable line says where and why."""


@dataclass(frozen=True)
class ProbeItem:
    """A fact (`answers`: any one of them is right) or an open question (`topic`: an
    on-topic reply uses one of these words)."""

    question: str
    answers: tuple[str, ...] = ()
    topic: tuple[str, ...] = ()

    def on_topic(self, reply: str) -> bool:
        """One of the topic words begins a word of the reply, in any case ("minute" counts
        in "minutes", "egg" not in "leggings")."""
        text = reply.lower()
        return any(re.search(rf"(?<![\w]){re.escape(w.lower())}", text) for w in self.topic)

    def passes(self, reply: str) -> bool:
        """The gate's verdict on `reply`: a fact answered right, an open question on topic."""
        return is_right(reply, self.answers) if self.answers else self.on_topic(reply)

    def settled(self, reply: str) -> bool:
        """The verdict on `reply` can no longer change however the reply goes on: a fact
        answered right with a character after the answer (an answer at the very end might
        still grow into a longer word: "Rome" → "Romeo"), an open question on topic. A trailing
        U+FFFD is a character still being decoded, so it is left out."""
        text = reply.rstrip("\ufffd")
        if self.answers:
            return is_right(text + "_", self.answers)  # "_" is a word character
        return self.on_topic(text)


# An open question's reply is long enough to drift: about a paragraph.
OPEN_TOKENS = 48
FACT_TOKENS = 32


@dataclass
class GateResult:
    base: float | None  # fraction of the facts right, the base model (None: no facts)
    candidate: float | None  # the same, the new version
    max_drop: float
    questions: int  # facts
    newly_wrong: list[str]  # facts the base answered and the version does not
    topic_base: float | None = None  # fraction of open questions answered on topic, base
    topic_candidate: float | None = None  # the same, the new version
    max_topic_drop: float = 0.0
    topic_questions: int = 0
    newly_off_topic: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        facts = self.base is None or self.candidate is None or \
            self.base - self.candidate <= self.max_drop + 1e-9
        topic = self.topic_base is None or self.topic_candidate is None or \
            self.topic_base - self.topic_candidate <= self.max_topic_drop + 1e-9
        return facts and topic

    def summary(self) -> str:
        """"facts 0.68 -> 0.65, on topic 0.93 -> 0.60" (the parts the probe has)."""
        parts = []
        if self.base is not None and self.candidate is not None:
            parts.append(f"facts {self.base:.2f} -> {self.candidate:.2f}")
        if self.topic_base is not None and self.topic_candidate is not None:
            parts.append(f"on topic {self.topic_base:.2f} -> {self.topic_candidate:.2f}")
        return ", ".join(parts)

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
            question = row["question"]
            kind = "topic" if "topic" in row else "answers"
            words = row[kind]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ProbeError(f"gate probe {path}:{n}: expected "
                             '{"question": "...", "answers": ["..."]} or '
                             '{"question": "...", "topic": ["..."]}') from exc
        if not (isinstance(question, str) and question.strip() and isinstance(words, list)
                and words and all(isinstance(a, str) and a.strip() for a in words)):
            raise ProbeError(f"gate probe {path}:{n}: a question and at least one "
                             f"{'topic word' if kind == 'topic' else 'answer'}")
        if kind == "topic":
            items.append(ProbeItem(question, topic=tuple(words)))
        else:
            items.append(ProbeItem(question, answers=tuple(words)))
    if not items:
        raise ProbeError(f"gate probe {path}: no questions")
    return items


def is_right(reply: str, answers: tuple[str, ...]) -> bool:
    """Any accepted answer as whole words, in any case."""
    text = reply.lower()
    # Not inside a longer word or number ("Romeo" is not "Rome", "18.0" is not "0").
    return any(re.search(rf"(?<![\w.]){re.escape(a.lower())}(?![\w])", text) for a in answers)


def chat_prompts(tokenizer: Any, questions: list[str]) -> tuple[list[list[int]], int]:
    """Each question as a one-message chat in the model's template, ready for its reply (the
    token ids), and the id to pad with."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    return [tokenizer.encode(str(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)),
        add_special_tokens=False) for q in questions], pad


@torch.no_grad()
def answer_all(model: Any, tokenizer: Any, items: list[ProbeItem],
               settle: bool = True) -> list[str]:
    """Each question asked greedily as a one-message chat, all in one batch that decodes step
    by step with the model's KV cache (the opening every prompt shares is computed once); a
    fact gets `FACT_TOKENS`, an open question `OPEN_TOKENS`.

    `settle`: a row leaves the batch as soon as its verdict can no longer change — a fact once
    an accepted answer stands whole in the reply, an open question once a topic word has
    begun a word (`ProbeItem.settled`). Both verdicts only ever turn from no to yes as a reply
    grows, so each is the one the full reply gets; the probe costs what its undecided rows
    cost. A base model answers most questions in its first dozen tokens: the batch thins
    fast. False: every row to its end or its limit (`clawrl bench trainer --phases gate`
    times both)."""
    if not items:
        return []
    was_training = model.training
    model.eval()
    try:
        return greedy_replies(model, tokenizer, items, settle)
    finally:
        model.train(was_training)


def greedy_replies(model: Any, tokenizer: Any, items: list[ProbeItem],
                   settle: bool) -> list[str]:
    """answer_all's decoding, the model already in eval mode."""
    from transformers import DynamicCache

    from clawrl.engine.runtime import eos_ids

    encoded, pad = chat_prompts(tokenizer, [item.question for item in items])
    device = model.device
    # What every prompt opens with (the chat template's system turn: 24 of SmolLM2's ~40
    # tokens) is computed once and its cache shared by every row; each row then reads its own
    # rest, left-padded against the shared part.
    shared = min(len(os.path.commonprefix(encoded)), min(map(len, encoded)) - 1)
    cache = DynamicCache()
    if shared:
        model(input_ids=torch.tensor([encoded[0][:shared]], device=device), cache=cache,
              use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(len(items))
    rests = [ids[shared:] for ids in encoded]
    width = max(len(ids) for ids in rests)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rests],
                             device=device)
    own = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rests],
                       device=device)
    mask = torch.cat([own.new_ones((len(items), shared)), own], dim=1)
    positions = shared + (own.cumsum(-1) - 1).clamp(min=0)
    limits = [FACT_TOKENS if item.answers else OPEN_TOKENS for item in items]
    stops = eos_ids(model, tokenizer)
    replies: list[list[int]] = [[] for _ in items]
    live = list(range(len(items)))  # the original index of each row of the batch
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                   cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    position = positions[:, -1]
    while True:
        chosen = logits.argmax(-1)
        keep = []
        for row, i in enumerate(live):
            token = int(chosen[row])
            if token in stops:
                continue
            replies[i].append(token)
            if len(replies[i]) >= limits[i] or (settle and items[i].settled(
                    tokenizer.decode(replies[i], skip_special_tokens=True))):
                continue
            keep.append(row)
        if not keep:
            break
        if len(keep) < len(live):
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            mask, position, chosen = mask[rows], position[rows], chosen[rows]
            live = [live[row] for row in keep]
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        position = position + 1
        logits = model(input_ids=chosen[:, None], attention_mask=mask,
                       position_ids=position[:, None], cache=cache, logits_to_keep=1,
                       use_cache=True).logits[:, -1]
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in replies]


def fraction(marks: list[bool]) -> float | None:
    return sum(marks) / len(marks) if marks else None


class Gate:
    """The probe and the base model's answers to it (`measure_base` once, at start)."""

    def __init__(self, items: list[ProbeItem], max_drop: float, tokenizer: Any,
                 max_topic_drop: float = 0.1) -> None:
        self.max_drop, self.max_topic_drop, self.tokenizer = max_drop, max_topic_drop, tokenizer
        self.facts = [item for item in items if item.answers]
        self.open = [item for item in items if item.topic]
        self.base_marks: tuple[list[bool], list[bool]] | None = None

    def _marks(self, model: Any) -> tuple[list[bool], list[bool]]:
        """(right, on topic): each fact answered right, each open question on topic — one
        batch, each row as long as its kind needs or until its verdict is settled."""
        replies = answer_all(model, self.tokenizer, self.facts + self.open)
        facts, opens = replies[:len(self.facts)], replies[len(self.facts):]
        return ([item.passes(r) for r, item in zip(facts, self.facts, strict=True)],
                [item.passes(r) for r, item in zip(opens, self.open, strict=True)])

    def measure_base(self, model: Any) -> str:
        """The base model's figures, as a line for the log."""
        self.base_marks = self._marks(model)
        right, topical = self.base_marks
        parts = []
        if self.facts:
            parts.append(f"{fraction(right):.2f} of {len(self.facts)} facts right")
        if self.open:
            parts.append(f"{fraction(topical):.2f} of {len(self.open)} open questions on topic")
        return ", ".join(parts)

    def check(self, model: Any) -> GateResult:
        return self._result(self._marks(model))

    def _result(self, marks: tuple[list[bool], list[bool]]) -> GateResult:
        assert self.base_marks is not None, "measure_base first"
        (was_right, was_topical), (right, topical) = self.base_marks, marks
        return GateResult(
            base=fraction(was_right), candidate=fraction(right), max_drop=self.max_drop,
            questions=len(self.facts),
            newly_wrong=[item.question for item, was, now in
                         zip(self.facts, was_right, right, strict=True) if was and not now],
            topic_base=fraction(was_topical), topic_candidate=fraction(topical),
            max_topic_drop=self.max_topic_drop, topic_questions=len(self.open),
            newly_off_topic=[item.question for item, was, now in
                             zip(self.open, was_topical, topical, strict=True)
                             if was and not now])
