"""Alembic environment: runs migrations against the URL the caller put in the config."""

from alembic import context

from clawrl.base.db import Base, create_engine

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "clawrl.base.dbcli sets sqlalchemy.url"
    connectable = create_engine(url)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    connectable.dispose()


run_migrations_online()
