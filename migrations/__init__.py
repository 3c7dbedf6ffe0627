"""Alembic migrations for the clawrl schema (models of record: proxy/db.py)."""
