"""Adapter version ids (the engine's ``lora_int_id``) are never reused: SQLite AUTOINCREMENT.

SQLite hands out ``max(rowid) + 1``, so deleting the newest version freed its id for the
next upload while requests of the deleted version could still be running under it (issue
14, item 9). ``AUTOINCREMENT`` keeps the largest id ever used in ``sqlite_sequence``.
SQLite cannot alter a table's key, so the table is rebuilt (batch mode copies the rows and
their ids). PostgreSQL's ``SERIAL`` sequence never hands out a value twice: nothing to do.

Revision ID: 0003_version_ids_never_reused (alembic_version holds at most 32 characters)
Revises: 0002_tenant_fair_share_limits
Create Date: 2026-11-30 15:05:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0003_version_ids_never_reused'
down_revision: str | None = '0002_tenant_fair_share_limits'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _rebuild_adapter_versions(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table('adapter_versions', recreate='always',
                              table_kwargs={'sqlite_autoincrement': autoincrement}):
        pass


def upgrade() -> None:
    _rebuild_adapter_versions(True)


def downgrade() -> None:
    _rebuild_adapter_versions(False)
