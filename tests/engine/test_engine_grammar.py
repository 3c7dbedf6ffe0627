"""Structured outputs (clawrl/engine/grammar.py): through the engine's HTTP routes, the real
tiny models write replies that parse and validate under the request's schema or tool choice,
their logprobs are those of the constrained distribution, and bad constraints are 400s."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS_MODEL = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-tools"
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "tags", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 10},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "role": {"enum": ["admin", "user", "guest"]},
              "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
              "address": {"type": "object", "required": ["zip"], "additionalProperties": False,
                          "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                         "door": {"type": ["integer", "null"],
                                                  "minimum": 1, "maximum": 9999}}}}}
LS = {"type": "function", "function": {
    "name": "ls", "description": "List a directory",
    "parameters": {"type": "object", "required": ["path"], "additionalProperties": False,
                   "properties": {"path": {"type": "string", "maxLength": 16}}}}}
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "required": ["city", "days"],
                   "additionalProperties": False,
                   "properties": {"city": {"enum": ["paris", "oslo", "lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


def chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=120)


def schema_format(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "person", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize("strict", [True, None])
def test_json_schema_replies_parse_and_validate_even_from_random_weights(
        engine_url: str, strict: bool | None) -> None:
    """The random-weight tiny model writes noise; under the schema every sampled reply (hot
    and greedy) parses and validates, and the logprobs are finite: the sampled token was
    always one the grammar allowed. (Every value here is bounded: under an unbounded integer
    the greedy noise model writes "7777…" until max_tokens, finish_reason "length".)"""
    for seed, temperature in ((1, 1.0), (2, 1.3), (3, 0.0)):
        response = chat(engine_url, response_format=schema_format(PERSON, strict),
                        max_tokens=400, temperature=temperature, seed=seed, logprobs=True,
                        top_logprobs=5)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        for entry in choice["logprobs"]["content"]:
            assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
            assert all(math.isfinite(t["logprob"]) for t in entry["top_logprobs"])


def test_json_object_is_a_json_object(module_engine_factory: Callable[..., str]) -> None:
    """`json_object` from the tiny world's tool model (trained weights), whole and streamed.
    Its grammar bounds nothing (any keys, any string): a reply that runs out of tokens first
    ends with "length" (seed 2 here rambles inside a key), every other one parses."""
    url = module_engine_factory(TOOLS_MODEL)
    for seed in (0, 1, 3):
        body = chat(url, response_format={"type": "json_object"}, max_tokens=200,
                    temperature=1.0, seed=seed).json()
        assert body["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
            "messages": ASK, "response_format": schema_format(PERSON, True),
            "max_tokens": 400, "temperature": 1.0, "seed": 5, "stream": True}) as stream:
        text = "".join(
            (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
            for line in stream.iter_lines() if line.startswith("data: {"))
    jsonschema.validate(json.loads(text), PERSON)


def _arguments(call: dict[str, Any]) -> dict[str, Any]:
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict)
    return args


def test_required_and_named_tool_choice_always_call_a_tool(
        module_engine_factory: Callable[..., str]) -> None:
    """`required`: one call or more, each to an offered function with valid arguments;
    a named function: calls to it only; `parallel_tool_calls: false`: exactly one."""
    url = module_engine_factory(TOOLS_MODEL)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (LS, WEATHER)}
    for seed in range(4):
        for choice, parallel in (("required", True), ("required", False),
                                 ({"type": "function", "function": {"name": "weather"}}, True)):
            response = chat(url, tools=[LS, WEATHER], tool_choice=choice,
                            parallel_tool_calls=parallel, max_tokens=300, temperature=1.2,
                            seed=seed)
            assert response.status_code == 200, response.text
            out = response.json()["choices"][0]
            assert out["finish_reason"] == "tool_calls", out
            calls = out["message"]["tool_calls"]
            assert calls and out["message"]["content"] == ""
            if not parallel:
                assert len(calls) == 1
            for call in calls:
                name = call["function"]["name"]
                assert name == "weather" or choice == "required"
                jsonschema.validate(_arguments(call), schemas[name])


def test_a_strict_function_under_auto_is_called_with_valid_arguments(
        module_engine_factory: Callable[..., str]) -> None:
    """`auto` with a strict function: the model may answer in text, but whenever it starts
    a call the call validates (the tiny tool model calls its tools often)."""
    url = module_engine_factory(TOOLS_MODEL)
    calls = []
    for seed in range(8):
        out = chat(url, messages=[{"role": "user", "content": "weather in paris?"}],
                   tools=[WEATHER], max_tokens=200, temperature=1.0, seed=seed
                   ).json()["choices"][0]
        assert "<tool_call>" not in (out["message"]["content"] or "")
        calls += out["message"]["tool_calls"] or []
    assert calls, "the tool model never called its tool"
    for call in calls:
        jsonschema.validate(_arguments(call), WEATHER["function"]["parameters"])


def test_a_reply_that_runs_out_of_tokens_ends_with_length(engine_url: str) -> None:
    out = chat(engine_url, response_format=schema_format(PERSON, True), max_tokens=4,
               temperature=0).json()["choices"][0]
    assert out["finish_reason"] == "length"
    assert out["message"]["content"] == '{"nam'  # cut where it stood: it does not parse


def test_generate_takes_sglang_constraints_and_returns_constrained_logprobs(
        engine_url: str) -> None:
    """/generate's `regex`, `ebnf`, `json_schema`; the top alternatives at each step are only
    tokens the grammar allows, and their probabilities sum to 1: the logprobs are those of
    the masked distribution the token was drawn from."""
    def generate(**sampling: Any) -> dict[str, Any]:
        response = httpx.post(f"{engine_url}/generate", timeout=120, json={
            "text": "Answer:", "return_logprob": True, "top_logprobs_num": 20,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, **sampling}})
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    for seed in range(3):
        body = generate(regex="(yes|no)[0-9]{2}", sampling_seed=seed)
        assert re.fullmatch("(yes|no)[0-9]{2}", body["text"]), body["text"]
    body = generate(regex="[ab]", sampling_seed=0)
    assert body["text"] in ("a", "b")
    first = body["meta_info"]["output_top_logprobs"][0]  # 20 asked; the grammar allows 2
    assert len(first) == 2 and body["output_ids"][0] in {t for _, t, _ in first}
    assert sum(math.exp(lp) for lp, _, _ in first) == pytest.approx(1.0, abs=1e-4)
    assert generate(ebnf='root ::= "x" ("y" | "z")+', max_new_tokens=6,
                    sampling_seed=1)["text"].startswith("x")
    body = generate(json_schema=json.dumps(PERSON), max_new_tokens=400, sampling_seed=2)
    jsonschema.validate(json.loads(body["text"]), PERSON)


BAD: list[tuple[str, str, dict[str, Any], str]] = [
    ("invalid schema", "chat", {"response_format": schema_format({"type": "strin"}, True)},
     'invalid json_schema: Unsupported type "strin"'),
    ("no schema", "chat", {"response_format": {"type": "json_schema",
                                               "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("unknown format", "chat", {"response_format": {"type": "yaml"}}, "'yaml'"),
    ("unknown function", "chat", {"tools": [LS], "tool_choice": {
        "type": "function", "function": {"name": "rm"}}}, "Tool 'rm' not found in tools list."),
    ("required without tools", "chat", {"tool_choice": "required"},
     "Tools cannot be empty if tool choice is set to required."),
    ("bad tool_choice", "chat", {"tools": [LS], "tool_choice": "sometimes"}, "tool_choice"),
    ("bad parameters", "chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": "required"},
     "invalid parameters of 'f'"),
    ("ignore_eos", "chat", {"response_format": {"type": "json_object"}, "ignore_eos": True},
     "ignore_eos"),
    ("two grammars", "generate", {"regex": "a", "ebnf": 'root ::= "a"'}, "Only one of"),
    ("bad regex", "generate", {"regex": "a("}, "invalid regex"),
    ("bad ebnf", "generate", {"ebnf": "root ::= "}, "invalid ebnf"),
    ("schema not a string", "generate", {"json_schema": {"type": "object"}}, "must be a string"),
]


@pytest.mark.parametrize(("name", "route", "fields", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_constraint_is_an_openai_shaped_400(engine_url: str, name: str, route: str,
                                                   fields: dict[str, Any], message: str) -> None:
    if route == "chat":
        response = chat(engine_url, max_tokens=5, **fields)
    else:
        response = httpx.post(f"{engine_url}/generate", timeout=60, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 5, **fields}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error


def test_a_length_bounded_string_refuses_control_characters(tiny_model_dir: Path) -> None:
    """xgrammar 0.2.7 lets raw control characters into a string with maxLength (which JSON,
    and `json.loads`, refuse); the engine's grammar does not."""
    import torch
    from transformers import AutoTokenizer

    from clawrl.engine.grammar import Constraint, Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, 768, {2})
    schema = json.dumps({"type": "object", "required": ["p"],
                         "properties": {"p": {"type": "string", "maxLength": 8}}})
    bell, tab, b = tokenizer.convert_tokens_to_ids(["ć", "ĉ", "b"])  # bytes 0x07, 0x09; "b"

    def allowed(compiled: Any) -> torch.Tensor:
        constraint = Constraint(compiled, 768)
        for token in tokenizer.encode('{"p": "a', add_special_tokens=False):
            constraint.accept(token)
        return constraint.mask(torch.zeros(768)) > float("-inf")

    theirs = allowed(grammars.compiler().compile_json_schema(schema, any_whitespace=False))
    assert theirs[bell] and theirs[tab] and theirs[b]
    ours = allowed(grammars.compile(("json_schema", schema)))
    assert not ours[bell] and not ours[tab] and ours[b]


