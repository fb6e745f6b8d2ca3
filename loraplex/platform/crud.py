"""Database reads and writes of the registry. Keyword-only functions over a
``Session``; they flush but never commit (the service layer commits, then
invalidates caches). Missing rows raise :class:`~loraplex.platform.errors.NotFound`.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.platform.errors import Conflict, LimitExceeded, NotFound
from loraplex.platform.models import (
    Adapter,
    AdapterEvaluation,
    AdapterVersion,
    AdminKey,
    ApiKey,
    Tenant,
    UsageCounter,
    utcnow,
)

READY = "ready"
SUPERSEDED = "superseded"
BROKEN = "broken"  # live, but its stored files failed the engine's content-hash check
LIVE = (READY, BROKEN)


# -- tenants ---------------------------------------------------------------------------------------
def create_tenant(*, session: Session, name: str, requests_per_minute: int | None, tokens_per_minute: int | None,
                  max_adapters: int, max_upload_mb: float, weight: float = 1.0,
                  max_concurrent_requests: int | None = None, max_queued_requests: int | None = None,
                  max_queue_time_s: float | None = None) -> Tenant:
    """Insert a tenant; raises ``Conflict`` if the name is taken."""
    if session.scalar(sa.select(Tenant.id).where(Tenant.name == name)) is not None:
        raise Conflict(f"tenant {name!r} already exists", param="name")
    tenant = Tenant(name=name, requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute,
                    max_adapters=max_adapters, max_upload_mb=max_upload_mb, weight=weight,
                    max_concurrent_requests=max_concurrent_requests, max_queued_requests=max_queued_requests,
                    max_queue_time_s=max_queue_time_s)
    session.add(tenant)
    session.flush()
    return tenant


def get_tenant(*, session: Session, name: str) -> Tenant:
    tenant = session.scalar(sa.select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(f"tenant {name!r} does not exist", param="tenant")
    return tenant


def list_tenants(*, session: Session) -> list[Tenant]:
    return list(session.scalars(sa.select(Tenant).order_by(Tenant.name)))


def count_tenant_children(*, session: Session, tenant_id: int) -> tuple[int, int]:
    """(active keys, adapters) of a tenant."""
    keys = session.scalar(sa.select(sa.func.count(ApiKey.id)).where(
        ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None)))
    adapters = session.scalar(sa.select(sa.func.count(Adapter.id)).where(Adapter.tenant_id == tenant_id))
    return int(keys or 0), int(adapters or 0)


def update_tenant(*, session: Session, tenant: Tenant, changes: dict[str, object]) -> Tenant:
    """Set the given columns (keys: limit names) and flush."""
    for field, value in changes.items():
        setattr(tenant, field, value)
    session.flush()
    return tenant


def delete_tenant(*, session: Session, tenant: Tenant) -> None:
    """Delete a tenant with its keys, adapters, versions and usage (database cascade)."""
    session.delete(tenant)
    session.flush()


# -- API keys --------------------------------------------------------------------------------------
def add_api_key(*, session: Session, tenant: Tenant, key_hash: str, prefix: str) -> ApiKey:
    key = ApiKey(tenant_id=tenant.id, key_hash=key_hash, prefix=prefix)
    session.add(key)
    session.flush()
    return key


def list_api_keys(*, session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.scalars(sa.select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id)))


def get_api_key(*, session: Session, tenant: Tenant, key_id: int) -> ApiKey:
    key = session.scalar(sa.select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant.id))
    if key is None:
        raise NotFound(f"key {key_id} of tenant {tenant.name!r} does not exist", param="key_id")
    return key


def revoke_api_key(*, session: Session, key: ApiKey) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def find_active_key(*, session: Session, key_hash: str) -> tuple[ApiKey, Tenant] | None:
    """The unrevoked key with this hash and its tenant, or None."""
    row = session.execute(sa.select(ApiKey, Tenant).join(Tenant, ApiKey.tenant_id == Tenant.id).where(
        ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))).first()
    return (row[0], row[1]) if row else None


# -- admin key -------------------------------------------------------------------------------------
def get_admin_key_hash(*, session: Session) -> str | None:
    return session.scalar(sa.select(AdminKey.key_hash).order_by(AdminKey.id).limit(1))


def add_admin_key(*, session: Session, key_hash: str, prefix: str) -> AdminKey:
    key = AdminKey(key_hash=key_hash, prefix=prefix)
    session.add(key)
    session.flush()
    return key


# -- adapters --------------------------------------------------------------------------------------
def get_adapter(*, session: Session, tenant_id: int, name: str) -> Adapter | None:
    return session.scalar(sa.select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))


def live_version(*, session: Session, adapter_id: int) -> AdapterVersion | None:
    """The newest ``ready`` or ``broken`` version of an adapter (a broken one is not skipped:
    its requests fail clearly rather than silently running an older version)."""
    return session.scalar(sa.select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter_id, AdapterVersion.status.in_(LIVE),
    ).order_by(AdapterVersion.version.desc()).limit(1))


def list_live_adapters(*, session: Session, tenant_id: int) -> list[tuple[Adapter, AdapterVersion]]:
    """(adapter, live version) pairs of a tenant, by name."""
    rows = session.execute(sa.select(Adapter, AdapterVersion).join(
        AdapterVersion, AdapterVersion.adapter_id == Adapter.id).where(
        Adapter.tenant_id == tenant_id, AdapterVersion.status.in_(LIVE)).order_by(Adapter.name))
    return [(a, v) for a, v in rows]


def count_adapters(*, session: Session, tenant_id: int) -> int:
    return int(session.scalar(sa.select(sa.func.count(Adapter.id)).where(Adapter.tenant_id == tenant_id)) or 0)


def add_adapter_version(*, session: Session, tenant_id: int, name: str, content_hash: str, rank: int,
                        alpha: float, target_modules: list[str], size_bytes: int, max_adapters: int | None = None,
                        modules_to_save: tuple[str, ...] = (), adapter_type: str = "lora"
                        ) -> tuple[AdapterVersion, list[AdapterVersion]]:
    """Record a new ``ready`` version of ``name`` (creating the adapter if new) and mark
    earlier ready versions ``superseded``. Returns (new version, superseded versions).

    A new adapter is created only while the tenant has fewer than ``max_adapters``
    (checked and inserted in one statement, after locking the tenant's row on databases
    that lock rows, so concurrent uploads cannot both take the last place). Raises
    ``LimitExceeded`` past it."""
    adapter = get_adapter(session=session, tenant_id=tenant_id, name=name)
    if adapter is None:
        adapter = _create_adapter_within_quota(session, tenant_id, name, max_adapters)
    last = session.scalar(sa.select(sa.func.max(AdapterVersion.version)).where(
        AdapterVersion.adapter_id == adapter.id)) or 0
    superseded = list(session.scalars(sa.select(AdapterVersion).where(
        AdapterVersion.adapter_id == adapter.id, AdapterVersion.status.in_(LIVE))))
    for old in superseded:
        old.status = SUPERSEDED
    version = AdapterVersion(adapter_id=adapter.id, version=last + 1, content_hash=content_hash, rank=rank,
                             alpha=alpha, target_modules=list(target_modules), size_bytes=size_bytes, status=READY,
                             modules_to_save=list(modules_to_save), adapter_type=adapter_type)
    session.add(version)
    session.flush()
    return version, superseded


def _create_adapter_within_quota(session: Session, tenant_id: int, name: str, max_adapters: int | None) -> Adapter:
    if max_adapters is None:
        adapter = Adapter(tenant_id=tenant_id, name=name)
        session.add(adapter)
        session.flush()
        return adapter
    # PostgreSQL: concurrent creators of one tenant queue here; the count below then sees the winner's row.
    session.execute(sa.select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    count = sa.select(sa.func.count(Adapter.id)).where(Adapter.tenant_id == tenant_id).scalar_subquery()
    columns = Adapter.__table__.c
    row = sa.select(sa.literal(tenant_id, columns.tenant_id.type), sa.literal(name, columns.name.type),
                    sa.literal(utcnow(), columns.created_at.type)).where(count < max_adapters)
    adapter_id = session.scalar(sa.insert(Adapter).from_select(["tenant_id", "name", "created_at"], row)
                                .returning(Adapter.id))
    if adapter_id is None:
        raise LimitExceeded(f"the tenant has reached max_adapters={max_adapters}", param="name")
    return session.get_one(Adapter, adapter_id)


def adapter_versions(*, session: Session, adapter_id: int) -> list[AdapterVersion]:
    return list(session.scalars(sa.select(AdapterVersion).where(AdapterVersion.adapter_id == adapter_id)))


def tenant_versions(*, session: Session, tenant_id: int) -> list[AdapterVersion]:
    return list(session.scalars(sa.select(AdapterVersion).join(Adapter).where(Adapter.tenant_id == tenant_id)))


def delete_adapter(*, session: Session, adapter: Adapter) -> None:
    session.delete(adapter)
    session.flush()


def content_hash_in_use(*, session: Session, content_hash: str) -> bool:
    """True if any live (ready or broken) version still points at this stored folder."""
    return session.scalar(sa.select(sa.func.count(AdapterVersion.id)).where(
        AdapterVersion.content_hash == content_hash, AdapterVersion.status.in_(LIVE))) > 0


def stored_content_hashes(*, session: Session) -> set[str]:
    """Content hashes of all live (ready or broken) versions: the folders the store must keep."""
    return set(session.scalars(sa.select(AdapterVersion.content_hash).where(AdapterVersion.status.in_(LIVE))))


def mark_version_broken(*, session: Session, version_id: int) -> bool:
    """Set a ``ready`` version ``broken``; False if it is not (any more) ready."""
    return session.execute(sa.update(AdapterVersion).where(
        AdapterVersion.id == version_id, AdapterVersion.status == READY).values(status=BROKEN)).rowcount > 0


def repair_versions(*, session: Session, content_hash: str) -> list[tuple[int, str]]:
    """Set the ``broken`` versions of this content ``ready`` again (its files were just stored
    anew); returns their (tenant id, adapter name) pairs."""
    rows = session.execute(sa.select(AdapterVersion, Adapter.tenant_id, Adapter.name).join(Adapter).where(
        AdapterVersion.content_hash == content_hash, AdapterVersion.status == BROKEN)).all()
    for version, _, _ in rows:
        version.status = READY
    session.flush()
    return [(tenant_id, name) for _, tenant_id, name in rows]


# -- usage -----------------------------------------------------------------------------------------
def record_usage(*, session: Session, tenant_id: int, requests: int, prompt_tokens: int,
                 completion_tokens: int, day: dt.date | None = None) -> None:
    """Add to the tenant's counters for ``day`` (UTC today by default)."""
    day = day or utcnow().date()
    values = dict(requests=UsageCounter.requests + requests,
                  prompt_tokens=UsageCounter.prompt_tokens + prompt_tokens,
                  completion_tokens=UsageCounter.completion_tokens + completion_tokens)
    updated = session.execute(sa.update(UsageCounter).where(
        UsageCounter.tenant_id == tenant_id, UsageCounter.day == day).values(**values)).rowcount
    if not updated:
        session.add(UsageCounter(tenant_id=tenant_id, day=day, requests=requests, prompt_tokens=prompt_tokens,
                                 completion_tokens=completion_tokens))
    session.flush()


