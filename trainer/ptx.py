"""The pretraining-data term: supervised text mixed into every step (InstructGPT's PPO-ptx).

Learning a user's style from rewards moves the whole model, and what it knows moves with it:
measured on the tiny world, answer accuracy falls about a point per version while two users'
styles are learnt (docs/eval.md). A term that keeps up the likelihood of text the model was
trained on before holds the knowledge in place while the style moves (Ouyang et al. 2022,
§3.5: "we mix the pretraining gradients into the PPO gradients"):

    loss += γ · ( −Σ_t m_t · log p_θ(x_t | x_<t) / Σ_t m_t )     over a batch of ptx examples

with γ = `ptx_coef` and m the examples' loss mask (an assistant's tokens for chat examples,
every token for plain text). It never reads the users' data, so it adds nothing of theirs.

`ptx_data` is a JSONL file, one example per line: `{"messages": [...]}` (OpenAI chat messages;
the loss is on the assistant messages, rendered with the model's own chat template) or
`{"text": "..."}` (the loss is on every token). Left unset, the data is the model
directory's own when its recipe.json names one (the tiny world's build writes its chat corpus
there).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clawrl.engine.chat import normalise_message
from clawrl.engine.protocol import EngineError


class PtxDataError(ValueError):
    """The ptx file cannot be used: one readable line says where and why."""


@dataclass(frozen=True)
class PtxExample:
    ids: list[int]
    mask: list[int]  # on the target grid: mask[j] = 1 trains the prediction of ids[j + 1]


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a mask over them: 1 on each assistant message's
    tokens (its content or tool calls and end marker), found as what rendering that message
    adds to the prompt rendered before it (the generation prompt included), so the chat
    template's own wording decides, as in the engine (clawrl/engine/chat.py `prompt_ids`)."""
    def render(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])

    ids = render(len(messages), False)
    mask = [0] * len(ids)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt, upto = render(i, True), render(i + 1, False)
        if ids[:len(prompt)] != prompt or ids[:len(upto)] != upto:
            raise PtxDataError("the chat template renders an earlier part of the chat "
                               "differently once later messages follow")
        for j in range(len(prompt), len(upto)):
            mask[j] = 1
    return ids, mask


def encode_line(tokenizer: Any, row: Any) -> tuple[list[int], list[int]]:
    """One JSONL row's ids and a 0/1 mask on those ids (which tokens carry the loss).

    A chat row is OpenAI's fine-tuning format: `messages` (tool calls and tool results
    included) and optional `tools`, rendered with the model's chat template."""
    if not isinstance(row, dict) or not (("messages" in row) ^ ("text" in row)):
        raise PtxDataError('expected an object with "messages" (a chat) or "text"')
    if "text" in row:
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise PtxDataError('"text" must be a non-empty string')
        ids = list(tokenizer(row["text"], add_special_tokens=False)["input_ids"])
        return ids, [1] * len(ids)
    messages, tools = row["messages"], row.get("tools")
    if not isinstance(messages, list) or not messages:
        raise PtxDataError('"messages" must be a non-empty list of chat messages')
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise PtxDataError('"tools" must be a list of tool objects')
    try:
        messages = [normalise_message(i, m) for i, m in enumerate(messages)]
    except EngineError as exc:
        raise PtxDataError(str(exc)) from exc
    if not any(m["role"] == "assistant" for m in messages):
        raise PtxDataError('"messages" has no assistant message to learn from')
    try:
        return _chat_ids(tokenizer, messages, tools or None)
    except PtxDataError:
        raise
    except Exception as exc:  # jinja errors: the row does not fit the model's template
        raise PtxDataError(f"cannot render the chat template: {exc}") from exc


def load_examples(path: Path, tokenizer: Any, max_tokens: int) -> list[PtxExample]:
    """Every example of `path`, cut to `max_tokens`; raises PtxDataError naming the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PtxDataError(f"ptx_data {path}: {exc.strerror or exc}") from exc
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids, mask = encode_line(tokenizer, json.loads(line))
        except (json.JSONDecodeError, PtxDataError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise PtxDataError(f"ptx_data {path} line {n}: {msg}") from exc
        ids, mask = ids[:max_tokens], mask[:max_tokens]
        if sum(mask[1:]) == 0:
            continue  # nothing left to learn once cut
        examples.append(PtxExample(ids, mask[1:]))
    if not examples:
        raise PtxDataError(f"ptx_data {path}: no example with tokens to learn from")
    return examples


class PtxBatches:
    """Endless batches of ptx examples: each pass over the data in a new seeded order."""

    def __init__(self, examples: list[PtxExample], batch_size: int, seed: int,
                 pad_id: int = 0) -> None:
        self.examples = examples
        self.batch_size = min(batch_size, len(examples))
        self.pad_id = pad_id
        self._rng = random.Random(seed)
        self._order: Iterator[int] = iter(())

    def _next_index(self) -> int:
        try:
            return next(self._order)
        except StopIteration:
            order = list(range(len(self.examples)))
            self._rng.shuffle(order)
            self._order = iter(order)
            return next(self._order)

    def next(self) -> tuple[Tensor, Tensor, Tensor]:
        """input_ids [b, L], attention_mask [b, L] (right padding), loss mask [b, L − 1]."""
        return pad_examples([self.examples[self._next_index()] for _ in range(self.batch_size)],
                            self.pad_id)


def pad_examples(picked: list[PtxExample], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """input_ids [b, L], attention_mask [b, L] (right padding), loss mask [b, L − 1]."""
    width = max(len(e.ids) for e in picked)
    ids = torch.full((len(picked), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(picked), width), dtype=torch.long)
    mask = torch.zeros((len(picked), width - 1))
    for b, e in enumerate(picked):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        attn[b, :len(e.ids)] = 1
        mask[b, :len(e.mask)] = torch.tensor(e.mask, dtype=mask.dtype)
    return ids, attn, mask
