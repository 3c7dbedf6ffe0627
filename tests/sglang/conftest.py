"""SGLang's own serving code over HTTP (tests/sglang/sglang_app.py), for the contract tests.

Skipped, with the reason, when SGLang's serving layer is not installed (`make install` installs
it: deploy/sglang-contract.txt). SGLang is only ever imported in the server's own process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from childproc import ChildServer
from proxyharness import ProxyFactory, RunningProxy, serve

from clawrl.base.settings import load_settings
from proxy.app import create_app

APP = Path(__file__).with_name("sglang_app.py")

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - depends on the install
    pytest.skip("SGLang's serving layer is not installed (make install puts it in .venv: "
                "pip install --no-deps -r deploy/sglang-contract.txt)", allow_module_level=True)


class SGLangServer(ChildServer):
    """One `sglang_app.py` child serving SGLang's routes over `scheduler` (a clawrl engine)."""

    def __init__(self, model_dir: Path, scheduler: str, log_path: Path, version: str) -> None:
        super().__init__("sglang_app", [sys.executable, str(APP), "--model", str(model_dir),
                                        "--scheduler", scheduler, "--port", "{port}",
                                        "--weight-version", version],
                         log_path, ready_path="/model_info", poll_s=0.5,
                         env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        super().wait_ready(timeout_s)


@pytest.fixture(scope="session")
def sglang_url(tiny_model_dir: Path, engine_url: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SGLang's routes over the shared engine (same model, same weight version label)."""
    server = SGLangServer(tiny_model_dir, engine_url,
                          tmp_path_factory.mktemp("sglang") / "sglang.log", "default")
    try:
        server.wait_ready()
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def sglang_factory(tmp_path: Path) -> Iterator[Callable[[Path, str], str]]:
    """Private SGLang servers over a given engine: `sglang_factory(model_dir, engine_url)`."""
    started: list[SGLangServer] = []

    def start(model_dir: Path, scheduler: str) -> str:
        server = SGLangServer(model_dir, scheduler, tmp_path / f"sglang{len(started)}.log",
                              "default")
        started.append(server)
        server.wait_ready()
        return server.url

    yield start
    for server in started:
        server.stop()


@pytest.fixture
async def proxy_factory(db_url: str, tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    """The real proxy app under uvicorn: `await proxy_factory(engine_url)` (as tests/proxy/)."""
    stack = contextlib.AsyncExitStack()

    async def start(engine_url: str) -> RunningProxy:
        settings = load_settings(
            state_dir=tmp_path, proxy={"journal_path": tmp_path / "journal.jsonl"},
            engine={"url": engine_url, "read_timeout_s": 120, "connect_timeout_s": 2})
        app = create_app(settings, db_url=db_url)
        url = await stack.enter_async_context(serve(app))
        return RunningProxy(url, app)

    async with stack:
        yield start
