"""Asynchronous front of the synchronous :class:`~loraplex.engine.llm_engine.LLMEngine`.

The engine is not thread-safe, so one dedicated thread owns it: it runs
``engine.step()`` while requests are unfinished and, between steps, executes
commands queued by the event loop (add a request, abort one, retire an
adapter, read stats). Outputs go back to per-request ``asyncio.Queue``s with
``loop.call_soon_threadsafe``; :meth:`AsyncEngine.generate` yields each
request's :class:`RequestOutput`s as its ``SamplingParams.output_kind`` asks (the
OpenAI server asks for ``"delta"``: each step's new tokens, text and logprobs). Closing the generator early
(client disconnected, task cancelled) aborts the request, which frees its KV
blocks and its adapter slot pin.

Each request may carry its tenant (:class:`~loraplex.engine.fairness.TenantShare`, for the
fair scheduler), a queueing deadline (on ``clock``: if the engine has not scheduled it by
then, it is aborted and its stream fails with ``QueueTimedOut``, HTTP 503) and an
``on_done`` callback run on the request's event loop once the engine is done with it
(finished, aborted or failed), which the per-tenant admission gate uses to free a slot.

Adapters are retired (``engine.remove_lora`` and a release callback that may
delete the files) only once no request added through this wrapper still uses
them, so in-flight requests finish on the version they started with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.engine.fairness import TenantShare
from loraplex.engine.llm_engine import EngineStats, LLMEngine
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.engine_client import generate_outputs
from loraplex.platform.errors import QueueTimedOut

if TYPE_CHECKING:
    from loraplex.engine.input_processor import ProcessedPrompt
    import torch

    from loraplex.adapters import BaseModelSpec
    from loraplex.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (never started, shut down, or crashed)."""


def _run_in_order(calls: list[Callable[[], None]]) -> None:
    """Run a delivery batch on its event loop; one failing call is logged and does not stop the others."""
    for call in calls:
        try:
            call()
        except Exception:  # noqa: BLE001 - the loop would log it too; the rest must still run
            logger.exception("stream delivery callback failed")


def hand_to_loops(batches: dict[Any, list[Callable[[], None]]]) -> None:
    """Run each event loop's calls there, in order, with one ``call_soon_threadsafe`` per loop (a loop
    that is closed has nobody listening: its calls are dropped)."""
    for loop, calls in batches.items():
        try:
            loop.call_soon_threadsafe(_run_in_order, calls)
        except RuntimeError:  # the loop is closed
            pass


