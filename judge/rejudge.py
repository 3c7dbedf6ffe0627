"""Re-judging: enqueue judge jobs again for turns already continued, e.g. with a new prompt.

Run: `clawrl judge rejudge --since 2026-01-01T00:00:00Z [--until ISO] [--prompt-version v2]`.
Selects main turns with a next state created in [since, until), of users not opted out of
training, without a judge job already queued or running. The job payload carries the
prompt version; the worker writes a new judgment (old ones stay for audit) and marks any
untrained sample of the turn `skipped_reason = 'superseded'`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

from sqlalchemy import Engine, text

from clawrl.base.jobs import JOB_CHANNEL
from judge.prompts import check_version

# One statement: insert the jobs and notify the workers (delivered at commit).
_REJUDGE_SQL = """
WITH picked AS (
    INSERT INTO jobs (kind, turn_id, payload, user_id)
    SELECT 'judge', t.id, jsonb_build_object('prompt_version', CAST(:version AS text),
                                             'rejudge', true), t.user_id
    FROM turns t JOIN users u ON u.id = t.user_id
    WHERE t.kind = 'main' AND t.next_state IS NOT NULL AND NOT u.train_opt_out
      AND t.created_at >= :since AND (CAST(:until AS timestamptz) IS NULL OR t.created_at < :until)
      AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.turn_id = t.id AND j.kind = 'judge'
                      AND j.status IN ('queued', 'running'))
    ORDER BY t.id
    RETURNING id
)
SELECT count(*) AS n, pg_notify(:channel, 'judge') FROM picked
"""


def enqueue_rejudge(db: Engine, since: dt.datetime, prompt_version: str,
                    until: dt.datetime | None = None) -> int:
    """Enqueue judge jobs for the matching turns; returns how many."""
    check_version(prompt_version)  # fail before touching the DB on a bad version
    with db.begin() as conn:
        row = conn.execute(text(_REJUDGE_SQL).bindparams(
            version=prompt_version, since=since, until=until, channel=JOB_CHANNEL)).one()
    return int(row.n)


def parse_time(value: str) -> dt.datetime:
    when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl judge rejudge",
                                description="Re-enqueue judge jobs for continued turns.")
    p.add_argument("--since", required=True, help="ISO time, e.g. 2026-01-01T00:00:00Z")
    p.add_argument("--until", help="ISO time (exclusive); default: now")
    p.add_argument("--prompt-version", default=None, help="template version, e.g. v1")
    args = p.parse_args(argv)
    from pydantic import ValidationError

    from clawrl.base.db import create_engine
    from clawrl.base.dbcli import resolve_admin_url
    from clawrl.base.statefile import apply_to_env
    from judge.config import describe_settings_error, load_judge_settings

    apply_to_env(os.environ)  # the running `clawrl up`'s database, from any folder

    try:
        since = parse_time(args.since)
        until = parse_time(args.until) if args.until else None
    except ValueError as exc:
        print(f"clawrl judge rejudge: bad time: {exc}", file=sys.stderr)
        return 2
    try:
        settings = load_judge_settings()
    except ValidationError as exc:
        print(f"clawrl judge rejudge: bad settings: {describe_settings_error(exc)}",
              file=sys.stderr)
        return 2
    version = args.prompt_version or settings.judge.prompt_version
    try:
        check_version(version)
    except (FileNotFoundError, ValueError) as exc:
        print(f"clawrl judge rejudge: unknown prompt version {version!r}: {exc}",
              file=sys.stderr)
        return 2
    try:
        # never creates an embedded database as a side effect
        engine = create_engine(resolve_admin_url(settings))
        try:
            n = enqueue_rejudge(engine, since, version, until)
        finally:
            engine.dispose()
    except Exception as exc:  # bad URL, server down, not migrated: one line, exit 1
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"clawrl judge rejudge: cannot use the database: {first}", file=sys.stderr)
        return 1
    print(f"enqueued {n} judge jobs (prompt version {version})")
    return 0
