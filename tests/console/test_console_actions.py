"""The console's actions through real HTTP: users and keys (a key is shown once and works at
once; revoked, it is refused at once), opt-outs, deletion with its confirmation, and rollback
through `clawrl versions rollback`'s code path against the real embedded engine."""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import httpx
import pytest
from conftest import Console, ConsoleFactory, csrf_of
from consoleseed import db, seed_judgment, seed_turn

from trainer.export import version_dir, write_version


async def feedback_status(console: Console, key: str) -> int:
    """401 for a key the proxy refuses; 404 (no such turn) for one it accepts."""
    async with httpx.AsyncClient(base_url=console.url) as client:
        resp = await client.post("/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                                 json={"turn_id": str(uuid.uuid4()), "rating": 1})
    return resp.status_code


async def test_users_and_keys(console: Console) -> None:
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/users")).text)
        created = await client.post("/console/users", data={"csrf": csrf, "name": "alice",
                                                            "rpm": "60"})
        assert created.status_code == 201
        secret = re.search(r'<pre class="secret" id="secret">(ck-[^<]+)</pre>', created.text)
        assert secret is not None
        key = secret.group(1)
        assert await feedback_status(console, key) == 404
        listing = (await client.get("/console/users")).text
        assert key not in listing and ">60<" in listing  # never shown again; its limit is
        prefix = re.search(r'data-key="([^"]+)"', listing)
        assert prefix is not None and key.startswith(f"ck-{prefix.group(1)}")

        second = await client.post("/console/keys", data={"csrf": csrf, "user": "alice",
                                                          "name": "laptop", "rpm": "0"})
        assert second.status_code == 201 and "unlimited" in second.text
        bad = await client.post("/console/keys", data={"csrf": csrf, "user": "nobody"})
        assert bad.status_code == 404 and "No user named" in bad.text
        bad_rpm = await client.post("/console/keys", data={"csrf": csrf, "user": "alice",
                                                           "rpm": "-3"})
        assert bad_rpm.status_code == 400
        dup = await client.post("/console/users", data={"csrf": csrf, "name": "alice"})
        assert dup.status_code == 409

        revoked = await client.post(f"/console/keys/{prefix.group(1)}/revoke",
                                    data={"csrf": csrf})
        assert revoked.status_code == 303
        assert await feedback_status(console, key) == 401

        out = await client.post("/console/users/alice/opt-out", data={"csrf": csrf,
                                                                      "training": "on"})
        assert out.status_code == 303
        with db(console.db_url) as conn:
            assert conn.execute("SELECT train_opt_out, log_opt_out FROM users").fetchone() == (
                True, False)


async def test_delete_says_what_goes_and_needs_the_name(console: Console) -> None:
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/users")).text)
        await client.post("/console/users", data={"csrf": csrf, "name": "bob"})
        with db(console.db_url) as conn:
            bob = conn.execute("SELECT id FROM users WHERE name = 'bob'").fetchone()
            assert bob is not None
            turns = [seed_turn(conn, bob[0]) for _ in range(3)]
            seed_judgment(conn, turns[0], 1)
        confirm = await client.get("/console/users/bob/delete")
        assert "3 turns" in confirm.text and "1 judgment " in confirm.text
        assert "1 API key" in confirm.text
        wrong = await client.post("/console/users/bob/delete", data={"csrf": csrf,
                                                                     "confirm_name": "bo"})
        assert wrong.status_code == 400
        done = await client.post("/console/users/bob/delete", data={"csrf": csrf,
                                                                    "confirm_name": "bob"})
        assert done.status_code == 303 and "3%20turns" in done.headers["location"]
        with db(console.db_url) as conn:
            assert conn.execute("SELECT count(*) FROM turns").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM users").fetchone() == (0,)
        assert "bob" not in (await client.get("/console/users")).text


def _copy_model(src: Path) -> object:
    def write(tmp: Path) -> None:
        for f in src.iterdir():
            if f.name == "config.json" or f.suffix == ".safetensors":
                shutil.copy(f, tmp / f.name)
    return write


async def test_rollback_through_the_real_engine(
        console_factory: ConsoleFactory, engine_factory: object, tiny_model_dir: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_url = engine_factory(tiny_model_dir)  # type: ignore[operator]
    monkeypatch.setenv("CLAWRL_TRAINER__MODEL", str(tiny_model_dir))
    weights = tmp_path / "weights"  # <state_dir>/weights: the console's state dir is tmp_path
    for n in (1, 2):
        write_version(weights, n, _copy_model(tiny_model_dir), tiny_model_dir)  # type: ignore[arg-type]
    console = await console_factory(engine_url)
    with db(console.db_url) as conn:
        conn.execute("INSERT INTO policy_versions (version, step, path, status, num_samples,"
                     " published_at) VALUES (1, 1, %s, 'published', 16, now() - interval '1 h'),"
                     " (2, 2, %s, 'published', 16, now())",
                     [str(version_dir(weights, 1)), str(version_dir(weights, 2))])
        # A version the gate rejected (trainer/gate.py): shown with its probe, never served.
        conn.execute("INSERT INTO policy_versions (version, step, path, status, stats) VALUES "
                     "(3, 3, 'v3', 'rejected', '{\"gate\": {\"base\": 0.7, \"candidate\": "
                     "0.4, \"topic_base\": 0.93, \"topic_candidate\": 0.6, "
                     "\"passed\": false}}')")

    def serving() -> str | None:
        return httpx.get(f"{engine_url}/model_info").json().get("weight_version")

    async with console.signed_in() as client:
        page = (await client.get("/console/versions")).text
        assert 'href="/console/versions/1/rollback"' in page
        assert re.search(r'data-version="3">.*?<td>rejected<br><span[^>]*>facts 0.70 → 0.40 · on topic 0.93 → 0.60',
                         page, re.S)
        assert 'href="/console/versions/3/rollback"' not in page
        confirm = await client.get("/console/versions/1/rollback")
        assert "1 newer version will be marked retired" in confirm.text
        csrf = csrf_of(confirm.text)
        done = await client.post("/console/versions/1/rollback", data={"csrf": csrf})
        assert done.status_code == 303 and "serves%20v1" in done.headers["location"]
        assert serving() == "1"
        page = (await client.get(done.headers["location"])).text
        assert '<strong id="serving">v1</strong>' in page
        assert re.search(r'data-version="2">\s*<td>v2</td>.*?<td>retired</td>', page, re.S)

        # A version whose folder is gone is refused, and the engine keeps serving v1.
        shutil.rmtree(version_dir(weights, 2))
        refused = await client.post("/console/versions/2/rollback", data={"csrf": csrf})
        assert "Rollback%20refused" in refused.headers["location"]
        assert serving() == "1"
        rejected = await client.post("/console/versions/3/rollback", data={"csrf": csrf})
        assert "rejected%20by%20the%20gate" in rejected.headers["location"]
        assert serving() == "1"
        missing = await client.get("/console/versions/7/rollback")
        assert missing.status_code == 400

        back = await client.post("/console/versions/0/rollback", data={"csrf": csrf})
        assert "serves%20v0" in back.headers["location"] and serving() == "0"
