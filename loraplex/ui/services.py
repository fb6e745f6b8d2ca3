"""Service functions the console needs that ``loraplex.platform.services`` lacks.

Thin wrappers over the platform's crud/services (no logic of their own beyond
composing them); they belong in ``loraplex/platform/services/`` and are kept
here only until the platform adopts them:

- :func:`preview_upload` -> ``services/adapters.py`` (the checks of
  ``upload_adapter`` without storing: name, staging, validation);
- :func:`preload_adapter` -> ``services/adapters.py``;
- :func:`usage_since` -> ``crud.py`` + ``services/stats.py``;
- :func:`disable_tenant` -> ``services/tenants.py``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from loraplex.adapters import AdapterInfo
from loraplex.platform import crud
from loraplex.platform.context import PlatformContext
from loraplex.platform.models import Tenant, UsageCounter
from loraplex.platform.schemas import TenantContext, UsagePublic
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import tenants as tenant_service
from loraplex.platform.services.uploads import UploadPart

PRELOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class UploadPreview:
    """What an upload would store: the validated adapter, and the live version it would
    supersede (None when the name is new)."""

    name: str
    info: AdapterInfo
    replaces_version: int | None
    base_model: str | None
    max_lora_rank: int


def preview_upload(*, session: Session, ctx: PlatformContext, tenant: TenantContext, name: str,
                   parts: list[UploadPart]) -> UploadPreview:
    """Run ``upload_adapter``'s name, staging and validation steps, then discard the staged files.

    Raises what ``upload_adapter`` raises for them: ``InvalidRequest`` (bad name, bad archive,
    adapter refused: the ``AdapterError`` message), ``PayloadTooLarge``, ``UnsupportedMediaType``,
    ``ServiceUnavailable`` (no base model to validate against).
    """
    info = adapter_service.validate_upload(ctx=ctx, tenant=tenant, name=name, parts=parts)
    adapter = crud.get_adapter(session=session, tenant_id=tenant.tenant_id, name=name)
    live = crud.live_version(session=session, adapter_id=adapter.id) if adapter else None
    return UploadPreview(name=name, info=info, replaces_version=live.version if live else None,
                         base_model=ctx.model_id, max_lora_rank=ctx.max_lora_rank)


def preload_adapter(*, ctx: PlatformContext, tenant_id: int, name: str) -> bool:
    """Register the live version of the tenant's adapter in the engine (read from disk into
    the host-memory cache), so its first request does not wait for the disk.

    Returns False when no engine with LoRA is running. Raises ``ModelNotFound`` for an
    unknown adapter and the engine's ``AdapterError`` for one it cannot load.
    """
    engine = ctx.engine
    route = adapter_service.resolve_adapter(ctx=ctx, tenant_id=tenant_id, name=name)
    if engine is None or not engine.is_running or not engine.lora_enabled:
        return False
    engine.preload_lora(adapter_service.lora_request(route)).result(PRELOAD_TIMEOUT_S)  # stats show it then
    return True


def usage_since(*, session: Session, since: dt.date) -> dict[str, UsagePublic]:
    """Per tenant name, requests and tokens counted on UTC days ``>= since`` (every tenant, zeros included)."""
    rows = session.execute(sa.select(
        Tenant.name, sa.func.coalesce(sa.func.sum(UsageCounter.requests), 0),
        sa.func.coalesce(sa.func.sum(UsageCounter.prompt_tokens), 0),
        sa.func.coalesce(sa.func.sum(UsageCounter.completion_tokens), 0),
    ).outerjoin(UsageCounter, sa.and_(UsageCounter.tenant_id == Tenant.id, UsageCounter.day >= since))
        .group_by(Tenant.name))
    return {name: UsagePublic(tenant=name, requests=int(r), prompt_tokens=int(p), completion_tokens=int(c))
            for name, r, p, c in rows}


def usage_total(*, session: Session) -> dict[str, UsagePublic]:
    """Per tenant name, requests and tokens over all days (``crud.usage_by_tenant``)."""
    return {name: UsagePublic(tenant=name, requests=r, prompt_tokens=p, completion_tokens=c)
            for name, r, p, c in crud.usage_by_tenant(session=session)}


def disable_tenant(*, session: Session, ctx: PlatformContext, name: str) -> int:
    """Revoke every active API key of the tenant (its requests get 401 at once; a new key
    re-enables it). Returns how many keys were revoked. Raises ``NotFound``."""
    revoked = 0
    for key in tenant_service.list_api_keys(session=session, tenant_name=name):
        if key.revoked_at is None:
            tenant_service.revoke_api_key(session=session, ctx=ctx, tenant_name=name, key_id=key.id)
            revoked += 1
    return revoked
