"""Readiness: can this process serve every request right now? (``GET /health/ready``)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Literal

import sqlalchemy as sa

from loraplex.platform.context import PlatformContext

logger = logging.getLogger(__name__)
Reachability = Literal["ok", "unavailable"]


@dataclass(frozen=True)
class Readiness:
    """``registry``: the database; ``cache``: Redis ("ok" for the in-process store);
    ``engine``: "ok", "stopped" or "none" (admin API only); ``usage_pending``: usage rows
    (tenant, day) waiting to be written; ``usage_lost_requests``: requests whose usage was
    dropped (logged) since start."""

    registry: Reachability
    cache: Reachability
    engine: Literal["ok", "stopped", "none"]
    usage_pending: int
    usage_lost_requests: int

    @property
    def ready(self) -> bool:
        return self.registry == "ok" and self.engine != "stopped"

    def to_dict(self) -> dict:
        return {"status": "ready" if self.ready else "not_ready", **asdict(self)}


def readiness(ctx: PlatformContext) -> Readiness:
    """Probe the database (``SELECT 1``) and the store; never raises."""
    try:
        with ctx.db.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        registry: Reachability = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        logger.warning("readiness: registry unreachable (%s)", type(exc).__name__)
        registry = "unavailable"
    cache: Reachability = "ok" if ctx.store.available() else "unavailable"
    engine = "none" if ctx.engine is None else ("ok" if ctx.engine.is_running else "stopped")
    return Readiness(registry=registry, cache=cache, engine=engine, usage_pending=ctx.usage.pending(),
                     usage_lost_requests=ctx.usage.lost.requests)
