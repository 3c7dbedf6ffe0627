"""Every failure of a judge or teacher endpoint maps to the right judge error (and thus to
retry-with-backoff or recorded failure), table-driven through the real HTTP clients."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from clawrl.base.engine_client import EngineClient
from judge.backends import ChatBackend
from judge.errors import (
    BackendRejected,
    BackendUnavailable,
    BackendUnreachable,
    BadBackendResponse,
    JudgeError,
    PromptTooLong,
)
from judge.teacher import TeacherEngine

Fault = Callable[[httpx.Request], httpx.Response]


def raises(exc: Exception) -> Fault:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc
    return handler


def status(code: int, message: str = "nope") -> Fault:
    return lambda request: httpx.Response(code, json={"error": {"message": message}})


CASES: list[tuple[str, Fault, type[JudgeError], bool]] = [
    # No connection at all: an outage, which the worker does not count against the job.
    ("refused", raises(httpx.ConnectError("refused")), BackendUnreachable, True),
    ("connect timeout", raises(httpx.ConnectTimeout("no answer")), BackendUnreachable, True),
    ("timeout", raises(httpx.ReadTimeout("slow")), BackendUnavailable, True),
    ("dropped", raises(httpx.RemoteProtocolError("eof")), BackendUnavailable, True),
    ("429", status(429), BackendUnavailable, True),
    ("500", status(500), BackendUnavailable, True),
    ("503 busy", status(503), BackendUnavailable, True),
    ("401", status(401), BackendRejected, False),
    ("404 model", status(404, "model not found"), BackendRejected, False),
    ("400 too long", status(400, "The input (900 tokens) is longer than the model's "
                                 "context length (512 tokens)."), PromptTooLong, False),
    ("not json", lambda r: httpx.Response(200, text="<html>"), BadBackendResponse, True),
    ("no choices", lambda r: httpx.Response(200, json={"id": "x"}), BadBackendResponse, True),
]


@pytest.mark.parametrize(("name", "fault", "error", "transient"), CASES,
                         ids=[c[0] for c in CASES])
async def test_judge_backend_errors(name: str, fault: Fault, error: type[JudgeError],
                                    transient: bool) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fault)) as client:
        backend = ChatBackend(client, "http://judge.test/v1", model="m", api_key=None,
                              concurrency=1)
        with pytest.raises(error) as caught:
            await backend.complete([{"role": "user", "content": "x"}], temperature=0.6,
                                   max_tokens=8)
    assert type(caught.value) is error and caught.value.transient is transient


@pytest.mark.parametrize(("name", "fault", "error", "transient"),
                         [c for c in CASES if c[0] != "no choices"], ids=[
                             c[0] for c in CASES if c[0] != "no choices"])
async def test_teacher_engine_errors(name: str, fault: Fault, error: type[JudgeError],
                                     transient: bool) -> None:
    async with EngineClient("http://engine.test",
                            transport=httpx.MockTransport(fault)) as client:
        teacher = TeacherEngine(client, concurrency=1)
        with pytest.raises(error) as caught:
            await teacher.token_logprobs([1, 2, 3], [4, 5])
    assert type(caught.value) is error and caught.value.transient is transient
