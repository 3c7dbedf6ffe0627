"""The console against an unfriendly operator's input and a second process: names that are
paths, limits past the database's integers, odd query parameters, huge SQL results, guessed
admin keys, and sessions signed out in another process or before a restart."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest
from conftest import ADMIN_KEY, Console, ConsoleFactory, csrf_of
from consoleseed import db, seed_turn, seed_user

from proxy.console import actions
from proxy.console.signin import MAX_FAILURES


async def test_a_name_that_is_a_path_acts_on_itself_only(console: Console) -> None:
    """A user named `x/../carol` (made before names were checked) once made the console's
    buttons act on `carol`: its URLs now keep it one segment."""
    carol, odd = seed_user(console.db_url, "carol"), seed_user(console.db_url, "x/../carol")
    async with console.signed_in() as client:
        page = (await client.get("/console/users")).text
        actions_of_odd = re.findall(r'action="(/console/users/x[^"]*)"', page)
        assert actions_of_odd == ["/console/users/x%2F..%2Fcarol/opt-out"]
        assert 'href="/console/users/x%2F..%2Fcarol/delete"' in page
        assert 'href="/console/turns?user=x%2F..%2Fcarol"' in page
        out = await client.post(actions_of_odd[0], data={"csrf": csrf_of(page),
                                                         "training": "on"})
        assert out.status_code == 303, out.text
        confirm = await client.get("/console/users/x%2F..%2Fcarol/delete")
        assert confirm.status_code == 200 and "x/../carol" in confirm.text
    with db(console.db_url) as conn:
        flags = dict(conn.execute("SELECT id, train_opt_out FROM users").fetchall())
    assert flags == {carol: False, odd: True}


@pytest.mark.parametrize("form, message", [
    ({"name": "dora", "rpm": "99999999999"}, "Requests per minute must be a whole number"),
    ({"name": "dora", "rpm": str(2**31)}, "rate_limit_rpm must be between 0 and"),
    ({"name": "dora", "rpm": "-3"}, "Requests per minute must be a whole number"),
    ({"name": "dora", "rpm": "²"}, "Requests per minute must be a whole number"),
    ({"name": "dora", "scope": "root"}, "Unknown scope"),
    ({"name": "x/../carol"}, "A user name must be"),
    ({"name": "dora\x00"}, "NUL"),
])
async def test_create_user_is_all_or_nothing_and_says_why(console: Console, form: dict[str, str],
                                                          message: str) -> None:
    """A refused first key used to leave its user created behind a 400 page (and a limit
    past int32 was a 500): now nothing is created and the page says why."""
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/users")).text)
        resp = await client.post("/console/users", data={"csrf": csrf, **form})
        assert resp.status_code == 400, resp.text[-800:]
        assert message in resp.text
    with db(console.db_url) as conn:
        assert conn.execute("SELECT count(*) FROM users").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (0,)


async def test_keys_get_a_scope_from_the_form(console: Console) -> None:
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/users")).text)
        made = await client.post("/console/users", data={"csrf": csrf, "name": "grader",
                                                         "scope": "verifier"})
        assert made.status_code == 201 and '<option value="verifier">' in made.text
        plain = await client.post("/console/keys", data={"csrf": csrf, "user": "grader"})
        assert plain.status_code == 201
        bad = await client.post("/console/keys", data={"csrf": csrf, "user": "grader",
                                                       "rpm": "99999999999"})
        assert bad.status_code == 400 and 'id="error"' in bad.text
    with db(console.db_url) as conn:
        assert conn.execute("SELECT scopes FROM api_keys ORDER BY id").fetchall() == [
            (["verifier"],), ([],)]


async def test_odd_parameters_are_400_pages_never_500(console: Console) -> None:
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        seed_turn(conn, alice)
    async with console.signed_in() as client:
        for query in ("before=%C2%B2", "before=99999999999999999999", "before=-1",
                      "user=%00", "version=%00", "session=%00", "us%00er=a"):
            resp = await client.get(f"/console/turns?{query}")
            assert resp.status_code == 400, (query, resp.status_code, resp.text[-400:])
            assert 'id="error-message"' in resp.text
        rows = await client.get("/console/turns/rows?user=%00")
        assert rows.status_code == 400
        huge = await client.get("/console/turns/99999999999999999999")
        assert huge.status_code == 404
        odd_user = await client.get("/console/users/%00/delete")
        assert odd_user.status_code == 400
        version = await client.get("/console/versions/99999999999/rollback")
        assert version.status_code == 400 and "No version" in version.text


async def test_the_sql_box_renders_a_bounded_page(console: Console) -> None:
    """2000 rows of 100 000 characters were 200 MB of HTML: now the first rows, each cell
    cut, within the page's budget, and the page says so."""
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/sql")).text)
        resp = await client.post("/console/sql", data={
            "csrf": csrf, "query": "SELECT g, repeat('x', 100000) FROM generate_series(1, 2000) g"})
        assert resp.status_code == 200
        assert len(resp.content) < 2 * actions.SQL_MAX_CHARS
        summary = re.search(r'<p class="muted" id="sql-summary">(.*?)</p>', resp.text, re.S)
        assert summary is not None
        shown = resp.text.count("<tr><td")
        assert 0 < shown < 2000
        assert f"the first {shown} rows of 2000 shown" in summary.group(1)
        assert f"longer than {actions.SQL_MAX_CELL} characters are cut" in summary.group(1)
        many = await client.post("/console/sql", data={
            "csrf": csrf, "query": "SELECT g FROM generate_series(1, 5000) g"})
        assert f"the first {actions.SQL_MAX_ROWS} rows of 5000 shown" in many.text
        assert many.text.count("<tr><td") == actions.SQL_MAX_ROWS


