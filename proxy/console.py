"""The terminal side of the admin commands: database resolution, one-line errors, tables,
and the read-only SQL runner behind `clawrl sql`.

`run_readonly_sql` is read-only three ways: the statement runs in a READ ONLY transaction
that is always rolled back, as the `clawrl_readonly` role when it exists (migration 0002;
so superuser-only functions are refused too), and through the extended query protocol,
which refuses a second statement (so `COMMIT; DELETE …` cannot escape the transaction).
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

from proxy.db import libpq_url
from proxy.dbcli import resolve_url
from proxy.errors import ClawrlError
from proxy.settings import load_settings

READONLY_ROLE = "clawrl_readonly"


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
        url = resolve_url(load_settings())
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


def run_readonly_sql(url: str, query: str, *, timeout_s: float = 60.0
                     ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one statement read-only; return its column names and rows."""
    if not query.strip():
        raise SqlError("Empty query.")
    with psycopg.connect(libpq_url(url), connect_timeout=10) as conn:
        conn.read_only = True
        try:
            conn.execute("SELECT set_config('statement_timeout', %s, true)",
                         [f"{int(timeout_s * 1000)}"])
            as_role = conn.execute(
                "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s)"
                " THEN pg_has_role(%s, 'MEMBER') ELSE false END",
                [READONLY_ROLE, READONLY_ROLE]).fetchone()
            if as_role is not None and as_role[0]:
                conn.execute(f"SET LOCAL ROLE {READONLY_ROLE}")
            cur = psycopg.RawCursor(conn)
            # prepare=True forces the extended protocol: exactly one statement.
            cur.execute(query, prepare=True)
            columns = [d.name for d in cur.description or []]
            rows = cur.fetchall() if cur.description else []
        except psycopg.Error as exc:
            raise SqlError(first_line(exc)) from exc
        finally:
            conn.rollback()
    return columns, rows


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
