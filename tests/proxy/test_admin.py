"""Admin: `clawrl users|keys|sql`, the /admin HTTP API, cascades, opt-outs, admin views."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine

from clawrl.base.db import create_async, libpq_url
from clawrl.base.errors import Unauthorized
from clawrl.base.settings import load_settings
from clawrl.cli.main import main as clawrl
from proxy import admin
from proxy.auth import Authenticator
from proxy.journal import Journal
from proxy.records import TurnRecord
from proxy.store import dead_letter_payload


@pytest.fixture
def cli_db(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CLI reads its database from the environment, as in a shell."""
    monkeypatch.setenv("CLAWRL_DATABASE__URL", db_url)
    return db_url


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = clawrl(argv)
    out, err = capsys.readouterr()
    return code, out, err


def add_judged_turn(url: str, user: str, reward: int | None, version: str = "0") -> int:
    """A turn with a next state, a judgment and a sample, as the proxy and judge write them."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        turn_id: int = conn.execute(
            """INSERT INTO turns (uid, user_id, request_messages, response_message,
                                 response_ids, status, weight_version, next_state)
               SELECT %s, id, '[{"role":"user","content":"hi"}]',
                      '{"role":"assistant","content":"hello"}', '{5,6}', 'ok', %s,
                      '[{"role":"user","content":"thanks"}]'
               FROM users WHERE name = %s RETURNING id""",
            [uuid.uuid4(), version, user]).fetchone()[0]  # type: ignore[index]
        judgment_id = conn.execute(
            "INSERT INTO judgments (turn_id, prompt_version, reward, hint) "
            "VALUES (%s, 'v1', %s, 'be brief') RETURNING id", [turn_id, reward]).fetchone()
        conn.execute(
            "INSERT INTO samples (turn_id, judgment_id, user_id, prompt_ids, response_ids, "
            "rollout_logprobs, reward) SELECT %s, %s, user_id, '{1}', '{5,6}', '{-1,-1}', %s "
            "FROM turns WHERE id = %s",
            [turn_id, judgment_id[0], reward, turn_id])  # type: ignore[index]
    return turn_id


def count(url: str, table: str) -> int:
    with psycopg.connect(libpq_url(url)) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # type: ignore[index]


def test_users_create_prints_a_key_once(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["users", "create", "alice", "--rpm", "30"], capsys)
    assert code == 0
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("ck-")
    code, out, _ = run(["keys", "list", "--user", "alice"], capsys)
    assert code == 0 and secret not in out and secret.split("-")[1] in out and "30" in out
    code, _, err = run(["users", "create", "alice"], capsys)
    assert code == 1 and err.strip() == "clawrl users: User 'alice' already exists."


def test_keys_create_list_revoke(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(["users", "create", "bob", "--no-key"], capsys)
    code, out, _ = run(["keys", "create", "--user", "bob", "--name", "ci", "--rpm", "5"], capsys)
    assert code == 0
    secret = out.strip().splitlines()[-1]
    prefix = secret.split("-")[1]
    code, out, _ = run(["keys", "revoke", prefix], capsys)
    assert code == 0 and f"revoked key {prefix} of bob" in out
    code, out, _ = run(["keys", "list"], capsys)
    assert "ci" in out and prefix in out
    for argv, message in [
        (["keys", "create", "--user", "nobody"], "No user named 'nobody'."),
        (["keys", "revoke", "ffff"], "No API key with prefix 'ffff'."),
        (["keys", "create", "--user", "bob", "--rpm", "-1"], "rate_limit_rpm must be between 0 and"),
    ]:
        code, _, err = run(argv, capsys)
        assert code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_keys_fair_share_limits(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--concurrent and --tpm set the key's fair-share limits (proxy/limits.py)."""
    code, out, _ = run(["users", "create", "erin", "--concurrent", "3", "--tpm", "50000"],
                       capsys)
    assert code == 0
    code, out, _ = run(["keys", "create", "--user", "erin", "--concurrent", "0"], capsys)
    assert code == 0
    rows = query_rows(cli_db, "SELECT max_concurrent, rate_limit_tpm FROM api_keys "
                              "ORDER BY id")
    assert rows == [(3, 50000), (0, None)]
    code, out, _ = run(["keys", "list", "--user", "erin"], capsys)
    assert "max_concurrent" in out and "rate_limit_tpm" in out and "50000" in out
    for argv in (["keys", "create", "--user", "erin", "--concurrent", "-2"],
                 ["keys", "create", "--user", "erin", "--tpm", str(2**40)],
                 ["users", "create", "fay", "--tpm", "-1"]):
        code, _, err = run(argv, capsys)
        assert code == 1 and "must be between 0 and" in err and len(err.strip().splitlines()) == 1
    assert query_rows(cli_db, "SELECT count(*) FROM users WHERE name = 'fay'") == [(0,)]


