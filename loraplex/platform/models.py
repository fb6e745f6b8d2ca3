"""Registry tables (SQLAlchemy 2 typed ORM). ``Base.metadata`` is the one metadata
object the Alembic migrations in ``migrations/`` are generated from.

Tenants own API keys and adapters; an adapter has versions (each a validated,
content-addressed PEFT folder); usage counters aggregate requests and tokens
per tenant and UTC day.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import JSON, TypeDecorator

# Deterministic constraint names, so migrations can name what they drop.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    """Timezone-aware current UTC time (what every timestamp column stores)."""
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator):
    """``DateTime(timezone=True)`` that always returns aware UTC datetimes (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    """A customer. Limits are ``None`` when unlimited. ``weight``: its share under the fair
    scheduler (2 = twice the service of weight 1 when both wait); ``max_concurrent_requests``
    in the engine at once, ``max_queued_requests`` waiting beyond those (then 429),
    ``max_queue_time_s`` before the first scheduling step (then 503)."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_adapters: Mapped[int] = mapped_column(Integer)
    max_upload_mb: Mapped[float] = mapped_column(Float)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    max_queued_requests: Mapped[int | None] = mapped_column(Integer)
    max_queue_time_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", cascade="all, delete-orphan",
                                                  passive_deletes=True)
    adapters: Mapped[list[Adapter]] = relationship(back_populates="tenant", cascade="all, delete-orphan",
                                                   passive_deletes=True)


class ApiKey(Base):
    """A tenant's bearer key. Only ``sha256(key)`` and a short display prefix are stored."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class AdminKey(Base):
    """The generated admin key's hash (only used when ``LORAPLEX_ADMIN_KEY`` is unset)."""

    __tablename__ = "admin_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Adapter(Base):
    """A named adapter of one tenant; ``name`` is unique per tenant. The live version is
    the newest one whose status is ``ready``."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")
    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", passive_deletes=True,
        order_by="AdapterVersion.version")


class AdapterVersion(Base):
    """One uploaded, validated version. ``content_hash`` (sha256 hex, the adapters package's
    ``version_id``) names its folder under ``<data_dir>/adapters/``; ``id`` doubles as the
    engine's ``lora_int_id`` and is never reused, not even after a delete (SQLite
    ``AUTOINCREMENT``; PostgreSQL sequences never hand a value out twice): requests of a
    deleted version may still be running under its id. ``status``: ``ready`` (live),
    ``superseded`` (a newer version is live), ``broken`` (live, but its stored files failed
    the engine's content-hash check; see ``services.adapters``). ``adapter_type``: ``lora``
    or ``dora`` (``AdapterInfo.adapter_type``).
    """

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_id_version"),
                      {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    modules_to_save: Mapped[list[str]] = mapped_column(JSON, default=list, server_default=text("'[]'"))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    adapter_type: Mapped[str] = mapped_column(String(16), default="lora", server_default="lora")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class AdapterEvaluation(Base):
    """How one adapter version scored against the base model on one evaluation set.

    ``run_id`` groups the rows of one run (one row per evaluated adapter version; the base
    model's scores of that run are repeated in ``base_*``). ``task``: ``multiple_choice``
    (``accuracy`` = fraction of items whose answer has the highest log-likelihood) or
    ``generation`` (``accuracy`` = normalized exact match of greedy output). ``mean_loglik``:
    mean over items of the summed log-likelihood (nats) of the answer / reference tokens.
    ``examples``: a few ``{"prompt", "expected", "base", "adapter"}`` dicts.
    """

    __tablename__ = "adapter_evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    adapter_version_id: Mapped[int] = mapped_column(ForeignKey("adapter_versions.id", ondelete="CASCADE"),
                                                    index=True)
    run_id: Mapped[str] = mapped_column(String(32), index=True)
    eval_set_name: Mapped[str] = mapped_column(String(128))
    eval_set_sha256: Mapped[str] = mapped_column(String(64))
    task: Mapped[str] = mapped_column(String(16))
    num_items: Mapped[int] = mapped_column(Integer)
    accuracy: Mapped[float] = mapped_column(Float)
    mean_loglik: Mapped[float] = mapped_column(Float)
    base_model: Mapped[str] = mapped_column(String(128))
    base_accuracy: Mapped[float] = mapped_column(Float)
    base_mean_loglik: Mapped[float] = mapped_column(Float)
    examples: Mapped[list[dict]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    adapter_version: Mapped[AdapterVersion] = relationship()


class UsageCounter(Base):
    """Requests and tokens served to one tenant on one UTC day."""

    __tablename__ = "usage_counters"
    __table_args__ = (UniqueConstraint("tenant_id", "day", name="uq_usage_counters_tenant_id_day"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    day: Mapped[dt.date] = mapped_column(Date)
    requests: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


__all__ = ["Base", "Tenant", "ApiKey", "AdminKey", "Adapter", "AdapterVersion", "UsageCounter", "AdapterEvaluation", "utcnow"]