def test_a_string_refuses_bytes_utf8_never_has(tiny_model_dir: Path) -> None:
    """xgrammar reads an overlong pair (0xC0 0xA5) as a character inside a JSON string; the
    client decodes it to two U+FFFD and counts one character more than `maxLength` allowed
    (seen once in 400 samples of the tiny model). The engine refuses tokens holding a byte
    UTF-8 never has, whatever the grammar allows."""
    import torch
    from transformers import AutoTokenizer

    from clawrl.engine.grammar import Constraint, Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, 768, {2})
    compiled = grammars.compile(("json_schema", STRING_SCHEMA))
    overlong, continuation, b = byte_tokens(tokenizer, 0xC0, 0xA5, ord("b"))
    assert grammars.utf8 is not None

    def allowed(with_utf8: bool) -> torch.Tensor:
        constraint = Constraint(compiled, 768, grammars.utf8 if with_utf8 else None)
        for token in tokenizer.encode('{"p": "a', add_special_tokens=False):
            constraint.accept(token)
        return constraint.mask(torch.zeros(768)) > float("-inf")

    assert allowed(False)[overlong]  # xgrammar alone lets it in
    ours = allowed(True)
    assert not ours[overlong] and ours[b]
    assert not ours[continuation]  # not where a character begins, as before


