"""Tenants, API keys and authentication: the business logic shared by the admin
API, the CLI and the console. Each writer commits, then invalidates the cached
lookups it changed (commit first, so a concurrent reader cannot re-cache the
old row after the invalidation)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from loraplex.platform import crud
from loraplex.platform.context import PlatformContext
from loraplex.platform.core.security import generate_key, hash_key, key_matches
from loraplex.platform.errors import InvalidRequest, Unauthenticated
from loraplex.platform.models import ApiKey, Tenant
from loraplex.platform.schemas import (
    ApiKeyCreated,
    ApiKeyPublic,
    TenantContext,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
)


_NULLABLE_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_queued_requests",
                    "max_queue_time_s")


def key_cache_key(key_hash: str) -> str:
    return f"key:{key_hash}"


def tenant_public(session: Session, tenant: Tenant) -> TenantPublic:
    keys, adapters = crud.count_tenant_children(session=session, tenant_id=tenant.id)
    return TenantPublic.model_validate(tenant).model_copy(update={"num_keys": keys, "num_adapters": adapters})


def _check_upload_limit(ctx: PlatformContext, max_upload_mb: float | None) -> None:
    cap = ctx.settings.max_upload_mb
    if max_upload_mb is not None and max_upload_mb > cap:
        raise InvalidRequest(f"max_upload_mb={max_upload_mb:g}: above this server's cap on one upload, {cap:g} MB "
                             "(LORAPLEX_MAX_UPLOAD_MB)", param="max_upload_mb")


def create_tenant(*, session: Session, ctx: PlatformContext, spec: TenantCreate) -> TenantPublic:
    """Create a tenant; unset limits take the server defaults (the upload limit at most the server's cap).
    Raises ``Conflict``, ``InvalidRequest``
    (``max_upload_mb`` above the server's ``max_upload_mb``)."""
    s = ctx.settings
    _check_upload_limit(ctx, spec.max_upload_mb)
    tenant = crud.create_tenant(
        session=session, name=spec.name,
        requests_per_minute=spec.requests_per_minute if "requests_per_minute" in spec.model_fields_set
        else s.default_tenant_requests_per_minute,
        tokens_per_minute=spec.tokens_per_minute if "tokens_per_minute" in spec.model_fields_set
        else s.default_tenant_tokens_per_minute,
        max_adapters=spec.max_adapters if spec.max_adapters is not None else s.default_tenant_max_adapters,
        max_upload_mb=spec.max_upload_mb if spec.max_upload_mb is not None
        else min(s.default_tenant_max_upload_mb, s.max_upload_mb),
        weight=spec.weight, max_concurrent_requests=spec.max_concurrent_requests,
        max_queued_requests=spec.max_queued_requests, max_queue_time_s=spec.max_queue_time_s)
    session.commit()
    return tenant_public(session, tenant)


def list_tenants(*, session: Session) -> list[TenantPublic]:
    return [tenant_public(session, t) for t in crud.list_tenants(session=session)]


def get_tenant(*, session: Session, name: str) -> TenantPublic:
    """Raises ``NotFound``."""
    return tenant_public(session, crud.get_tenant(session=session, name=name))


def update_tenant(*, session: Session, ctx: PlatformContext, name: str, changes: TenantUpdate) -> TenantPublic:
    """Change the limits present in ``changes`` (``null`` rates and queueing limits = unlimited;
    ``null`` max_adapters / max_upload_mb / weight are ignored). Raises ``NotFound``, ``InvalidRequest`` (as
    :func:`create_tenant`)."""
    _check_upload_limit(ctx, changes.max_upload_mb)
    tenant = crud.get_tenant(session=session, name=name)
    values = {k: v for k, v in changes.model_dump(exclude_unset=True).items()
              if v is not None or k in _NULLABLE_LIMITS}
    crud.update_tenant(session=session, tenant=tenant, changes=values)
    keys = crud.list_api_keys(session=session, tenant=tenant)
    session.commit()
    ctx.cache.invalidate(*(key_cache_key(k.key_hash) for k in keys))
    return tenant_public(session, tenant)


def delete_tenant(*, session: Session, ctx: PlatformContext, name: str) -> None:
    """Delete a tenant, its keys (401 at once), adapters (retired from the engine once idle,
    files removed) and usage. Raises ``NotFound``."""
    from loraplex.platform.services.adapters import adapter_cache_keys, retire_versions

    tenant = crud.get_tenant(session=session, name=name)
    keys = crud.list_api_keys(session=session, tenant=tenant)
    versions = [(v.id, v.content_hash) for v in crud.tenant_versions(session=session, tenant_id=tenant.id)]
    adapter_names = [a.name for a in tenant.adapters]
    tenant_id = tenant.id
    crud.delete_tenant(session=session, tenant=tenant)
    session.commit()
    ctx.cache.invalidate(*(key_cache_key(k.key_hash) for k in keys),
                         *adapter_cache_keys(tenant_id, *adapter_names))
    retire_versions(ctx, versions)


def create_api_key(*, session: Session, ctx: PlatformContext, tenant_name: str) -> ApiKeyCreated:
    """A new key for the tenant; the plaintext is in the result only. Raises ``NotFound``."""
    tenant = crud.get_tenant(session=session, name=tenant_name)
    new = generate_key()
    key = crud.add_api_key(session=session, tenant=tenant, key_hash=new.key_hash, prefix=new.prefix)
    session.commit()
    return ApiKeyCreated(id=key.id, prefix=key.prefix, created_at=key.created_at, revoked_at=None,
                         key=new.plaintext)


def list_api_keys(*, session: Session, tenant_name: str) -> list[ApiKeyPublic]:
    tenant = crud.get_tenant(session=session, name=tenant_name)
    return [ApiKeyPublic.model_validate(k) for k in crud.list_api_keys(session=session, tenant=tenant)]


def revoke_api_key(*, session: Session, ctx: PlatformContext, tenant_name: str, key_id: int) -> ApiKeyPublic:
    """Revoke a key: requests with it get 401 from now on. Raises ``NotFound``."""
    tenant = crud.get_tenant(session=session, name=tenant_name)
    key: ApiKey = crud.revoke_api_key(session=session, key=crud.get_api_key(session=session, tenant=tenant,
                                                                            key_id=key_id))
    session.commit()
    ctx.cache.invalidate(key_cache_key(key.key_hash))
    return ApiKeyPublic.model_validate(key)


def tenant_context(*, session: Session, name: str) -> TenantContext:
    """The limits of tenant ``name`` as an admin acts on its behalf (``key_id`` 0). Raises ``NotFound``."""
    tenant = crud.get_tenant(session=session, name=name)
    return _context(tenant, key_id=0)


def _context(tenant: Tenant, *, key_id: int) -> TenantContext:
    return TenantContext(tenant_id=tenant.id, tenant_name=tenant.name, key_id=key_id,
                         requests_per_minute=tenant.requests_per_minute, tokens_per_minute=tenant.tokens_per_minute,
                         max_adapters=tenant.max_adapters, max_upload_mb=tenant.max_upload_mb, weight=tenant.weight,
                         max_concurrent_requests=tenant.max_concurrent_requests,
                         max_queued_requests=tenant.max_queued_requests, max_queue_time_s=tenant.max_queue_time_s)


def authenticate_tenant(*, ctx: PlatformContext, token: str | None) -> TenantContext:
    """The tenant owning bearer ``token`` (read through the cache). Raises ``Unauthenticated``."""
    if not token:
        raise Unauthenticated("Missing bearer key: send `Authorization: Bearer <key>`.")
    key_hash = hash_key(token)

    def load() -> dict | None:
        with ctx.sessions() as session:
            found = crud.find_active_key(session=session, key_hash=key_hash)
            if found is None:
                return None
            key, tenant = found
            return _context(tenant, key_id=key.id).model_dump()

    data = ctx.cache.get_or_load(key_cache_key(key_hash), load)
    if data is None:
        raise Unauthenticated("Incorrect API key provided.")
    return TenantContext.model_validate(data)


def authenticate_admin(*, ctx: PlatformContext, token: str | None) -> None:
    """Raises ``Unauthenticated`` unless ``token`` is the admin key."""
    if not token or not key_matches(token, ctx.admin_key_hash):
        raise Unauthenticated("Missing or incorrect admin key.")


def authenticate_metrics_reader(*, ctx: PlatformContext, token: str | None) -> None:
    """Raises ``Unauthenticated`` unless ``token`` is the admin key or ``settings.metrics_key``."""
    metrics_key = ctx.settings.metrics_key
    if token and metrics_key is not None and key_matches(token, hash_key(metrics_key.get_secret_value())):
        return
    if not token or not key_matches(token, ctx.admin_key_hash):
        raise Unauthenticated("Missing or incorrect key: /metrics needs the admin key or the metrics key.")


def disable_tenant(*, session: Session, ctx: PlatformContext, name: str) -> int:
    """Revoke every active API key of the tenant (its requests get 401 at once; a new key
    re-enables it). Returns how many keys were revoked. Raises ``NotFound``."""
    revoked = 0
    for key in list_api_keys(session=session, tenant_name=name):
        if key.revoked_at is None:
            revoke_api_key(session=session, ctx=ctx, tenant_name=name, key_id=key.id)
            revoked += 1
    return revoked