def usage_by_tenant(*, session: Session, since: dt.date | None = None) -> list[tuple[str, int, int, int]]:
    """(tenant name, requests, prompt tokens, completion tokens) summed over all days, or over the
    UTC days ``>= since``; every tenant, zeros included."""
    joined = UsageCounter.tenant_id == Tenant.id
    if since is not None:
        joined = sa.and_(joined, UsageCounter.day >= since)
    rows = session.execute(sa.select(
        Tenant.name, sa.func.coalesce(sa.func.sum(UsageCounter.requests), 0),
        sa.func.coalesce(sa.func.sum(UsageCounter.prompt_tokens), 0),
        sa.func.coalesce(sa.func.sum(UsageCounter.completion_tokens), 0),
    ).outerjoin(UsageCounter, joined).group_by(Tenant.name).order_by(Tenant.name))
    return [(name, int(r), int(p), int(c)) for name, r, p, c in rows]


def adapter_version_names(*, session: Session) -> list[tuple[int, str, str, int]]:
    """(tenant id, tenant name, adapter name, version) of every stored adapter version."""
    rows = session.execute(sa.select(Tenant.id, Tenant.name, Adapter.name, AdapterVersion.version)
                           .join(Adapter, Adapter.tenant_id == Tenant.id)
                           .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id))
    return [(int(t), tenant, name, int(v)) for t, tenant, name, v in rows]


