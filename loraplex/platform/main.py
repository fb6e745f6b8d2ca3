"""The app factory: ``create_app(settings, engine=None)``.

``engine`` may be an :class:`~loraplex.engine.llm_engine.LLMEngine` (wrapped),
an :class:`~loraplex.platform.engine_client.EngineClient` (an ``AsyncEngine``, or
the Ray Serve replicas' client), or None: then ``settings.replicas`` replicas of
``settings.model`` are deployed on Ray Serve, or without ``replicas`` the model is
loaded in this process, or, without a model, only the admin API works (serving
answers 503). The app starts the engine thread at startup and
stops it at shutdown; at startup it also removes what interrupted uploads left on disk
(``services.adapters.clean_storage``) and starts the upload checkers' forkserver;
``app.state.ctx`` is the :class:`PlatformContext` the
console shares. The platform never imports the console: ``loraplex serve`` and
``loraplex demo up`` mount it through the hook the CLI passes in
(:func:`loraplex.platform.cli.add_commands`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import AsyncIterator
from typing import TextIO

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.engine.gc_heap import freeze_gc_heap, unfreeze_gc_heap
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.guards import RequestGuard, SecurityHeaders
from loraplex.platform.api.routes import adapters, completions, evaluations, models, stats, tenants
from loraplex.platform.api.uploads import MULTIPART_OVERHEAD_BYTES
from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.cache import publish_stats
from loraplex.platform.context import PlatformContext, build_context
from loraplex.platform.engine_client import EngineClient
from loraplex.platform.services.adapters import MB, clean_storage
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)


def build_engine(settings: Settings):
    """An ``LLMEngine`` for ``settings.model`` with the engine options that were set (the rest: the
    engine's defaults)."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    if not settings.model:
        raise ValueError("Settings.model is not set: pass --model or LORAPLEX_MODEL")
    config = EngineConfig(model=settings.model, download_dir=str(settings.cache_dir), **settings.engine_values())
    return LLMEngine(config)


def create_app(settings: Settings, engine=None, *, out: TextIO = sys.stdout) -> FastAPI:
    """Build the FastAPI app (database migrated, admin key settled, engine wrapped).

    Raises ``ValueError`` for an unusable model and what ``LLMEngine`` raises.
    """
    async_engine = _as_async_engine(settings, engine)
    ctx = build_context(settings, async_engine, out=out)
    app = FastAPI(title="loraplex", version="0.1.0", lifespan=_lifespan,
                  description="Multi-tenant LoRA serving with an OpenAI-compatible API.")
    app.state.ctx = ctx
    install_error_handlers(app)
    for router in (completions.router, models.router, adapters.tenant_router, adapters.admin_router,
                   tenants.router, stats.router, evaluations.router):
        app.include_router(router)
    app.add_middleware(RequestGuard, ctx=ctx, max_json_body_bytes=int(settings.max_json_body_mb * MB),
                       max_upload_body_bytes=int(settings.max_upload_mb * MB) + MULTIPART_OVERHEAD_BYTES)
    app.add_middleware(_RequestMetrics, ctx=ctx)
    app.add_middleware(SecurityHeaders)  # outermost: every response, the console's included
    return app


def _as_async_engine(settings: Settings, engine) -> EngineClient | None:
    """The engine client to serve: ``engine`` when it is one, an ``AsyncEngine`` over an
    ``LLMEngine``; without ``engine``: ``settings.replicas`` replicas on Ray Serve, else an
    engine for ``settings.model`` in a process of its own (``settings.engine_in_own_process``,
    the default) or in this process, else None (admin API only)."""
    from loraplex.engine.llm_engine import LLMEngine

    if engine is None:
        if not settings.model:
            return None
        if settings.replicas is not None:
            try:
                from loraplex.platform.cluster.launch import start_replicas
            except ImportError as exc:
                raise ValueError(f"--replicas needs Ray Serve ({exc}): pip install 'loraplex[cluster]'") from None
            return start_replicas(settings)
        if settings.engine_in_own_process:
            from loraplex.platform.engine_process import ProcessEngineClient

            return ProcessEngineClient(settings)
        engine = build_engine(settings)
    if isinstance(engine, LLMEngine):
        return AsyncEngine(engine, stats_interval_s=settings.stats_interval_s)
    return engine


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    ctx: PlatformContext = app.state.ctx
    await run_in_threadpool(clean_storage, ctx)
    if ctx.upload_validator is not None:
        threading.Thread(target=ctx.upload_validator.warm_up, name="loraplex-forkserver-start", daemon=True).start()
    publisher = None
    if ctx.engine is not None:
        ctx.engine.start()
        publisher = asyncio.create_task(_publish_stats(ctx))
    # The app, its database engine and an engine in this process live until shutdown: keep full collections
    # off them while serving (engine/gc_heap.py); unfrozen at shutdown, so that an app shut down in a process
    # that goes on is garbage like any other.
    if ctx.settings.gc_freeze:
        await run_in_threadpool(freeze_gc_heap)
    try:
        yield
    finally:
        if ctx.settings.gc_freeze:
            unfreeze_gc_heap()
        if publisher is not None:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher
        if ctx.engine is not None:
            await run_in_threadpool(ctx.engine.shutdown)
        await run_in_threadpool(ctx.usage.close)
        ctx.db.dispose()


async def _publish_stats(ctx: PlatformContext) -> None:
    """Push the engine's stats snapshot to the store for the console, every stats interval."""
    interval = ctx.settings.stats_interval_s
    while True:
        snapshot = ctx.engine.stats_dict()
        if snapshot is not None:
            try:
                await run_in_threadpool(publish_stats, ctx.store, snapshot, interval * 5)
            except Exception:  # noqa: BLE001 - stats are best effort
                logger.exception("publishing engine stats failed")
        await asyncio.sleep(interval)


class _RequestMetrics:
    """Counts ``/v1/*`` requests by route template and status code."""

    def __init__(self, app: ASGIApp, *, ctx: PlatformContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.ctx.metrics.requests.labels(endpoint, str(status["code"])).inc()
