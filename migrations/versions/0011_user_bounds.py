"""no one user steers: key scopes, the sampling a turn was drawn with, job owners, console
sessions that outlive a restart

- `api_keys.scopes` (text[], default empty): what a key may do beyond chatting. 'verifier'
  lets it set session outcomes (`X-Session-Outcome`, `POST /v1/sessions/{id}/outcome`):
  environments, graders and admins hold it; an ordinary user key does not.
- `turns.sampling` (jsonb): the sampling distribution the reply was drawn from, as the
  engine applied it (the request's parameters over the model's defaults): temperature,
  top_p, top_k, min_p, penalties and whether a logit_bias was sent. The trainer reads it to
  keep the importance ratio on the behaviour distribution or to skip the sample.
- `jobs.user_id`: whose turn a job serves, so workers can claim fairly across users.
- `console_sessions`: signed-in console sessions (only a hash of the cookie is stored), so
  signing out holds across processes and restarts.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 04:20:00
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('api_keys', sa.Column(
        'scopes', postgresql.ARRAY(sa.Text()), nullable=False,
        server_default=sa.text("'{}'::text[]")))
    op.add_column('turns', sa.Column('sampling', postgresql.JSONB(), nullable=True))
    op.add_column('jobs', sa.Column(
        'user_id', sa.BigInteger(), sa.ForeignKey('users.id', ondelete='CASCADE'),
        nullable=True))
    op.create_table(
        'console_sessions',
        sa.Column('token_hash', sa.Text(), primary_key=True),
        sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    op.drop_table('console_sessions')
    op.drop_column('jobs', 'user_id')
    op.drop_column('turns', 'sampling')
    op.drop_column('api_keys', 'scopes')
