"""Migrations and the registry on SQLite and on a real PostgreSQL server
(``LORAPLEX_TEST_DATABASE_URL``; see scripts/ci_services.sh)."""

from __future__ import annotations

import io

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from platform_testlib import adapter_members, make_peft_adapter, make_settings, new_tenant, zip_bytes

from loraplex.platform.db import downgrade_database, make_db_engine, upgrade_database
from loraplex.platform.models import Adapter, AdapterVersion, ApiKey, Base, Tenant, UsageCounter

TABLES = {"tenants", "api_keys", "admin_keys", "adapters", "adapter_versions", "usage_counters",
          "adapter_evaluations"}


def _engine(database_url, tmp_path) -> sa.Engine:
    return make_db_engine(database_url or f"sqlite:///{tmp_path / 'registry.db'}")


def _tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade_on_an_empty_database(database_url, tmp_path):
    engine = _engine(database_url, tmp_path)
    assert _tables(engine) == set()
    upgrade_database(engine)
    assert _tables(engine) == TABLES
    with engine.connect() as conn:  # the migrations produce exactly the models' schema
        assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []
    downgrade_database(engine)
    assert _tables(engine) == set()
    upgrade_database(engine)
    assert _tables(engine) == TABLES
    upgrade_database(engine)  # idempotent
    engine.dispose()


def test_registry_round_trip(database_url, tmp_path, serve, tiny_llama_dir):
    """Tenants, keys, adapters, usage and cascading delete on the chosen database."""
    live = serve(database_url=database_url)
    assert live.ctx.db.dialect.name == ("sqlite" if database_url is None else "postgresql")
    key = new_tenant(live, "acme", requests_per_minute=50, max_upload_mb=5)
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "adapter")
    with live.admin() as admin, live.tenant(key) as client:
        upload = admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                            files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")})
        assert upload.status_code == 201, upload.text
        assert admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                          files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")}
                          ).json()["version"] == 2
        done = client.post("/v1/completions", json={"model": "poet", "prompt": "hi", "max_tokens": 3,
                                                    "ignore_eos": True})
        assert done.status_code == 200, done.text
        usage = done.json()["usage"]
        assert live.ctx.usage.flush()  # usage is written by a background writer
        stats = admin.get("/admin/stats").json()
        assert stats["tenants"] == [{"tenant": "acme", "requests": 1, "prompt_tokens": usage["prompt_tokens"],
                                     "completion_tokens": 3}]
        tenant = admin.get("/admin/tenants/acme").json()
        assert (tenant["num_keys"], tenant["num_adapters"], tenant["requests_per_minute"]) == (1, 1, 50)
        assert admin.delete("/admin/tenants/acme").status_code == 204
    with live.ctx.sessions() as session:
        counts = [session.scalar(sa.select(sa.func.count()).select_from(t))
                  for t in (Tenant, ApiKey, Adapter, AdapterVersion, UsageCounter)]
    assert counts == [0, 0, 0, 0, 0]


def test_generated_admin_key_is_printed_once_and_only_its_hash_stored(database_url, tmp_path):
    from loraplex.platform.context import build_context

    settings = make_settings(tmp_path, admin_key=None, database_url=database_url)
    first_out, second_out = io.StringIO(), io.StringIO()
    ctx = build_context(settings, None, out=first_out)
    key = first_out.getvalue().strip().rsplit(" ", 1)[-1]
    assert key.startswith("lpx-admin-") and len(key) > 40
    again = build_context(settings, None, out=second_out)
    assert second_out.getvalue() == ""  # printed once
    assert again.admin_key_hash == ctx.admin_key_hash
    with ctx.db.connect() as conn:
        dump = " ".join(str(row) for row in conn.execute(sa.text("SELECT * FROM admin_keys")))
    assert key not in dump and ctx.admin_key_hash in dump
    from loraplex.platform.services.tenants import authenticate_admin

    authenticate_admin(ctx=ctx, token=key)
    from loraplex.platform.errors import Unauthenticated

    with pytest.raises(Unauthenticated):
        authenticate_admin(ctx=ctx, token=key + "x")
    ctx.db.dispose()
    again.db.dispose()


def test_newest_migration_file_is_alembics_head(database_url, tmp_path):
    """The fast path of ``upgrade_database`` (no Alembic import when the database is current)
    relies on file stems being the revision ids, in order: check it against Alembic itself."""
    from alembic.script import ScriptDirectory

    from loraplex.platform.db import alembic_config, current_revision, newest_migration_id

    engine = make_db_engine(database_url or f"sqlite:///{tmp_path / 'r.db'}")
    try:
        assert current_revision(engine) is None
        upgrade_database(engine)
        head = ScriptDirectory.from_config(alembic_config(engine)).get_current_head()
        assert newest_migration_id() == head == current_revision(engine) == "0006_add_adapter_modules_to_save"
    finally:
        engine.dispose()
