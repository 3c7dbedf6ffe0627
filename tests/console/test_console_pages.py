"""The console's read pages on a real database: the overview's reward by version agrees with
the `reward_by_version` view (also after a turn is judged again), turns filter and page, a
turn shows its conversation, tokens, next state, votes, hint and advantage strip, and the
SQL box runs as `clawrl_sql` (what `clawrl sql` refuses, it refuses)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from conftest import Console, csrf_of
from consoleseed import db, seed_judgment, seed_turn, seed_user

from proxy.console import tally


@pytest.fixture(autouse=True)
def no_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows count at once (the tally waits LAG_S for in-flight transactions)."""
    monkeypatch.setattr(tally, "LAG_S", 0.0)


def view_rows(db_url: str) -> dict[str | None, tuple[Any, ...]]:
    with db(db_url) as conn:
        rows = conn.execute("SELECT weight_version, turns, judged, positive, neutral, negative,"
                            " abstained, hints FROM reward_by_version").fetchall()
    return {r[0]: tuple(r[1:]) for r in rows}


def page_rows(data: dict[str, Any]) -> dict[str | None, tuple[Any, ...]]:
    return {r["version"]: (r["turns"], r["judged"], r["positive"], r["neutral"], r["negative"],
                           r["abstained"], r["hints"]) for r in data["reward_by_version"]}


async def test_reward_by_version_matches_the_view_as_turns_are_judged(console: Console) -> None:
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        t = [seed_turn(conn, alice, version=v) for v in ("1", "1", "1", "2", "2", "10")]
        seed_turn(conn, alice, version="2", kind="side")  # never counted
        seed_judgment(conn, t[0], 1)
        seed_judgment(conn, t[1], -1, hint="Answer in French.")
        seed_judgment(conn, t[2], None)  # abstained
        seed_judgment(conn, t[3], 0)
    async with console.signed_in() as client:
        first = (await client.get("/console/api/overview")).json()
        assert page_rows(first) == view_rows(console.db_url)
        assert [r["version"] for r in first["reward_by_version"]] == ["1", "2", "10"]
        v1 = first["reward_by_version"][0]
        assert v1["mean"] == 0.0 and v1["std"] == 1.0  # +1 and -1
        # Judged again: the newest judgment counts, the old one leaves the counts.
        with db(console.db_url) as conn:
            seed_judgment(conn, t[1], 1)
            seed_judgment(conn, t[5], -1, hint="Shorter.")
            seed_turn(conn, alice, version="10")
        second = (await client.get("/console/api/overview")).json()
        assert page_rows(second) == view_rows(console.db_url)
        assert page_rows(second)["1"] == (3, 3, 2, 0, 0, 1, 0)
        assert second["turns"] == 8 and second["latest_turn_id"] == max(t) + 2


async def test_overview_page_and_its_event_stream(console: Console) -> None:
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        seed_judgment(conn, seed_turn(conn, alice, version="3"), 1)
        conn.execute("INSERT INTO jobs (kind, turn_id) SELECT 'judge', id FROM turns")
    async with console.signed_in() as client:
        page = await client.get("/console")
        assert page.status_code == 200
        assert 'data-stat="judge_backlog">1<' in page.text
        assert "/console/static/uPlot.iife.min.js" in page.text
        for name in ("uPlot.iife.min.js", "console.js", "console.css"):
            assert (await client.get(f"/console/static/{name}")).status_code == 200
        assert (await client.get("/console/static/..%2Fsignin.py")).status_code == 404
        async with client.stream("GET", "/console/events") as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines: list[str] = []
            async for line in stream.aiter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    break
        assert "event: overview" in lines
        assert '"judge_backlog": 1' in lines[-1] and '"version": "3"' in lines[-1]


async def test_turn_filters_and_paging(console: Console) -> None:
    alice, bob = seed_user(console.db_url, "alice"), seed_user(console.db_url, "bob")
    session = uuid.uuid4()
    with db(console.db_url) as conn:
        old = seed_turn(conn, alice, text="ancient", created_at="2020-01-01T00:00:00Z")
        a1 = seed_turn(conn, alice, session=session, index=0, text="first of session",
                       next_state=[{"role": "user", "content": "no, in French"}])
        a2 = seed_turn(conn, alice, session=session, index=1, version="2")
        b1 = seed_turn(conn, bob, text="bob asks")
        seed_judgment(conn, a1, -1, hint="Answer in French.")
        seed_judgment(conn, b1, 1)
        many = [seed_turn(conn, bob, text=f"bulk {i}") for i in range(55)]

    async def ids(client: Any, query: str) -> list[int]:
        resp = await client.get(f"/console/turns?{query}")
        assert resp.status_code == 200, resp.text
        import re
        return [int(x) for x in re.findall(r'<tr data-turn="(\d+)"', resp.text)]

    async with console.signed_in() as client:
        assert await ids(client, "user=alice") == [a2, a1, old]
        assert await ids(client, f"session={session}") == [a2, a1]
        assert await ids(client, "version=2") == [a2]
        assert await ids(client, "reward=-1") == [a1]
        assert await ids(client, "reward=1") == [b1]
        assert await ids(client, "hint=yes") == [a1]
        assert a1 not in await ids(client, "hint=no")
        assert await ids(client, "user=alice&reward=unjudged") == [a2, old]
        assert await ids(client, "user=alice&until=2021-01-01T00:00") == [old]
        assert old not in await ids(client, "user=alice&since=2021-01-01T00:00")
        first = await ids(client, "user=bob")
        assert first == sorted(many, reverse=True)[:50]
        second = await ids(client, f"user=bob&before={first[-1]}")
        assert second == sorted(many, reverse=True)[50:] + [b1]
        for bad in ("session=nope", "reward=2", "hint=maybe", "since=yesterday", "before=x"):
            resp = await client.get(f"/console/turns?{bad}")
            assert resp.status_code == 400, bad
            assert 'id="error-message"' in resp.text
        assert (await client.get("/console/turns/999999")).status_code == 404
        assert (await client.get("/console/turns/abc")).status_code == 404


