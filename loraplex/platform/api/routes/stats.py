"""Admin stats, Prometheus metrics and health."""

from __future__ import annotations

from fastapi import APIRouter, Response

from loraplex.platform.api.deps import AdminDep, CtxDep, SessionDep
from loraplex.platform.schemas import StatsPublic
from loraplex.platform.services import stats as stats_service

router = APIRouter(tags=["operations"])


@router.get("/admin/stats", response_model=StatsPublic)
def get_stats(session: SessionDep, ctx: CtxDep, _: AdminDep) -> StatsPublic:
    return stats_service.platform_stats(session=session, ctx=ctx)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(ctx: CtxDep) -> Response:
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/health")
def health(ctx: CtxDep) -> dict[str, str]:
    return {"status": "ok" if ctx.engine is None or ctx.engine.is_running else "engine_stopped"}
