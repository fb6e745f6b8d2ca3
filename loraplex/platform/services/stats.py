"""``GET /admin/stats`` (and the console): engine, adapter slots, cache, per-tenant usage."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy.orm import Session

from loraplex.platform import crud
from loraplex.platform.cache import read_stats
from loraplex.platform.context import PlatformContext
from loraplex.platform.schemas import StatsPublic, UsagePublic
from loraplex.platform.lora_names import engine_lora_name


def engine_stats(ctx: PlatformContext) -> dict | None:
    """This process's engine snapshot, else the one last published to the store (e.g. by
    the serving process, when the console runs elsewhere)."""
    if ctx.engine is not None:
        snapshot = ctx.engine.stats_dict()
        if snapshot is not None:
            return snapshot
    return read_stats(ctx.store)


def platform_stats(*, session: Session, ctx: PlatformContext) -> StatsPublic:
    engine = engine_stats(ctx)
    slots = engine.pop("lora", None) if engine else None
    usage = list(usage_by_tenant(session=session).values())
    return StatsPublic(engine=engine, adapter_slots=slots, cache=ctx.cache.stats(), tenants=usage)


def usage_by_tenant(*, session: Session, since: dt.date | None = None) -> dict[str, UsagePublic]:
    """Per tenant name (every tenant, zeros included): requests and tokens over all days, or on the
    UTC days ``>= since``."""
    return {name: UsagePublic(tenant=name, requests=r, prompt_tokens=p, completion_tokens=c)
            for name, r, p, c in crud.usage_by_tenant(session=session, since=since)}


@dataclass(frozen=True)
class AdapterLabel:
    """Who an engine adapter (``lora_name``) belongs to, for display: ``"acme/support v2"``."""

    tenant: str
    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name} v{self.version}"


def adapter_labels(*, session: Session) -> dict[str, AdapterLabel]:
    """Engine ``lora_name`` -> :class:`AdapterLabel` for every stored adapter version (admin only:
    it names every tenant)."""
    return {engine_lora_name(tenant_id, name, version): AdapterLabel(tenant, name, version)
            for tenant_id, tenant, name, version in crud.adapter_version_names(session=session)}
