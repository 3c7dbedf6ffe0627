"""session outcomes: a verifier's outcome per session, mixed into the trainer's rewards

- `sessions.outcome` (double, in [-1, 1]) with who and when set it: `outcome_source`
  ('api': `POST /v1/sessions/{id}/outcome`, 'header': `X-Session-Outcome`),
  `outcome_key_id` (the API key; SET NULL when the key row goes) and `outcome_at`.
- `samples.outcome`: the outcome the trainer mixed into a sample's reward, written with
  `trained_step` (docs/trainer.md, "Outcome rewards").
- Views: `turns_with_rewards` and `session_turns` gain a last column `session_outcome`;
  a new view `session_outcomes` has one row per session (outcome, who/when, its main turns,
  judged turns, mean process reward, trained samples and how many of them saw the outcome).

`clawrl_readonly` (migration 0002) reads whole tables, so the new columns are readable as
they are; the new view is granted to it explicitly (its default privileges only cover
objects made by the role that set them).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04 10:00:00
"""

import importlib.util
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

READONLY = "clawrl_readonly"
_COMMENT = "clawrl admin view (migrations/versions/{file})"
_THIS = Path(__file__).name


def _views_0002() -> dict[str, str]:
    """The 0002 view bodies (what a downgrade restores), read from that revision's file."""
    spec = importlib.util.spec_from_file_location(
        "clawrl_migration_0002", Path(__file__).with_name("0002_admin_views.py"))
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    views: dict[str, str] = module.VIEWS
    return views


# Appended columns only: CREATE OR REPLACE VIEW keeps the view (its grants and dependants).
TURNS_WITH_REWARDS = """
    SELECT t.id AS turn_id, t.uid, t.user_id, u.name AS user_name, t.session_id,
           t.index_in_session, t.kind, t.status, t.state, t.created_at,
           t.weight_version, t.finish_reason, t.latency_ms,
           cardinality(t.response_ids) AS response_tokens,
           t.request_messages, t.response_message, t.next_state,
           j.id AS judgment_id, j.reward, j.hint, j.reason AS judge_reason,
           j.prompt_version, j.judge_model, j.created_at AS judged_at,
           j.teacher_logprobs IS NOT NULL AS has_teacher_logprobs,
           s.outcome AS session_outcome
    FROM turns t
    JOIN users u ON u.id = t.user_id
    LEFT JOIN sessions s ON s.id = t.session_id
    LEFT JOIN LATERAL (
        SELECT * FROM judgments jj WHERE jj.turn_id = t.id
        ORDER BY jj.created_at DESC, jj.id DESC LIMIT 1
    ) j ON true
"""

SESSION_TURNS = """
    SELECT t.session_id, t.index_in_session, t.id AS turn_id, u.name AS user_name,
           t.kind, t.state, t.status, t.created_at,
           (SELECT m->>'content' FROM jsonb_array_elements(t.request_messages)
                WITH ORDINALITY AS e(m, i)
             WHERE m->>'role' = 'user' ORDER BY i DESC LIMIT 1) AS last_user_message,
           t.response_message->>'content' AS reply,
           t.next_state, t.next_state_at, t.next_turn_id,
           s.outcome AS session_outcome
    FROM turns t
    JOIN users u ON u.id = t.user_id
    LEFT JOIN sessions s ON s.id = t.session_id
"""

SESSION_OUTCOMES = """
    SELECT s.id AS session_id, s.user_id, u.name AS user_name, s.external_id,
           s.created_at, s.last_turn_at, s.closed_at,
           s.outcome, s.outcome_source, s.outcome_at,
           count(t.turn_id) AS turns,
           count(t.judgment_id) AS judged,
           avg(t.reward)::double precision AS process_reward_mean,
           (SELECT count(*) FROM samples sm JOIN turns st ON st.id = sm.turn_id
             WHERE st.session_id = s.id AND sm.trained_step IS NOT NULL) AS trained_samples,
           (SELECT count(*) FROM samples sm JOIN turns st ON st.id = sm.turn_id
             WHERE st.session_id = s.id AND sm.trained_step IS NOT NULL
               AND sm.outcome IS NOT NULL) AS trained_with_outcome
    FROM sessions s
    JOIN users u ON u.id = s.user_id
    LEFT JOIN turns_with_rewards t ON t.session_id = s.id AND t.kind = 'main'
    GROUP BY s.id, u.name
"""


def _grant(view: str) -> None:
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}') THEN
                EXECUTE 'GRANT SELECT ON {view} TO {READONLY}';
            END IF;
        END $$;
    """)


def upgrade() -> None:
    op.add_column('sessions', sa.Column('outcome', sa.Double(), nullable=True))
    op.add_column('sessions', sa.Column('outcome_source', sa.String(length=16), nullable=True))
    op.add_column('sessions', sa.Column(
        'outcome_key_id', sa.BigInteger(),
        sa.ForeignKey('api_keys.id', ondelete='SET NULL'), nullable=True))
    op.add_column('sessions', sa.Column('outcome_at', sa.DateTime(timezone=True),
                                        nullable=True))
    op.add_column('samples', sa.Column('outcome', sa.Double(), nullable=True))
    op.execute(f"CREATE OR REPLACE VIEW turns_with_rewards AS {TURNS_WITH_REWARDS}")
    op.execute(f"CREATE OR REPLACE VIEW session_turns AS {SESSION_TURNS}")
    op.execute(f"CREATE VIEW session_outcomes AS {SESSION_OUTCOMES}")
    op.execute("COMMENT ON VIEW session_outcomes IS "
               f"'{_COMMENT.format(file=_THIS)}'")
    _grant("session_outcomes")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS session_outcomes")
    # A view cannot lose a column in place: drop the 0002 views and make them again.
    views = _views_0002()
    for name in reversed(list(views)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for name, body in views.items():
        op.execute(f"CREATE VIEW {name} AS {body}")
        op.execute(f"COMMENT ON VIEW {name} IS '{_COMMENT.format(file='0002_admin_views.py')}'")
        _grant(name)
    op.drop_column('samples', 'outcome')
    op.drop_column('sessions', 'outcome_at')
    op.drop_column('sessions', 'outcome_key_id')
    op.drop_column('sessions', 'outcome_source')
    op.drop_column('sessions', 'outcome')
