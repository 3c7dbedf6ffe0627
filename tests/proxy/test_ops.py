"""Operations: readiness while the engine is busy or down, the `clawrl proxy` CLI's errors,
and how streamed tool-call deltas are merged for the turn log."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from proxyharness import ProxyFactory, chunk, closed_port_url

from proxy.sse import StreamCollector, client_chunk, iter_data


async def test_readyz_busy_engine_is_ready_down_is_not(
        proxy_factory: ProxyFactory, engine_factory: object, tiny_model_dir: object) -> None:
    engine = engine_factory(tiny_model_dir)  # type: ignore[operator]
    busy = await proxy_factory(engine)
    down = await proxy_factory(closed_port_url())
    async with httpx.AsyncClient() as http:
        assert (await http.post(f"{engine}/pause_generation", json={"mode": "abort"},
                                timeout=30)).status_code == 200
        assert (await http.get(f"{engine}/health", timeout=30)).status_code == 503
        ready = await http.get(f"{busy.url}/readyz")
        assert ready.status_code == 200 and ready.json()["engine"] == "busy"
        await http.post(f"{engine}/continue_generation", json={}, timeout=30)
        not_ready = await http.get(f"{down.url}/readyz")
        assert not_ready.status_code == 503 and not_ready.json()["engine"] == "down"
        assert (await http.get(f"{down.url}/healthz")).status_code == 200


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--engine-url", "not a url"], {}, "invalid engine URL"),
    ([], {"CLAWRL_DATABASE__URL": "nosuchdb://x/y"}, "bad database URL"),
    ([], {"CLAWRL_DATABASE__URL": "::::"}, "bad database URL"),
    ([], {"CLAWRL_PROXY__PORT": "abc"}, "bad setting proxy.port"),
])
def test_cli_bad_input_is_one_line(args: list[str], env: dict[str, str],
                                   expected: str) -> None:
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "proxy", *args],
                          capture_output=True, text=True, timeout=60, env={"PATH": "", **env})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0]


def test_stream_collector_merges_tool_call_deltas() -> None:
    collector = StreamCollector()
    deltas = [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                         "function": {"name": "time", "arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
    ]
    for delta in deltas:
        event = chunk()
        event["choices"][0]["delta"] = delta
        collector.add(event)
    collector.add(chunk(finish="tool_calls"))
    collector.add({"choices": [], "sglext": {"input_ids": [1, 2], "output_ids": [[3, 4, 5]]}})
    message = collector.message()
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
    assert collector.finish_reason == "tool_calls"
    assert (collector.prompt_ids, collector.response_ids) == ([1, 2], [3, 4, 5])


def test_client_chunks_drop_proxy_only_fields() -> None:
    assert client_chunk({"choices": [], "sglext": {"input_ids": [1]}},
                        wants_logprobs=False) is None
    out = client_chunk(chunk("a", logprob=-1.0), wants_logprobs=False)
    assert out is not None and out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert json.loads(out[6:])["choices"][0]["logprobs"] is None
    kept = client_chunk(chunk("a", logprob=-1.0), wants_logprobs=True)
    assert kept is not None
    assert json.loads(kept[6:])["choices"][0]["logprobs"]["content"][0]["logprob"] == -1.0


async def test_sse_parsing_groups_by_read_and_handles_framing() -> None:
    class Pieces(httpx.AsyncByteStream):
        async def __aiter__(self):  # type: ignore[no-untyped-def,override]
            yield b'data: {"a": 1}\n\ndata: {"b": 2}\n\nda'  # two events and a partial one
            yield b'ta: {"c": 3}\r\n\r\n: comment\n\n'  # CRLF framing, a comment
            yield b'event: sglext_ids\ndata: {"d":\ndata: 4}\n\ndata: [DONE]\n\n'

    response = httpx.Response(200, stream=Pieces())
    groups = [group async for group in iter_data(response)]
    assert groups == [[b'{"a": 1}', b'{"b": 2}'], [b'{"c": 3}'], [b'{"d":\n4}', b"[DONE]"]]
