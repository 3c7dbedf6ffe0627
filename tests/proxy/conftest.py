"""Fixtures for the proxy's chat-path tests (helpers live in proxyharness.py).

`proxy_factory(engine_url, **proxy_settings)` starts `create_app(...)` under uvicorn on a
free port inside the test's event loop and returns a `RunningProxy`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import ProxyFactory, RunningProxy, serve

from clawrl.base.settings import load_settings
from proxy.app import create_app


@pytest.fixture
async def proxy_factory(db_url: str, tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    """`await proxy_factory(engine_url, db_url=..., transport=..., **proxy_settings)`."""
    stack = contextlib.AsyncExitStack()

    async def start(engine_url: str, *, db_url_override: str | None = None,
                    transport: httpx.AsyncBaseTransport | None = None,
                    read_timeout_s: float = 60.0, **proxy: Any) -> RunningProxy:
        proxy.setdefault("journal_path", tmp_path / "journal.jsonl")
        settings = load_settings(
            state_dir=tmp_path, proxy=proxy,
            engine={"url": engine_url, "read_timeout_s": read_timeout_s, "connect_timeout_s": 2})
        app = create_app(settings, db_url=db_url_override or db_url, engine_transport=transport)
        url = await stack.enter_async_context(serve(app))
        return RunningProxy(url, app)

    async with stack:
        yield start
