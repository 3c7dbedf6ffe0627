"""The ORM models are the schema of record: migrations must produce exactly them."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from clawrl.base import dbcli
from clawrl.base.db import Base, create_engine


def _diff(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_from_empty_equals_models(empty_db_url: str) -> None:
    dbcli.upgrade(empty_db_url)
    assert _diff(empty_db_url) == []


def test_downgrade_upgrade_round_trip(empty_db_url: str) -> None:
    dbcli.upgrade(empty_db_url)
    dbcli.downgrade(empty_db_url, "base")
    diff = _diff(empty_db_url)
    # After a full downgrade every model table is missing again.
    added = {d[1].name for d in diff if d[0] == "add_table"}  # type: ignore[index,union-attr]
    assert added == set(Base.metadata.tables)
    dbcli.upgrade(empty_db_url)
    assert _diff(empty_db_url) == []
