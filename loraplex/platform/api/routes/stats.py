"""Admin stats, Prometheus metrics and health."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import AdminDep, CtxDep, MetricsReaderDep, SessionDep
from loraplex.platform.schemas import StatsPublic
from loraplex.platform.services import health as health_service
from loraplex.platform.services import stats as stats_service

router = APIRouter(tags=["operations"])


@router.get("/admin/stats", response_model=StatsPublic)
def get_stats(session: SessionDep, ctx: CtxDep, _: AdminDep) -> StatsPublic:
    return stats_service.platform_stats(session=session, ctx=ctx)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(ctx: CtxDep, _: MetricsReaderDep) -> Response:
    """Prometheus text format; needs the admin key or ``LORAPLEX_METRICS_KEY`` (labels name tenants' adapters)."""
    return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/health")
def health(ctx: CtxDep) -> JSONResponse:
    """Liveness: 200 while the process and its engine thread run, 503 once the engine stopped."""
    alive = ctx.engine is None or ctx.engine.is_running
    return JSONResponse({"status": "ok" if alive else "engine_stopped"}, status_code=200 if alive else 503)


@router.get("/health/ready")
async def ready(ctx: CtxDep) -> JSONResponse:
    """Readiness: 200 when the registry database answers and the engine runs, else 503.
    The cache (Redis) is reported but does not make the server unready (the in-process
    fallback serves; see README "Security model")."""
    report = await run_in_threadpool(health_service.readiness, ctx)
    return JSONResponse(report.to_dict(), status_code=200 if report.ready else 503)
