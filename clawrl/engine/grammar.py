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
        self.never_utf8: torch.Tensor | None = None  # [V] bool, set with the compiler

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=sorted(self._stop_ids))
                self.never_utf8 = never_utf8(info.decoded_vocab, self._vocab_size)
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


# Bytes no UTF-8 text contains: 0xC0 and 0xC1 lead only overlong encodings, 0xF5-0xFF
# nothing. xgrammar reads an overlong pair as a character (a byte-level vocabulary has a token
# per byte: the tiny world's model once wrote b"\xc0\xa5" inside a JSON string, which Python
# decodes to two U+FFFD and which broke the schema's maxLength as the client counts it).
_NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})


def never_utf8(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """`[V]` bool: the tokens holding a byte that never occurs in UTF-8 text."""
    out = torch.zeros(vocab_size, dtype=torch.bool)
    for token, raw in enumerate(decoded_vocab[:vocab_size]):
        if not _NEVER_IN_UTF8.isdisjoint(raw):
            out[token] = True
    return out


class Constraint:
    """One sequence's grammar state, used on the scheduler thread only. Besides what the
    grammar refuses, it refuses tokens holding a byte UTF-8 never has (`never_utf8`): a
    constrained reply is text a client parses."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int,
                 never: torch.Tensor | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.never = never
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar refuses here set to -inf (a copy)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, self._bitmask[0].to(out.device),
                                        vocab_size=self.vocab_size)
        if self.never is not None:
            width = min(out.shape[-1], self.never.shape[0])
            out[..., :width].masked_fill_(self.never[:width].to(out.device), float("-inf"))
        return out

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # cannot happen after `mask`: a bug if it does
            raise RuntimeError(f"the grammar refused token {token} it allowed")
