"""per-user adapter versions: every personal adapter the trainer saved, per user

- `adapter_versions` (one row per user and version): the folder, its status ('saved',
  'published', 'retired'), the training step that made it and its figures. A user's
  versions count 1, 2, … on their own; deleting the user deletes the rows (and
  `clawrl users delete` the folders and the engine's copy).
- `training_steps.user_id`: the user whose adapter a step trained (personal mode); NULL for
  a step of the shared model. Deleting the user deletes their steps.

`clawrl_readonly` reads new tables through migration 0002's default privileges.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 10:00:00
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'adapter_versions',
        sa.Column('user_id', sa.BigInteger(), nullable=False),
        sa.Column('version', sa.Integer(), nullable=False),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('path', sa.Text(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('num_samples', sa.Integer(), server_default=sa.text('0'), nullable=False),
        sa.Column('loss', sa.Double(), nullable=True),
        sa.Column('reward_mean', sa.Double(), nullable=True),
        sa.Column('stats', postgresql.JSONB(astext_type=sa.Text()),
                  server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'),
                  nullable=False),
        sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['user_id'], ['users.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('user_id', 'version'),
    )
    op.add_column('training_steps', sa.Column('user_id', sa.BigInteger(), nullable=True))
    op.create_foreign_key('training_steps_user_id_fkey', 'training_steps', 'users',
                          ['user_id'], ['id'], ondelete='CASCADE')


def downgrade() -> None:
    op.drop_constraint('training_steps_user_id_fkey', 'training_steps', type_='foreignkey')
    op.drop_column('training_steps', 'user_id')
    op.drop_table('adapter_versions')
