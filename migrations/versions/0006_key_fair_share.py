"""per-key fair share: requests in flight and tokens per minute

`api_keys.max_concurrent` (requests of the key in flight at once) and
`api_keys.rate_limit_tpm` (prompt + completion tokens per minute), beside
`rate_limit_rpm`: NULL means the proxy's default, 0 unlimited (proxy/limits.py).
Analysts (`clawrl_readonly`, migration 0004's column grants) may read both.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 13:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

READONLY = "clawrl_readonly"


def upgrade() -> None:
    op.add_column('api_keys', sa.Column('max_concurrent', sa.Integer(), nullable=True))
    op.add_column('api_keys', sa.Column('rate_limit_tpm', sa.Integer(), nullable=True))
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}') THEN
                EXECUTE 'GRANT SELECT (max_concurrent, rate_limit_tpm) ON api_keys TO {READONLY}';
            END IF;
        END $$;
    """)


def downgrade() -> None:
    # Dropping a column drops its column grants with it.
    op.drop_column('api_keys', 'rate_limit_tpm')
    op.drop_column('api_keys', 'max_concurrent')
