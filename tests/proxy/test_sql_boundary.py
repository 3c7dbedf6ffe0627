"""`clawrl sql` is a real boundary: it logs in as `clawrl_sql` (migration 0004), and every
way out that works on a superuser connection is refused by the server, in one line.

The attacks run on the machine's Postgres (trust auth) through the `clawrl` entry point;
the missing-role and grown-rights refusals and the embedded Postgres run on a private
embedded server, since roles are shared by every database of a server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from clawrl.base import dbcli
from clawrl.base.db import libpq_url
from clawrl.cli.main import main as clawrl

ROOT = Path(__file__).resolve().parents[2]
MARKER = Path(tempfile.gettempdir()) / f"clawrl-sql-attack-{uuid.uuid4().hex}"


@pytest.fixture
def cli_db(db_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CLAWRL_DATABASE__URL", db_url)
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute("INSERT INTO users (name) VALUES ('gus')")
        conn.execute("INSERT INTO api_keys (user_id, prefix, secret_hash) "
                     "SELECT id, 'abc123', 'the-hash' FROM users")
    return db_url


def sql(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = clawrl(["sql", *argv])
    out, err = capsys.readouterr()
    return code, out, err


ATTACKS = [
    # The reproduction: back to the login user, then a shell command.
    (f"DO $$BEGIN RESET ROLE; EXECUTE 'COPY (SELECT 1) TO PROGRAM ''id > {MARKER}'''; END$$",
     "COPY to or from an external program"),
    ("SET ROLE postgres", 'permission denied to set role "postgres"'),
    ("SET SESSION AUTHORIZATION postgres", "permission denied to set session authorization"),
    ("SELECT set_config('role', 'postgres', false)", 'permission denied to set role'),
    ("DO $$BEGIN PERFORM set_config('role', 'postgres', false); END$$",
     'permission denied to set role'),
    (f"COPY (SELECT 1) TO PROGRAM 'id > {MARKER}'", "COPY to or from an external program"),
    (f"COPY (SELECT 1) TO '{MARKER}'", "COPY to a file"),
    ("SELECT pg_read_file('/etc/passwd')", "permission denied for function pg_read_file"),
    ("SELECT lo_import('/etc/passwd')", "permission denied for function lo_import"),
    ("SELECT * FROM dblink('dbname=postgres', 'SELECT 1') AS t(x int)",
     "function dblink(unknown, unknown) does not exist"),
    ("WITH gone AS (DELETE FROM users RETURNING *) SELECT * FROM gone", "read-only"),
    ("SELECT * FROM users FOR UPDATE", "FOR UPDATE"),
    ("SELECT secret_hash FROM api_keys", "permission denied for table api_keys"),
    ("SELECT * FROM api_keys", "permission denied for table api_keys"),
    ("SELECT 1; DELETE FROM users", "cannot insert multiple commands"),
    ("CREATE EXTENSION dblink", "read-only"),
    ("ALTER ROLE clawrl_sql SUPERUSER", "read-only"),
]


@pytest.mark.parametrize("query, message", ATTACKS, ids=[a[0][:40] for a in ATTACKS])
def test_attack_is_refused_in_one_line(cli_db: str, capsys: pytest.CaptureFixture[str],
                                       query: str, message: str) -> None:
    code, out, err = sql([query], capsys)
    assert code == 1 and out == ""
    assert err.startswith("clawrl sql: ") and len(err.splitlines()) == 1, err
    assert message in err, err
    assert not MARKER.exists()
    with psycopg.connect(libpq_url(cli_db)) as conn:
        assert conn.execute("SELECT count(*) FROM users").fetchone() == (1,)


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "601"])
def test_timeout_outside_its_bounds_is_refused(cli_db: str, capsys: pytest.CaptureFixture[str],
                                               timeout: str) -> None:
    code, out, err = sql(["--timeout", timeout, "SELECT 1"], capsys)
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        f"clawrl sql: --timeout must be more than 0 and at most 600 seconds, not "
        f"{float(timeout):g}."]


@pytest.mark.parametrize("query", [
    "SELECT set_config('statement_timeout', '0', false), pg_sleep(30)",
    "DO $$BEGIN PERFORM set_config('statement_timeout', '0', false); "
    "PERFORM pg_sleep(30); END$$",
])
def test_the_statement_cannot_lift_its_timeout(cli_db: str, capsys: pytest.CaptureFixture[str],
                                               query: str) -> None:
    code, _, err = sql(["--timeout", "1", query], capsys)
    assert code == 1
    assert err.strip() == "clawrl sql: canceling statement due to statement timeout"


def test_it_runs_as_the_sql_role_and_reads_what_analysts_read(
        cli_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = sql(["--csv", "SELECT current_user, session_user, "
                          "(SELECT prefix FROM api_keys) AS prefix, "
                          "(SELECT live_keys FROM activity_by_user) AS live_keys"], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == ["current_user,session_user,prefix,live_keys",
                                "clawrl_sql,clawrl_sql,abc123,1"]


def test_roles_hold_no_write_or_secret_rights(cli_db: str) -> None:
    """What the server says the roles may do, table by table."""
    with psycopg.connect(libpq_url(cli_db)) as conn:
        role = conn.execute("SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, "
                            "rolreplication, rolbypassrls FROM pg_roles "
                            "WHERE rolname = 'clawrl_sql'").fetchone()
        assert role == (True, False, False, False, False, False)
        # Not a member (directly or not) of any superuser or server-file role.
        assert conn.execute(
            "SELECT array_agg(rolname) FROM pg_roles WHERE pg_has_role('clawrl_sql', oid, "
            "'MEMBER') AND rolname <> 'clawrl_sql'").fetchone() == (["clawrl_readonly"],)
        settings = conn.execute(
            "SELECT setconfig FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole "
            "WHERE r.rolname = 'clawrl_sql' AND s.setdatabase = 0").fetchone()
        assert settings is not None and "statement_timeout=60s" in settings[0]
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        assert "turns" in tables and "api_keys" in tables
        for role_name in ("clawrl_sql", "clawrl_readonly"):
            for table in tables:
                for right in ("INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES",
                              "TRIGGER"):
                    assert not conn.execute("SELECT has_table_privilege(%s, %s, %s)",
                                            [role_name, table, right]).fetchone()[0]  # type: ignore[index]
            assert conn.execute("SELECT has_column_privilege(%s, 'api_keys', 'prefix', "
                                "'SELECT')", [role_name]).fetchone() == (True,)
            assert conn.execute("SELECT has_column_privilege(%s, 'api_keys', 'secret_hash', "
                                "'SELECT')", [role_name]).fetchone() == (False,)
            assert conn.execute("SELECT has_table_privilege(%s, 'turns', 'SELECT')",
                                [role_name]).fetchone() == (True,)


def test_the_entry_point_refuses_in_one_line(cli_db: str) -> None:
    """The installed command, as a shell runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env["CLAWRL_DATABASE__URL"] = cli_db
    done = subprocess.run([sys.executable, "-m", "clawrl.cli.main", "sql", "SET ROLE postgres"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == 'clawrl sql: permission denied to set role "postgres"'


# --- a private embedded server: the embedded default, a missing or over-privileged role ----

@pytest.fixture(scope="module")
def embedded_url() -> Iterator[str]:
    state = Path(tempfile.mkdtemp(prefix="clawrl-sqlrole-", dir="/tmp"))
    try:
        url = dbcli.start_embedded(state)
        dbcli.upgrade(url)
        yield url
    finally:
        dbcli.stop_embedded(state)
        shutil.rmtree(state, ignore_errors=True)


def _admin(url: str, statement: str) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(statement)


def test_embedded_postgres_runs_as_the_sql_role_and_refuses_the_attack(
        embedded_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLAWRL_DATABASE__URL", embedded_url)
    code, out, _ = sql(["--csv", "SELECT session_user, (SELECT count(*) FROM users)"], capsys)
    assert code == 0 and out.splitlines()[1] == "clawrl_sql,0"
    code, out, err = sql([ATTACKS[0][0]], capsys)
    assert code == 1 and ATTACKS[0][1] in err and len(err.splitlines()) == 1
    assert not MARKER.exists()


def test_a_missing_role_is_refused_never_run_as_the_login_user(
        embedded_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLAWRL_DATABASE__URL", embedded_url)
    _admin(embedded_url, "DROP OWNED BY clawrl_sql")
    _admin(embedded_url, "DROP ROLE clawrl_sql")
    try:
        code, out, err = sql(["SELECT session_user"], capsys)
        assert code == 1 and out == ""
        assert err.strip().splitlines() == [
            "clawrl sql: the database has no role clawrl_sql (migration 0004); run `clawrl db "
            "upgrade` as a user who may create roles. Not running the query as another user."]
    finally:
        dbcli.downgrade(embedded_url, "0003")
        dbcli.upgrade(embedded_url)
    code, out, _ = sql(["SELECT session_user"], capsys)
    assert code == 0 and "clawrl_sql" in out


@pytest.mark.parametrize("grant", ["ALTER ROLE clawrl_sql SUPERUSER",
                                   "GRANT pg_execute_server_program TO clawrl_readonly",
                                   "GRANT postgres TO clawrl_sql"])
def test_a_role_that_grew_rights_is_refused(embedded_url: str, grant: str,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CLAWRL_DATABASE__URL", embedded_url)
    _admin(embedded_url, grant)
    try:
        code, out, err = sql(["SELECT 1"], capsys)
    finally:
        _admin(embedded_url, "ALTER ROLE clawrl_sql NOSUPERUSER")
        _admin(embedded_url, "REVOKE pg_execute_server_program FROM clawrl_readonly")
        _admin(embedded_url, "REVOKE postgres FROM clawrl_sql")
    assert code == 1 and out == ""
    assert err.startswith("clawrl sql: role clawrl_sql may do more than read")
    assert len(err.splitlines()) == 1


def test_migration_round_trip_keeps_the_role_for_other_databases(embedded_url: str) -> None:
    """Downgrading one database does not drop a role another database still grants to."""
    _admin(embedded_url, "CREATE DATABASE other")
    other = embedded_url.replace("/postgres?", "/other?")
    assert other != embedded_url
    try:
        dbcli.upgrade(other)
        dbcli.downgrade(other, "0003")
        with psycopg.connect(libpq_url(embedded_url)) as conn:
            assert conn.execute("SELECT count(*) FROM pg_roles "
                                "WHERE rolname = 'clawrl_sql'").fetchone() == (1,)
            # The downgraded database gave clawrl_readonly back the whole table.
        with psycopg.connect(libpq_url(other)) as conn:
            assert conn.execute("SELECT has_column_privilege('clawrl_readonly', 'api_keys', "
                                "'secret_hash', 'SELECT')").fetchone() == (True,)
        dbcli.upgrade(other)
    finally:
        _admin(embedded_url, "DROP DATABASE other WITH (FORCE)")


def test_migrating_another_database_writes_the_shared_role_only_where_it_differs(
        embedded_url: str) -> None:
    """Roles are shared by every database of a server: migrating one more database leaves
    the role's rows as they are (two databases migrated at once wrote the same row and one
    failed with "tuple concurrently updated"), and puts back a right it should not have."""
    rows = ("SELECT (SELECT xmin::text FROM pg_authid WHERE rolname = 'clawrl_sql'), "
            "(SELECT m.xmin::text FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.member "
            "WHERE r.rolname = 'clawrl_sql')")

    def role_rows() -> tuple[str, str]:
        with psycopg.connect(libpq_url(embedded_url)) as conn:
            row = conn.execute(rows).fetchone()
        assert row is not None and None not in row
        return row[0], row[1]

    before = role_rows()
    _admin(embedded_url, "CREATE DATABASE third")
    third = embedded_url.replace("/postgres?", "/third?")
    try:
        dbcli.upgrade(third)
        assert role_rows() == before
        _admin(embedded_url, "ALTER ROLE clawrl_sql CREATEDB")
        dbcli.downgrade(third, "0003")
        dbcli.upgrade(third)
        with psycopg.connect(libpq_url(embedded_url)) as conn:
            assert conn.execute("SELECT rolcreatedb FROM pg_roles "
                                "WHERE rolname = 'clawrl_sql'").fetchone() == (False,)
    finally:
        _admin(embedded_url, "DROP DATABASE third WITH (FORCE)")