STRING_SCHEMA = json.dumps({"type": "object", "required": ["p"],
                            "properties": {"p": {"type": "string", "maxLength": 12}}})


def byte_tokens(tokenizer: Any, *raw: int) -> list[int]:
    """The tokens of single bytes (the tiny model's vocabulary has one per byte), found by
    the bytes xgrammar decodes each token to."""
    import xgrammar as xgr

    vocab = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=768).decoded_vocab
    ids = {token: i for i, token in enumerate(vocab)}
    return [ids[bytes([x])] for x in raw]


@pytest.mark.parametrize(("lead", "refused", "allowed"), [
    ((0xE0,), 0x9F, 0xA0),  # E0 80-9F: an overlong three-byte form
    ((0xED,), 0xA0, 0x9F),  # ED A0-BF: a surrogate
    ((0xF0,), 0x8F, 0x90),  # F0 80-8F: an overlong four-byte form
    ((0xF4,), 0x90, 0x8F),  # F4 90+: past U+10FFFF
    ((0xF1, 0x80), 0x7F, 0xBF),  # inside a four-byte character: continuation bytes only
])
def test_a_character_split_across_tokens_stays_well_formed(
        tiny_model_dir: Path, lead: tuple[int, ...], refused: int, allowed: int) -> None:
    """Each byte is its own token here, so every character is split across tokens: the
    constraint carries the UTF-8 byte state from one token to the next and refuses what
    xgrammar lets through after a valid lead byte."""
    import torch
    from transformers import AutoTokenizer

    from clawrl.engine.grammar import Constraint, Grammars

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    grammars = Grammars(tokenizer, 768, {2})
    compiled = grammars.compile(("json_schema", STRING_SCHEMA))
    for utf8 in (None, grammars.utf8):
        constraint = Constraint(compiled, 768, utf8)
        for token in tokenizer.encode('{"p": "a', add_special_tokens=False):
            constraint.accept(token)
        for token in byte_tokens(tokenizer, *lead):
            assert constraint.mask(torch.zeros(768))[token] > float("-inf")
            constraint.accept(token)
        open_ = constraint.mask(torch.zeros(768)) > float("-inf")
        bad, good, quote = byte_tokens(tokenizer, refused, allowed, ord('"'))
        assert open_[good]
        if utf8 is None:
            continue
        assert not open_[bad]  # ill-formed however the grammar reads it
        assert not open_[quote]  # the string cannot close on half a character
    assert any(constraint.mask(torch.zeros(768))[t] > float("-inf")
               for t in byte_tokens(tokenizer, *range(0x80, 0xC0)))
