"""Prompt tokens before the engine sees a request: refuse what cannot fit, with bounded work.

An engine tokenises a prompt before it can say the prompt is too long, and does so in its
own loop: one key's 4 MB single message cost 1.4M tokens of the engine's time before a 400,
and every other key waited. So the proxy measures first (`PromptSizer`):

1. **Bytes, at once.** The text the chat template renders — message contents (stripped, as
   templates may trim them), tool calls' names and the strings inside their arguments, and
   the strings inside the tools' JSON schemas (names, keys, descriptions, enums) — is at
   least `text bytes / L` tokens, where L is the longest token of the vocabulary in UTF-8
   bytes (`max_token_bytes` when the tokenizer is unknown). A request whose bound alone
   cannot fit the context is refused without tokenising anything.
2. **The tokenizer, bounded.** With the served model's `tokenizer.json` readable (the
   engine's `/model_info` names it; the embedded engine is on this machine; or
   `CLAWRL_PROXY__TOKENIZER_PATH`), a request that might not fit — its text could exceed
   the context even at one token per byte — is counted with the `tokenizers` fast
   tokenizer, on one worker thread off the event loop, chunk by chunk, stopping as soon as
   the count is past what fits. No request costs more than about one context's worth of
   tokenisation, and small requests (the usual ones) cost none.

The count joins the texts with newlines and takes two tokens off per chunk tokenised apart,
so it stays at or under what the engine counts for the rendered prompt (which adds the
template's role markers around every message). Refused: 400 `context_length_exceeded` with
the engine's own wording. The count is also the prompt estimate that the key's tokens per
minute are charged (proxy/limits.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from clawrl.base.errors import BadRequest

log = logging.getLogger("clawrl.proxy")

# Tokenised in pieces of about this many characters, so a count can stop early.
CHUNK_CHARS = 16 * 1024
# Tokens taken off the count per piece tokenised apart (merges lost at a cut).
SLACK_PER_CHUNK = 2
# Below this, the rendered prompt cannot reach the context: template and tool boilerplate
# a template may add around the request's own bytes (3x covers \\uXXXX escapes of tools).
TEMPLATE_BYTES = 1024
ESCAPE_FACTOR = 3


class ContextTooLong(BadRequest):
    """A prompt that cannot fit the model's context (the engine's own code and wording)."""

    code = "context_length_exceeded"


@dataclass
class PromptText:
    """What of a chat body the template renders, as one string for the tokenizer."""

    text: str
    nbytes: int  # UTF-8 bytes of `text`


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, object keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _arguments(raw: Any) -> Iterator[str]:
    """A tool call's arguments: the strings inside them (a template may re-serialise the
    JSON more compactly), or the text itself when it is not JSON."""
    if isinstance(raw, str):
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            yield raw.strip()
            return
        yield from _strings(parsed)
    else:
        yield from _strings(raw)


def prompt_text(body: dict[str, Any]) -> PromptText:
    """The texts of a (validated) chat body that any chat template renders."""
    parts: list[str] = []
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content.strip())
        elif isinstance(content, list):
            parts.extend(p["text"].strip() for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    parts.append(function["name"])
                parts.extend(_arguments(function.get("arguments")))
    parts.extend(_strings(body.get("tools") or []))
    text = "\n".join(p for p in parts if p)
    return PromptText(text, len(text.encode("utf-8", "surrogatepass")))


def too_long(prompt_tokens: int, requested: int | None, context: int) -> bool:
    """What the engines refuse: a prompt of the whole context, or one that leaves less
    than the `max_tokens` asked for."""
    return prompt_tokens >= context or (bool(requested)
                                        and prompt_tokens + (requested or 0) > context)


def refusal(prompt_tokens: int, requested: int | None, context: int) -> ContextTooLong:
    """The 400 for a prompt that cannot fit (the count is a lower bound: "at least")."""
    at_least = "at least "
    if prompt_tokens >= context:
        return ContextTooLong(f"The input ({at_least}{prompt_tokens} tokens) is longer than the "
                              f"model's context length ({context} tokens).", param="messages")
    return ContextTooLong(
        f"Requested token count exceeds the model's maximum context length of {context} "
        f"tokens. You requested a total of {at_least}{prompt_tokens + (requested or 0)} "
        f"tokens: {at_least}{prompt_tokens} tokens from the input messages and {requested} "
        "tokens for the completion. Please reduce the number of tokens in the input messages "
        "or the completion to fit within the limit.", param="messages")


def _longest_token_bytes(vocab: dict[str, int]) -> int:
    """An upper bound on any token's length in UTF-8 bytes: a byte-level BPE spells each
    byte as one character, a SentencePiece vocabulary spells text as UTF-8 ('▁' for a
    space); the larger reading of the two is never short."""
    return max((max(len(t), len(t.encode("utf-8", "surrogatepass"))) for t in vocab), default=1)


class PromptSizer:
    """Bounds and counts prompt tokens; follows the served model's tokenizer."""

    def __init__(self, *, max_token_bytes: int, tokenizer_path: Path | None = None) -> None:
        self.default_token_bytes = max(1, max_token_bytes)
        self.max_token_bytes = self.default_token_bytes
        self.configured = tokenizer_path
        self.tokenizer: Any = None
        self.source: tuple[str, float] | None = None  # (tokenizer.json, its mtime)
        # One thread: concurrent counts queue, so they never take more than a core.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-count")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def bound(self, prompt: PromptText) -> int:
        """Tokens the prompt's text is at least, from its bytes alone."""
        return prompt.nbytes // self.max_token_bytes

    @staticmethod
    def may_exceed(raw_bytes: int, context: int) -> bool:
        """Whether a body of `raw_bytes` could render to `context` tokens at one token per
        byte (if not, counting is not needed)."""
        return ESCAPE_FACTOR * raw_bytes + TEMPLATE_BYTES >= context

    async def count(self, prompt: PromptText, stop_at: int) -> int:
        """The prompt text's tokens (minus the slack of its cuts), counted until past
        `stop_at`; on the worker thread, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._count, self.tokenizer,
                                          prompt.text, stop_at)

    @staticmethod
    def _count(tokenizer: Any, text: str, stop_at: int) -> int:
        total, start = 0, 0
        while start < len(text) and total < stop_at:
            end = min(len(text), start + CHUNK_CHARS)
            if end < len(text):  # cut at a space, where merges across the cut are rare
                space = text.rfind(" ", start + CHUNK_CHARS // 2, end)
                end = space if space > start else end
            # encode_batch releases the GIL (encode does not): the event loop keeps running.
            encoded = tokenizer.encode_batch([text[start:end]], add_special_tokens=False)
            total += max(0, len(encoded[0].ids) - SLACK_PER_CHUNK)
            start = end
        return total

    async def follow(self, info: dict[str, Any]) -> None:
        """Load the served model's tokenizer when the engine's model info names one this
        machine can read (the setting first); keep the last one otherwise."""
        path = _tokenizer_file(self.configured, info)
        if path is None:
            return
        try:
            source = (str(path), path.stat().st_mtime)
        except OSError:
            return
        if source == self.source:
            return
        try:
            tokenizer, longest = await asyncio.to_thread(_load, path)
        except Exception as exc:  # tokenizers raises a plain Exception for a bad file
            log.warning("cannot load the tokenizer %s: %s", path, exc,
                        extra={"action": "tokenizer_load_failed"})
            self.source = source
            return
        self.tokenizer, self.max_token_bytes, self.source = tokenizer, max(1, longest), source
        log.info("prompt tokens counted with %s (longest token %d bytes)", path, longest,
                 extra={"action": "tokenizer_loaded"})


def _tokenizer_file(configured: Path | None, info: dict[str, Any]) -> Path | None:
    candidates: list[Any] = [configured] if configured is not None else [
        info.get("tokenizer_path"), info.get("model_path")]
    for candidate in candidates:
        if not isinstance(candidate, (str, os.PathLike)) or not str(candidate):
            continue
        path = Path(candidate)
        if path.is_dir():
            path = path / "tokenizer.json"
        if path.is_file():
            return path
    return None


def _load(path: Path) -> tuple[Any, int]:
    from tokenizers import Tokenizer  # optional: installed with [train]; else bytes only

    tokenizer = Tokenizer.from_file(str(path))
    return tokenizer, _longest_token_bytes(tokenizer.get_vocab(with_added_tokens=True))