def test_verifier_scope_from_the_cli(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--scope verifier` issues a key that may set session outcomes; `keys list` shows it;
    an unknown scope is refused by argparse and nothing is created."""
    code, out, _ = run(["users", "create", "grader", "--scope", "verifier"], capsys)
    assert code == 0 and "scopes: verifier" in out
    code, out, _ = run(["keys", "create", "--user", "grader", "--name", "plain"], capsys)
    assert code == 0 and "scopes" not in out
    assert query_rows(cli_db, "SELECT scopes FROM api_keys ORDER BY id") == [
        (["verifier"],), ([],)]
    code, out, _ = run(["keys", "list", "--user", "grader"], capsys)
    header, _, first, second = out.splitlines()[:4]
    assert "scopes" in [c.strip() for c in header.split(" | ")]
    assert "verifier" in first and "verifier" not in second
    with pytest.raises(SystemExit):
        clawrl(["keys", "create", "--user", "grader", "--scope", "admin"])
    assert "invalid choice" in capsys.readouterr().err
    assert count(cli_db, "api_keys") == 2


@pytest.mark.parametrize("argv, message", [
    (["users", "create", "hugo", "--rpm", str(2**31)], "rate_limit_rpm must be between 0 and"),
    (["users", "create", "hugo", "--concurrent", str(2**31)], "max_concurrent must be between"),
    (["users", "create", "x/../carol"], "A user name must be"),
    (["users", "create", "a b"], "A user name must be"),
    (["users", "create", "x" * 65], "A user name must be"),
    (["users", "create", "--", "-x"], "A user name must be"),
])
def test_bad_users_and_limits_are_one_line_and_create_nothing(
        cli_db: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """A limit past the column's int32 was a database overflow (a traceback, or a 500 on the
    API): now one line, and nothing is created, not even the user of a refused first key."""
    code, _, err = run(argv, capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert count(cli_db, "users") == 0 and count(cli_db, "api_keys") == 0


def test_user_names_that_stay_allowed() -> None:
    for name in ("alice", "ada", "sim-0-lowercase", "env-toolcall", "header-agent", "u",
                 "bench", "ünïcode", "a.b@c+d_e", "x" * 64):
        assert admin.check_name(name) == name


def test_sql_prints_a_bounded_number_of_rows(cli_db: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["sql", "--limit", "3", "SELECT g FROM generate_series(1, 50) g"],
                       capsys)
    assert code == 0
    assert out.splitlines()[2:] == ["1", "2", "3", "(first 3 of 50 rows; --limit 0 prints all)"]
    code, out, _ = run(["sql", "--limit", "0", "SELECT g FROM generate_series(1, 50) g"],
                       capsys)
    assert code == 0 and out.splitlines()[-1] == "(50 rows)"
    code, out, _ = run(["sql", "SELECT g FROM generate_series(1, 20000) g"], capsys)
    assert code == 0 and out.splitlines()[-1] == (
        f"(first {admin.SQL_CLI_ROWS} of 20000 rows; --limit 0 prints all)")
    assert len(out.splitlines()) == admin.SQL_CLI_ROWS + 3


@pytest.mark.parametrize("key, ok", [
    (None, True), ("", False), ("   ", False), ("short-key", False), ("x" * 15, False),
    ("x" * 16, True), ("ck-admin-" + "y" * 43, True),
])
def test_admin_key_must_be_long_enough(key: str | None, ok: bool) -> None:
    problem = admin.admin_key_problem(None if key is None else SecretStr(key))
    assert (problem is None) == ok
    if not ok:
        assert problem is not None and "CLAWRL_PROXY__ADMIN_KEY" in problem
        assert "\n" not in problem


@pytest.mark.parametrize("key", ["", "  ", "sekrit"])
def test_proxy_refuses_to_start_with_an_empty_or_short_admin_key(
        key: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """`CLAWRL_PROXY__ADMIN_KEY=""` turned the console on with an empty password: now the
    proxy refuses, in one line, before it opens a port; create_app refuses as well."""
    monkeypatch.setenv("CLAWRL_PROXY__ADMIN_KEY", key)
    monkeypatch.setenv("CLAWRL_DATABASE__URL", "postgresql://postgres@127.0.0.1:1/x")
    assert clawrl(["proxy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clawrl proxy: CLAWRL_PROXY__ADMIN_KEY") and "\n" not in err
    from proxy.app import create_app

    with pytest.raises(ValueError, match="CLAWRL_PROXY__ADMIN_KEY"):
        create_app(load_settings(state_dir=tmp_path), db_url="postgresql://u@h/db")


async def test_admin_api_bounds_limits_and_scopes(db: AsyncEngine) -> None:
    """2^31 requests per minute was a 500 (integer overflow in Postgres): now a 400."""
    async with client(admin_app(db, "sekrit")) as c:
        assert (await c.post("/admin/users", json={"name": "hal"})).status_code == 201
        for body, param in (({"rate_limit_rpm": 2**31}, "rate_limit_rpm"),
                            ({"rate_limit_tpm": 2**31}, "rate_limit_tpm"),
                            ({"max_concurrent": 2**63}, "max_concurrent"),
                            ({"scopes": ["root"]}, "scopes")):
            r = await c.post("/admin/keys", json={"user": "hal", **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
        r = await c.post("/admin/users", json={"name": "x/../carol"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_user_name"
        r = await c.post("/admin/keys", json={"user": "hal", "scopes": ["verifier"]})
        assert r.status_code == 201 and r.json()["scopes"] == ["verifier"]
        listed = (await c.get("/admin/keys")).json()["data"]
        assert [k["scopes"] for k in listed] == [["verifier"]]


def test_delete_user_cascades(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(["users", "create", "carol"], capsys)
    run(["users", "create", "dave"], capsys)
    add_judged_turn(cli_db, "carol", 1)
    add_judged_turn(cli_db, "carol", -1)
    add_judged_turn(cli_db, "dave", 1)
    code, out, _ = run(["users", "delete", "carol"], capsys)
    assert code == 0 and "2 turns, 2 judgments, 2 samples" in out
    assert (count(cli_db, "turns"), count(cli_db, "judgments"), count(cli_db, "samples"),
            count(cli_db, "api_keys")) == (1, 1, 1, 1)
    code, _, err = run(["users", "delete", "carol"], capsys)
    assert code == 1 and "No user named 'carol'" in err


def test_delete_user_forgets_journal_and_dead_letters(
        cli_db: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of a deleted user stays behind: not their turns waiting in the journal, not
    their dead letters (records the database had refused)."""
    monkeypatch.setenv("CLAWRL_STATE_DIR", str(tmp_path))
    run(["users", "create", "carol"], capsys)
    run(["users", "create", "dave"], capsys)
    ids = {name: uid for uid, name in query_rows(cli_db, "SELECT id, name FROM users")}
    records = {name: TurnRecord(uid=str(uuid.uuid4()), user_id=ids[name], api_key_id=None,
                                request_messages=[{"role": "user", "content": f"{name} said"}],
                                params={}) for name in ("carol", "dave")}
    journal = Journal(tmp_path / "journal")
    journal.append([records["carol"], records["dave"], records["carol"]])
    with psycopg.connect(libpq_url(cli_db), autocommit=True) as conn:
        for record in records.values():
            conn.execute("INSERT INTO dead_letters (kind, payload, error) VALUES "
                         "('turn', %s, 'refused')", [dead_letter_payload(record)])
    code, out, _ = run(["users", "delete", "carol"], capsys)
    assert code == 0 and "1 dead_letters, 2 journaled_turns" in out
    journal.seal()
    left = [r for s in journal.segments() for r in journal.read(s)]
    assert [r.user_id for r in left if isinstance(r, TurnRecord)] == [ids["dave"]]
    assert b"carol said" not in b"".join(s.read_bytes() for s in journal.segments())
    payloads = [p for (p,) in query_rows(cli_db, "SELECT payload FROM dead_letters")]
    assert len(payloads) == 1 and "dave said" in payloads[0]


def query_rows(url: str, sql: str) -> list[Any]:
    with psycopg.connect(libpq_url(url)) as conn:
        return conn.execute(sql.encode()).fetchall()


def test_opt_out_and_in(cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(["users", "create", "erin", "--no-key"], capsys)
    assert run(["users", "opt-out", "erin", "--training"], capsys)[0] == 0
    with psycopg.connect(libpq_url(cli_db)) as conn:
        flags = conn.execute("SELECT train_opt_out, log_opt_out FROM users").fetchone()
    assert flags == (True, False)
    run(["users", "opt-out", "erin", "--logging"], capsys)
    run(["users", "opt-in", "erin", "--training"], capsys)
    with psycopg.connect(libpq_url(cli_db)) as conn:
        flags = conn.execute("SELECT train_opt_out, log_opt_out FROM users").fetchone()
    assert flags == (False, True)
    with pytest.raises(SystemExit):  # argparse: neither flag given
        clawrl(["users", "opt-out", "erin"])


def test_sql_prints_a_table_from_the_views(cli_db: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    run(["users", "create", "fay"], capsys)
    add_judged_turn(cli_db, "fay", 1, version="3")
    add_judged_turn(cli_db, "fay", None, version="3")
    code, out, _ = run(["sql", "SELECT weight_version, turns, judged, reward_mean, positive, "
                        "abstained, hints FROM reward_by_version"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split(" | ") == ["weight_version", "turns", "judged", "reward_mean",
                                     "positive", "abstained", "hints"]
    assert [c.strip() for c in lines[2].split("|")] == ["3", "2", "2", "1", "1", "1", "2"]
    assert lines[-1] == "(1 row)"
    code, out, _ = run(["sql", "SELECT user_name, turns, reward_mean FROM activity_by_user"],
                       capsys)
    assert code == 0 and "fay" in out
    code, out, _ = run(["sql", "SELECT last_user_message, reply, next_state FROM session_turns"],
                       capsys)
    assert code == 0 and "hi" in out and "hello" in out and "thanks" in out
    code, out, _ = run(["sql", "SELECT reward, hint FROM turns_with_rewards ORDER BY turn_id"],
                       capsys)
    assert code == 0 and "be brief" in out
    code, out, _ = run(["sql", "--csv", "SELECT reward, hint, next_state FROM turns_with_rewards "
                        "ORDER BY turn_id"], capsys)
    assert code == 0 and out.splitlines() == [
        "reward,hint,next_state",
        '1,be brief,"[{""role"": ""user"", ""content"": ""thanks""}]"',
        ',be brief,"[{""role"": ""user"", ""content"": ""thanks""}]"']


@pytest.mark.parametrize("query, message", [
    ("DELETE FROM users", "cannot execute DELETE in a read-only transaction"),
    ("COMMIT; DELETE FROM users", "cannot insert multiple commands into a prepared statement"),
    ("CREATE TABLE x (a int)", "read-only transaction"),
    ("SELECT * FROM nope", 'relation "nope" does not exist'),
    ("SELECT pg_read_file('/etc/passwd')", "permission denied"),
    ("   ", "Empty query."),
])
def test_sql_is_read_only(cli_db: str, capsys: pytest.CaptureFixture[str], query: str,
                          message: str) -> None:
    run(["users", "create", "gus", "--no-key"], capsys)
    code, out, err = run(["sql", query], capsys)
    assert code == 1 and out == ""
    assert err.startswith("clawrl sql: ") and message in err and len(err.splitlines()) == 1
    assert count(cli_db, "users") == 1


@pytest.mark.parametrize("url, message", [
    ("not a url", "bad database URL"),
    ("postgresql://postgres@127.0.0.1:1/x", "database error at postgresql://postgres@127.0.0.1:1/x"),
])
@pytest.mark.parametrize("argv", [["users", "list"], ["keys", "list"], ["sql", "SELECT 1"]])
def test_bad_database_url_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str], url: str,
                                      message: str, argv: list[str]) -> None:
    monkeypatch.setenv("CLAWRL_DATABASE__URL", url)
    code, out, err = run(argv, capsys)
    assert code == 1 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


# --- HTTP ---------------------------------------------------------------------------------

@pytest.fixture
async def db(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async(db_url)
    yield engine
    await engine.dispose()


def admin_app(db: AsyncEngine, admin_key: str | None) -> FastAPI:
    settings = load_settings()
    settings.proxy.admin_key = SecretStr(admin_key) if admin_key else None
    app = FastAPI()
    app.state.settings, app.state.db = settings, db
    app.state.authenticator = Authenticator(db, settings.proxy)
    app.include_router(admin.admin_router)
    return app


def client(app: FastAPI, key: str | None = "sekrit") -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                             headers=headers)


@pytest.mark.parametrize("configured, sent, status, code", [
    (None, "sekrit", 403, "admin_api_disabled"),
    ("sekrit", None, 401, "missing_api_key"),
    ("sekrit", "wrong", 401, "invalid_admin_key"),
])
async def test_admin_api_is_guarded(db: AsyncEngine, configured: str | None, sent: str | None,
                                    status: int, code: str) -> None:
    async with client(admin_app(db, configured), sent) as c:
        for method, path in [("GET", "/admin/users"), ("POST", "/admin/keys"),
                             ("DELETE", "/admin/users/x")]:
            r = await c.request(method, path, json={"user": "x"})
            assert r.status_code == status
            assert r.json()["error"]["code"] == code


async def test_admin_api_users_and_keys(db: AsyncEngine) -> None:
    app = admin_app(db, "sekrit")
    async with client(app) as c:
        r = await c.post("/admin/users", json={"name": "hal"})
        assert r.status_code == 201 and r.json()["name"] == "hal"
        r = await c.post("/admin/users", json={"name": "hal"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "user_exists"
        r = await c.post("/admin/users", json={"nom": "x"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/admin/keys", json={"user": "hal", "rate_limit_rpm": 9,
                                              "max_concurrent": 2, "rate_limit_tpm": 900})
        assert r.status_code == 201
        assert (r.json()["max_concurrent"], r.json()["rate_limit_tpm"]) == (2, 900)
        secret, prefix = r.json()["key"], r.json()["prefix"]
        listed = (await c.get("/admin/keys", params={"user": "hal"})).json()["data"]
        assert [k["prefix"] for k in listed] == [prefix] and secret not in str(listed)
        principal = await app.state.authenticator.authenticate(
            {"authorization": f"Bearer {secret}"})
        assert (principal.rate_limit_rpm, principal.max_concurrent,
                principal.rate_limit_tpm) == (9, 2, 900)
        r = await c.post("/admin/keys", json={"user": "hal", "max_concurrent": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_concurrent"
        r = await c.patch("/admin/users/hal", json={"train_opt_out": True})
        assert r.json()["train_opt_out"] is True and r.json()["log_opt_out"] is False
        # The opt-out is visible at once: the admin API drops the principal cache.
        principal = await app.state.authenticator.authenticate(
            {"authorization": f"Bearer {secret}"})
        assert principal.train_opt_out is True
        r = await c.post(f"/admin/keys/{prefix}/revoke")
        assert r.status_code == 200 and r.json()["revoked_at"] is not None
        with pytest.raises(Unauthorized):
            await app.state.authenticator.authenticate({"authorization": f"Bearer {secret}"})
        assert (await c.post("/admin/keys/nope/revoke")).status_code == 404
        r = await c.delete("/admin/users/hal")
        assert r.json() == {"name": "hal", "deleted": True, "turns": 0, "judgments": 0,
                            "samples": 0, "adapter_versions": 0, "dead_letters": 0,
                            "adapter_folders": 0}
        assert (await c.get("/admin/users")).json()["data"] == []
        assert (await c.patch("/admin/users/hal", json={})).status_code == 400


# --- through the real proxy app -------------------------------------------------------------

async def test_keys_from_the_admin_api_work_on_the_chat_route(proxy_factory: Any) -> None:
    """Issue, rate-limit and revoke a key over /admin on the running proxy (no engine needed:
    an authenticated chat request then fails at the engine, 502)."""
    proxy = await proxy_factory("http://127.0.0.1:9", admin_key="sekrit-admin-key-0123")
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as c:
        admin_headers = {"authorization": "Bearer sekrit-admin-key-0123"}
        assert (await c.post("/admin/users", json={"name": "ivy"},
                             headers=admin_headers)).status_code == 201
        r = await c.post("/admin/keys", json={"user": "ivy", "rate_limit_rpm": 1},
                         headers=admin_headers)
        key, prefix = r.json()["key"], r.json()["prefix"]
        user = {"authorization": f"Bearer {key}"}
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = await c.post("/v1/chat/completions", json=chat, headers=user)
        assert r.status_code == 502  # authenticated; the engine is not there
        r = await c.post("/v1/chat/completions", json=chat, headers=user)
        assert r.status_code == 429 and r.headers["retry-after"] == "60"
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = await c.get("/admin/users", headers=user)  # a user key is not the admin key
        assert r.status_code == 401
        await c.post(f"/admin/keys/{prefix}/revoke", headers=admin_headers)
        r = await c.post("/v1/chat/completions", json=chat, headers=user)
        assert r.status_code == 401 and r.json()["error"]["code"] == "revoked_api_key"