# -- evaluations -----------------------------------------------------------------------------------
def add_evaluations(*, session: Session, rows: list[AdapterEvaluation]) -> list[AdapterEvaluation]:
    """Insert one run's evaluation rows and flush."""
    session.add_all(rows)
    session.flush()
    return rows


def list_evaluations(*, session: Session, tenant_id: int | None, adapter_name: str | None = None,
                     ) -> list[tuple[AdapterEvaluation, Tenant, Adapter, AdapterVersion]]:
    """(evaluation, tenant, adapter, version) rows, newest first; ``tenant_id`` None = every
    tenant (admin); ``adapter_name`` filters one adapter (of ``tenant_id``)."""
    query = (sa.select(AdapterEvaluation, Tenant, Adapter, AdapterVersion)
             .join(AdapterVersion, AdapterEvaluation.adapter_version_id == AdapterVersion.id)
             .join(Adapter, AdapterVersion.adapter_id == Adapter.id)
             .join(Tenant, AdapterEvaluation.tenant_id == Tenant.id)
             .order_by(AdapterEvaluation.id.desc()))
    if tenant_id is not None:
        query = query.where(AdapterEvaluation.tenant_id == tenant_id, Adapter.tenant_id == tenant_id)
    if adapter_name is not None:
        query = query.where(Adapter.name == adapter_name)
    return [tuple(row) for row in session.execute(query)]
