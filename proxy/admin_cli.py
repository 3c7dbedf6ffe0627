"""The terminal side of the admin commands: database resolution, one-line errors, tables,
and the read-only SQL runner behind `clawrl sql`.

`run_readonly_sql` holds by the database's own rights, not by anything said on the
connection: it logs in as `clawrl_sql` (migration 0004), a separate login role that is no
superuser nor a member of one and may only SELECT (no key hashes), so `RESET ROLE`,
`SET ROLE`, `set_config('role', …)`, `COPY … TO PROGRAM`, `pg_read_file`, `lo_import` and
writes are refused by the server whatever the statement does. It never falls back to the
login user: when that role is missing, cannot log in or has grown rights, it refuses.
On top: a READ ONLY transaction that is always rolled back, a statement timeout
(0 < --timeout <= 600 s), and the extended query protocol, which refuses a second statement.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from clawrl.base.db import libpq_url
from clawrl.base.dbcli import resolve_admin_url
from clawrl.base.errors import ClawrlError
from clawrl.base.settings import load_settings

SQL_ROLE = "clawrl_sql"
MAX_TIMEOUT_S = 600.0
# Members of these may run programs or read server files (superusers may do anything).
_DANGEROUS_ROLES = ("pg_execute_server_program", "pg_read_server_files",
                    "pg_write_server_files")


class SqlError(ClawrlError):
    status, type, code = 400, "invalid_request_error", "sql_error"


def safe_url(url: str) -> str:
    """The URL with its password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def run_cli(prog: str, op: Callable[[str], int]) -> int:
    """Resolve the database URL and run `op(url)`; any failure is one line on stderr, exit 1."""
    url = "<unresolved>"
    try:
        url = resolve_admin_url(load_settings())
        return op(url)
    except ClawrlError as exc:
        print(f"{prog}: {exc.message}", file=sys.stderr)
    except ArgumentError as exc:
        print(f"{prog}: bad database URL {url!r}: {first_line(exc)}", file=sys.stderr)
    except (DBAPIError, psycopg.Error, OSError) as exc:
        inner = getattr(exc, "orig", None) or exc
        print(f"{prog}: database error at {safe_url(url)}: {first_line(inner)}",
              file=sys.stderr)
    except Exception as exc:  # a CLI answers with one line, never a traceback
        print(f"{prog}: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
    return 1


def sql_role_url(url: str) -> str:
    """The database URL with the login replaced by `clawrl_sql` (and no password: a server
    that wants one gets it from ~/.pgpass or PGPASSWORD)."""
    return make_url(libpq_url(url)).set(username=SQL_ROLE, password=None).render_as_string(
        hide_password=False)


def _connect_as_sql_role(url: str) -> psycopg.Connection[Any]:
    try:
        conn = psycopg.connect(sql_role_url(url), connect_timeout=10)
    except psycopg.OperationalError as exc:
        if f'role "{SQL_ROLE}" does not exist' in str(exc):
            raise SqlError(f"the database has no role {SQL_ROLE} (migration 0004); run "
                           f"`clawrl db upgrade` as a user who may create roles. Not running "
                           f"the query as another user.") from exc
        raise  # unreachable, refused (e.g. no password for the role): a database error
    try:
        row = conn.execute(
            "SELECT session_user, r.rolsuper OR r.rolbypassrls OR EXISTS ("
            "  SELECT 1 FROM pg_roles d WHERE (d.rolsuper OR d.rolname = ANY(%s))"
            "  AND pg_has_role(session_user, d.oid, 'MEMBER'))"
            " FROM pg_roles r WHERE r.rolname = session_user",
            [list(_DANGEROUS_ROLES)]).fetchone()
        conn.rollback()
    except BaseException:
        conn.close()
        raise
    if row is None or row[0] != SQL_ROLE or row[1]:
        conn.close()
        raise SqlError(f"role {SQL_ROLE} may do more than read (superuser, BYPASSRLS, or a "
                       f"member of a superuser or server-file role); refusing. Fix it with "
                       f"`clawrl db upgrade` or ALTER ROLE {SQL_ROLE} NOSUPERUSER.")
    return conn


def run_readonly_sql(url: str, query: str, *, timeout_s: float = 60.0
                     ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one statement as `clawrl_sql`, read-only; return its column names and rows."""
    columns, rows, _ = run_readonly_sql_rows(url, query, timeout_s=timeout_s)
    return columns, rows


def run_readonly_sql_rows(url: str, query: str, *, timeout_s: float = 60.0,
                          max_rows: int | None = None
                          ) -> tuple[list[str], list[tuple[Any, ...]], int]:
    """As `run_readonly_sql`, but only the first `max_rows` rows become Python values (None:
    all); returns the column names, those rows and how many rows the statement gave."""
    if not query.strip():
        raise SqlError("Empty query.")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise SqlError(f"--timeout must be more than 0 and at most {MAX_TIMEOUT_S:.0f} "
                       f"seconds, not {timeout_s:g}.")
    with _connect_as_sql_role(url) as conn:
        conn.read_only = True
        try:
            conn.execute("SELECT set_config('statement_timeout', %s, true)",
                         [f"{max(1, int(timeout_s * 1000))}"])
            cur = psycopg.RawCursor(conn)
            # prepare=True forces the extended protocol: exactly one statement.
            cur.execute(query, prepare=True)
            columns = [d.name for d in cur.description or []]
            rows: list[tuple[Any, ...]] = []
            total = 0
            if cur.description:
                rows = cur.fetchall() if max_rows is None else cur.fetchmany(max_rows)
                total = max(cur.rowcount, len(rows))
        except psycopg.Error as exc:
            raise SqlError(first_line(exc)) from exc
        finally:
            conn.rollback()
    return columns, rows, total


def format_cell(value: Any, max_width: int = 0) -> str:
    if value is None:
        text = ""
    elif isinstance(value, dt.datetime):
        text = value.strftime("%Y-%m-%d %H:%M:%S")
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    elif isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    if max_width and len(text) > max_width:
        text = text[: max_width - 1] + "…"
    return text


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                max_width: int = 60) -> None:
    """Print rows as an aligned, psql-like table."""
    cells = [[format_cell(v, max_width) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def print_csv(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Rows as CSV, cells in full (JSON values as JSON text)."""
    def cell(v: Any) -> Any:
        if v is None:
            return ""
        return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v

    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([cell(v) for v in row] for row in rows)
