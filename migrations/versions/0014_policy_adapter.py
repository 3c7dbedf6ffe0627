"""the shared model as a LoRA adapter: `policy_versions.adapter`

The trainer publishes a shared-model version trained as a LoRA adapter on the frozen base
with `/load_lora_adapter` under `policy-v{N}` (trainer/policy_adapter.py) and names it in
its version's row; the proxy serves users without a personal adapter the newest published
version's adapter (proxy/auth.py). NULL: a full-weight version (swapped into the engine with
`/update_weights_from_disk`), and every version written before this revision.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 12:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('policy_versions', sa.Column('adapter', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('policy_versions', 'adapter')
