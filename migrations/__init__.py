"""Alembic migrations for the clawrl schema (models of record: clawrl/base/db.py)."""
