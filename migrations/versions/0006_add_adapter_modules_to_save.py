"""Add adapter_versions.modules_to_save: the modules an adapter version replaces by a full copy.

PEFT ``modules_to_save`` copies of ``embed_tokens`` / ``lm_head`` (a JSON list of module names,
``[]`` for plain LoRA). Existing versions get ``[]``. Downgrade drops the column.

Revision ID: 0006_add_adapter_modules_to_save
Revises: 0005_add_adapter_version_type
Create Date: 2026-12-01 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006_add_adapter_modules_to_save'
down_revision: str | None = '0005_add_adapter_version_type'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE ... ADD COLUMN, never a batch rebuild: rebuilding ``adapter_versions`` would drop its
    # AUTOINCREMENT (0003) and, with foreign keys on, its evaluations through ON DELETE CASCADE.
    op.add_column('adapter_versions',
                  sa.Column('modules_to_save', sa.JSON(), server_default=sa.text("'[]'"), nullable=False))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN, never a batch rebuild (see 0002).
    op.drop_column('adapter_versions', 'modules_to_save')
