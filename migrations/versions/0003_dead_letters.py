"""dead letters: records the turn writer could not store

One bad record (a turn the database refuses) must never stop the writer; it is kept here
with its raw JSON and the error, for an admin to read with SQL.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 11:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dead_letters',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('payload', sa.Text(), nullable=False),
    sa.Column('error', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )


def downgrade() -> None:
    op.drop_table('dead_letters')
