"""Fixtures for judge tests (helpers live in judgedb.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from clawrl.base.db import create_engine


@pytest.fixture
def db(db_url: str) -> Iterator[Engine]:
    """A sync engine on this test's fresh database."""
    engine = create_engine(db_url)
    yield engine
    engine.dispose()
