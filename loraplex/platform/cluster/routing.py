"""Adapter-aware replica ranking: plain Python, no Ray (the Ray Serve request router and the
no-Ray benchmark both use it).

A request for adapter version ``key`` (:func:`adapter_routing_key`; ``""`` = the base model)
ranks the replicas in tiers, best first::

    tier 0  the version is in a device slot (or the router sent it there within the hint TTL)
    tier 1  the version is in the host-memory cache (a slot load, no disk read)
    tier 2  a slot is empty (the load evicts nothing)
    tier 3  a slot is unpinned (the load evicts an idle adapter)
    last    every replica, least loaded first

A replica whose load exceeds the least loaded replica's by more than ``max_imbalance`` drops out
of tiers 0-3 (it stays in the last one), so affinity never queues requests behind a hot replica
while another idles. Within a tier, replicas are ordered by load, then most empty slots, then id
(new adapters spread over replicas). The base model needs no slot: one tier, least loaded first. Ray Serve tries the tiers in order and, within one, takes
the replica with the fewest requests in flight that is below its ``max_ongoing_requests``; a full
replica is skipped, so load spills to the next tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.adapters.lora_request import LoRARequest

BASE_MODEL_KEY = ""
"""The routing key of base-model requests (no adapter, no multiplexed id)."""


def adapter_routing_key(lora: LoRARequest | None) -> str:
    """The routing key (Ray Serve's multiplexed model id) of a request's adapter version:
    ``"<lora_int_id>:<version_id>"`` (the registry's version row and its content hash), so two
    versions of one adapter never share a key; :data:`BASE_MODEL_KEY` for the base model."""
    if lora is None:
        return BASE_MODEL_KEY
    return f"{lora.lora_int_id}:{lora.version_id or ''}"


@dataclass(frozen=True)
class ReplicaRoutingStats:
    """What a replica reports to the router (Ray Serve's ``record_routing_stats``).

    ``gpu`` / ``cpu``: routing keys of the adapter versions in a device slot / in the host
    cache; ``empty_slots``: slots holding no adapter; ``idle_slots``: slots holding an adapter
    no running request pins (a new adapter can take them now); ``num_requests``: the engine's
    running + waiting + swapped sequences.
    """

    gpu: frozenset[str]
    cpu: frozenset[str]
    empty_slots: int
    idle_slots: int
    num_requests: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``record_routing_stats`` returns)."""
        return {"gpu": sorted(self.gpu), "cpu": sorted(self.cpu), "empty_slots": self.empty_slots,
                "idle_slots": self.idle_slots, "num_requests": self.num_requests}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ReplicaRoutingStats | None:
        """The stats in ``data``; None when the replica has not reported yet (``{}`` or None)."""
        if not data:
            return None
        return cls(frozenset(data["gpu"]), frozenset(data["cpu"]), int(data["empty_slots"]),
                   int(data["idle_slots"]), int(data["num_requests"]))


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it: ``stats`` (None: not reported yet) and ``load``,
    the requests in flight on it (the router's own count, fresher than ``stats``)."""

    replica_id: str
    stats: ReplicaRoutingStats | None
    load: int


def rank_replicas(replicas: Sequence[ReplicaView], key: str, *, max_imbalance: int,
                  hinted: Collection[str] = ()) -> list[list[str]]:
    """Replica ids in tiers, best first (see the module docstring); empty tiers are left out.

    ``hinted``: replicas the router sent ``key`` to recently (they count as holding it in a
    slot). Raises ``ValueError`` for a negative ``max_imbalance``.
    """
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance={max_imbalance}: must be >= 0")
    if not replicas:
        return []
    by_load = sorted(replicas, key=lambda r: (r.load, -(r.stats.empty_slots if r.stats else 0), r.replica_id))
    everyone = [r.replica_id for r in by_load]
    if key == BASE_MODEL_KEY:
        return [everyone]
    ceiling = by_load[0].load + max_imbalance
    tiers: list[list[str]] = [[], [], [], []]
    for replica in by_load:
        tier = _tier(replica, key, hinted)
        if tier is not None and replica.load <= ceiling:
            tiers[tier].append(replica.replica_id)
    return [tier for tier in tiers if tier] + [everyone]


def _tier(replica: ReplicaView, key: str, hinted: Collection[str]) -> int | None:
    stats = replica.stats
    if replica.replica_id in hinted or (stats is not None and key in stats.gpu):
        return 0
    if stats is None:
        return None
    if key in stats.cpu:
        return 1
    if stats.empty_slots > 0:
        return 2
    if stats.idle_slots > 0:
        return 3
    return None


class RoutingHints:
    """Where the router sent each adapter version recently.

    A replica's residency report lags (it is polled every few seconds); until ``ttl_s`` has
    passed since the router last sent ``key`` to a replica, that replica counts as holding
    ``key`` in a slot, so a burst of requests for a new adapter lands on one replica instead of
    loading it everywhere. ``clock``: monotonic seconds.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s={ttl_s}: must be >= 0")
        self.ttl_s = ttl_s
        self.clock = clock
        self._sent: dict[str, dict[str, float]] = {}  # key -> replica id -> last time sent

    def record(self, key: str, replica_id: str) -> None:
        """``key`` was just sent to ``replica_id`` (the base model's key is ignored)."""
        if key == BASE_MODEL_KEY:
            return
        self._sent.setdefault(key, {})[replica_id] = self.clock()
        if len(self._sent) > 1024:
            self._expire()

    def replicas_for(self, key: str) -> set[str]:
        """Replicas ``key`` was sent to within the last ``ttl_s`` seconds."""
        sent = self._sent.get(key)
        if not sent:
            return set()
        now = self.clock()
        return {replica for replica, at in sent.items() if now - at <= self.ttl_s}

    def forget_replica(self, replica_id: str) -> None:
        """Drop every hint naming ``replica_id`` (it died)."""
        for sent in self._sent.values():
            sent.pop(replica_id, None)

    def _expire(self) -> None:
        now = self.clock()
        for key in list(self._sent):
            alive = {r: at for r, at in self._sent[key].items() if now - at <= self.ttl_s}
            if alive:
                self._sent[key] = alive
            else:
                del self._sent[key]


def routing_stats_from_engine(stats: dict[str, Any] | None, keys: dict[str, str]) -> ReplicaRoutingStats:
    """A replica's report from its engine's stats snapshot (``stats_to_dict`` form; None = no
    snapshot yet: nothing resident, no load). ``keys``: routing key of each ``lora_name`` the
    replica has served or preloaded (names it never saw are left out)."""
    if stats is None:
        return ReplicaRoutingStats(frozenset(), frozenset(), 0, 0, 0)
    lora = stats.get("lora") or {}
    slots = lora.get("slots", [])
    gpu = _keys_of((s["lora_name"] for s in slots if s["lora_name"] is not None), keys)
    cpu = _keys_of(lora.get("cpu_cache_lru", []), keys)
    empty = sum(1 for s in slots if s["lora_name"] is None)
    idle = sum(1 for s in slots if s["lora_name"] is not None and s["pin_count"] == 0)
    return ReplicaRoutingStats(gpu, cpu, empty, idle, stats["num_running"] + stats["num_waiting"] + stats["num_swapped"])


def _keys_of(names: Iterable[str], keys: dict[str, str]) -> frozenset[str]:
    return frozenset(keys[name] for name in names if name in keys)