async def test_a_turn_page_shows_everything_about_it(console: Console) -> None:
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        turn = seed_turn(conn, alice, text="What is <b>2+2</b>?", reply="4",
                         next_state=[{"role": "user", "content": "in French please"}])
        old = seed_judgment(conn, turn, 0, votes=[{"text": "unclear. Score: 0", "score": 0}])
        new = seed_judgment(conn, turn, -1, hint="Answer in French.", teacher=[-0.5, -0.2, -1.0],
                            votes=[{"text": "The user corrected it. Score: -1", "score": -1},
                                   {"text": "garbled", "score": None}])
        conn.execute("INSERT INTO training_steps (step, version, status, num_samples, num_tokens)"
                     " VALUES (4, 2, 'ok', 1, 3)")
        conn.execute("INSERT INTO samples (turn_id, judgment_id, user_id, prompt_ids,"
                     " response_ids, rollout_logprobs, reward, teacher_logprobs, trained_step)"
                     " VALUES (%s, %s, %s, '{1}', '{11,12,13}', '{-0.1,-2.5,-0.01}', -1,"
                     " '{-0.5,-0.2,-1.0}', 4)", [turn, new, alice])
    async with console.signed_in() as client:
        page = (await client.get(f"/console/turns/{turn}")).text
    assert "What is &lt;b&gt;2+2&lt;/b&gt;?" in page  # escaped, never markup
    assert '<pre id="reply">4' in page
    assert "in French please" in page
    assert page.count('class="tok"') == 3 and "logprob -2.500" in page
    assert "The user corrected it. Score: -1" in page and "garbled" in page
    assert "unclear. Score: 0" in page and f'data-judgment="{old}"' in page
    assert "Answer in French." in page
    assert "trained at step 4 (v2)" in page
    # teacher - rollout: -0.4, +2.3, -0.99
    assert 'id="advantage"' in page and "token 1: +2.300" in page and "token 0: -0.400" in page


async def test_sql_box_runs_as_the_read_only_role(console: Console) -> None:
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        seed_turn(conn, alice)
        conn.execute("INSERT INTO api_keys (user_id, prefix, secret_hash) VALUES (%s, 'p1', 'h')",
                     [alice])
    async with console.signed_in() as client:
        csrf = csrf_of((await client.get("/console/sql")).text)

        async def run(query: str) -> Any:
            return await client.post("/console/sql", data={"csrf": csrf, "query": query})

        ok = await run("SELECT user_name, turns FROM activity_by_user")
        assert ok.status_code == 200 and "<td class=\"text\">alice</td>" in ok.text
        who = await run("SELECT current_user")
        assert "<td class=\"text\">clawrl_sql</td>" in who.text
        for query, message in [("DELETE FROM turns", "read-only transaction"),
                               ("SELECT secret_hash FROM api_keys", "permission denied"),
                               ("SELECT 1; SELECT 2", "multiple commands"),
                               ("SET ROLE postgres", "permission denied"),
                               ("", "Empty query")]:
            resp = await run(query)
            assert resp.status_code == 400 and message in resp.text, (query, resp.text[-600:])
        with db(console.db_url) as conn:
            assert conn.execute("SELECT count(*) FROM turns").fetchone() == (1,)


async def test_many_pages_at_once_stay_correct(console: Console) -> None:
    """Concurrent refreshes of the tally (several tabs) never count a row twice."""
    alice = seed_user(console.db_url, "alice")
    with db(console.db_url) as conn:
        for i in range(20):
            seed_judgment(conn, seed_turn(conn, alice, version=str(i % 3)), (i % 3) - 1)
    async with console.signed_in() as client:
        pages = await asyncio.gather(*[client.get("/console/api/overview") for _ in range(6)])
    for page in pages:
        assert page_rows(page.json()) == view_rows(console.db_url)
