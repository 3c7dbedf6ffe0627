"""Fixtures for the console's tests: the real proxy app under uvicorn with an admin key,
real Postgres, and an httpx client that signs in through the sign-in form like a browser.
Rows to look at come from consoleseed.py.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from proxyharness import closed_port_url, serve

from clawrl.base.settings import load_settings
from proxy.app import create_app

ADMIN_KEY = "ck-admin-console-test-key"


@dataclass
class Console:
    url: str
    app: Any
    db_url: str

    def client(self) -> httpx.AsyncClient:
        # Origin as a browser sends it with a form: the console's own.
        return httpx.AsyncClient(base_url=self.url, follow_redirects=False, timeout=30.0,
                                 headers={"Origin": self.url})

    @contextlib.asynccontextmanager
    async def signed_in(self) -> AsyncIterator[httpx.AsyncClient]:
        async with self.client() as client:
            await self.sign_in(client)
            yield client

    async def sign_in(self, client: httpx.AsyncClient) -> None:
        page = await client.get("/console/login")
        token = re.search(r'name="token" value="([^"]+)"', page.text)
        assert token is not None, page.text
        resp = await client.post("/console/login", data={"token": token.group(1),
                                                        "admin_key": ADMIN_KEY, "next": ""})
        assert resp.status_code == 303, resp.text


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html[:2000]
    return found.group(1)


ConsoleFactory = Callable[..., Awaitable[Console]]


@pytest.fixture
async def console_factory(db_url: str, tmp_path: Path) -> AsyncIterator[ConsoleFactory]:
    stack = contextlib.AsyncExitStack()

    async def start(engine_url: str | None = None, *, admin_key: str | None = ADMIN_KEY,
                    **proxy: Any) -> Console:
        proxy.setdefault("journal_path", tmp_path / "journal")
        if admin_key is not None:
            proxy["admin_key"] = admin_key
        settings = load_settings(state_dir=tmp_path, proxy=proxy, engine={
            "url": engine_url or closed_port_url(), "connect_timeout_s": 2})
        app = create_app(settings, db_url=db_url)
        url = await stack.enter_async_context(serve(app))
        return Console(url, app, db_url)

    async with stack:
        yield start


@pytest.fixture
async def console(console_factory: ConsoleFactory) -> Console:
    return await console_factory()