async def test_sign_out_holds_in_every_process_and_after_a_restart(
        console_factory: ConsoleFactory) -> None:
    """Two proxy processes on one database (the second also stands for a restart): a
    session signed out on one is refused by the other; only a hash of the cookie is kept."""
    first, second = await console_factory(), await console_factory()
    async with first.signed_in() as a:
        page = await a.get("/console")
        cookie = a.cookies.get("clawrl_console") or ""
        async with second.client() as b:
            b.cookies.set("clawrl_console", cookie, path="/console")
            assert (await b.get("/console")).status_code == 200  # one session, both processes
            with db(first.db_url) as conn:
                stored = [h for (h,) in conn.execute(
                    "SELECT token_hash FROM console_sessions").fetchall()]
            assert stored == [hashlib.sha256(cookie.encode()).hexdigest()]
            out = await a.post("/console/logout", data={"csrf": csrf_of(page.text)})
            assert out.status_code == 303
            assert (await b.get("/console")).status_code == 303
            assert (await b.get("/console/api/overview")).status_code == 303
    third = await console_factory()  # a restart: nothing in memory
    async with third.client() as c:
        c.cookies.set("clawrl_console", cookie, path="/console")
        assert (await c.get("/console")).status_code == 303


async def _try(client: Any, key: str) -> Any:
    page = await client.get("/console/login")
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    assert token is not None
    return await client.post("/console/login", data={"token": token.group(1),
                                                     "admin_key": key, "next": ""})


async def test_failed_sign_ins_are_throttled(console: Console) -> None:
    async with console.client() as client:
        assert (await _try(client, ADMIN_KEY)).status_code == 303  # no failures yet
    async with console.client() as client:
        for _ in range(MAX_FAILURES):
            assert (await _try(client, "ck-guess")).status_code == 401
        for key in ("ck-guess", ADMIN_KEY):  # even the right key waits now
            resp = await _try(client, key)
            assert resp.status_code == 429, resp.text[-400:]
            assert 1 <= int(resp.headers["retry-after"]) <= 60
            assert "Too many failed sign-ins" in resp.text
            assert "clawrl_console=" not in resp.headers.get("set-cookie", "")
