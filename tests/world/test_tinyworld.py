"""The tiny model directory: tokenizer ids agree on every load path, chat template, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from clawrl.world import model as tinyworld

TEXTS = [
    "Hello world",
    "café naïve Straße 東京 😀 — “quotes”",
    "e\u0301 is decomposed; \u00e9 is not",  # NFC folds the first into the second
    "  leading spaces\n\n\ttabs 12345 3.14 -7 1e10",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "I'm sure you'LL see we've done it",
    "\r\n\r\nwindows  lines  \n",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    "x" * 300,
    "",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_token_ids_agree_across_load_paths(tiny_model_dir: Path) -> None:
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert auto(text)["input_ids"] == ids, text
        assert auto.encode(text) == ids, text
        assert auto.decode(ids) == raw.decode(ids, skip_special_tokens=False)
    # Special tokens are single ids, never split, and decode back to themselves.
    for i, token in enumerate(tinyworld.SPECIAL_TOKENS):
        assert raw.encode(token).ids == [i]
        assert auto.convert_tokens_to_ids(token) == i
    assert auto.eos_token == tinyworld.IM_END and auto.eos_token_id == 2
    assert auto.pad_token_id == 0 and auto.bos_token is None


def test_model_dir_loads_with_transformers(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.vocab_size == len(tok) == 768
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_chat_template_renders_tools_calls_and_results(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Harbor"}'}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "21 C"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Harbor"}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\n21 C\n</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    # Arguments as an object render the same as the OpenAI JSON string.
    as_dict = [*messages[:2], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Harbor"}}}]}]
    rendered = tok.apply_chat_template(as_dict, tools=TOOLS, tokenize=False)
    assert '"arguments": {"city": "Harbor"}}' in rendered


def test_plain_chat_is_chatml_without_default_system(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_init_is_reproducible(tmp_path: Path) -> None:
    a = tinyworld.init_model_dir(tmp_path / "a", seed=3)
    b = tinyworld.init_model_dir(tmp_path / "b", seed=3)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not (tmp_path / "a.tmp").exists()


def test_train_tokenizer_reaches_vocab_size_and_roundtrips() -> None:
    tok = tinyworld.train_tokenizer(["the cat sat on the mat. " * 50, "numbers 1234 5678"],
                                    vocab_size=300)
    assert tok.get_vocab_size() <= 300
    assert [tok.token_to_id(t) for t in tinyworld.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.decode(tok.encode("the cat: 東京").ids) == "the cat: 東京"


def test_model_config_rejects_unknown_size() -> None:
    with pytest.raises(ValueError, match="unknown size"):
        tinyworld.model_config("huge", 768)


def test_cli_errors_are_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "clawrl.world", "frobnicate"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "unknown subcommand" in out.stderr
    out = subprocess.run([sys.executable, "-m", "clawrl.world", "init", "/proc/nope/x"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
