"""The Ray Serve request router of the engine replicas: :func:`~.routing.rank_replicas` over
the replicas' residency reports (``record_routing_stats``) and the router's own counts of
requests in flight.

It runs in the process that holds the deployment handle (the gateway). The request's
multiplexed model id is its adapter version's routing key (:func:`~.routing.adapter_routing_key`).
Each routed request leaves a :class:`~.routing.RoutingHints` entry, so the replica it went to
counts as holding that version until its next report shows it (``hint_ttl_s``).

Configured through ``RequestRouterConfig.request_router_kwargs`` (``initialize_state``):
``max_imbalance`` (requests; default 4) and ``hint_ttl_s`` (seconds; default 2 x the stats period).
"""

from __future__ import annotations

import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from loraplex.platform.cluster.routing import (
    BASE_MODEL_KEY,
    ReplicaRoutingStats,
    ReplicaView,
    RoutingHints,
    rank_replicas,
)

DEFAULT_MAX_IMBALANCE = 4
DEFAULT_HINT_TTL_S = 2.0


class AdapterAwareRequestRouter(RequestRouter):
    """Prefers replicas holding the request's adapter version (slot, then host cache), then
    ones with a free slot, then the least loaded (see :mod:`loraplex.platform.cluster.routing`)."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         hint_ttl_s: float = DEFAULT_HINT_TTL_S) -> None:
        """Raises ``ValueError`` for a negative value."""
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance={max_imbalance}: must be >= 0")
        self.max_imbalance = max_imbalance
        self.hints = RoutingHints(hint_ttl_s, time.monotonic)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = _routing_key(pending_request)
        views = [ReplicaView(r.replica_id.unique_id, ReplicaRoutingStats.from_dict(r.routing_stats), self._load(r))
                 for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = rank_replicas(views, key, max_imbalance=self.max_imbalance, hinted=self.hints.replicas_for(key))
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.hints.record(_routing_key(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.hints.forget_replica(replica_id.unique_id)

    def _load(self, replica: RunningReplica) -> int:
        """Requests in flight on ``replica``: the router's queue-length cache, else the replica's report."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached
        stats = ReplicaRoutingStats.from_dict(replica.routing_stats)
        return stats.num_requests if stats is not None else 0


def _routing_key(pending_request: PendingRequest | None) -> str:
    if pending_request is None:
        return BASE_MODEL_KEY
    return pending_request.metadata.multiplexed_model_id or BASE_MODEL_KEY
