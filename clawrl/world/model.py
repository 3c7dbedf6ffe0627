"""The tiny world model's building blocks: tokenizer, chat template, config, model directory.

`init_model_dir` (`clawrl tinyworld init DIR`) writes, in a few seconds, a randomly
initialised Qwen2-style causal LM with a byte-level BPE tokenizer and a ChatML chat template
(tools rendered like Qwen2.5); clawrl/world/pretrain.py pretrains it on the synthetic world
corpus (`clawrl tinyworld build DIR`, clawrl/world/cli.py).

The tokenizer is trained with exactly the pre-tokenizer and normalizer that transformers'
`Qwen2Tokenizer` installs when it loads a Qwen2 tokenizer (NFC, the Qwen2 split regex, byte
level), so `AutoTokenizer.from_pretrained(DIR)`, `tokenizers.Tokenizer.from_file`, the engine
and the trainer all produce the same ids (tests/trainer/test_tinyworld.py checks this).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2

# transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX, copied so the file and the class agree.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

SIZES: dict[str, dict[str, int]] = {
    "test": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2},
}

# ChatML with Qwen2.5-style tools. Differences from Qwen2.5: no default system prompt, tool
# call arguments may be a JSON string (OpenAI wire format) or an object, and list-of-parts
# content is joined. Tool results (role "tool") are grouped into one user turn of
# <tool_response> blocks, as Qwen2.5 does.
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is none -%}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}{%- elif part.text is defined -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
# The system turn when the request has tools: the JSON signatures, as Qwen2.5 renders them.
QWEN_TOOLS_HEADER = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
)
_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + render_content(message.content) }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_template(tools_header: str = QWEN_TOOLS_HEADER) -> str:
    """The ChatML template with `tools_header` deciding how a request's tools (and its system
    message) open the prompt: `{%- if tools %}…{%- elif messages[0].role == 'system' %}…
    {%- endif %}`. The tool-call track's model renders them shorter (clawrl/world/tools.py)."""
    return _CONTENT_MACRO + tools_header + _MESSAGES


CHAT_TEMPLATE = chat_template()

# Built-in text for `init`: enough variety that common words, digits, JSON and the chat
# markup get merges. The pretraining corpus (clawrl/world/pretrain.py) trains its own.
_SEED_TEXT = """\
The quick brown fox jumps over the lazy dog. A small town sits by the river, where people
walk to the market every morning. Alice likes tea, Bob prefers coffee, and Carol reads
books about the sea. What is the capital of the little world? It is called Harbor.
Please answer briefly. Thanks, that helps! Could you say it again in lowercase?
No, that is wrong: the library opens at 9 and closes at 17. Numbers: 0 1 2 3 4 5 6 7 8 9,
42, 3.14, 2026-12-02, 100%. Code: def f(x): return x * 2  # double it
Unicode: café, naïve, Straße, 東京, 😀, — “quotes” and ‘apostrophes’. Tabs\tand  spaces.
I'm sure you'll see we've done it; they'd say it's fine.
"""


def _seed_texts() -> list[str]:
    tool = {"type": "function", "function": {"name": "get_weather", "description":
            "Get the weather for a city", "parameters": {"type": "object", "properties":
            {"city": {"type": "string"}}, "required": ["city"]}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Harbor"}}\n</tool_call>'
    chat = (f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n"
            f"{IM_START}user\nHello! How are you?{IM_END}\n"
            f"{IM_START}assistant\nI am fine, thank you.{IM_END}\n"
            f"{IM_START}assistant\n{call}{IM_END}\n"
            f"{IM_START}user\n<tool_response>\nsunny, 21 degrees\n</tool_response>{IM_END}\n")
    # Deterministic filler sentences so the merges reach the full vocabulary size.
    words = re.findall(r"[A-Za-z]+", _SEED_TEXT.lower())
    filler = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}."
              for i in range(400)]
    return [_SEED_TEXT] * 4 + [chat] * 4 + [json.dumps(tool)] * 2 + filler


def train_tokenizer(texts: Iterable[str], vocab_size: int = 768) -> Tokenizer:
    """Train a byte-level BPE tokenizer with Qwen2's pre-tokenizer and normalizer.

    The special tokens get ids 0..2 (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`); the
    256 byte symbols follow, then merges up to `vocab_size` in total. Deterministic for the
    same texts.
    """
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def model_config(size: str, vocab_size: int) -> Any:
    """A Qwen2Config for `size` ("test" or "small"): tied embeddings, 4x FFN, GQA."""
    from transformers import Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    dims: dict[str, Any] = dict(SIZES[size])
    return Qwen2Config(
        vocab_size=vocab_size, intermediate_size=4 * dims["hidden_size"],
        max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT), use_cache=True,
        dtype="float32", **dims,
    )


def _tokenizer_config(template: str = CHAT_TEMPLATE) -> dict[str, Any]:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 2048,
        "split_special_tokens": False,
        "chat_template": template,
    }


def save_tokenizer(directory: Path, tokenizer: Tokenizer, template: str = CHAT_TEMPLATE) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(template), indent=2))
    (directory / "chat_template.jinja").write_text(template)


def save_model_dir(directory: str | Path, model: Any, tokenizer: Tokenizer,
                   template: str = CHAT_TEMPLATE) -> Path:
    """Save `model` (a transformers causal LM) and `tokenizer` as an HF model directory.

    Writes safetensors weights, config.json, generation_config.json (eos `<|im_end|>`) and
    the tokenizer files. Returns the directory.
    """
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=tokenizer.token_to_id(IM_END), pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        bos_token_id=None, do_sample=True, temperature=1.0, top_p=1.0,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(out, tokenizer, template)
    return out


def init_model_dir(directory: str | Path, *, seed: int = 0, size: str = "test") -> Path:
    """Build a randomly initialised tiny model with its tokenizer into `directory`.

    Writes into a sibling temp dir and renames it into place, so a reader never sees a half
    written model. An existing directory is replaced.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    out = Path(directory)
    tokenizer = train_tokenizer(_seed_texts(), vocab_size=768)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(size, tokenizer.get_vocab_size()))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(tmp, model, tokenizer)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
