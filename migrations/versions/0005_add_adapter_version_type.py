"""Add adapter_versions.adapter_type: "lora" or "dora" (issue 19, DoRA adapters are served).

Existing versions are plain LoRA (DoRA uploads were refused before), so they get "lora".
Downgrade drops the column.

Revision ID: 0005_add_adapter_version_type
Revises: 0004_add_adapter_evaluations
Create Date: 2026-12-01 03:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005_add_adapter_version_type'
down_revision: str | None = '0004_add_adapter_evaluations'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('adapter_type', sa.String(length=16), server_default='lora', nullable=False))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35 has it), never a batch rebuild: rebuilding
    # ``adapter_versions`` drops the old table, and with foreign keys on that deletes every
    # version's evaluations through ON DELETE CASCADE.
    op.drop_column('adapter_versions', 'adapter_type')
