"""The console in a real headless browser (Debian's Chromium driven by Playwright): sign in,
chat through the OpenAI SDK against the real proxy and embedded engine, watch the turns and
their judgments arrive live, read a turn, roll back a version and see the engine serve it;
any console error or uncaught page error fails the test.

Skipped when /usr/bin/chromium or the `playwright` package is missing
(`apt-get install -y chromium`, `pip install playwright`; never `playwright install`).
Set CLAWRL_CONSOLE_SCREENSHOTS=docs/console to write each page's screenshot there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ADMIN_KEY, ConsoleFactory
from consoleseed import db
from proxyharness import create_user

from clawrl.base.db import create_async
from judge.config import load_judge_settings
from judge.worker import Worker
from trainer.export import write_version

CHROMIUM = Path("/usr/bin/chromium")
# The random test model rarely ends a reply by itself; common stop strings end it early.
STOP = [" ", "e", "a", "o"]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright package is not installed (pip install playwright)")
expect = playwright_api.expect
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="no /usr/bin/chromium (apt-get install -y chromium)")


def _copy_model(src: Path) -> Any:
    def write(tmp: Path) -> None:
        for f in src.iterdir():
            if f.name == "config.json" or f.suffix == ".safetensors":
                shutil.copy(f, tmp / f.name)
    return write


async def test_the_console_in_a_browser(
        console_factory: ConsoleFactory, engine_factory: Any, tiny_model_dir: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shots = Path(os.environ.get("CLAWRL_CONSOLE_SCREENSHOTS") or tmp_path / "shots")
    os.makedirs(shots, exist_ok=True)
    engine_url = engine_factory(tiny_model_dir)
    monkeypatch.setenv("CLAWRL_TRAINER__MODEL", str(tiny_model_dir))
    write_version(tmp_path / "weights", 1, _copy_model(tiny_model_dir), tiny_model_dir)
    console = await console_factory(engine_url)
    _, key = create_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        conn.execute("INSERT INTO policy_versions (version, step, path, status, num_samples, "
                     "loss, reward_mean, published_at) VALUES (1, 1, %s, 'published', 8, "
                     "0.42, 0.25, now())", [str(tmp_path / "weights" / "v000001")])
    import openai

    chat = openai.AsyncOpenAI(base_url=f"{console.url}/v1", api_key=key, max_retries=0)
    problems: list[str] = []

    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.set_default_timeout(30_000)
        expect.set_options(timeout=30_000)
        try:
            # Sign in (a wrong key first).
            await page.goto(f"{console.url}/console/turns")
            assert page.url.startswith(f"{console.url}/console/login")
            await page.screenshot(path=str(shots / "signin.png"))
            await page.fill("#admin_key", "not-the-key")
            await page.click("button[type=submit]")
            await page.wait_for_selector("#login-error")
            problems.clear()  # the browser logs the 401 answer itself as an error
            await page.fill("#admin_key", ADMIN_KEY)
            await page.click("button[type=submit]")
            await page.wait_for_url(f"{console.url}/console/turns")

            # Chat through the SDK: a turn, and its continuation (the first turn's next state).
            messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
            # (common stop strings end the random model's reply early, so the judge does
            # not skip it as cut off by the length limit)
            first = await chat.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                                       max_tokens=48, stop=STOP)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "no, say it in French"}]
            await chat.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=8)
            # The list swaps the new turns in by itself (server-sent events).
            await expect(page.locator("#turns tr[data-turn]")).to_have_count(2)
            with db(console.db_url) as conn:
                ids = [r[0] for r in conn.execute("SELECT id FROM turns ORDER BY id")]
                assert len(ids) == 2
            # A real judge worker (the policy engine as its model) judges the continued turn;
            # its judgment appears in the list by itself (the random model mostly abstains).
            judge_settings = load_judge_settings(
                database={"url": console.db_url}, engine={"url": engine_url},
                judge={"poll_interval_s": 0.1, "max_tokens": 16, "teacher_enabled": False})
            judge_db = create_async(console.db_url)
            stop_judge = asyncio.Event()
            judge = asyncio.create_task(
                Worker(judge_settings, judge_db, console.db_url).run(stop_judge))
            cell = f'#turns tr[data-turn="{ids[0]}"] td.reward'
            try:
                await expect(page.locator(cell)).not_to_have_text("…", timeout=120_000)
            finally:
                stop_judge.set()
                await judge
                await judge_db.dispose()
            with db(console.db_url) as conn:
                row = conn.execute("SELECT votes, judge_model FROM judgments WHERE turn_id = %s",
                                   [ids[0]]).fetchone()
            assert row is not None and len(row[0]) == 3, row
            await page.screenshot(path=str(shots / "turns.png"), full_page=True)

            # The turn's page: conversation, next state, tokens, the vote, the hint.
            await page.click(f'#turns tr[data-turn="{ids[0]}"] a')
            await page.wait_for_selector("#tokens .tok")
            text = await page.inner_text("main")
            assert "hello there" in text and "no, say it in French" in text
            # every vote the judge model wrote is on the page, as the browser reads it back
            shown = await page.locator("section.judgment ol.votes pre").all_inner_texts()
            assert len(shown) == 3, shown
            for vote, seen in zip(row[0], shown, strict=True):
                words = [w for w in str(vote.get("text") or "").split() if w.isalnum()]
                assert all(w in seen for w in words), (vote, seen)
            await page.screenshot(path=str(shots / "turn.png"), full_page=True)

            # The overview: numbers and the reward chart (uPlot draws into canvases).
            await page.goto(f"{console.url}/console")
            await page.wait_for_selector("#reward-chart canvas")
            await expect(page.locator('[data-stat="turns"]')).to_have_text("2")
            await asyncio.sleep(2.5)  # one live update goes through the chart
            await page.screenshot(path=str(shots / "overview.png"), full_page=True)

            # Roll back to v1 with the confirmation, and the engine serves it.
            await page.goto(f"{console.url}/console/versions")
            await page.click('a[href="/console/versions/1/rollback"]')
            await page.screenshot(path=str(shots / "rollback.png"))
            await page.click("#confirm-rollback")
            await page.wait_for_selector("#note")
            assert "now serves v1" in await page.inner_text("#note")
            async with httpx.AsyncClient() as client:
                info = (await client.get(f"{engine_url}/model_info")).json()
            assert info["weight_version"] == "1"
            await page.screenshot(path=str(shots / "versions.png"), full_page=True)
            reply = await chat.chat.completions.with_raw_response.create(
                model="default", messages=[{"role": "user", "content": "after the rollback"}],
                max_tokens=4)
            assert reply.http_response.status_code == 200
            await page.goto(f"{console.url}/console/turns?version=1")
            await expect(page.locator("#turns tr[data-turn]")).to_have_count(1)

            # Users and keys, and the SQL box.
            await page.goto(f"{console.url}/console/users")
            await page.fill("#create-user input[name=name]", "bob")
            await page.click("#create-user button")
            secret = await page.inner_text("#secret")
            assert secret.startswith("ck-")
            await page.screenshot(path=str(shots / "users.png"), full_page=True)
            await page.goto(f"{console.url}/console/sql")
            await page.fill("#query", "SELECT weight_version, turns, judged, reward_mean "
                                      "FROM reward_by_version ORDER BY weight_version")
            await page.click("#sql-form button")
            await page.wait_for_selector("#sql-result")
            await page.screenshot(path=str(shots / "sql.png"), full_page=True)
        finally:
            await browser.close()
            await chat.close()
    assert problems == []
