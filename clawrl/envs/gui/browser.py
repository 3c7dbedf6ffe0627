"""Headless Chromium for the GUI track (Debian's /usr/bin/chromium driven by Playwright; a
downloaded browser is never used). One host per process: a thread with its own event loop
holds Playwright and its browsers, so they outlive any one episode's (or `asyncio.run`'s)
loop and are reused; each episode gets a fresh browser context (its own cookies, storage and
page) on the browser with the fewest live ones. Callers await `host.run(coro)` from any loop.

    host = browser_host()
    tab = await host.run(host.open(url))
    snap = await host.run(tab.snapshot())
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         # the apps are served on 127.0.0.1; no other host resolves
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
VIEWPORT = {"width": 800, "height": 600}
WALK_JS = Path(__file__).with_name("walk.js").read_text()
SETTLE_JS = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
T = TypeVar("T")


def browser_missing() -> str | None:
    """What is missing to run the browser, in words, or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} (apt-get install -y chromium)"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright package (pip install playwright; never `playwright install`)"
    return None


class Tab:
    """One episode's browser context and page; its methods run on the host's loop."""

    def __init__(self, context: Any, page: Any, browser: int) -> None:
        self.context, self.page, self.browser = context, page, browser

    async def snapshot(self) -> dict[str, Any]:
        """The page walked (clawrl/envs/gui/walk.js): title, size, scroll, elements."""
        snap: dict[str, Any] = await self.page.evaluate(WALK_JS)
        return snap

    async def state(self) -> Any:
        """The application's own state (window.app.state), None when there is none."""
        return await self.page.evaluate("() => window.app ? window.app.state : null")

    async def center(self, gid: int) -> tuple[float, float] | None:
        box = await self.page.evaluate(
            "(g) => { const el = document.querySelector(`[data-gid=\"${g}\"]`);"
            " if (!el) return null; const r = el.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; }", gid)
        return None if box is None else (box[0], box[1])

    async def click_at(self, x: float, y: float) -> None:
        await self.page.mouse.click(x, y)

    async def fill(self, gid: int, text: str) -> bool:
        """Focus the field, select its text and type over it (one input event, as a paste);
        no actionability waits, which a loaded machine can push past any timeout. False when
        the element is gone."""
        found = await self.page.evaluate(
            "(g) => { const el = document.querySelector(`[data-gid=\"${g}\"]`);"
            " if (!el) return false; el.focus(); if (el.select) el.select(); return true; }", gid)
        if found:
            if text:
                await self.page.keyboard.insert_text(text)
            else:
                await self.page.keyboard.press("Delete")
        return bool(found)

    async def press(self, key: str) -> None:
        await self.page.keyboard.press(key)

    async def scroll(self, dx: float, dy: float) -> None:
        await self.page.mouse.move(VIEWPORT["width"] / 2, VIEWPORT["height"] / 2)
        await self.page.mouse.wheel(dx, dy)
        await self.page.wait_for_timeout(50)  # the wheel scrolls asynchronously

    async def settle(self) -> None:
        """Two animation frames: the app's handlers have run and the page has laid out."""
        await self.page.evaluate(SETTLE_JS)

    async def screenshot(self, path: str) -> None:
        await self.page.screenshot(path=path)


class BrowserHost:
    """Playwright and `browsers` Chromium processes on a thread of their own."""

    def __init__(self, browsers: int = 1) -> None:
        self.size = browsers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="clawrl-gui-browsers",
                                       daemon=True)
        self.thread.start()
        self.playwright: Any = None
        self.browsers: list[Any] = []
        self.live: list[int] = []  # open contexts per browser
        self._started: asyncio.Future[None] | None = None

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the host's loop; awaitable from any other loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _start(self) -> None:
        if self._started is None:
            self._started = self.loop.create_future()
            try:
                missing = browser_missing()
                if missing:
                    raise RuntimeError(f"the gui environment needs {missing}")
                from playwright.async_api import async_playwright

                self.playwright = await async_playwright().start()
                for _ in range(self.size):
                    self.browsers.append(await self.playwright.chromium.launch(
                        executable_path=str(CHROMIUM), args=FLAGS))
                    self.live.append(0)
                self._started.set_result(None)
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started.exception()  # retrieved: no "never retrieved" warning
                raise
        await asyncio.shield(self._started)

    async def open(self, url: str) -> Tab:
        """A fresh context and page on the least busy browser, at `url`."""
        await self._start()
        i = min(range(self.size), key=self.live.__getitem__)
        self.live[i] += 1
        try:
            context = await self.browsers[i].new_context(viewport=VIEWPORT)
            page = await context.new_page()
            page.set_default_timeout(5000)
            await page.goto(url)
        except BaseException:
            self.live[i] -= 1
            raise
        return Tab(context, page, i)

    async def close(self, tab: Tab) -> None:
        self.live[tab.browser] -= 1
        await tab.context.close()

    async def _stop(self) -> None:
        for browser in self.browsers:
            await browser.close()
        if self.playwright is not None:
            await self.playwright.stop()

    def stop(self) -> None:
        """Close the browsers and Playwright, then the host's loop (from outside the loop)."""
        if self.loop.is_closed():
            return
        if self._started is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


_lock = threading.Lock()
_host: BrowserHost | None = None


def browser_host(browsers: int = 1) -> BrowserHost:
    """The process's host, started on first use with `browsers` browsers (later calls share
    it, whatever they ask); stopped at exit or by `stop_browsers()`."""
    global _host
    with _lock:
        if _host is None:
            _host = BrowserHost(browsers)
            atexit.register(stop_browsers)
        return _host


def stop_browsers() -> None:
    global _host
    with _lock:
        host, _host = _host, None
    if host is not None:
        host.stop()
