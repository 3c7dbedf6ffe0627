"""`POST /v1/responses`: the OpenAI Responses API, served by the chat path.

A Responses request is translated into a chat completions body (`to_chat`) and then goes
exactly the way a chat request goes (`ResponsesEndpoint` is proxy/chat.py's endpoint with
another `parse`): the same auth, fair share, engine call and adapter, the same turn record
with chat-shaped `request_messages`, so sessions are inferred, judged and trained the same.
The engine's chat reply is rendered back as a `response` object (`ResponsesShape.whole`)
or, streamed, as the Responses event sequence (`ResponsesRenderer`).

Stateless: the proxy keeps no response objects, so `previous_response_id`, `conversation`,
`item_reference` input items and `background` are refused; the client sends the whole
conversation in `input` each time (what `store: false` clients do anyway). Only function
tools are served (no built-in tools: web search, file search, code interpreter, ...), and
only text (no images, files or audio).

Translation (request):

    instructions                         -> a leading system message
    input: "text"                        -> one user message
    {role, content} / {type: message}    -> a message of that role (text parts joined)
    {type: function_call}                -> a tool call of the assistant message before it
                                            (or of a new assistant message)
    {type: function_call_output}         -> a tool message (tool_call_id = call_id)
    {type: reasoning}                    -> dropped (reasoning is never replayed)
    tools [{type: function, name, ...}]  -> chat tools [{type: function, function: {...}}]
    tool_choice {type: function, name}   -> {type: function, function: {name}}
    max_output_tokens                    -> max_tokens
    text.format json_schema/json_object  -> response_format
    reasoning.effort                     -> reasoning_effort

Reply: one `message` output item (`output_text`) when the reply has text or no tool
calls, then one `function_call` item per tool call; `status` is `incomplete`, with
`incomplete_details.reason = max_output_tokens`, when generation stopped at the token limit.
Ids are derived from the turn's id: `resp_<turn uid hex>`, `msg_…`, `fc_…`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clawrl.base.errors import BadRequest, ClawrlError
from proxy.chat import ChatEndpoint, ChatTurn
from proxy.openai_types import (
    ChatCompletionRequest,
    FunctionDef,
    Temperature,
    TopP,
    describe_error,
    load_body,
    validate_chat_body,
)
from proxy.sse import StreamCollector
from proxy.upstream import EngineReply

RESPONSES_PATH = "/v1/responses"
_INT64 = 2**63 - 1

_NOT_STORED = ("the proxy stores no response objects; send the whole conversation in "
               "'input' (as with store: false)")
# Top-level fields refused with a reason (when present and not null / false).
_REFUSED = {
    "previous_response_id": _NOT_STORED,
    "conversation": _NOT_STORED,
    "prompt": "stored prompts are not supported",
    "background": "background responses are not supported",
    "context_management": "server-side compaction is not supported",
}
_TEXT_ONLY = "the served model reads text only (no images, files or audio)"
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_TOOL_CHOICES = ("none", "auto", "required")
_EFFORTS: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low",
                                   "medium": "medium", "high": "high", "xhigh": "high"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Strict):
    """The accepted fields of a Responses request (anything else is a 400 naming it)."""

    model: str | None = Field(default=None, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=_INT64)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    background: Literal[False] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    service_tier: str | None = Field(default=None, max_length=64)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None


def _bad(message: str, param: str, code: str = "invalid_request") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _unsupported_keys(item: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    for key in item:
        if key not in allowed:
            raise _bad(f"Unsupported parameter: '{where}.{key}' is not accepted.",
                       f"{where}.{key}", "unsupported_parameter")


def _string(item: dict[str, Any], key: str, where: str, *, required: bool = True,
            max_length: int | None = None) -> str:
    value = item.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise _bad(f"'{where}.{key}' must be a string." if value is not None
                   else f"'{where}.{key}' is a required property", f"{where}.{key}")
    if max_length is not None and len(value) > max_length:
        raise _bad(f"Invalid value for '{where}.{key}': at most {max_length} characters.",
                   f"{where}.{key}")
    return value


def _texts(content: Any, where: str) -> list[str]:
    """The texts of a content value (a string, or a list of text parts); 400 for media."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or a list of content parts.", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if not isinstance(part, dict):
            raise _bad(f"'{at}' must be an object.", at)
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            raise _bad(f"Unsupported content type {kind!r} in '{at}.type': {_TEXT_ONLY}.",
                       f"{at}.type", "unsupported_content")
        if kind == "refusal":
            _unsupported_keys(part, frozenset({"type", "refusal"}), at)
            texts.append(_string(part, "refusal", at))
            continue
        if kind not in _TEXT_PARTS:
            raise _bad(f"Invalid value for '{at}.type': expected 'input_text' or "
                       f"'output_text', got {kind!r}.", f"{at}.type")
        _unsupported_keys(part, _PART_KEYS, at)
        texts.append(_string(part, "text", at))
    return texts


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Chat content: one text as a string, several as text parts."""
    texts = _texts(content, where)
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": text} for text in texts]


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (see the module's table); BadRequest names
    the offending item as `input.<i>…`."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(f"'{where}' must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _unsupported_keys(item, _MESSAGE_KEYS, where)
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise _bad(f"Invalid value for '{where}.role': expected one of "
                           f"{', '.join(_MESSAGE_ROLES)}, got {role!r}.", f"{where}.role")
            if "content" not in item:
                raise _bad(f"'{where}.content' is a required property", f"{where}.content")
            messages.append({"role": role, "content": _content(item["content"],
                                                               f"{where}.content")})
        elif kind == "function_call":
            _unsupported_keys(item, _CALL_KEYS, where)
            call = {"id": _string(item, "call_id", where, max_length=256), "type": "function",
                    "function": {"name": _string(item, "name", where, max_length=256),
                                 "arguments": _string(item, "arguments", where,
                                                      required=False)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _unsupported_keys(item, _OUTPUT_KEYS, where)
            call_id = _string(item, "call_id", where, max_length=256)
            if "output" not in item:
                raise _bad(f"'{where}.output' is a required property", f"{where}.output")
            output = "".join(_texts(item["output"], f"{where}.output"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # never replayed to the model (as chat clients drop reasoning_content)
        elif kind == "item_reference":
            raise _bad(f"Unsupported input item in '{where}': 'item_reference': {_NOT_STORED}.",
                       f"{where}.type", "unsupported_input")
        else:
            raise _bad(f"Unsupported input item type {kind!r} in '{where}.type': the proxy "
                       f"accepts messages, function_call and function_call_output items.",
                       f"{where}.type", "unsupported_input")
    return messages


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools (name, description, parameters at the top level) as chat
    tools; any other tool type is a 400."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"Unsupported tool type {kind!r} in '{where}.type': only function "
                       f"tools are served (the proxy runs no built-in tools such as "
                       f"web_search, file_search or code_interpreter).", f"{where}.type",
                       "unsupported_tool")
        fields = {k: v for k, v in tool.items() if k != "type"}
        try:
            function = FunctionDef.model_validate(fields)
        except ValidationError as exc:
            message, param, code = describe_error(exc, prefix=where)
            raise BadRequest(message, param=param, code=code) from exc
        out.append({"type": "function",
                    "function": function.model_dump(exclude_none=True)})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice in _TOOL_CHOICES:
            return choice
    elif choice.get("type") == "function":
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name and set(choice) <= {"type", "name", "function"}:
            return {"type": "function", "function": {"name": name}}
    raise _bad("Unsupported value for 'tool_choice': expected 'none', 'auto', 'required' or "
               "{\"type\": \"function\", \"name\": …} (there are no built-in tools).",
               "tool_choice", "unsupported_tool_choice")


def response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema" and set(fmt) <= {"type", "name", "schema", "strict",
                                               "description"}:
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                       if k != "type"}}
    raise _bad("Unsupported value for 'text.format': expected a 'text', 'json_object' or "
               "'json_schema' format.", "text.format")


def to_chat(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body a Responses request asks for."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        if not request.input:
            raise _bad("'input' must contain at least one item.", "input")
        messages.extend(input_messages(request.input))
    if not any(m["role"] not in ("system", "developer") for m in messages):
        raise _bad("'input' must contain at least one message that is not a system or "
                   "developer message.", "input")
    body: dict[str, Any] = {"messages": messages}
    if request.model:
        body["model"] = request.model
    if request.tools:
        body["tools"] = chat_tools(request.tools)
    if request.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(request.tool_choice)
    for name in ("parallel_tool_calls", "temperature", "top_p", "user"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.text is not None and request.text.format is not None:
        fmt = response_format(request.text.format)
        if fmt is not None:
            body["response_format"] = fmt
    if request.reasoning is not None and request.reasoning.effort is not None:
        effort = _EFFORTS[request.reasoning.effort]
        if effort is not None:
            body["reasoning_effort"] = effort
    if request.stream:
        body["stream"] = True
    return body


def parse_responses_request(raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest,
                                                  ResponsesRequest]:
    """The chat body a Responses request translates to, its validated chat view and the
    validated Responses request; or BadRequest (OpenAI-shaped, naming the field)."""
    body = load_body(raw)
    # null means "not given" (SDKs send it for unset options); background: false too.
    body = {k: v for k, v in body.items()
            if v is not None and not (k == "background" and v is False)}
    for name, why in _REFUSED.items():
        if name in body:
            raise _bad(f"Unsupported parameter: '{name}' is not accepted: {why}.", name,
                       "unsupported_parameter")
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        message, param, code = describe_error(exc)
        raise BadRequest(message, code=code, param=param) from exc
    chat = to_chat(request)
    return chat, validate_chat_body(chat), request


def _item_ids(uid: str) -> str:
    return uuid.UUID(uid).hex


def response_id(uid: str) -> str:
    """The Responses id of a turn: `resp_` and its uid in hex."""
    return f"resp_{_item_ids(uid)}"


def message_item(uid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{_item_ids(uid)}", "status": status,
            "role": "assistant", "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(uid: str, index: int, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{_item_ids(uid)}_{index}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def call_id_of(uid: str, index: int, call: dict[str, Any]) -> str:
    given = call.get("id")
    return given if isinstance(given, str) and given else f"call_{_item_ids(uid)}_{index}"


def _arguments(raw: Any) -> str:
    return raw if isinstance(raw, str) else orjson.dumps(raw).decode()


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return content or ""


def output_items(uid: str, message: dict[str, Any], *, incomplete: bool) -> list[dict[str, Any]]:
    """A chat reply message as Responses output items: the text (when there is some, or
    nothing else), then the tool calls."""
    status = "incomplete" if incomplete else "completed"
    text, calls = _message_text(message), message.get("tool_calls") or []
    items = [message_item(uid, text, status)] if text or not calls else []
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        items.append(call_item(uid, i, call_id_of(uid, i, call), str(function.get("name") or ""),
                               _arguments(function.get("arguments") or ""), "completed"))
    return items


def usage(reply: EngineReply) -> dict[str, Any]:
    """Responses usage: the token ids the engine reported (exact), else its usage."""
    reported = reply.usage or {}
    given_in, given_out = reported.get("prompt_tokens"), reported.get("completion_tokens")
    inputs = len(reply.prompt_ids) if reply.prompt_ids is not None else int(given_in or 0)
    outputs = len(reply.response_ids) if reply.response_ids is not None else int(given_out or 0)
    return {"input_tokens": inputs,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": outputs, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inputs + outputs}


@dataclass
class ResponsesShape:
    """A Responses client's view of the reply: a `response` object, or its events."""

    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, turn: ChatTurn, *, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
        request = self.request
        fmt = (request.text.format if request.text is not None else None) or {"type": "text"}
        effort = request.reasoning.effort if request.reasoning is not None else None
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": response_id(turn.uid), "object": "response", "created_at": self.created_at,
            "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": turn.served_model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": effort, "summary": None},
            "store": False, "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": fmt}, "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [], "truncation": request.truncation or "disabled",
            "usage": usage if done else None, "user": request.user,
            "metadata": request.metadata or {},
        }

    def whole(self, turn: ChatTurn, data: dict[str, Any], reply: EngineReply) -> bytes:
        incomplete = reply.finish_reason == "length"
        return orjson.dumps(self.response(
            turn, status="incomplete" if incomplete else "completed",
            output=output_items(turn.uid, reply.message, incomplete=incomplete),
            usage=usage(reply)))

    def renderer(self, turn: ChatTurn) -> ResponsesRenderer:
        return ResponsesRenderer(self, turn)


