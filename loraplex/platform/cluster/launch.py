"""Deploy the engine replicas on Ray Serve and return the gateway's client for them.

``start_replicas(settings)``: joins the Ray cluster at ``settings.ray_address`` (or starts a
local one), starts Serve without its HTTP proxy (the gateway is loraplex's FastAPI app),
deploys ``settings.replicas`` copies of :class:`~.replica.EngineReplica` (``replica_num_gpus``
GPUs and ``replica_num_cpus`` CPUs each, at most ``replica_max_ongoing_requests`` requests in
flight each) with the :class:`~.router.AdapterAwareRequestRouter` (residency reports every
``stats_interval_s``), waits until they run and returns a
:class:`~.client.ReplicaEngineClient`. Its ``shutdown`` deletes the application, and stops
Serve and Ray when they were started here. Every node must have loraplex installed and see the
adapter store (``data_dir``) and model folders at the same paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from loraplex.platform.cluster.client import ReplicaEngineClient
from loraplex.platform.cluster.replica import EngineReplica
from loraplex.platform.cluster.router import AdapterAwareRequestRouter
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)
APP_NAME = "loraplex"
DEPLOYMENT_NAME = "engine"


def replica_settings(settings: Settings) -> Settings:
    """``settings`` as sent to the replicas: without the keys and storage URLs they never use
    (the registry, Redis and keys stay with the gateway)."""
    return settings.model_copy(update={"admin_key": None, "metrics_key": None, "database_url": None,
                                       "redis_url": None})


def replica_gpus(settings: Settings) -> float:
    """``settings.replica_num_gpus``, or 1 for a CUDA device (``auto``: when this host has one), else 0."""
    if settings.replica_num_gpus is not None:
        return settings.replica_num_gpus
    device = settings.device or "auto"
    if device == "auto":
        import torch

        return 1.0 if torch.cuda.is_available() else 0.0
    return 1.0 if device == "cuda" else 0.0


def start_replicas(settings: Settings, *, app_name: str = APP_NAME,
                   engine_factory: Callable[[Settings], Any] | None = None) -> ReplicaEngineClient:
    """See the module docstring. ``engine_factory(settings) -> LLMEngine`` builds each replica's
    engine (default ``main.build_engine``). Raises ``ValueError`` without ``settings.model`` or
    ``settings.replicas``, and what Ray raises when the cluster cannot place the replicas."""
    if not settings.model or not settings.replicas:
        raise ValueError("start_replicas needs Settings.model and Settings.replicas")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=settings.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")
    max_ongoing = settings.replica_max_ongoing_requests or settings.max_num_seqs or 256
    router = RequestRouterConfig(request_router_class=AdapterAwareRequestRouter,
                                 request_router_kwargs={"max_imbalance": settings.routing_max_imbalance,
                                                        "hint_ttl_s": 2 * settings.stats_interval_s},
                                 request_routing_stats_period_s=settings.stats_interval_s,
                                 request_routing_stats_timeout_s=max(5.0, 5 * settings.stats_interval_s))
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=settings.replicas, max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_gpus": replica_gpus(settings), "num_cpus": settings.replica_num_cpus},
        request_router_config=router, health_check_period_s=max(1.0, settings.stats_interval_s))
    logger.info("deploying %d engine replica(s) of %s on Ray Serve", settings.replicas, settings.model)
    handle = serve.run(deployment.bind(replica_settings(settings), engine_factory), name=app_name, route_prefix=None)
    info = handle.describe.remote().result()

    def undeploy() -> None:
        try:
            serve.delete(app_name)
            if started_ray:
                serve.shutdown()
                ray.shutdown()
        except Exception:  # noqa: BLE001 - shutting down: report, do not raise
            logger.exception("undeploying the engine replicas failed")

    return ReplicaEngineClient(handle, info, stats_interval_s=settings.stats_interval_s, on_shutdown=undeploy)
