"""per-user LoRA adapters: which adapter serves a user, and which one served each turn

- `user_adapters` (one row per user): the engine adapter name, its version and folder, and
  `loaded` (true once the publisher loaded it into the engine). The proxy serves a user with
  their adapter while `loaded`, else the base model (docs/proxy.md, "Personal adapters").
- `turns.adapter`, `turns.adapter_version`: the adapter that served the turn; NULL: base.

`clawrl_readonly` reads new tables through migration 0002's default privileges and whole
`turns` rows, so nothing is granted here.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'user_adapters',
        sa.Column('user_id', sa.BigInteger(), nullable=False),
        sa.Column('name', sa.Text(), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('path', sa.Text(), nullable=False),
        sa.Column('loaded', sa.Boolean(), server_default=sa.text('false'), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('user_id'),
        sa.UniqueConstraint('name'),
    )
    op.add_column('turns', sa.Column('adapter', sa.Text(), nullable=True))
    op.add_column('turns', sa.Column('adapter_version', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('turns', 'adapter_version')
    op.drop_column('turns', 'adapter')
    op.drop_table('user_adapters')
