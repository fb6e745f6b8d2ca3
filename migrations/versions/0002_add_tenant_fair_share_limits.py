"""Add tenant fair-share settings: scheduling weight and queueing limits.

``weight`` (fair scheduler share, default 1), ``max_concurrent_requests``,
``max_queued_requests`` and ``max_queue_time_s`` (NULL = unlimited). Existing
tenants get weight 1 and no limits. Downgrade drops the four columns.

Revision ID: 0002_tenant_fair_share_limits
Revises: 0001_create_registry_tables
Create Date: 2026-11-30 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002_tenant_fair_share_limits'
down_revision: str | None = '0001_create_registry_tables'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weight', sa.Float(), server_default='1', nullable=False))
        batch_op.add_column(sa.Column('max_concurrent_requests', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_queued_requests', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_queue_time_s', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('max_queue_time_s')
        batch_op.drop_column('max_queued_requests')
        batch_op.drop_column('max_concurrent_requests')
        batch_op.drop_column('weight')
