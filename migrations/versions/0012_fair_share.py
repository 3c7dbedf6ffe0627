"""fair share across users: the indexes of the fair claims and the view `training_shares`

- `ix_jobs_claimable_owner` (kind, coalesce(user_id, 0), available_at, id), partial on the
  claimable states like `ix_jobs_claimable`: the judge workers' claim visits each user with
  claimable jobs (a loose index scan) and takes each one's oldest first (clawrl/base/jobs.py).
- `ix_samples_ready_user` (user_id, id), partial on the untrained, unskipped samples: the
  trainer's claim draws each user's oldest ready samples round robin (trainer/data.py).
- `ix_samples_trained_step` (trained_step) where set, and `ix_training_steps_created_at`:
  a user's samples trained into the shared model in the last window (the trainer's cap per
  user per window), the view below and the proxy's `/metrics` read them per step.
- Queued and running judge jobs get their turn's user in `jobs.user_id` (added by 0011), so
  jobs queued before this revision are claimed fairly too.
- View `training_shares`: one row per shared-model training step (= version) and user: the
  samples of that user the step trained and their share of the step's samples. Granted to
  `clawrl_readonly` (its default privileges cover only objects made by the role that set
  them).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 06:00:00
"""

from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

READONLY = "clawrl_readonly"
_COMMENT = f"clawrl admin view (migrations/versions/{Path(__file__).name})"

TRAINING_SHARES = """
    SELECT ts.version, ts.step, ts.created_at AS trained_at, s.user_id, u.name AS user_name,
           count(*) AS samples,
           sum(count(*)) OVER (PARTITION BY ts.step) AS version_samples,
           (count(*)::double precision
            / sum(count(*)) OVER (PARTITION BY ts.step))::double precision AS share
    FROM training_steps ts
    JOIN samples s ON s.trained_step = ts.step
    JOIN users u ON u.id = s.user_id
    WHERE ts.user_id IS NULL
    GROUP BY ts.step, s.user_id, u.name
"""


def upgrade() -> None:
    op.create_index('ix_jobs_claimable_owner', 'jobs',
                    ['kind', sa.text('coalesce(user_id, 0)'), 'available_at', 'id'],
                    unique=False, postgresql_where=sa.text("status IN ('queued', 'running')"))
    op.create_index('ix_samples_ready_user', 'samples', ['user_id', 'id'], unique=False,
                    postgresql_where=sa.text('trained_step IS NULL AND skipped_reason IS NULL'))
    op.create_index('ix_samples_trained_step', 'samples', ['trained_step'], unique=False,
                    postgresql_where=sa.text('trained_step IS NOT NULL'))
    op.create_index('ix_training_steps_created_at', 'training_steps', ['created_at'],
                    unique=False)
    op.execute("""
        UPDATE jobs SET user_id = t.user_id FROM turns t
        WHERE t.id = jobs.turn_id AND jobs.user_id IS NULL
          AND jobs.status IN ('queued', 'running')
    """)
    op.execute(f"CREATE VIEW training_shares AS {TRAINING_SHARES}")
    op.execute(f"COMMENT ON VIEW training_shares IS '{_COMMENT}'")
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}') THEN
                EXECUTE 'GRANT SELECT ON training_shares TO {READONLY}';
            END IF;
        END $$;
    """)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS training_shares")
    op.drop_index('ix_training_steps_created_at', table_name='training_steps')
    op.drop_index('ix_samples_trained_step', table_name='samples')
    op.drop_index('ix_samples_ready_user', table_name='samples')
    op.drop_index('ix_jobs_claimable_owner', table_name='jobs')
