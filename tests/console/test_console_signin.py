"""Signing in to the console: the admin key buys a signed, HttpOnly, SameSite=Strict session
cookie; every POST needs its CSRF token and the console's origin; signing out ends it."""

from __future__ import annotations

import re

from conftest import ADMIN_KEY, Console, ConsoleFactory, csrf_of


async def test_pages_send_a_visitor_to_sign_in(console: Console) -> None:
    async with console.client() as client:
        for path in ("/console", "/console/turns?user=a", "/console/versions", "/console/sql"):
            resp = await client.get(path)
            assert resp.status_code == 303, path
            assert resp.headers["location"].startswith("/console/login?next=/console")
        assert (await client.get("/console/api/overview")).status_code == 303
        assert (await client.post("/console/sql", data={"query": "SELECT 1"})).status_code == 401


async def test_sign_in_sets_a_strict_httponly_cookie(console: Console) -> None:
    async with console.client() as client:
        page = await client.get("/console/login?next=/console/turns")
        token = re.search(r'name="token" value="([^"]+)"', page.text)
        assert token is not None
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        wrong = await client.post("/console/login", data={
            "token": token.group(1), "admin_key": "ck-wrong", "next": "/console/turns"})
        assert wrong.status_code == 401 and "Incorrect admin key" in wrong.text
        token2 = re.search(r'name="token" value="([^"]+)"', wrong.text)
        assert token2 is not None
        ok = await client.post("/console/login", data={
            "token": token2.group(1), "admin_key": ADMIN_KEY, "next": "/console/turns"})
        assert ok.status_code == 303 and ok.headers["location"] == "/console/turns"
        cookie = [h for h in ok.headers.get_list("set-cookie")
                  if h.startswith("clawrl_console=")][0].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
        assert (await client.get("/console/turns")).status_code == 200


async def test_sign_in_needs_the_form_token_and_never_redirects_off_site(
        console: Console) -> None:
    async with console.client() as client:
        # No login cookie / token: a cross-site login form cannot sign anyone in.
        resp = await client.post("/console/login", data={"token": "x", "admin_key": ADMIN_KEY})
        assert resp.status_code == 403 and "clawrl_console=" not in resp.headers.get(
            "set-cookie", "")
        page = await client.get("/console/login")
        token = re.search(r'name="token" value="([^"]+)"', page.text)
        assert token is not None
        resp = await client.post("/console/login", data={
            "token": token.group(1), "admin_key": ADMIN_KEY, "next": "https://evil.example/"})
        assert resp.headers["location"] == "/console"


async def test_posts_need_the_csrf_token_and_the_same_origin(console: Console) -> None:
    async with console.signed_in() as client:
        page = await client.get("/console/users")
        csrf = csrf_of(page.text)
        no_token = await client.post("/console/users", data={"name": "mallory"})
        assert no_token.status_code == 403 and "security token" in no_token.text
        forged = await client.post("/console/users", data={"name": "mallory", "csrf": "f" * 64})
        assert forged.status_code == 403
        other_site = await client.post("/console/users", data={"name": "mallory", "csrf": csrf},
                                       headers={"Origin": "https://evil.example"})
        assert other_site.status_code == 403
        assert "mallory" not in (await client.get("/console/users")).text
        ok = await client.post("/console/users", data={"name": "alice", "csrf": csrf})
        assert ok.status_code == 201 and "alice" in ok.text


async def test_sign_out_ends_the_session(console: Console) -> None:
    async with console.signed_in() as client:
        page = await client.get("/console")
        assert page.status_code == 200
        stolen = client.cookies.get("clawrl_console")
        out = await client.post("/console/logout", data={"csrf": csrf_of(page.text)})
        assert out.status_code == 303
        assert (await client.get("/console")).status_code == 303
    async with console.client() as replay:  # the old cookie no longer works either
        replay.cookies.set("clawrl_console", stolen or "", path="/console")
        assert (await replay.get("/console")).status_code == 303


async def test_console_is_off_without_an_admin_key(console_factory: ConsoleFactory) -> None:
    console = await console_factory(admin_key=None)
    async with console.client() as client:
        page = await client.get("/console/login")
        assert page.status_code == 403 and "CLAWRL_PROXY__ADMIN_KEY" in page.text
        resp = await client.post("/console/login", data={"token": "x", "admin_key": "x"})
        assert resp.status_code == 403
