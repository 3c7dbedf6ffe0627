"""Structured outputs: grammar-constrained decoding with xgrammar, the library SGLang uses.

A client that asks for JSON (`response_format`), for a tool call (`tool_choice: "required"`
or a named function) or for a `strict` function wants output that parses; sampling from the
model and hoping does not deliver it (a small model rarely writes valid JSON). So the reply
is sampled under a grammar: before each token, the grammar's matcher marks which tokens can
continue a valid output, the others get -inf, and the sampled token is fed back to the
matcher. The reply then always parses, unless `max_new_tokens` runs out first: it ends
with finish_reason "length", cut where it stood, as OpenAI's does.

What a request asks for becomes a `(kind, text)` pair, SGLang's sampling_params key and
value (`/generate` takes them as given: `json_schema`, `regex`, `ebnf`, `structural_tag`),
translated as SGLang 0.5.x's OpenAI adapter translates:
- `response_format` `json_schema` -> its schema (`strict` or not: always constrained);
  `json_object` -> the schema `{"type": "object"}`;
- `tool_choice` `"required"` or a named function -> a structural tag: one or more calls (one
  when `parallel_tool_calls` is false) in the model's tool-call format, the one the reply
  parser reads (clawrl/engine/chat.py: `<tool_call>\\n{"name": …, "arguments": …}\\n
  </tool_call>`), each call's arguments under that function's `parameters`;
- `tool_choice` `"auto"` with any `strict` function -> the same calls behind a trigger: free
  text until the model writes `<tool_call>`, then a call that validates;
- a response_format constraint wins over a tool constraint (SGLang's rule).

JSON is compiled without free whitespace (SGLang's `--constrained-json-disable-any-whitespace`):
a model that may put any whitespace between tokens can spend its whole budget on it, and
compact JSON is what the chat template renders for earlier calls.

Logprobs are those of the constrained distribution the token was drawn from (masked logits,
as SGLang returns them); the trainer does not train such turns (trainer/offpolicy.py).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch
import xgrammar as xgr

from clawrl.engine.protocol import EngineError

Spec = tuple[str, str]  # (kind, text): SGLang's sampling_params key and its value
JSON_OBJECT = '{"type": "object"}'
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# A function without `parameters` takes none (OpenAI's reading).
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# xgrammar 0.2.7 writes a string with minLength/maxLength as `[^"\\\r\n]{m,n}`, which lets raw
# control characters in (JSON forbids them, so `json.loads` would refuse the reply): the class
# is narrowed to the one it uses for other strings.
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_STRICT_CHARS = '[^\\0-\\x1f\\"\\\\\\r\\n]'
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def invalid(what: str, exc: Exception) -> EngineError:
    """A 400 naming what is wrong, from xgrammar's error (its C++ source location cut)."""
    lines = str(exc).strip().splitlines()
    reason = _CPP_PREFIX.sub("", lines[0]) if lines else repr(exc)
    return EngineError(f"invalid {what}: {reason}")


def json_grammar(schema: str | dict[str, Any], what: str = "json_schema") -> str:
    """The EBNF of compact JSON valid under `schema`; EngineError when it is not a schema."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise invalid(what, exc) from exc
    return str(grammar).replace(_LOOSE_CHARS, _STRICT_CHARS)


def _function(tool: Any) -> dict[str, Any]:
    """A tool's `function` object ({} when it has none)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn if isinstance(fn, dict) else {}


