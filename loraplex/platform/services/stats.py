"""``GET /admin/stats`` (and the console): engine, adapter slots, cache, per-tenant usage."""

from __future__ import annotations

from sqlalchemy.orm import Session

from loraplex.platform import crud
from loraplex.platform.cache import read_stats
from loraplex.platform.context import PlatformContext
from loraplex.platform.schemas import StatsPublic, UsagePublic


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
    usage = [UsagePublic(tenant=name, requests=r, prompt_tokens=p, completion_tokens=c)
             for name, r, p, c in crud.usage_by_tenant(session=session)]
    return StatsPublic(engine=engine, adapter_slots=slots, cache=ctx.cache.stats(), tenants=usage)
