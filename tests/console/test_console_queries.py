"""Every console query is index-backed: with sequential scans priced out
(`enable_seqscan = off`), no plan reads `turns` or `judgments` (the tables that grow) from end
to end, and the version and time filters use their own indexes (migration 0005).
The figures with a million turns come from `clawrl bench console` (clawrl/bench/console.py)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection

from clawrl.base.db import create_engine
from clawrl.bench.console import FILL
from proxy.console import queries, tally

GROWING = {"turns", "judgments"}


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)


def explain(conn: Connection, sql: Any, params: dict[str, Any]) -> list[dict[str, Any]]:
    statement = sql if isinstance(sql, str) else sql.text
    plan = conn.execute(text(f"EXPLAIN (FORMAT JSON) {statement}"), params).scalar_one()
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return list(plan_nodes(plan[0]["Plan"]))


def seq_scans(nodes: list[dict[str, Any]]) -> set[str]:
    return {n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"} & GROWING


def indexes(nodes: list[dict[str, Any]]) -> set[str]:
    return {n["Index Name"] for n in nodes if "Index Name" in n}


@pytest.fixture
def conn(db_url: str) -> Iterator[Connection]:
    engine = create_engine(db_url)
    with engine.connect() as c:
        for sql in FILL[:-1]:  # the bench's synthetic log, small
            c.execute(text(sql.format(turns=5000, users=20, versions=20)))
        c.execute(text("ANALYZE"))
        c.commit()
        c.execute(text("SET enable_seqscan = off"))
        yield c
    engine.dispose()


def test_every_turn_filter_is_index_backed(conn: Connection) -> None:
    session = conn.execute(text("SELECT session_id FROM turns LIMIT 1")).scalar_one()
    old = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=450)
    filters = {
        "none": queries.TurnFilter(),
        "user": queries.TurnFilter(user="user7"),
        "session": queries.TurnFilter(session=session),
        "version": queries.TurnFilter(version="1"),
        "reward": queries.TurnFilter(reward="-1"),
        "unjudged": queries.TurnFilter(reward="unjudged"),
        "hint": queries.TurnFilter(has_hint=True),
        "until": queries.TurnFilter(until=old),
        "since": queries.TurnFilter(since=old),
        "before": queries.TurnFilter(before=2500),
        "all": queries.TurnFilter(user="user7", version="1", reward="1", has_hint=False,
                                  since=old - dt.timedelta(hours=1), until=old, before=4000),
    }
    for name, f in filters.items():
        nodes = explain(conn, *queries.turns_query(f))
        assert seq_scans(nodes) == set(), (name, nodes)
    assert "ix_turns_version_id" in indexes(explain(conn, *queries.turns_query(
        filters["version"])))
    assert "ix_turns_created_at" in indexes(explain(conn, *queries.turns_query(
        filters["until"])))
    assert "ix_turns_session_id" in indexes(explain(conn, *queries.turns_query(
        filters["session"])))


def test_overview_turn_page_and_tally_are_index_backed(conn: Connection) -> None:
    for name, sql in queries.OVERVIEW.items():
        assert seq_scans(explain(conn, sql, {})) == set(), name
    assert "ix_turns_created_at" in indexes(explain(conn, queries.OVERVIEW["turns_last_minute"],
                                                    {}))
    for name, sql in queries.TURN.items():
        assert seq_scans(explain(conn, sql, {"id": 42})) == set(), name
    assert seq_scans(explain(conn, queries.LAST_TURN_BY_USER, {})) == set()
    # The tally's incremental reads: primary-key ranges past what it has seen.
    for sql, params in [(tally.LAST_TURN, {"mark": 4000, "lag": 2.0, "batch": 1000}),
                        (tally.NEW_TURNS, {"mark": 4000, "upto": 4100}),
                        (tally.LAST_JUDGMENT, {"mark": 3000, "lag": 2.0, "batch": 1000}),
                        (tally.NEW_JUDGMENTS, {"mark": 3000, "upto": 3100})]:
        assert seq_scans(explain(conn, sql, params)) == set(), sql.text


def test_the_check_can_fail(conn: Connection) -> None:
    """A filter on a column no index covers shows up as a sequential scan."""
    nodes = explain(conn, "SELECT id FROM turns WHERE finish_reason = :r ORDER BY id DESC "
                          "LIMIT 5", {"r": "stop"})
    nodes += explain(conn, "SELECT count(*) FROM turns WHERE latency_ms > 1", {})
    assert seq_scans(nodes) == {"turns"}
