"""admin views and a read-only role

Views for admins and analysts (query them with `clawrl sql "…"`):

- `turns_with_rewards`: one row per turn with its latest judgment (reward, hint, why).
- `reward_by_version`: per served weight version: turns, judged turns, mean reward,
  how many +1 / 0 / -1 / abstentions, accepted hints.
- `activity_by_user`: per user: opt-outs, live keys, sessions, turns (total, last 24 h),
  last turn time, mean reward.
- `session_turns`: turns in session order with the user's last message, the reply text and
  the next state that followed it (what the judge sees).

`clawrl_readonly` is a NOLOGIN role granted SELECT on every table and view (also future
tables), for analysts: `GRANT clawrl_readonly TO alice;`. `clawrl sql` runs its queries as
this role. Roles are cluster-wide: the role is created only if missing and only when the
migrating user may create roles; downgrade revokes this database's grants and drops the
role only when nothing else on the server still depends on it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 15:50:00
"""

from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

ROLE = "clawrl_readonly"

VIEWS = {
    "turns_with_rewards": """
        SELECT t.id AS turn_id, t.uid, t.user_id, u.name AS user_name, t.session_id,
               t.index_in_session, t.kind, t.status, t.state, t.created_at,
               t.weight_version, t.finish_reason, t.latency_ms,
               cardinality(t.response_ids) AS response_tokens,
               t.request_messages, t.response_message, t.next_state,
               j.id AS judgment_id, j.reward, j.hint, j.reason AS judge_reason,
               j.prompt_version, j.judge_model, j.created_at AS judged_at,
               j.teacher_logprobs IS NOT NULL AS has_teacher_logprobs
        FROM turns t
        JOIN users u ON u.id = t.user_id
        LEFT JOIN LATERAL (
            SELECT * FROM judgments jj WHERE jj.turn_id = t.id
            ORDER BY jj.created_at DESC, jj.id DESC LIMIT 1
        ) j ON true
    """,
    "reward_by_version": """
        SELECT weight_version,
               count(*) AS turns,
               count(judgment_id) AS judged,
               avg(reward)::double precision AS reward_mean,
               count(*) FILTER (WHERE reward = 1) AS positive,
               count(*) FILTER (WHERE reward = 0) AS neutral,
               count(*) FILTER (WHERE reward = -1) AS negative,
               count(*) FILTER (WHERE judgment_id IS NOT NULL AND reward IS NULL)
                   AS abstained,
               count(hint) AS hints,
               min(created_at) AS first_turn_at,
               max(created_at) AS last_turn_at
        FROM turns_with_rewards
        WHERE kind = 'main'
        GROUP BY weight_version
    """,
    "activity_by_user": """
        SELECT u.id AS user_id, u.name AS user_name, u.created_at,
               u.train_opt_out, u.log_opt_out,
               (SELECT count(*) FROM api_keys k
                 WHERE k.user_id = u.id AND k.revoked_at IS NULL) AS live_keys,
               (SELECT count(*) FROM sessions s WHERE s.user_id = u.id) AS sessions,
               count(t.turn_id) AS turns,
               count(t.turn_id) FILTER (WHERE t.created_at > now() - interval '24 hours')
                   AS turns_24h,
               count(t.turn_id) FILTER (WHERE t.status <> 'ok') AS failed_turns,
               max(t.created_at) AS last_turn_at,
               avg(t.reward)::double precision AS reward_mean
        FROM users u
        LEFT JOIN turns_with_rewards t ON t.user_id = u.id
        GROUP BY u.id
    """,
    "session_turns": """
        SELECT t.session_id, t.index_in_session, t.id AS turn_id, u.name AS user_name,
               t.kind, t.state, t.status, t.created_at,
               (SELECT m->>'content' FROM jsonb_array_elements(t.request_messages)
                    WITH ORDINALITY AS e(m, i)
                 WHERE m->>'role' = 'user' ORDER BY i DESC LIMIT 1) AS last_user_message,
               t.response_message->>'content' AS reply,
               t.next_state, t.next_state_at, t.next_turn_id
        FROM turns t
        JOIN users u ON u.id = t.user_id
    """,
}


def upgrade() -> None:
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body}")
        op.execute(f"COMMENT ON VIEW {name} IS "
                   f"'clawrl admin view (migrations/versions/0002_admin_views.py)'")
    # Create the role when missing; a managed Postgres may not let us (then skip it).
    op.execute(f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                BEGIN
                    CREATE ROLE {ROLE} NOLOGIN;
                EXCEPTION
                    WHEN duplicate_object OR unique_violation THEN NULL;
                    WHEN insufficient_privilege THEN
                        RAISE NOTICE 'no privilege to create role {ROLE}; skipped';
                END;
            END IF;
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                EXECUTE 'GRANT USAGE ON SCHEMA public TO {ROLE}';
                EXECUTE 'GRANT SELECT ON ALL TABLES IN SCHEMA public TO {ROLE}';
                EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {ROLE}';
            END IF;
        END $$;
    """)


def downgrade() -> None:
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                -- Revokes every grant (and default privilege) to the role in this database.
                BEGIN
                    EXECUTE 'DROP OWNED BY {ROLE}';
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'no privilege to revoke grants of role {ROLE}; kept';
                    RETURN;
                END;
                IF NOT EXISTS (SELECT 1 FROM pg_shdepend d JOIN pg_roles r ON r.oid = d.refobjid
                               WHERE r.rolname = '{ROLE}')
                   AND NOT EXISTS (SELECT 1 FROM pg_auth_members m JOIN pg_roles r
                                   ON r.oid = m.roleid WHERE r.rolname = '{ROLE}') THEN
                    BEGIN
                        EXECUTE 'DROP ROLE {ROLE}';
                    EXCEPTION WHEN dependent_objects_still_exist OR undefined_object
                                   OR insufficient_privilege THEN NULL;
                    END;
                END IF;
            END IF;
        END $$;
    """)
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
