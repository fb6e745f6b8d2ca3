"""The gateway's engine client over N engine replicas on Ray Serve
(:class:`~loraplex.platform.engine_client.EngineClient`).

Requests: ``add_request`` sends an :class:`~.replica.EngineCall` through the deployment handle
with the adapter version's routing key as multiplexed model id (the adapter-aware router picks
the replica) and returns once the replica's engine accepted it (or raises what the engine
raised: ``InvalidRequestError``, ``PromptTooLongError``, ``AdapterError``...). The stream then
yields the replica's outputs. When the replica dies meanwhile (process killed, node lost) the
stream raises :class:`~loraplex.platform.errors.ReplicaFailed` (503 ``replica_failed``; a
started stream ends with that error event); Ray Serve replaces the replica and routes new
requests to live ones. Closing the stream cancels the call, which aborts the request on its
replica.

Model facts (tokenizer, vocabulary, context length, adapter dtype) come from the model folder
and one replica's :class:`~.replica.ReplicaInfo`
(:class:`~loraplex.platform.engine_facts.RemoteModelFacts`); the grammar compiler for request
validation runs here. Stats: every ``stats_interval_s`` each replica's snapshot is fetched (a broadcast)
and merged (:func:`~.stats.merge_replica_stats`); ``requests_routed`` counts accepted requests
per (adapter routing key, replica). Retiring an adapter waits until no request sent through this client uses it, then
each replica forgets it, then ``on_released`` runs (it may delete the files).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import ray.exceptions
from ray.serve.exceptions import RequestCancelledError

from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.fairness import TenantShare
from loraplex.engine.input_processor import ProcessedPrompt
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.async_engine import EngineStoppedError
from loraplex.platform.cluster.replica import Accepted, EngineCall, ReplicaInfo
from loraplex.platform.cluster.routing import adapter_routing_key
from loraplex.platform.cluster.stats import merge_replica_stats
from loraplex.platform.engine_client import generate_outputs
from loraplex.platform.engine_facts import RemoteModelFacts
from loraplex.platform.errors import ReplicaFailed

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)
RETIRE_TIMEOUT_S = 60.0
PRELOAD_TIMEOUT_S = 120.0


class ReplicaEngineClient(RemoteModelFacts):
    """See the module docstring. ``handle``: the replicas' deployment handle; ``info``: one
    replica's description; ``on_shutdown``: undeploys (and stops Ray if it was started for
    this gateway)."""

    def __init__(self, handle: DeploymentHandle, info: ReplicaInfo, *, stats_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(info)  # tokenizer, model spec, prompt validation, grammar compiler
        self.handle = handle
        self.clock = clock
        self.stats_interval_s = stats_interval_s
        self.requests_routed: Counter[tuple[str, str]] = Counter()  # (routing key, replica id) -> requests
        self._on_shutdown = on_shutdown
        self._lock = threading.Lock()
        self._lora_users: dict[int, int] = {}
        self._retiring: dict[int, list[Callable[[], None]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="loraplex-replicas")
        self._snapshot: dict[str, Any] | None = None
        self._poller: asyncio.Task | None = None
        self._running = False

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Accept requests; on a running event loop also start polling the replicas' stats."""
        self._running = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._poller is None or self._poller.done() or self._poller.get_loop() is not loop:
            self._poller = loop.create_task(self._poll_stats())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop accepting requests and polling; undeploy (``on_shutdown``)."""
        self._running = False
        poller, self._poller = self._poller, None
        if poller is not None and not poller.get_loop().is_closed():
            poller.get_loop().call_soon_threadsafe(poller.cancel)
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None
        self._executor.shutdown(wait=False)

    @property
    def is_running(self) -> bool:
        return self._running

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None, *, tenant: TenantShare | None = None,
                          queue_deadline: float | None = None, retry_after_s: int = 1,
                          on_done: Callable[[], None] | None = None) -> ReplicaRequestStream:
        """As ``AsyncEngine.add_request``; also raises ``ReplicaFailed`` (the replica died
        before accepting) and ``EngineStoppedError`` (this client is shut down)."""
        if not self._running:
            raise EngineStoppedError("the engine replicas are shut down")
        timeout_s = None if queue_deadline is None else max(0.0, queue_deadline - self.clock())
        # a ProcessedPrompt (validated here by input_processor) travels as is; the replica's engine takes it
        prompt = prompt_token_ids if isinstance(prompt_token_ids, ProcessedPrompt) else list(prompt_token_ids)
        call = EngineCall(request_id, prompt, params, lora_request, tenant, timeout_s, retry_after_s)
        key = adapter_routing_key(lora_request)
        handle = self.handle.options(stream=True, multiplexed_model_id=key)
        stream = ReplicaRequestStream(self, request_id, handle.generate.remote(call), key,
                                      lora_request.lora_int_id if lora_request else None, on_done)
        await stream.wait_accepted()
        return stream

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request`, then yield its outputs until it finishes (aborting it if closed early)."""
        return generate_outputs(self, request_id, prompt_token_ids, params, lora_request)

    def preload_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future:
        """Register and read the adapter on the replica the router picks for it (its next
        requests go there); the future fails with the engine's ``AdapterError`` for a bad one."""
        handle = self.handle.options(multiplexed_model_id=adapter_routing_key(lora_request))

        def load() -> bool:
            try:
                return handle.preload_lora.remote(lora_request).result(timeout_s=PRELOAD_TIMEOUT_S)
            except BaseException as exc:
                raise translate_error(exc) from None

        return self._executor.submit(load)

    def retire_lora(self, lora_int_id: int, on_released: Callable[[], None] | None = None) -> None:
        """Once no request sent through this client uses the adapter, every replica forgets it,
        then ``on_released`` runs (on a worker thread)."""
        with self._lock:
            self._retiring.setdefault(lora_int_id, [])
            if on_released is not None:
                self._retiring[lora_int_id].append(on_released)
            idle = self._lora_users.get(lora_int_id, 0) == 0
        if idle:
            self._finish_retirement(lora_int_id)

    def stats_dict(self) -> dict[str, Any] | None:
        """The replicas' merged stats (:func:`merge_replica_stats`) as of the last poll, or None."""
        return self._snapshot

    async def refresh_stats(self) -> dict[str, Any] | None:
        """Fetch every replica's snapshot now, merge them and keep the result (see :meth:`stats_dict`)."""
        results = await self.handle.broadcast("stats").results_async(timeout_s=max(5.0, 5 * self.stats_interval_s),
                                                                      return_exceptions=True)
        snapshots = [r for r in results if isinstance(r, dict)]
        self._snapshot = merge_replica_stats(snapshots) if snapshots else None
        return self._snapshot

    # -- plumbing ---------------------------------------------------------------------------------
    async def _poll_stats(self) -> None:
        while True:
            try:
                await self.refresh_stats()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - stats are best effort; the next poll tries again
                logger.warning("polling the replicas' stats failed", exc_info=True)
            await asyncio.sleep(self.stats_interval_s)

    def _use(self, lora_int_id: int | None) -> None:
        if lora_int_id is not None:
            with self._lock:
                self._lora_users[lora_int_id] = self._lora_users.get(lora_int_id, 0) + 1

    def _release(self, lora_int_id: int | None) -> None:
        if lora_int_id is None:
            return
        with self._lock:
            self._lora_users[lora_int_id] -= 1
            if self._lora_users[lora_int_id]:
                return
            del self._lora_users[lora_int_id]
            retiring = lora_int_id in self._retiring
        if retiring:
            self._finish_retirement(lora_int_id)

    def _finish_retirement(self, lora_int_id: int) -> None:
        with self._lock:
            callbacks = self._retiring.pop(lora_int_id, None)
        if callbacks is None:
            return

        def forget_everywhere() -> None:
            try:
                results = self.handle.broadcast("retire_lora", lora_int_id).results(
                    timeout_s=RETIRE_TIMEOUT_S, return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        logger.warning("a replica could not retire adapter %d: %s", lora_int_id, result)
            except Exception:  # noqa: BLE001 - the adapter is unused here anyway; release it
                logger.exception("retiring adapter %d on the replicas failed", lora_int_id)
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - a cleanup failure must not stop the others
                    logger.exception("release callback of adapter %d failed", lora_int_id)

        self._executor.submit(forget_everywhere)


class ReplicaRequestStream:
    """One request's outputs from its replica (async iterator; ends after the finished one).

    ``replica_id``: the replica whose engine took it. Raises ``ReplicaFailed`` when that
    replica dies, or what its engine raised. :meth:`close` aborts the request unless it finished.
    """

    def __init__(self, owner: ReplicaEngineClient, request_id: str, response, routing_key: str,
                 lora_int_id: int | None, on_done: Callable[[], None] | None) -> None:
        self.owner = owner
        self.request_id = request_id
        self.routing_key = routing_key
        self.replica_id: str | None = None
        self.finished = False
        self._response = response
        self._lora_int_id = lora_int_id
        self._on_done = on_done
        self._ended = False
        self._failure: BaseException | None = None
        owner._use(lora_int_id)

    async def wait_accepted(self) -> None:
        """Wait for the replica's :class:`~.replica.Accepted`; raises what refused the request
        (``on_done`` is not called then, as ``AsyncEngine.add_request`` does)."""
        try:
            first = await self._response.__anext__()
        except BaseException as exc:
            self.finished = True
            self._end(call_on_done=False)
            if isinstance(exc, StopAsyncIteration):
                raise ReplicaFailed("the engine replica ended the request before accepting it") from None
            raise translate_error(exc) from None
        if not isinstance(first, Accepted):  # a replica of another loraplex version
            self.close()
            raise ReplicaFailed("the engine replica answered out of protocol")
        self.replica_id = first.replica_id
        self.owner.requests_routed[self.routing_key, first.replica_id] += 1

    def __aiter__(self) -> ReplicaRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._response.__anext__()
        except BaseException as exc:
            self.finished = True
            self._end()
            if self._failure is not None:  # fail(): the cancelled response ends with the given error
                raise self._failure from None
            if isinstance(exc, StopAsyncIteration):
                raise ReplicaFailed("the engine replica ended the request before it finished") from None
            if isinstance(exc, asyncio.CancelledError):
                self._response.cancel()
                raise
            raise translate_error(exc) from None
        self.finished = output.finished
        if self.finished:
            self._end()
        return output

    def close(self) -> None:
        """Abort the request on its replica (frees its KV blocks and slot pin) unless it finished."""
        if not self.finished:
            self.finished = True
            self._response.cancel()
        self._end()

    def fail(self, exc: BaseException) -> None:
        """Abort the request on its replica unless it finished; the stream then raises ``exc``."""
        if not self.finished:
            self._failure = exc
            self._response.cancel()

    def _end(self, *, call_on_done: bool = True) -> None:
        if self._ended:
            return
        self._ended = True
        self.owner._release(self._lora_int_id)
        if call_on_done and self._on_done is not None:
            self._on_done()


_REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError,
                 ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError)


def translate_error(exc: BaseException) -> BaseException:
    """The platform's view of an exception from a replica call: the engine's own exception (a
    task error is unwrapped), ``ReplicaFailed`` when the replica is gone, else ``exc``."""
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
            return cause
        exc = cause if isinstance(cause, BaseException) else exc
    if isinstance(exc, _REPLICA_LOST):
        logger.warning("engine replica lost: %s", exc)
        return ReplicaFailed("the engine replica serving this request failed; retry (it is being replaced)")
    if isinstance(exc, RequestCancelledError):
        return asyncio.CancelledError()
    return exc
