"""Alembic environment for the loraplex registry.

The database comes from, in order: an engine passed by
``loraplex.platform.db.alembic_config`` (``config.attributes["engine"]``), the
``sqlalchemy.url`` option, or the platform settings (``LORAPLEX_DATABASE_URL`` /
``LORAPLEX_DATA_DIR``). SQLite runs in batch mode so ALTERs work there too.
"""

from __future__ import annotations

import logging.config

from alembic import context

from loraplex.platform.db import make_db_engine
from loraplex.platform.models import Base

config = context.config
if config.config_file_name is not None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _engine():
    engine = config.attributes.get("engine")
    if engine is not None:
        return engine
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        from loraplex.platform.settings import Settings

        url = Settings().resolved_database_url
    return make_db_engine(url)


def run_migrations_offline() -> None:
    url = config.get_main_option("sqlalchemy.url") or str(_engine().url)
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = _engine()
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite", compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