def _call_tags(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One structural tag per function: `<tool_call>\\n{"name": NAME, "arguments": ` then its
    arguments, then `}\\n</tool_call>` (what clawrl/engine/tools.py renders)."""
    tags = []
    for tool in tools:
        fn = _function(tool)
        if not isinstance(fn.get("name"), str):
            raise EngineError("tools: each function needs a name")
        begin = f'{TOOL_OPEN}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, ' \
                '"arguments": '
        tags.append({"type": "tag", "begin": begin, "end": f"}}\n{TOOL_CLOSE}",
                     "content": {"type": "grammar",
                                 "grammar": json_grammar(fn.get("parameters") or _NO_PARAMETERS,
                                                         f"parameters of {fn['name']!r}")}})
    return tags


def tool_calls_tag(tools: list[dict[str, Any]], *, required: bool, parallel: bool) -> str:
    """The structural tag for calls to `tools`: nothing but calls when `required`, else
    free text with calls behind the `<tool_call>` trigger."""
    tags = _call_tags(tools)
    if required:
        fmt: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                               "at_least_one": True, "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": tags,
               "at_least_one": False, "stop_after_first": not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def named_tool(tool_choice: Any) -> str | None:
    """The function a `tool_choice` object names ({"type": "function", "function": {"name"}})."""
    if not isinstance(tool_choice, dict):
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise EngineError('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": …}}')
    return name


def offered(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the prompt offers: none under "none", only the named one under a named
    choice (as SGLang renders it), else all."""
    if not tools or tool_choice == "none":
        return None
    name = named_tool(tool_choice)
    return tools if name is None else [t for t in tools if _function(t).get("name") == name]


def check_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """SGLang's checks (`serving_chat._validate_request`), as 400s."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not tools:
            raise EngineError("Tools cannot be empty if tool choice is set to required.")
        return
    if isinstance(tool_choice, str):
        raise EngineError(f'tool_choice must be "none", "auto", "required" or a function, '
                          f'not {tool_choice!r}')
    name = named_tool(tool_choice)
    if not tools:
        raise EngineError("Tools cannot be empty if tool choice is set to a specific tool.")
    if not any(_function(t).get("name") == name for t in tools):
        raise EngineError(f"Tool '{name}' not found in tools list.")


def response_format_spec(fmt: dict[str, Any] | None) -> Spec | None:
    """The constraint of an OpenAI `response_format` (None for text or none)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", JSON_OBJECT)
    if kind == "json_schema":
        spec = (fmt or {}).get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise EngineError("response_format.json_schema.schema (a JSON schema) is required "
                              "for a json_schema response format")
        return ("json_schema", json.dumps(schema, ensure_ascii=False))
    raise EngineError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                      f"not {kind!r}")


def chat_spec(response_format: dict[str, Any] | None, tools: list[dict[str, Any]] | None,
              tool_choice: Any, parallel_tool_calls: bool) -> Spec | None:
    """The constraint a chat request asks for, or None (see the module docstring)."""
    check_tool_choice(tools, tool_choice)
    spec = response_format_spec(response_format)
    if spec is not None or not tools or tool_choice == "none":
        return spec
    if tool_choice == "required":
        return ("structural_tag", tool_calls_tag(tools, required=True,
                                                 parallel=parallel_tool_calls))
    name = named_tool(tool_choice)
    if name is not None:
        chosen = [t for t in tools if _function(t).get("name") == name]
        return ("structural_tag", tool_calls_tag(chosen, required=True,
                                                 parallel=parallel_tool_calls))
    if any(_function(t).get("strict") for t in tools):
        return ("structural_tag", tool_calls_tag(tools, required=False,
                                                 parallel=parallel_tool_calls))
    return None


