"""Migration 0006 (adapter_versions.modules_to_save) on SQLite: existing versions (inserted before 0005 added
adapter_type) get [] and keep their ids and AUTOINCREMENT; the downgrade to 0005 drops only that column."""

from __future__ import annotations

import sqlalchemy as sa


def test_existing_versions_get_no_copies_and_survive_the_round_trip(tmp_path):
    from loraplex.platform.db import downgrade_database, make_db_engine, upgrade_database
    from loraplex.platform.models import AdapterVersion

    engine = make_db_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    upgrade_database(engine, "0004_add_adapter_evaluations")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenants (id, name, max_adapters, max_upload_mb, weight, created_at) VALUES (1, 't', 5, 1.0, 1.0, '2026-01-01')"))
        conn.execute(sa.text("INSERT INTO adapters VALUES (1, 1, 'a', '2026-01-01')"))
        conn.execute(sa.text("INSERT INTO adapter_versions (adapter_id, version, content_hash, rank, alpha, "
                             "target_modules, size_bytes, status, created_at) VALUES (1, 1, :h, 4, 8.0, "
                             "'[\"q_proj\"]', 1, 'ready', '2026-01-01')"), {"h": "h" * 64})
    upgrade_database(engine)
    with sa.orm.Session(engine) as session:
        [version] = session.scalars(sa.select(AdapterVersion)).all()
        assert (version.id, version.target_modules, version.modules_to_save, version.adapter_type) == (
            1, ["q_proj"], [], "lora")
    with engine.connect() as conn:
        sql = conn.execute(sa.text("SELECT sql FROM sqlite_master WHERE name = 'adapter_versions'")).scalar()
    assert "AUTOINCREMENT" in sql and "modules_to_save" in sql
    downgrade_database(engine, "0005_add_adapter_version_type")
    with engine.connect() as conn:
        columns = [row[1] for row in conn.execute(sa.text("PRAGMA table_info(adapter_versions)"))]
        assert "modules_to_save" not in columns and "adapter_type" in columns
        assert conn.execute(sa.text("SELECT id, version FROM adapter_versions")).all() == [(1, 1)]
    engine.dispose()
