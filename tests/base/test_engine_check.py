"""The start-up compatibility check (clawrl/base/engine_check.py) against the real embedded engine,
and against the same engine with one field removed from its answers (as an older SGLang)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from proxyharness import closed_port_url

from clawrl.base.engine_check import (
    JUDGE_NEEDS,
    PROXY_NEEDS,
    TRAINER_NEEDS,
    EngineIncompatible,
    check_engine,
)
from clawrl.base.engine_client import EngineClient


class Without(httpx.AsyncBaseTransport):
    """Forwards to the real engine and drops one field from its JSON answers (and chunks)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.inner = httpx.AsyncHTTPTransport()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def _strip(self, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: self._strip(v) for k, v in data.items() if k != self.field}
        if isinstance(data, list):
            return [self._strip(v) for v in data]
        return data

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        await response.aclose()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            lines = []
            for line in body.decode().split("\n"):
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    line = "data: " + json.dumps(self._strip(json.loads(line[5:])))
                lines.append(line)
            body = "\n".join(lines).encode()
        elif body.startswith(b"{"):
            body = json.dumps(self._strip(json.loads(body))).encode()
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-length"]
        return httpx.Response(response.status_code, headers=headers, content=body)


async def test_embedded_engine_meets_every_need(engine_url: str) -> None:
    async with EngineClient(engine_url) as client:
        assert await check_engine(client, (*PROXY_NEEDS, *JUDGE_NEEDS, *TRAINER_NEEDS))


@pytest.mark.parametrize(("field", "needs", "says"), [
    ("response_token_ids", PROXY_NEEDS, "choices[0].response_token_ids (return_token_ids) "
                                        "(SGLang 0.5.18 or later"),
    ("sglext", PROXY_NEEDS, "sglext.input_ids (return_input_ids_in_sglext) (SGLang 0.5.20"),
    ("weight_version", TRAINER_NEEDS, "/model_info answer has no weight_version (SGLang 0.5.4"),
    ("input_token_logprobs", JUDGE_NEEDS, "meta_info.input_token_logprobs"),
])
async def test_missing_field_is_named_with_the_release(engine_url: str, field: str,
                                                       needs: tuple[Any, ...], says: str) -> None:
    async with EngineClient(engine_url, transport=Without(field)) as client:
        with pytest.raises(EngineIncompatible) as caught:
            await check_engine(client, needs)
    message = str(caught.value)
    assert says in message and "\n" not in message


async def test_unreachable_engine_is_not_judged() -> None:
    async with EngineClient(closed_port_url(), timeout=2.0) as client:
        assert await check_engine(client, PROXY_NEEDS) is False


async def test_an_engine_that_does_not_answer_in_time_is_not_judged() -> None:
    """A busy engine (a stack's first probes queued ahead) is not an incompatible one: the
    judge exited at start on a timeout ("not compatible"), taking its stack down."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # accepts connections, never answers
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        async with EngineClient(url, timeout=httpx.Timeout(1.0, connect=2.0)) as client:
            assert await check_engine(client, JUDGE_NEEDS) is False


# An OpenAI-compatible server that is not SGLang enough (like an older release): chat answers
# without token ids, /model_info without a weight version, no /generate.
_OLD_ENGINE = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/model_info":
            return self._send(200, {"model_path": "old"})
        return self._send(200, {"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/chat/completions":
            return self._send(200, {"id": "c", "object": "chat.completion", "model": "old",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hi"}}]})
        return self._send(404, {"detail": "Not Found"})
    def log_message(self, *a): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_port, flush=True)
server.serve_forever()
"""


@pytest.fixture
def old_engine_url() -> Any:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _OLD_ENGINE], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{proc.stdout.readline().strip()}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize(("argv", "needle"), [
    (["proxy", "--port", "0"], "prompt_token_ids"),
    # (the teacher's prompt ids come from the chat route, so that is what it misses first)
    (["judge"], "prompt_token_ids"),
    (["train", "--once"], "weight_version"),
])
def test_each_process_refuses_to_start_on_an_engine_without_what_it_needs(
        argv: list[str], needle: str, old_engine_url: str, db_url: str,
        tiny_model_dir: Any) -> None:
    """`clawrl proxy | judge | train` each ask the engine once at start and exit 1 with one
    line naming what is missing, before serving or training anything."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CLAWRL_DATABASE__URL": db_url, "CLAWRL_ENGINE__URL": old_engine_url,
           "CLAWRL_TRAINER__MODEL": str(tiny_model_dir)}
    env.pop("CLAWRL_ENGINE__API_KEY", None)
    if argv[0] == "proxy":
        argv = [*argv, "--engine-url", old_engine_url]
    out = subprocess.run([sys.executable, "-m", "clawrl.cli.main", *argv], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"clawrl {argv[0]}: the engine at {old_engine_url}")
    assert needle in lines[0], lines[0]