@dataclass
class StreamTarget:
    """Where the engine thread hands one request's outputs: ``queue.put_nowait(item)`` (a
    ``RequestOutput`` or the exception that ended the request) scheduled through
    ``loop.call_soon_threadsafe`` (an asyncio loop; the engine process's pipe stands in for one:
    ``engine_process.py``); ``on_done`` runs through ``loop`` once the engine forgot the request."""

    loop: Any
    queue: Any
    lora_int_id: int | None
    on_done: Callable[[], None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` to the request's event loop (dropped if that loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Retirement:
    callbacks: list[Callable[[], None]] = field(default_factory=list)


class AsyncEngine:
    """Runs ``engine`` in a background thread; see the module docstring.

    ``stats_interval_s``: how often (while busy) the stats snapshot read by
    :meth:`stats_dict` is refreshed; it is also refreshed whenever the engine goes idle.
    ``on_snapshot(stats)``: called on the engine thread with each new snapshot (the engine process sends it on).
    """

    def __init__(self, engine: LLMEngine, *, stats_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_snapshot: Callable[[EngineStats], None] | None = None) -> None:
        self.engine = engine
        self.on_snapshot = on_snapshot  # called on the engine thread with each new stats snapshot
        self.clock = clock
        self._deadlines: dict[str, tuple[float, int]] = {}  # request id -> (deadline, Retry-After seconds)
        self.stats_interval_s = stats_interval_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, StreamTarget] = {}
        self._lora_users: dict[int, int] = {}
        self._retiring: dict[int, _Retirement] = {}
        self._snapshot: EngineStats | None = None
        self._snapshot_at = 0.0
        self._crashed: BaseException | None = None

    # -- properties of the served model -------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Prompt + generated tokens of one sequence, at most."""
        return self.engine.max_model_len

    @property
    def max_lora_rank(self) -> int:
        return self.engine.config.max_lora_rank

    @property
    def max_full_module_slots(self) -> int:
        return self.engine.config.max_full_module_slots

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_pool is not None

    @property
    def model_name(self) -> str:
        """The model folder's name (the default model id)."""
        return Path(self.engine.model_path).name

    @property
    def base_spec(self) -> BaseModelSpec:
        """The :class:`~loraplex.adapters.BaseModelSpec` uploads are validated against."""
        return self.engine.adapter_spec

    @property
    def vocab_size(self) -> int:
        """The model's logits width."""
        return self.engine.spec.vocab_size

    @property
    def input_processor(self):
        """The engine's prompt validation (``engine/input_processor.py``), run by the server before queueing."""
        return self.engine.input_processor

    @property
    def serving_dtype(self) -> torch.dtype | None:
        """The adapters' slot dtype (None without LoRA)."""
        return self.engine.lora_pool.dtype if self.engine.lora_pool is not None else None

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The engine's grammar compiler (thread-safe; compiled constraints are cached)."""
        return self.engine.structured_outputs

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and stop the thread."""
        if self._thread is None:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None, *, tenant: TenantShare | None = None,
                          queue_deadline: float | None = None, retry_after_s: int = 1,
                          on_done: Callable[[], None] | None = None) -> RequestStream:
        """Queue a request and return the stream of its outputs (cumulative or delta, as
        ``params.output_kind`` says).

        ``tenant``: whom it is served for (fair scheduling). ``queue_deadline``: ``clock`` time by
        which the engine must have scheduled it, else it is aborted and the stream raises
        ``QueueTimedOut`` (``retry_after_s`` for its ``Retry-After``). ``on_done``: called on this
        event loop once the engine is done with the request (not called when this raises).

        Raises what ``LLMEngine.add_request`` raises (``InvalidRequestError``,
        ``PromptTooLongError``, ``AdapterError``), or ``EngineStoppedError``.
        """
        loop = asyncio.get_running_loop()
        stream = StreamTarget(loop, asyncio.Queue(), lora_request.lora_int_id if lora_request else None, on_done)
        await asyncio.wrap_future(self.submit_request(request_id, prompt_token_ids, params, lora_request, stream,
                                                      tenant=tenant, queue_deadline=queue_deadline,
                                                      retry_after_s=retry_after_s))
        return RequestStream(functools.partial(self.abort_nowait, request_id), request_id, stream.queue)

    def submit_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt, params: SamplingParams,
                       lora_request: LoRARequest | None, target: StreamTarget, *, tenant: TenantShare | None = None,
                       queue_deadline: float | None = None, retry_after_s: int = 1) -> concurrent.futures.Future:
        """:meth:`add_request` without an event loop of the caller's: the request's outputs go to
        ``target``; the future is done once the engine took the request (or holds what refused it)."""
        return self._submit(lambda: self._add(request_id, prompt_token_ids, params, lora_request, target, tenant,
                                              queue_deadline, retry_after_s))

    def abort_nowait(self, request_id: str) -> concurrent.futures.Future:
        """:meth:`abort` from any thread (the future is done once the engine thread ran it)."""
        return self._submit(lambda: self._abort(request_id))

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request`, then yield its outputs until it finishes (aborting it if closed early)."""
        return generate_outputs(self, request_id, prompt_token_ids, params, lora_request)

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished)."""
        await self._call(lambda: self._abort(request_id))

    def retire_lora(self, lora_int_id: int, on_released: Callable[[], None] | None = None) -> None:
        """Remove an adapter from the engine once no request uses it, then call ``on_released``
        (on the engine thread). Safe to call for an id the engine never loaded."""
        self._submit(lambda: self._retire(lora_int_id, on_released))

    def run_on_engine_thread(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between two steps (the only safe place to touch
        ``self.engine``); the future holds its result. Fails with ``EngineStoppedError`` when
        the thread is not running."""
        return self._submit(fn)

    def preload_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future:
        """Register an adapter now (read from disk into the host cache) so its first request does
        not wait for the disk; the future fails with the engine's ``AdapterError`` for a bad one."""
        def load() -> bool:
            added = self.engine.preload_lora(lora_request)
            self._take_snapshot()
            return added

        return self._submit(load)

    async def get_stats(self) -> EngineStats:
        """Fresh engine stats, read on the engine thread."""
        return await self._call(self._take_snapshot)

    def stats_dict(self) -> dict[str, Any] | None:
        """The latest stats snapshot as plain data (``lora``: the slot pool's stats), or None."""
        snapshot = self._snapshot
        return stats_to_dict(snapshot) if snapshot is not None else None

    # -- plumbing (event-loop side) ---------------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.is_running:
            future.set_exception(EngineStoppedError(f"the engine is not running ({self._crashed or 'stopped'})"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._refresh_snapshot(force=self._snapshot_stale())
                    self._wake.wait(self.stats_interval_s)
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine thread crashed")
            self._crashed = exc
        finally:
            self._shutdown_streams(self._crashed or EngineStoppedError("the engine was shut down"))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine.step() failed; failing the requests in flight")
            self._fail_all(exc)
            return
        self._deliver_all(outputs)
        if self._deadlines:
            self._expire_queued()
        # Under load a snapshot every stats interval; at once when this step drained the engine (the idle
        # view). Not at every finished request: at saturation most steps finish one, and the snapshot
        # (block and tenant counts, and with the engine process a pipe message) took ~15% of the engine's
        # host time there (bench_online --emulate-gpu-ms, py-spy; RESULTS.md session 12).
        self._refresh_snapshot(force=not self.engine.has_unfinished_requests())
        if not outputs:  # nothing progressed (e.g. waiting for a free adapter slot): do not spin
            self._wake.wait(0.002)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             lora_request: LoRARequest | None, stream: StreamTarget, tenant: TenantShare | None = None,
             queue_deadline: float | None = None, retry_after_s: int = 1) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, lora_request, tenant=tenant)
        self._streams[request_id] = stream
        if queue_deadline is not None:
            self._deadlines[request_id] = (queue_deadline, retry_after_s)
        if stream.lora_int_id is not None:
            self._lora_users[stream.lora_int_id] = self._lora_users.get(stream.lora_int_id, 0) + 1

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one ``call_soon_threadsafe`` per event loop, not one per
        output (each is a lock and a self-pipe write, and a step can advance hundreds of streams: 256 outputs
        took 1.1-3.9 ms of this thread one by one, 0.1 ms batched, on the 2-core development machine). The
        loop runs the queue puts, and the ``on_done`` of each finished stream right after its last output,
        in the order of ``outputs``."""
        batches: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            todo = batches.setdefault(stream.loop, [])
            todo.append(functools.partial(stream.queue.put_nowait, output))
            if output.finished:
                self._forget(output.request_id, todo)
        hand_to_loops(batches)

    def _abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self.engine.abort_request(request_id)
            self._forget(request_id)

    def _expire_queued(self) -> None:
        """Abort the requests still unscheduled at their queueing deadline (stream: 503)."""
        now = self.clock()
        for request_id, (deadline, retry_after) in list(self._deadlines.items()):
            group = self.engine.groups.get(request_id)
            if group is None or group.first_scheduled_time is not None:
                del self._deadlines[request_id]
            elif now >= deadline:
                stream = self._streams.get(request_id)
                if stream is not None:  # the error before the abort's on_done: a stream's consumer may go with it
                    stream.put(QueueTimedOut("the request waited longer than its tenant's max_queue_time_s "
                                             "before being scheduled (the server is busy)",
                                             retry_after_s=retry_after))
                self._abort(request_id)

    def _forget(self, request_id: str, todo: list[Callable[[], None]] | None = None) -> None:
        """Drop the request's stream; its ``on_done`` runs on the stream's loop (appended to ``todo``, the
        batch :meth:`_deliver_all` hands that loop, when given)."""
        stream = self._streams.pop(request_id)
        self._deadlines.pop(request_id, None)
        if stream.on_done is not None:
            if todo is not None:
                todo.append(stream.on_done)
            else:
                try:
                    stream.loop.call_soon_threadsafe(stream.on_done)
                except RuntimeError:  # the loop is closed
                    pass
        lora_int_id = stream.lora_int_id
        if lora_int_id is None:
            return
        self._lora_users[lora_int_id] -= 1
        if self._lora_users[lora_int_id] == 0:
            del self._lora_users[lora_int_id]
            if lora_int_id in self._retiring:
                self._finish_retirement(lora_int_id)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(exc)
            try:
                self._abort(request_id)
            except Exception:  # noqa: BLE001 - keep failing the others
                logger.exception("abort of %s failed", request_id)

    def _retire(self, lora_int_id: int, on_released: Callable[[], None] | None) -> None:
        retirement = self._retiring.setdefault(lora_int_id, _Retirement())
        if on_released is not None:
            retirement.callbacks.append(on_released)
        if self._lora_users.get(lora_int_id, 0) == 0:
            self._finish_retirement(lora_int_id)

    def _finish_retirement(self, lora_int_id: int) -> None:
        retirement = self._retiring.pop(lora_int_id)
        if self.engine.lora_pool is not None and lora_int_id in self.engine.list_loras():
            self.engine.remove_lora(lora_int_id)
        for callback in retirement.callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - a cleanup failure must not stop the engine
                logger.exception("release callback of adapter %d failed", lora_int_id)

    def _shutdown_streams(self, exc: BaseException) -> None:
        self._fail_all(exc)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(exc)

    def _snapshot_stale(self) -> bool:
        """True when the last snapshot still shows work (or none was taken): the engine is idle now."""
        s = self._snapshot
        return s is None or s.num_running + s.num_waiting + s.num_swapped > 0 or s.kv_blocks_used > 0

    def _take_snapshot(self) -> EngineStats:
        self._snapshot = self.engine.get_stats()
        self._snapshot_at = time.monotonic()
        if self.on_snapshot is not None:
            self.on_snapshot(self._snapshot)
        return self._snapshot

    def _refresh_snapshot(self, *, force: bool) -> None:
        if force or time.monotonic() - self._snapshot_at >= self.stats_interval_s:
            self._take_snapshot()


class RequestStream:
    """Async iterator over one request's outputs (as its ``output_kind`` asks); ends after the finished one.

    Raises ``EngineStoppedError`` (or the exception ``engine.step()`` raised) if the
    engine fails meanwhile. :meth:`close` aborts the request unless it finished.
    """

    def __init__(self, abort: Callable[[], Any], request_id: str, outputs: asyncio.Queue) -> None:
        self._abort = abort  # aborts the request in its engine
        self.request_id = request_id
        self._outputs = outputs
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request (frees its KV blocks and adapter pin) unless it already finished."""
        if not self.finished:
            self.finished = True
            self._abort()

    def fail(self, exc: BaseException) -> None:
        """Abort the request unless it finished, and end the stream with ``exc`` after the outputs already queued."""
        if not self.finished:
            self._outputs.put_nowait(exc)  # before the abort, which may queue the request's last (aborted) output
            self._abort()


def stats_to_dict(stats: EngineStats) -> dict[str, Any]:
    """``EngineStats`` as JSON-ready data (the ``lora`` pool stats flattened to a dict)."""
    data = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name not in ("lora", "tenants")}
    data["tenants"] = [dataclasses.asdict(t) for t in stats.tenants]
    lora = stats.lora
    if dataclasses.is_dataclass(lora):
        data["lora"] = dataclasses.asdict(lora)
    elif isinstance(lora, dict):
        data["lora"] = dict(lora)
    else:
        data["lora"] = None
    return data