@dataclass
class _Call:
    output_index: int
    call_id: str
    name: str


class ResponsesRenderer:
    """Engine chat chunks as the Responses event stream: `response.created`,
    `response.in_progress`, then per output item `response.output_item.added`, its
    content (`response.content_part.added`, `response.output_text.delta`… for text;
    `response.function_call_arguments.delta`… for a tool call) and, at the end, its `…done`
    events, then `response.completed` (or `response.incomplete` at the token limit) with
    the whole response and usage. A failed stream ends with an `error` event and
    `response.failed`. Every event carries its `sequence_number`."""

    def __init__(self, shape: ResponsesShape, turn: ChatTurn) -> None:
        self.shape, self.turn = shape, turn
        self.seq = 0
        self.items = 0  # output items opened so far
        self.text_index: int | None = None
        self.calls: dict[int, _Call] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _response(self, status: str, output: list[dict[str, Any]] | None = None,
                  reply: EngineReply | None = None, error: dict[str, Any] | None = None,
                  ) -> dict[str, Any]:
        return self.shape.response(self.turn, status=status, output=output or [],
                                   usage=usage(reply) if reply is not None else None,
                                   error=error)

    def start(self) -> bytes:
        response = self._response("in_progress")
        return (self._event("response.created", response=response)
                + self._event("response.in_progress", response=response))

    def _open_text(self) -> bytes:
        self.text_index, self.items = self.items, self.items + 1
        item = message_item(self.turn.uid, "", "in_progress")
        item["content"] = []
        return (self._event("response.output_item.added", output_index=self.text_index,
                            item=item)
                + self._event("response.content_part.added", item_id=item["id"],
                              output_index=self.text_index, content_index=0,
                              part=text_part("")))

    def chunk(self, chunk: dict[str, Any]) -> bytes | None:
        out: list[bytes] = []
        uid = self.turn.uid
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self.text_index is None:
                    out.append(self._open_text())
                out.append(self._event(
                    "response.output_text.delta", item_id=f"msg_{_item_ids(uid)}",
                    output_index=self.text_index, content_index=0, delta=text, logprobs=[]))
            for raw in delta.get("tool_calls") or []:
                index = int(raw.get("index") or 0)
                function = raw.get("function") or {}
                call = self.calls.get(index)
                if call is None:
                    call = self.calls[index] = _Call(self.items, call_id_of(uid, index, raw),
                                                     str(function.get("name") or ""))
                    self.items += 1
                    out.append(self._event(
                        "response.output_item.added", output_index=call.output_index,
                        item=call_item(uid, index, call.call_id, call.name, "",
                                       "in_progress")))
                if function.get("arguments"):
                    out.append(self._event(
                        "response.function_call_arguments.delta",
                        item_id=f"fc_{_item_ids(uid)}_{index}",
                        output_index=call.output_index, delta=function["arguments"]))
        return b"".join(out) or None

    def end(self, collector: StreamCollector, failure: ClawrlError | None) -> bytes:
        reply = collector.reply()
        uid = self.turn.uid
        if failure is not None:
            error = {"code": "server_error", "message": failure.message}
            return (self._event("error", code=failure.code, message=failure.message,
                                param=None)
                    + self._event("response.failed",
                                  response=self._response("failed", reply=reply, error=error)))
        incomplete = reply.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        out: list[bytes] = []
        if self.text_index is None and not self.calls:
            out.append(self._open_text())  # an empty reply is an empty message
        # Per output item: its closing events (kind, fields), then its output_item.done.
        closing: dict[int, tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]] = {}
        if self.text_index is not None:
            item = message_item(uid, "".join(collector.content), status)
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": self.text_index,
                     "content_index": 0}
            closing[self.text_index] = (item, [
                ("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {**where, "part": part})])
        for index, call in self.calls.items():
            merged = (collector.tool_calls.get(index) or {}).get("function") or {}
            arguments = str(merged.get("arguments") or "")
            item = call_item(uid, index, call.call_id, call.name or str(merged.get("name") or ""),
                             arguments, "completed")
            closing[call.output_index] = (item, [(
                "response.function_call_arguments.done",
                {"item_id": item["id"], "output_index": call.output_index,
                 "arguments": arguments})])
        done: dict[int, dict[str, Any]] = {}
        for index in sorted(closing):
            item, events = closing[index]
            out.extend(self._event(kind, **fields) for kind, fields in events)
            out.append(self._event("response.output_item.done", output_index=index, item=item))
            done[index] = item
        output = [done[i] for i in sorted(done)]
        kind = "response.incomplete" if incomplete else "response.completed"
        out.append(self._event(kind, response=self._response(status, output, reply)))
        return b"".join(out)


class ResponsesEndpoint(ChatEndpoint):
    """`POST /v1/responses`: proxy/chat.py's endpoint over a translated request."""

    def parse(self, raw: bytes) -> tuple[dict[str, Any], ChatCompletionRequest,
                                         ResponsesShape, dict[str, Any]]:
        body, chat, request = parse_responses_request(raw)
        extra: dict[str, Any] = {"api": "responses"}
        if request.metadata:
            extra["metadata"] = request.metadata
        return body, chat, ResponsesShape(request), extra

    def tokens_field(self, chat: ChatCompletionRequest) -> str:
        return "max_output_tokens"
