"""Shared fixtures: a real Postgres, isolated per test.

Each test gets a fresh database cloned from a template that was migrated once per run
(`CREATE DATABASE … TEMPLATE …` takes milliseconds). The server is the one at
CLAWRL_TEST_PG (default postgresql://postgres@127.0.0.1:5432/postgres); `.ci/run` starts the
machine's Postgres when it is not running.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from proxy import dbcli

ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _url_for(dbname: str) -> str:
    return make_url(ADMIN_URL).set(database=dbname).render_as_string(hide_password=False)


def _admin() -> psycopg.Connection:
    return psycopg.connect(ADMIN_URL, autocommit=True)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """Name of a database migrated to head, used as the template for every test DB."""
    name = f"clawrl_tpl_{uuid.uuid4().hex[:8]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dbcli.upgrade(_url_for(name))
    yield name
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_url(pg_template: str) -> Iterator[str]:
    """URL of a fresh, migrated database for this test only."""
    name = f"clawrl_t_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _url_for(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_db_url() -> Iterator[str]:
    """URL of a fresh, empty database (no migrations applied)."""
    name = f"clawrl_e_{uuid.uuid4().hex[:10]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield _url_for(name)
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
