"""One engine replica: the body of the Ray Serve deployment (``launch.py`` wraps it with
``serve.deployment``). Each replica builds its ``LLMEngine`` from the gateway's settings
(``main.build_engine``: one source of engine flags) on the device Ray gave it, and runs it
with an :class:`~loraplex.platform.async_engine.AsyncEngine`.

Calls (all through the deployment handle):

- ``generate(EngineCall)`` (streaming): yields :class:`Accepted` once the engine has taken
  the request (or raises what ``AsyncEngine.add_request`` raises), then the request's outputs
  until the finished one. Cancelling the call (the gateway's stream closed) aborts the request.
- ``describe()`` -> :class:`ReplicaInfo`; ``stats()`` -> the engine's stats snapshot (plain
  data, plus ``replica_id``); ``preload_lora(LoRARequest)``; ``retire_lora(lora_int_id)``.
- ``record_routing_stats()`` (Ray Serve calls it every ``request_routing_stats_period_s``):
  :class:`~.routing.ReplicaRoutingStats` as a dict, from the latest engine snapshot.
- ``check_health()``: fails once the engine thread has stopped, so Ray replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.fairness import TenantShare
from loraplex.engine.gc_heap import freeze_gc_heap
from loraplex.engine.input_processor import ProcessedPrompt
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.async_engine import AsyncEngine, EngineStoppedError
from loraplex.platform.cluster.routing import adapter_routing_key, routing_stats_from_engine
from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineCall:
    """One engine request sent to a replica (``AsyncEngine.add_request``'s arguments).
    ``queue_timeout_s``: seconds from arrival at the replica by which the engine must have
    scheduled it (None: no bound); the gateway's deadline made relative, as clocks differ
    between hosts."""

    request_id: str
    prompt_token_ids: list[int] | ProcessedPrompt  # token ids, or the gateway's validated prompt
    params: SamplingParams
    lora_request: LoRARequest | None = None
    tenant: TenantShare | None = None
    queue_timeout_s: float | None = None
    retry_after_s: int = 1


@dataclass(frozen=True)
class Accepted:
    """First item of a ``generate`` stream: the engine of replica ``replica_id`` took the request."""

    replica_id: str


@dataclass(frozen=True)
class ReplicaInfo:
    """What the gateway needs to know about the served model (the same on every replica).
    ``serving_dtype``: the adapters' slot dtype name (``"bfloat16"``), None without LoRA.
    ``base_spec``: the engine's :class:`~loraplex.adapters.BaseModelSpec` that uploads are checked
    against (with tensor parallelism its ``vocab_size`` is None: embedding / LM-head adapters are
    refused); None = the model folder's."""

    replica_id: str
    model_path: str
    max_model_len: int
    max_lora_rank: int
    lora_enabled: bool
    serving_dtype: str | None
    max_full_module_slots: int = 0
    base_spec: Any = None

    @classmethod
    def of(cls, engine: AsyncEngine, replica_id: str) -> ReplicaInfo:
        """The description of ``engine`` (an in-process ``AsyncEngine``)."""
        dtype = engine.serving_dtype
        return cls(replica_id, str(Path(engine.engine.model_path).resolve()), engine.max_model_len,
                   engine.max_lora_rank, engine.lora_enabled,
                   str(dtype).removeprefix("torch.") if dtype is not None else None,
                   engine.max_full_module_slots, engine.base_spec)


class EngineReplica:
    """The deployment body; see the module docstring. ``settings``: the gateway's settings
    without secrets (``launch.replica_settings``); ``engine_factory(settings) -> LLMEngine``
    (default ``main.build_engine``; benchmarks pass one that builds random weights)."""

    def __init__(self, settings: Settings, engine_factory: Callable[[Settings], Any] | None = None) -> None:
        from loraplex.platform.main import build_engine

        self.replica_id = _replica_id()
        engine = (engine_factory or build_engine)(settings)
        self.engine = AsyncEngine(engine, stats_interval_s=settings.stats_interval_s)
        self.engine.start()
        if settings.gc_freeze:
            freeze_gc_heap()  # this replica's process holds its engine for good (engine/gc_heap.py)
        self._keys: dict[str, str] = {}  # lora_name -> routing key, of every adapter this replica was given
        logger.info("engine replica %s ready (%s)", self.replica_id, self.engine.model_name)

    async def generate(self, call: EngineCall) -> AsyncIterator[Accepted | RequestOutput]:
        self._remember(call.lora_request)
        deadline = None if call.queue_timeout_s is None else self.engine.clock() + call.queue_timeout_s
        stream = await self.engine.add_request(call.request_id, call.prompt_token_ids, call.params, call.lora_request,
                                               tenant=call.tenant, queue_deadline=deadline,
                                               retry_after_s=call.retry_after_s)
        try:
            yield Accepted(self.replica_id)
            async for output in stream:
                yield output
        finally:
            stream.close()  # aborts the request unless it finished (cancelled: the gateway closed it)

    def describe(self) -> ReplicaInfo:
        return ReplicaInfo.of(self.engine, self.replica_id)

    def stats(self) -> dict[str, Any] | None:
        snapshot = self.engine.stats_dict()
        return None if snapshot is None else {**snapshot, "replica_id": self.replica_id}

    async def preload_lora(self, lora_request: LoRARequest) -> bool:
        """Register the adapter and read it into the host cache; raises the engine's ``AdapterError``."""
        self._remember(lora_request)
        return await asyncio.wrap_future(self.engine.preload_lora(lora_request))

    async def retire_lora(self, lora_int_id: int) -> None:
        """Forget the adapter once this replica's requests on it are done."""
        loop = asyncio.get_running_loop()
        released = loop.create_future()
        self.engine.retire_lora(lora_int_id, lambda: loop.call_soon_threadsafe(_set_done, released))
        await released
        self._keys = {name: key for name, key in self._keys.items() if not key.startswith(f"{lora_int_id}:")}

    def record_routing_stats(self) -> dict[str, Any]:
        return routing_stats_from_engine(self.engine.stats_dict(), self._keys).to_dict()

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise EngineStoppedError(f"the engine thread of replica {self.replica_id} stopped")

    def __del__(self) -> None:  # Ray Serve stops a replica by dropping it
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            engine.engine.close()

    def _remember(self, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self._keys[lora_request.lora_name] = adapter_routing_key(lora_request)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id
