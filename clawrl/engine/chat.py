"""`/v1/chat/completions` for the embedded engine, shaped like SGLang 0.5.x `serving_chat.py`.

The prompt is the model's chat template (or the requested LoRA adapter's own, when its folder
has one) rendered by `tokenizer.apply_chat_template` (tools included; for a template that cannot render tools, in the format of clawrl/engine/tools.py)
and encoded without added special tokens, or the request's own `input_ids`.
Token ids come back as `choices[].prompt_token_ids` / `response_token_ids`
(`return_token_ids`, non-stream only) or in a response-level `sglext` object
(`return_input_ids_in_sglext` / `return_output_ids_in_sglext` or the `x-sglext-return-*-ids: 1`
headers), which streaming sends as a last `choices: []` chunk before usage.

Every chunk and response carries `metadata.weight_version`. (SGLang 0.5.x puts `metadata` on
the non-stream response only; stream chunks here carry it as an extension a client of real
SGLang must not rely on.) Tool calls are parsed like SGLang's `qwen25` parser: JSON objects
between `<tool_call>` and `</tool_call>`; with tools, streamed text stops at `<tool_call>` and
the calls arrive whole in one delta before the `tool_calls` finish chunk.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from clawrl.engine.grammar import chat_spec, offered
from clawrl.engine.protocol import (
    ChatCompletionRequest,
    EngineError,
    check_bias_ids,
    check_sampling,
    engine_failure,
    sse_error,
)
from clawrl.engine.runtime import Engine
from clawrl.engine.scheduler import Sequence
from clawrl.engine.tools import render_tool_messages

Disconnected = Callable[[], Awaitable[bool]]
_ROLES = {"system", "developer", "user", "assistant", "tool"}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def normalise_message(i: int, message: Any) -> dict[str, Any]:
    """An OpenAI chat message as the chat template takes it (text parts joined, null content
    as "", tool-call arguments parsed); EngineError names the message and what is wrong."""
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        role = message.get("role") if isinstance(message, dict) else None
        raise EngineError(f"messages.{i}.role: unknown role {role!r} "
                          f"(expected one of {', '.join(sorted(_ROLES))})")
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                raise EngineError(f"messages.{i}.content: only text parts are supported")
        out["content"] = ("\n" if out["role"] != "tool" else " ").join(texts)
    elif not isinstance(content, str):
        raise EngineError(f"messages.{i}.content must be a string, a list of parts or null")
    calls = out.get("tool_calls")
    if out["role"] == "assistant" and calls:
        out["tool_calls"] = [_normalise_call(i, c) for c in calls]
    return out


def _normalise_call(i: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise EngineError(f"messages.{i}.tool_calls: each call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: deep nesting
            raise EngineError("Assistant tool call function.arguments must be valid JSON.") from exc
    if not isinstance(args, dict):
        raise EngineError("Assistant tool call function.arguments must be a JSON object.")
    return {**call, "function": {**fn, "arguments": args}}


def prompt_ids(engine: Engine, req: ChatCompletionRequest) -> list[int]:
    """Render and encode the prompt (or take `input_ids` as given)."""
    if req.input_ids is not None:
        return list(req.input_ids)
    if not req.messages:
        raise EngineError("Messages cannot be empty.")
    messages = [normalise_message(i, m) for i, m in enumerate(req.messages)]
    prefix = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        # SGLang: continue the final assistant message, or else treat it as a user turn.
        if req.continue_final_message:
            prefix = messages.pop()["content"]
        else:
            messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    tools: Any = offered(req.tools, req.tool_choice)
    if not engine.renders_tools and (tools or any(
            m.get("tool_calls") or m["role"] == "tool" for m in messages)):
        messages, tools = render_tool_messages(messages, tools), None
    # An adapter trained on prompts of its own template (the judge's) is served with it.
    template = engine.adapters.chat_template(req.lora_name(engine.served_model_name))
    try:
        text = engine.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            chat_template=template, **(req.chat_template_kwargs or {}))
    except Exception as exc:  # jinja errors in the template are the request's fault
        raise EngineError(f"cannot render the chat template: {exc}") from exc
    return engine.encode(str(text) + prefix)


def check_context(engine: Engine, n_prompt: int, max_new_tokens: int) -> None:
    if n_prompt == 0:
        raise EngineError("the prompt is empty")
    if n_prompt >= engine.context_len:
        raise EngineError(f"The input ({n_prompt} tokens) is longer than the model's context "
                          f"length ({engine.context_len} tokens).")
    if n_prompt + max_new_tokens > engine.context_len:
        raise EngineError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{engine.context_len} tokens. You requested a total of {n_prompt + max_new_tokens} "
            f"tokens: {n_prompt} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.")


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Split `text` into normal content and OpenAI tool calls (SGLang qwen25 detector)."""
    start = text.find(TOOL_OPEN)
    if start == -1:
        return text, []
    names = {t.get("function", {}).get("name") for t in tools}
    calls: list[dict[str, Any]] = []
    for match in _TOOL_RE.finditer(text, start):
        try:
            found = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        # One object per tag (Qwen2.5), or a list of them (SmolLM2's own format).
        for obj in found if isinstance(found, list) else [found]:
            if not isinstance(obj, dict) or obj.get("name") not in names:
                continue
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "index": len(calls),
                          "type": "function",
                          "function": {"name": obj["name"],
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
    return text[:start].strip(), calls


def visible_text(engine: Engine, seq: Sequence, *, final: bool) -> str:
    """The reply text so far: stop token/string trimmed, unfinished stops held back."""
    p, ids = seq.params, seq.output_ids
    if ids and (ids[-1] in engine.eos_ids or ids[-1] in p.stop_token_ids) and not p.no_stop_trim:
        ids = ids[:-1]
    text = engine.decode(ids, skip_special_tokens=p.skip_special_tokens)
    for stop in p.stop:
        cut = text.find(stop) if stop and not p.no_stop_trim else -1
        if cut != -1:
            text = text[:cut]
    if final:
        return text
    text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its next byte
    held = max((k for s in p.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


def _logprob_entries(engine: Engine, seq: Sequence, start: int, end: int) -> dict[str, Any]:
    content = []
    for i in range(start, end):
        token = engine.token_text(seq.output_ids[i])
        top = seq.output_top[i] if seq.top_logprobs_num > 0 else []
        content.append({
            "token": token, "bytes": list(token.encode()), "logprob": seq.output_logprobs[i],
            "top_logprobs": [{"token": engine.token_text(t), "bytes":
                              list(engine.token_text(t).encode()), "logprob": lp}
                             for lp, t in top],
        })
    return {"content": content}


def _metadata(seq: Sequence, engine: Engine) -> dict[str, Any]:
    spans = seq.weight_spans
    meta: dict[str, Any] = {"weight_version": spans[-1]["version"] if spans
                            else engine.weight_version}
    if len(spans) > 1:
        meta["weight_versions"] = spans
    return meta


def _usage(n_prompt: int, seq: Sequence) -> dict[str, Any]:
    n = len(seq.output_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
            "reasoning_tokens": 0}


def _finish(seq: Sequence, has_calls: bool) -> tuple[str, Any]:
    assert seq.finish is not None
    kind = seq.finish["type"]
    if has_calls and kind == "stop":
        return "tool_calls", None
    return kind, seq.finish.get("matched")


def _sglext(req: ChatCompletionRequest, ids: list[int], seq: Sequence) -> dict[str, Any] | None:
    ext: dict[str, Any] = {}
    if req.return_input_ids_in_sglext:
        ext["input_ids"] = ids
    if req.return_output_ids_in_sglext:
        ext["output_ids"] = [list(seq.output_ids)]
    return ext or None


def prepare(engine: Engine, req: ChatCompletionRequest, rid: str | None) -> Sequence:
    """Validate the request and build its Sequence (raises EngineError -> 400)."""
    req.refuse_unsupported()
    grammar = chat_spec(req.response_format, req.tools, req.tool_choice,
                        req.parallel_tool_calls)
    ids = prompt_ids(engine, req)
    if any(not 0 <= t < engine.vocab_size for t in ids):
        raise EngineError(f"input_ids must be in [0, {engine.vocab_size})")
    params = req.sampling(engine.generation_defaults)
    params.grammar = grammar
    if params.max_new_tokens < 0:
        params.max_new_tokens = max(engine.context_len - len(ids), 0)
    check_sampling(params)
    check_bias_ids(params, engine.vocab_size)
    check_context(engine, len(ids), params.max_new_tokens)
    return Sequence(rid=rid or f"chatcmpl-{uuid.uuid4().hex}", input_ids=ids, params=params,
                    return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                    lora_name=req.lora_name(engine.served_model_name))


async def complete(engine: Engine, req: ChatCompletionRequest, seq: Sequence,
                   disconnected: Disconnected | None = None) -> dict[str, Any]:
    """Run a non-streaming chat completion and build the response body."""
    await engine.run(seq, disconnected)
    if (failure := engine_failure(seq.finish)) is not None:
        raise failure
    text = visible_text(engine, seq, final=True)
    calls: list[dict[str, Any]] = []
    if req.tools and req.tool_choice != "none":
        text, calls = parse_tool_calls(text, req.tools)
    reason, matched = _finish(seq, bool(calls))
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "reasoning_content": None,
                    "tool_calls": calls or None},
        "logprobs": _logprob_entries(engine, seq, 0, len(seq.output_ids)) if req.logprobs
        else None,
        "finish_reason": reason, "matched_stop": matched,
    }
    if req.return_token_ids or req.return_prompt_token_ids:
        choice["prompt_token_ids"] = seq.input_ids
    if req.return_token_ids:
        choice["response_token_ids"] = list(seq.output_ids)
    body: dict[str, Any] = {
        "id": seq.rid, "object": "chat.completion", "created": int(time.time()),
        "model": req.model, "choices": [choice], "usage": _usage(len(seq.input_ids), seq),
        "metadata": _metadata(seq, engine),
    }
    ext = _sglext(req, seq.input_ids, seq)
    if ext:
        body["sglext"] = ext
    return body


async def stream(engine: Engine, req: ChatCompletionRequest, seq: Sequence,
                 disconnected: Disconnected | None = None) -> AsyncIterator[str]:
    """SSE chunks for a streaming chat completion, pushed as tokens are sampled."""
    created = int(time.time())
    with_tools = bool(req.tools and req.tool_choice != "none")

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": seq.rid, "object": "chat.completion.chunk", "created": created,
                "model": req.model, "choices": choices, "metadata": _metadata(seq, engine),
                **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(d: dict[str, Any], start: int, end: int) -> str:
        logprobs = _logprob_entries(engine, seq, start, end) if req.logprobs and end > start \
            else None
        return chunk([{"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": None}])

    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}])
    sent_text, sent_tokens = "", 0
    async for _ in engine.generate(seq, disconnected):
        if (failure := engine_failure(seq.finish)) is not None:
            yield sse_error(failure)
            yield "data: [DONE]\n\n"
            return
        final = seq.finish is not None
        end = len(seq.output_ids)
        text = visible_text(engine, seq, final=final)
        if with_tools:
            cut = text.find(TOOL_OPEN)
            if cut != -1:
                text = text[:cut]
            elif not final:
                text = text[: len(text) - max((k for k in range(1, len(TOOL_OPEN))
                                               if text.endswith(TOOL_OPEN[:k])), default=0)]
        new = text[len(sent_text):] if text.startswith(sent_text) else ""
        if new or (req.logprobs and end > sent_tokens):
            yield delta({"content": new} if new else {}, sent_tokens, end)
            sent_text, sent_tokens = sent_text + new, end
    calls: list[dict[str, Any]] = []
    if with_tools:
        _, calls = parse_tool_calls(visible_text(engine, seq, final=True), req.tools or [])
        if calls:
            yield delta({"tool_calls": calls}, 0, 0)
    reason, matched = _finish(seq, bool(calls))
    yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason,
                  "matched_stop": matched}])
    ext = _sglext(req, seq.input_ids, seq)
    if ext:  # SGLang's ChatCompletionStreamResponse writes its unset usage as null here
        yield chunk([], usage=None, sglext=ext)
    if (req.stream_options or {}).get("include_usage"):
        yield chunk([], usage=_usage(len(seq.input_ids), seq))
    yield "data: [DONE]\n\n"
