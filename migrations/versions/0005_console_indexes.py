"""indexes for the console's turn filters

The console (proxy/console/) lists turns newest first by id and filters them by weight version
and by time. Without these, a filter on an old version or an old time range walks the
primary key back through every newer turn (seconds with a million turns):

- `ix_turns_version_id` (weight_version, id): a version's turns, newest first;
- `ix_turns_created_at` (created_at): a time range, and the turns of the last minute.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 12:00:00
"""

from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_turns_version_id', 'turns', ['weight_version', 'id'], unique=False)
    op.create_index('ix_turns_created_at', 'turns', ['created_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_turns_created_at', table_name='turns')
    op.drop_index('ix_turns_version_id', table_name='turns')
