"""a login role for `clawrl sql`, and no key hashes for the read-only roles

`clawrl sql` connects as `clawrl_sql`, its own login role, never as the (super)user that runs
the stack: `SET LOCAL ROLE` on a superuser connection is no boundary (`RESET ROLE`,
`set_config('role', …)` inside a DO block undo it). The role is

- LOGIN, NOSUPERUSER, NOCREATEDB, NOCREATEROLE, NOREPLICATION, NOBYPASSRLS, 16 connections;
- a member of `clawrl_readonly` (migration 0002) only, so it reads what analysts read:
  every table and view, except `api_keys.secret_hash` (column grants below);
- read-only by default, with a statement timeout (60 s) and an idle-in-transaction timeout,
  whoever logs in as it.

It has no password: on a server with password authentication set one
(`ALTER ROLE clawrl_sql PASSWORD '…'`) and put it in ~/.pgpass or PGPASSWORD.

Roles are cluster-wide, grants per database. The role is created when missing and when the
migrating user may create roles (else `clawrl sql` refuses to run). Its USAGE on the schema
is granted directly in each database, so a downgrade here drops the role only when no other
database on the server still uses it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 15:00:00
"""

from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

ROLE = "clawrl_sql"
READONLY = "clawrl_readonly"
# api_keys columns an analyst may read: everything but secret_hash.
KEY_COLUMNS = "id, user_id, prefix, name, rate_limit_rpm, created_at, revoked_at, last_used_at"


# The role as upgrade() leaves it, attributes and settings, as a condition on pg_roles: it is
# altered only when this does not hold.
ROLE_AS_WANTED = (
    "rolcanlogin AND NOT rolsuper AND NOT rolcreatedb AND NOT rolcreaterole"
    " AND NOT rolreplication AND NOT rolbypassrls"
    " AND coalesce(rolconfig, '{}') @> ARRAY['statement_timeout=60s',"
    " 'idle_in_transaction_session_timeout=60s', 'default_transaction_read_only=on']")


def upgrade() -> None:

    op.execute(f"""
        DO $$
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                BEGIN
                    CREATE ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE
                        NOREPLICATION NOBYPASSRLS INHERIT CONNECTION LIMIT 16;
                EXCEPTION
                    WHEN duplicate_object OR unique_violation THEN NULL;
                    WHEN insufficient_privilege THEN
                        RAISE NOTICE 'no privilege to create role {ROLE}; skipped';
                END;
            END IF;
            -- Roles are cluster-wide: only what differs is altered, so databases migrated
            -- at once on one server (two stacks, two test workers) never write the same
            -- role's row concurrently ("tuple concurrently updated").
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}' AND NOT ({ROLE_AS_WANTED}))
            THEN
                BEGIN
                    -- A role of that name made by someone else must not keep more rights.
                    EXECUTE 'ALTER ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE'
                            ' NOREPLICATION NOBYPASSRLS';
                    EXECUTE 'ALTER ROLE {ROLE} SET statement_timeout = ''60s''';
                    EXECUTE 'ALTER ROLE {ROLE} SET idle_in_transaction_session_timeout = ''60s''';
                    EXECUTE 'ALTER ROLE {ROLE} SET default_transaction_read_only = on';
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'no privilege to alter role {ROLE}; kept as it is';
                END;
            END IF;
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                EXECUTE 'GRANT USAGE ON SCHEMA public TO {ROLE}';
                IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}')
                   AND NOT pg_has_role('{ROLE}', '{READONLY}', 'MEMBER') THEN
                    EXECUTE 'GRANT {READONLY} TO {ROLE}';
                END IF;
            END IF;
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}') THEN
                EXECUTE 'REVOKE SELECT ON api_keys FROM {READONLY}';
                EXECUTE 'GRANT SELECT ({KEY_COLUMNS}) ON api_keys TO {READONLY}';
            END IF;
        END $$;
    """)


def downgrade() -> None:
    op.execute(f"""
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READONLY}') THEN
                -- Revoking the table privilege revokes the column privileges too.
                EXECUTE 'REVOKE SELECT ON api_keys FROM {READONLY}';
                EXECUTE 'GRANT SELECT ON api_keys TO {READONLY}';
            END IF;
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}') THEN
                BEGIN
                    -- Revokes every grant to the role in this database.
                    EXECUTE 'DROP OWNED BY {ROLE}';
                EXCEPTION WHEN insufficient_privilege THEN
                    RAISE NOTICE 'no privilege to revoke grants of role {ROLE}; kept';
                    RETURN;
                END;
                IF NOT EXISTS (SELECT 1 FROM pg_shdepend d JOIN pg_roles r ON r.oid = d.refobjid
                               WHERE r.rolname = '{ROLE}') THEN
                    BEGIN
                        EXECUTE 'DROP ROLE {ROLE}';
                    EXCEPTION WHEN dependent_objects_still_exist OR undefined_object
                                   OR insufficient_privilege OR object_in_use THEN NULL;
                    END;
                END IF;
            END IF;
        END $$;
    """)
