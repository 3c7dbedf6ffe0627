"""`clawrl bench pace` (clawrl/eval/pace.py): what it reads from the stack's tables, against
real Postgres; a person's conversation against the proxy in front of a scripted engine; and
its bad arguments, one readable line."""

from __future__ import annotations

import datetime as dt
import random
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from clawrl.eval.everyday import load
from clawrl.eval.pace import (
    FollowUp,
    Person,
    Reply,
    Run,
    plot,
    read_turns,
    render,
    settle,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]


def _insert(conn: psycopg.Connection, user: int, session: uuid.UUID, index: int,
            version: str | None = None) -> tuple[int, str]:
    conn.execute("INSERT INTO sessions (id, user_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                 (session, user))
    row = conn.execute(
        "INSERT INTO turns (uid, user_id, session_id, index_in_session, request_messages, "
        "response_message, weight_version, status, state) VALUES (gen_random_uuid(), %s, %s, "
        "%s, '[]', '{}', %s, 'ok', 'continued') RETURNING id, uid::text",
        (user, session, index, version)).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def test_it_follows_each_follow_up_to_the_version_that_served_it(db_url: str,
                                                                tmp_path: Path) -> None:
    """Four replies followed up: one trained into a published version, one into a version
    the gate rejected, one judged but not trained yet, one judged with no sample."""
    from clawrl.base.db import libpq_url

    t0 = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
    session = uuid.uuid4()
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        user = int(conn.execute("INSERT INTO users (name) VALUES ('pace') RETURNING id")
                   .fetchone()[0])
        turns = [_insert(conn, user, session, i, None if i == 0 else "1") for i in range(4)]
        ids, uids = [t[0] for t in turns], [t[1] for t in turns]
        for version, status, published in ((1, "published", t0 + dt.timedelta(seconds=40)),
                                           (2, "rejected", None)):
            conn.execute("INSERT INTO policy_versions (version, step, path, status, "
                         "num_samples, published_at) VALUES (%s, %s, 'v', %s, 2, %s)",
                         (version, version, status, published))
        for turn, (judged, step) in zip(ids, ((5, 1), (7, 2), (9, None), (3, None)),
                                        strict=True):
            j = conn.execute("INSERT INTO judgments (turn_id, prompt_version, reward, "
                             "created_at) VALUES (%s, 'p', -1, %s) RETURNING id",
                             (turn, t0 + dt.timedelta(seconds=judged))).fetchone()[0]
            if turn == ids[3]:
                continue  # no majority: a judgment and no sample
            conn.execute("INSERT INTO samples (turn_id, judgment_id, user_id, prompt_ids, "
                         "response_ids, rollout_logprobs, reward, trained_step) VALUES "
                         "(%s, %s, %s, '{1}', '{2}', '{-0.5}', -1, %s)",
                         (turn, j, user, step))
    run = Run("brief", 0.0)
    sent = t0.timestamp() + 1
    run.followups = [FollowUp(sent, uids[i], kind)
                     for i, kind in enumerate(("correction", "off_topic", "praise", "move_on"))]
    run.replies = [Reply(sent - 1, uids[i], i == 0, i == 1, True, 10 * (i + 1))
                   for i in range(3)]
    rows = read_turns(db_url, user)
    assert settle(run, rows) is False  # the third is judged, not trained yet
    served, rejected, waiting, unsampled = run.followups
    assert (served.status, served.version, served.served_s, served.judged_s) == (
        "served", 1, 39.0, 4.0)
    assert (rejected.status, rejected.version, rejected.served_s) == ("rejected", 2, None)
    assert waiting.status == "untrained" and waiting.judged_s == 8.0
    assert unsampled.status == "no sample" and unsampled.judged_s == 2.0
    assert [r.version for r in run.replies] == [None, "1", "1"]

    versions = [{"published_at": t0 + dt.timedelta(seconds=40), "status": "published",
                 "num_samples": 2, "created_at": t0 + dt.timedelta(seconds=30)},
                {"published_at": None, "status": "rejected", "num_samples": 2,
                 "created_at": t0 + dt.timedelta(seconds=50)}]
    summary = summarize(run, versions, t0.timestamp(), 5.0)
    assert summary["served_s"]["corrections"] == {"n": 1, "median": 39.0, "p90": 39.0,
                                                  "max": 39.0}
    assert summary["not_served"] == {"no sample": 1, "rejected": 1, "untrained": 1}
    assert summary["versions"]["published"] == 1 and summary["versions"]["rejected"] == 1
    assert summary["windows"] == [{"from_min": 0.0, "replies": 1, "satisfied": 0.0,
                                   "on_topic": 1.0, "words": 10.0, "versions": ["base"]}]
    assert "minutes  first replies  satisfied  on topic  words  versions" in render(summary)
    plot(run, versions, t0.timestamp(), tmp_path / "pace.png")
    assert (tmp_path / "pace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_conversation_follows_up_what_it_asked(tmp_path: Path) -> None:
    """The person against a scripted chat endpoint: a long reply is corrected, then redone;
    every follow-up names the reply it follows and the session the proxy answered."""
    sent: list[list[dict[str, str]]] = []
    data = load()

    def answer(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        sent.append(body["messages"])
        asked = [q for q in data.questions
                 if any(q.text in m["content"] for m in body["messages"])][-1]
        # On the question's topic: long at first, then brief.
        text = " ".join(asked.topic * 20) if len(sent) == 1 else f"{asked.topic[0]}, briefly."
        return httpx.Response(200, json={"choices": [{"message": {"content": text}}]},
                              headers={"X-Clawrl-Turn-Id": f"t-{len(sent)}"})

    run = Run("brief", 0.0)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer),
                                 base_url="http://proxy") as client:
        await Person(client, data, "brief", 0.0, 64, random.Random(0), run).conversation()
    kinds = [f.kind for f in run.followups]
    assert kinds[0] == "correction"
    # Each follow-up names the turn of the reply just before it.
    assert [f.turn for f in run.followups] == [f"t-{i + 1}" for i in range(len(kinds))]
    assert [r.turn for r in run.replies] == [f"t-{i + 1}" for i in range(len(run.replies))]
    assert run.replies[0].first and not run.replies[0].satisfied
    assert not run.replies[1].first  # the redo
    # Each follow-up was sent with the whole conversation before it.
    assert all(len(m) == 2 * (i + 1) + 1 for i, m in enumerate(sent[1:]))


@pytest.mark.parametrize(("args", "says"), [
    (["--minutes", "0"], "--minutes, --max-tokens and --window must be > 0"),
    (["--think", "-1"], "--think and --drain >= 0"),
])
def test_bad_arguments_are_one_line(args: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "bench", "pace", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_an_unreachable_database_is_one_line(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "CLAWRL_DATABASE__URL":
           "postgresql+psycopg://postgres@127.0.0.1:5432/no_such_database_for_pace",
           "CLAWRL_STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "bench", "pace",
                           "--proxy-url", "http://127.0.0.1:9"], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("clawrl bench pace: the stack's database: ")
    assert "no_such_database_for_pace" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
