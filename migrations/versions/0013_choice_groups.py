"""the rest of the OpenAI surface: choice groups, sessions the client ended, SQL NULL

- `turns.group_id` (uuid) and `turns.group_index` (smallint): a request with `n` > 1 is
  stored as one turn per choice, each with the request's group id and its choice index
  (NULL for a single reply), with a partial index for the sibling lookup and a group
  baseline.
- `sessions.done_at`: when the client ended the session (`X-Session-Done`). Such a session
  stays closed: a later request naming it no longer reopens it (`closed_at` stays).
- Nullable JSONB columns of `turns` that held JSON `null` for a missing value (`tools`
  of a request without tools, `response_message` of a failed turn, `sampling`,
  `next_state`) hold SQL NULL, as the models now write them. Not undone by the downgrade:
  both read as None.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08 09:00:00
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

_NULLABLE_JSONB = ('tools', 'response_message', 'sampling', 'next_state')


def upgrade() -> None:
    op.add_column('turns', sa.Column('group_id', postgresql.UUID(as_uuid=True), nullable=True))
    op.add_column('turns', sa.Column('group_index', sa.SmallInteger(), nullable=True))
    op.create_index('ix_turns_group_id', 'turns', ['group_id'], unique=False,
                    postgresql_where=sa.text('group_id IS NOT NULL'))
    op.add_column('sessions', sa.Column('done_at', sa.DateTime(timezone=True), nullable=True))
    for column in _NULLABLE_JSONB:
        op.execute(f"UPDATE turns SET {column} = NULL WHERE {column} = 'null'::jsonb")


def downgrade() -> None:
    op.drop_column('sessions', 'done_at')
    op.drop_index('ix_turns_group_id', table_name='turns',
                  postgresql_where=sa.text('group_id IS NOT NULL'))
    op.drop_column('turns', 'group_index')
    op.drop_column('turns', 'group_id')
