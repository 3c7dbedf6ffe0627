"""turn kinds and agent context: why a turn is side or main, and a second fingerprint

- `turns.kind_reason`: 'header' (the client's `X-Turn-Type`), the name of the side-call rule
  that matched (proxy/turnkinds.py: 'silent_poll', 'summary', 'title'), or NULL.
- `turns.conversation_fingerprint`: the context fingerprint without the messages an agent
  appends after the request's opening message and never replays (proxy/sessions.py), with
  its partial index for open turns.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 01:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('turns', sa.Column('kind_reason', sa.String(length=32), nullable=True))
    op.add_column('turns', sa.Column('conversation_fingerprint', sa.LargeBinary(),
                                     nullable=True))
    op.create_index('ix_turns_user_conversation', 'turns',
                    ['user_id', 'conversation_fingerprint'], unique=False,
                    postgresql_where=sa.text(
                        "state = 'open' AND conversation_fingerprint IS NOT NULL"))


def downgrade() -> None:
    op.drop_index('ix_turns_user_conversation', table_name='turns',
                  postgresql_where=sa.text(
                      "state = 'open' AND conversation_fingerprint IS NOT NULL"))
    op.drop_column('turns', 'conversation_fingerprint')
    op.drop_column('turns', 'kind_reason')
