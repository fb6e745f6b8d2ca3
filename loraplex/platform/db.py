"""Database engine, sessions and migrations.

SQLite (a file under ``data_dir``) is the embedded default; PostgreSQL works
through ``LORAPLEX_DATABASE_URL`` (``postgresql+psycopg://...``). The schema is
owned by the Alembic migrations in ``<repo>/migrations`` and applied at start
with :func:`upgrade_database`; Alembic is imported only when a migration has to run
(a database already at the newest revision costs one query, which keeps CLI calls fast).
Migration files are named ``<revision id>.py`` with ids that sort in order (``0001_...``).
"""

from __future__ import annotations

import re

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
CONNECT_TIMEOUT_S = 5


def make_db_engine(url: str) -> sa.Engine:
    """Create the SQLAlchemy engine for ``url`` (PostgreSQL: connections time out after
    ``CONNECT_TIMEOUT_S``). For SQLite: creates the parent folder,
    allows use from the server's worker threads, turns on foreign keys (cascading
    deletes) and WAL journaling, and waits up to 30 s for a lock."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
        # An unreachable (black-holed) server must fail a connection attempt in seconds, not minutes:
        # waiting request threads would otherwise exhaust the worker pool.
        return sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    if parsed.get_backend_name() != "sqlite":
        return sa.create_engine(url, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    sa.event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def make_session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (responses are built after it)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any exception."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def alembic_config(engine: sa.Engine) -> Config:
    """An Alembic config for ``engine`` using the repository's ``migrations/`` folder."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    config.attributes["engine"] = engine
    return config


def upgrade_database(engine: sa.Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (idempotent)."""
    if revision == "head" and current_revision(engine) == newest_migration_id():
        return
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def newest_migration_id() -> str:
    """Revision id of the newest migration file: file names start with a 4-digit sequence number
    (``0004_...``) and sort in order; the id is the file's ``revision`` line (ids are at most 32
    characters, ``alembic_version``'s width, so they may be shorter than the file stem)."""
    newest = max((MIGRATIONS_DIR / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"), key=lambda p: p.name)
    match = re.search(r"^revision: str = ['\"]([^'\"]+)['\"]", newest.read_text(encoding="utf-8"), re.M)
    if match is None:
        raise RuntimeError(f"{newest.name}: no `revision: str = '...'` line")
    return match.group(1)


def current_revision(engine: sa.Engine) -> str | None:
    """The revision stored in ``alembic_version``; None for a database without migrations."""
    with engine.connect() as connection:
        if not sa.inspect(connection).has_table("alembic_version"):
            return None
        rows = connection.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    return rows[0] if len(rows) == 1 else None


def downgrade_database(engine: sa.Engine, revision: str = "base") -> None:
    """Revert migrations down to ``revision`` (``base`` = empty database)."""
    from alembic import command

    command.downgrade(alembic_config(engine), revision)