def structural_tag(text: str) -> str | xgr.StructuralTag:
    """A `structural_tag` as xgrammar compiles it: the current format as given; SGLang's
    legacy one (`{"structures": [{begin, schema, end}], "triggers": […]}`, which its
    tool-call parsers still send) converted as SGLang's xgrammar backend converts it."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError:
        return text  # xgrammar says what is wrong with it
    if not isinstance(tag, dict) or tag.get("structures") is None:
        return text
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                   end=s["end"]) for s in tag["structures"]]
    converted = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    converted.format.at_least_one = bool(tag.get("at_least_one", False))  # type: ignore[union-attr]
    return converted


class Grammars:
    """The engine's grammar compiler: the tokenizer's vocabulary read once (on first use:
    a large vocabulary takes a moment), compiled grammars cached by xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self.utf8: Utf8 | None = None  # set with the compiler

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=sorted(self._stop_ids))
                self.utf8 = Utf8(info.decoded_vocab, self._vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, spec: Spec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; EngineError (a 400) when it is not valid."""
        kind, text = spec
        compiler = self.compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_grammar(json_grammar(text))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            return compiler.compile_structural_tag(structural_tag(text))
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:  # xgrammar's, pydantic's
            raise invalid(kind, exc) from exc


# UTF-8 as a byte automaton (RFC 3629's table of well-formed sequences). A state is what the
# next byte must be and how many continuation bytes are still due: (lo, hi, due); START is
# between characters. xgrammar reads some ill-formed sequences as characters inside a JSON
# string (the tiny world's model once wrote the overlong pair b"\xc0\xa5", which Python decodes
# to two U+FFFD and which broke the schema's maxLength as the client counts it); the byte state
# refuses every one of them: overlong forms (C0, C1, E0 80-9F, F0 80-8F), surrogates
# (ED A0-BF), code points past U+10FFFF (F4 90+, F5-FF), stray continuation bytes, and a
# character left unfinished where the grammar moves on.
Utf8State = tuple[int, int, int]
START: Utf8State = (0, 0, 0)
_CONT: tuple[int, int] = (0x80, 0xBF)


def _lead(byte: int) -> Utf8State | None:
    if byte < 0x80:
        return START
    if 0xC2 <= byte <= 0xDF:
        return (*_CONT, 1)
    if byte == 0xE0:
        return (0xA0, 0xBF, 2)
    if byte == 0xED:
        return (0x80, 0x9F, 2)
    if 0xE1 <= byte <= 0xEF:
        return (*_CONT, 2)
    if byte == 0xF0:
        return (0x90, 0xBF, 3)
    if 0xF1 <= byte <= 0xF3:
        return (*_CONT, 3)
    if byte == 0xF4:
        return (0x80, 0x8F, 3)
    return None  # a continuation byte where a character begins, or C0, C1, F5-FF


def utf8_after(state: Utf8State | None, raw: bytes) -> Utf8State | None:
    """The state after `raw` from `state`; None once the bytes are not well-formed UTF-8."""
    for byte in raw:
        if state is None:
            return None
        lo, hi, due = state
        if due == 0:
            state = _lead(byte)
        elif lo <= byte <= hi:
            state = START if due == 1 else (*_CONT, due - 1)
        else:
            return None
    return state


class Utf8:
    """Which tokens keep a reply well-formed UTF-8 from each byte state: START's mask made
    with the compiler, the others (a character split across tokens) when first needed."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        self._vocab = decoded_vocab[:vocab_size]
        self._size = vocab_size
        self._by_first: dict[int, list[int]] = {}  # first byte -> tokens; -1: no bytes
        for token, raw in enumerate(self._vocab):
            self._by_first.setdefault(raw[0] if raw else -1, []).append(token)
        self._refused: dict[Utf8State, torch.Tensor] = {}
        self.refused(START)

    def refused(self, state: Utf8State) -> torch.Tensor:
        """`[V]` bool: the tokens that would make the text ill-formed from `state`."""
        if state not in self._refused:
            lo, hi, due = state
            # Mid-character only tokens that open with a due byte can follow (and those with
            # no bytes): a few hundred to read, not the vocabulary.
            firsts = range(-1, 256) if due == 0 else [-1, *range(lo, hi + 1)]
            out = torch.ones(self._size, dtype=torch.bool)
            for first in firsts:
                for token in self._by_first.get(first, ()):
                    out[token] = utf8_after(state, self._vocab[token]) is None
            self._refused[state] = out
        return self._refused[state]

    def after(self, state: Utf8State, token: int) -> Utf8State:
        raw = self._vocab[token] if token < len(self._vocab) else b""
        following = utf8_after(state, raw)
        return START if following is None else following  # (masked: cannot happen)


class Constraint:
    """One sequence's grammar state, used on the scheduler thread only. Besides what the
    grammar refuses, it refuses tokens that would make the reply ill-formed UTF-8 (`Utf8`): a
    constrained reply is text a client parses."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 utf8: Utf8 | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.utf8, self.utf8_state = utf8, START
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar refuses here set to -inf (a copy)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, self._bitmask[0].to(out.device),
                                        vocab_size=self.vocab_size)
        if self.utf8 is not None:
            refused = self.utf8.refused(self.utf8_state)
            width = min(out.shape[-1], refused.shape[0])
            out[..., :width].masked_fill_(refused[:width].to(out.device), float("-inf"))
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # cannot happen after `mask`: a bug if it does
            raise RuntimeError(f"the grammar refused token {token} it allowed")
        if self.utf8 is not None:
            self.utf8_state = self.utf8.after(self.utf8_state, token)
