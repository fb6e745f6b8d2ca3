"""The engine in a process of its own (``loraplex serve``'s default; ``--no-engine-process`` keeps it a thread).

Why: in one process the gateway's event loop (HTTP, authentication, one server-sent event per
request and step) and the engine thread share one GIL. ``bench_online.py --quick
--emulate-gpu-ms`` measured on the 2-core development machine ~100-120 us of event-loop CPU per
streamed token against ~60-90 us of engine thread, and under load each torch call of the engine
thread (which releases the GIL) waits to win it back from the loop's bursts, so decode steps
stretch past the device time. vLLM (API server / EngineCore processes) and SGLang (tokenizer
manager / scheduler processes) split the two the same way.

How: :class:`ProcessEngineClient` starts a child process (``spawn``) that builds the engine
(``main.build_engine(settings)`` or the given factory) and runs it with an
:class:`~loraplex.platform.async_engine.AsyncEngine`. The child's streams deliver to a
:class:`_PipeSink` instead of an event loop: a step's outputs leave in one pipe message, pickled
on the engine thread. This process keeps the model facts the API needs
(:class:`~loraplex.platform.engine_facts.RemoteModelFacts`: tokenizer, prompt validation, grammar
compiler) and one reader thread that hands each message's outputs to the streams' event loops
with one ``call_soon_threadsafe`` per loop and message.

Messages (tuples over a ``multiprocessing`` pipe), gateway -> engine: ``("add", EngineCall)``,
``("abort", request_id)``, ``("preload", token, LoRARequest)``, ``("retire", token, lora_int_id)``,
``("stop",)``. Engine -> gateway: ``("info", ReplicaInfo)`` once built (or
``("start_failed", exc)``), ``("accepted", request_id)`` / ``("refused", request_id, exc)``,
``("batch", [("out", request_id, RequestOutput, same_prompt_logprobs) | ("error", request_id, exc) |
("done", request_id)])``, ``("result", token, value, exc)``, ``("stats", snapshot)``, ``("lost", exc)`` (the
engine thread died). The child exits when the gateway's end of the pipe closes; when the child dies, every
open stream raises ``EngineStoppedError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.util
import pickle
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from loraplex.engine.gc_heap import freeze_gc_heap
from loraplex.engine.input_processor import InvalidRequestError, ProcessedPrompt
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.parent_watch import exit_when_parent_exits
from loraplex.platform.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    RequestStream,
    StreamTarget,
    hand_to_loops,
    stats_to_dict,
)
from loraplex.platform.cluster.replica import EngineCall, ReplicaInfo
from loraplex.platform.core.signals import sigint_blocked
from loraplex.platform.engine_client import generate_outputs
from loraplex.platform.engine_facts import RemoteModelFacts

if TYPE_CHECKING:
    from loraplex.adapters.lora_request import LoRARequest
    from loraplex.engine.fairness import TenantShare
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.settings import Settings

logger = logging.getLogger(__name__)


# -- the engine's side (child process) ------------------------------------------------------------
class _PipeSink:
    """Stands in for the event loop of the child's request streams (``StreamTarget.loop``): what the
    engine thread schedules (a step's deliveries, a stream's error, an ``on_done``) runs at once and
    the messages it queued leave in one send. Only the engine thread queues; sends take a lock."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self.gateway_gone = False

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)
        self.flush()

    def queue(self, message: tuple) -> None:
        self._pending.append(message)

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self.send(("batch", batch))

    def send(self, message: tuple) -> None:
        """Send ``message``; once the gateway is gone, drop it (the main thread sees the pipe close and stops
        the engine; the engine thread must not die of a broken pipe meanwhile)."""
        with self._lock:
            if self.gateway_gone:
                return
            try:
                self._conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self.gateway_gone = True


class _Outbox:
    """The child's ``StreamTarget.queue`` of one request: outputs and the error that ended it, as messages.
    An output leaves without what the gateway holds already (it restores them, :meth:`ProcessEngineClient._deliver`):
    the prompt's text and token ids (it sent them) and prompt logprobs unchanged since the previous output (the
    whole list travels in every output; a long prompt would cost kilobytes per request and step)."""

    def __init__(self, request_id: str, sink: _PipeSink) -> None:
        self._request_id = request_id
        self._sink = sink
        self._prompt_logprobs_sent = -1  # length of the prompt logprobs last sent

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._sink.queue(("error", self._request_id, picklable(item)))
            return
        item.prompt, item.prompt_token_ids = None, None  # a fresh object per output: the engine keeps its own
        logprobs = item.prompt_logprobs
        same = logprobs is not None and len(logprobs) == self._prompt_logprobs_sent
        if same:
            item.prompt_logprobs = None
        else:
            self._prompt_logprobs_sent = -1 if logprobs is None else len(logprobs)
        self._sink.queue(("out", self._request_id, item, same))


def picklable(exc: BaseException) -> BaseException:
    """``exc`` when it survives pickling, else a ``RuntimeError`` naming it (an exception class whose
    ``__init__`` does not take its ``args`` cannot be rebuilt in the other process)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure gets the same stand-in
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child_main(conn, settings: Settings, engine_factory: Callable[[Settings], Any] | None) -> None:
    """Body of the engine process: build, report, then serve the gateway's messages until it goes."""
    # Ctrl-C reaches the whole process group: the gateway drains its requests and then stops this process
    # ("stop", or the pipe closing); SIGTERM still ends it (the gateway's last resort, terminate()). The
    # gateway started this process with SIGINT blocked (core.signals), so a Ctrl-C during the imports
    # before this line stayed pending; ignored now, it is dropped when unblocked.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    exit_when_parent_exits("engine process")  # a killed gateway cannot close the pipe while the model loads
    logging.basicConfig(level=getattr(logging, str(settings.log_level).upper(), logging.INFO))
    try:
        if engine_factory is None:
            from loraplex.platform.main import build_engine

            engine_factory = build_engine
        sink = _PipeSink(conn)
        engine = AsyncEngine(engine_factory(settings), stats_interval_s=settings.stats_interval_s,
                             on_snapshot=_SnapshotSender(sink))
        engine.start()
    except BaseException as exc:  # noqa: BLE001 - reported to the gateway, which raises it
        conn.send(("start_failed", picklable(exc)))
        return
    if settings.gc_freeze:
        freeze_gc_heap()  # this process holds its engine until it exits (engine/gc_heap.py)
    sink.send(("info", ReplicaInfo.of(engine, "engine-process")))
    stop = threading.Event()
    threading.Thread(target=_push_stats, args=(engine, sink, stop), name="loraplex-engine-stats", daemon=True).start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the gateway is gone
                break
            if message[0] == "stop":
                break
            _handle(engine, sink, message)
    finally:
        stop.set()
        engine.shutdown()
        engine.engine.close()


def _handle(engine: AsyncEngine, sink: _PipeSink, message: tuple) -> None:
    kind = message[0]
    if kind == "add":
        call: EngineCall = message[1]
        request_id = call.request_id
        target = StreamTarget(sink, _Outbox(request_id, sink),
                              call.lora_request.lora_int_id if call.lora_request else None,
                              functools.partial(sink.queue, ("done", request_id)))
        deadline = None if call.queue_timeout_s is None else engine.clock() + call.queue_timeout_s
        accepted = engine.submit_request(request_id, call.prompt_token_ids, call.params, call.lora_request, target,
                                         tenant=call.tenant, queue_deadline=deadline, retry_after_s=call.retry_after_s)
        # sent by the engine thread, or by this thread when the future was done already: outputs of the
        # request may leave first (the gateway registered the stream before sending "add")
        accepted.add_done_callback(lambda f: sink.send(
            ("accepted", request_id) if f.exception() is None else ("refused", request_id, picklable(f.exception()))))
    elif kind == "abort":
        engine.abort_nowait(message[1])
    elif kind == "preload":
        token = message[1]
        engine.preload_lora(message[2]).add_done_callback(functools.partial(_send_result, sink, token))
    elif kind == "retire":
        token = message[1]
        engine.retire_lora(message[2], lambda: sink.send(("result", token, None, None)))
    else:
        logger.error("engine process: unknown message %r", kind)


def _send_result(sink: _PipeSink, token: int, future: concurrent.futures.Future) -> None:
    exc = future.exception()
    sink.send(("result", token, None if exc is not None else future.result(),
               None if exc is None else picklable(exc)))


# A busy engine's snapshots (taken every stats interval, and when asked) are sent at most this often.
STATS_MIN_INTERVAL_S = 0.05


class _SnapshotSender:
    """``AsyncEngine.on_snapshot`` of the engine process (engine thread): a snapshot of an idle engine leaves at
    once, so the gateway's stats are current when a request's last output arrives; a busy engine's at most every
    ``STATS_MIN_INTERVAL_S`` (:func:`_push_stats` sends the last one held back)."""

    def __init__(self, sink: _PipeSink) -> None:
        self._sink = sink
        self._sent_at = 0.0
        self.sent: object = None

    def __call__(self, stats) -> None:
        now = time.monotonic()
        if stats.num_running + stats.num_waiting + stats.num_swapped == 0 or now - self._sent_at >= \
                STATS_MIN_INTERVAL_S:
            self.send(stats)

    def send(self, stats) -> None:
        self._sent_at = time.monotonic()
        self.sent = stats
        self._sink.send(("stats", stats_to_dict(stats)))


def _push_stats(engine: AsyncEngine, sink: _PipeSink, stop: threading.Event) -> None:
    """Every ``STATS_MIN_INTERVAL_S``: send the snapshot :class:`_SnapshotSender` held back, if any; once the
    engine thread has stopped (crashed), say so: the gateway then reports the engine as not running."""
    sender: _SnapshotSender = engine.on_snapshot
    while not stop.wait(STATS_MIN_INTERVAL_S):
        if not engine.is_running:
            sink.send(("lost", picklable(EngineStoppedError(
                f"the engine thread of the engine process stopped ({engine._crashed or 'shut down'})"))))
            return
        snapshot = engine._snapshot
        if snapshot is not None and snapshot is not sender.sent:
            sender.send(snapshot)


# -- the gateway's side ---------------------------------------------------------------------------
def _answer_future() -> concurrent.futures.Future:
    """A future the reader thread completes; already running, so a caller's cancel (``wrap_future`` of a
    cancelled task) cannot make the reader's ``set_result`` fail."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


class _OpenRequest:
    """A request in the engine process: where its outputs go (``target``), its prompt as the gateway sent it
    (the engine derives its outputs' ``prompt`` and ``prompt_token_ids`` from it) and the prompt logprobs
    last received."""

    __slots__ = ("target", "text", "token_ids", "prompt_logprobs")

    def __init__(self, target: StreamTarget, prompt: list[int] | ProcessedPrompt) -> None:
        self.target = target
        processed = isinstance(prompt, ProcessedPrompt)
        self.text = prompt.text if processed else None
        self.token_ids = prompt.token_ids if processed else prompt
        self.prompt_logprobs = None


def _stop_process(conn, process, send_lock: threading.Lock, timeout_s: float = 10.0) -> None:
    """Ask the engine process to stop, wait ``timeout_s``, then terminate it; close the pipe."""
    try:
        with send_lock:
            conn.send(("stop",))
    except (OSError, ValueError):  # already gone
        pass
    process.join(timeout_s)
    if process.is_alive():
        process.terminate()
        process.join(5)
    conn.close()


class ProcessEngineClient(RemoteModelFacts):
    """The :class:`~loraplex.platform.engine_client.EngineClient` of an engine in a child process;
    see the module docstring. Starting it builds the engine there and waits for it (a model load:
    seconds to minutes). ``engine_factory(settings) -> LLMEngine``: a picklable callable (default
    ``main.build_engine``; benchmarks pass one that builds random weights).

    Raises what building the engine raised (``ConfigError``, ``ValueError``, ...), or
    ``EngineStoppedError`` when the child died before reporting.
    """

    def __init__(self, settings: Settings, engine_factory: Callable[[Settings], Any] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not a daemon: the engine may start processes of its own (tensor-parallel workers), which a daemonic
        # process may not. It exits when this end of the pipe closes; at interpreter exit the finalizer below
        # stops it before multiprocessing joins its non-daemonic children.
        self._process = context.Process(target=_child_main, args=(child_conn, settings, engine_factory),
                                        name="loraplex-engine-process")
        self._reader: threading.Thread | None = None
        with sigint_blocked():
            self._process.start()
        child_conn.close()
        self._running = False  # until the engine reported
        self._send_lock = threading.Lock()
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_process, args=(self._conn, self._process, self._send_lock), exitpriority=10)
        snapshot, first = None, None
        try:
            first = self._conn.recv()
            while first[0] == "stats":  # the engine's first snapshot may come before its description
                snapshot, first = first[1], self._conn.recv()
        except (EOFError, OSError):
            first = None  # it died before reporting
        except BaseException:  # e.g. Ctrl-C while the model loads: stop the child now, not after a stop timeout
            self._abandon_start(terminate=True)
            raise
        if first is None or first[0] == "start_failed":
            self._abandon_start()
            if first is None:
                raise EngineStoppedError(f"the engine process exited while starting (exit code "
                                         f"{self._process.exitcode})")
            raise first[1]
        super().__init__(first[1])
        self.clock = clock
        self.stats_interval_s = settings.stats_interval_s
        self._lock = threading.Lock()
        self._requests: dict[str, _OpenRequest] = {}
        self._answers: dict[Any, concurrent.futures.Future] = {}  # ("add", request id) or token -> future
        self._tokens = itertools.count(1)
        self._snapshot: dict[str, Any] | None = snapshot
        self._lost: BaseException | None = None
        self._running = True
        self._reader = threading.Thread(target=self._read, name="loraplex-engine-pipe", daemon=True)
        self._reader.start()

    def _abandon_start(self, *, terminate: bool = False) -> None:
        """The engine never reported: terminate the child when asked (it may still be loading), wait for it to
        exit, and close the pipe (its finalizer is no longer needed)."""
        self._finalizer.cancel()
        if terminate:
            self._process.terminate()
        self._process.join(10)
        self._conn.close()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the engine process runs from construction on."""

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (requests in flight end with ``EngineStoppedError``)."""
        if not self._running:
            return
        self._running = False
        if self._finalizer.still_active():  # else it ran at interpreter exit already
            self._finalizer.cancel()
            _stop_process(self._conn, self._process, self._send_lock, timeout_s)
        if self._reader is not None:
            self._reader.join(5)

    @property
    def is_running(self) -> bool:
        return self._running and self._lost is None and self._process.is_alive()

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None, *, tenant: TenantShare | None = None,
                          queue_deadline: float | None = None, retry_after_s: int = 1,
                          on_done: Callable[[], None] | None = None) -> RequestStream:
        """As ``AsyncEngine.add_request`` (raises what the engine raised, or ``EngineStoppedError``)."""
        if not self.is_running:
            raise EngineStoppedError(f"the engine process is not running ({self._lost or 'stopped'})")
        loop = asyncio.get_running_loop()
        target = StreamTarget(loop, asyncio.Queue(), lora_request.lora_int_id if lora_request else None, on_done)
        accepted = _answer_future()
        prompt = prompt_token_ids if isinstance(prompt_token_ids, ProcessedPrompt) else list(prompt_token_ids)
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequestError(f"request_id={request_id!r} is already in use")
            self._requests[request_id] = _OpenRequest(target, prompt)
            self._answers["add", request_id] = accepted
        # the gateway's deadline made relative (the two processes share the clock, but it stays one path)
        timeout_s = None if queue_deadline is None else max(0.0, queue_deadline - self.clock())
        sent = False
        try:
            self._send(("add", EngineCall(request_id, prompt, params, lora_request, tenant, timeout_s, retry_after_s)))
            sent = True
            await asyncio.wrap_future(accepted)
        except BaseException as exc:
            with self._lock:
                self._requests.pop(request_id, None)
                self._answers.pop(("add", request_id), None)
            refused = accepted.done() and accepted.exception() is not None
            if sent and not refused:  # cancelled while (or after) the engine took it: it must not run on
                self._abort(request_id)
            if isinstance(exc, (OSError, ValueError)) and not sent:  # the pipe is closed: the process is gone
                raise EngineStoppedError(f"the engine process is not running ({self._lost or exc})") from None
            raise
        return RequestStream(functools.partial(self._abort, request_id), request_id, target.queue)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """:meth:`add_request`, then yield its outputs until it finishes (aborting it if closed early)."""
        return generate_outputs(self, request_id, prompt_token_ids, params, lora_request)

    def preload_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future:
        """Register the adapter and read it into the engine's host cache; the future fails with the
        engine's ``AdapterError`` for a bad one."""
        return self._ask("preload", lora_request)

    def retire_lora(self, lora_int_id: int, on_released: Callable[[], None] | None = None) -> None:
        """The engine forgets the adapter once no request uses it; then ``on_released`` runs (on this
        client's reader thread)."""
        future = self._ask("retire", lora_int_id)
        if on_released is not None:
            future.add_done_callback(lambda f: on_released() if f.exception() is None else None)

    def stats_dict(self) -> dict[str, Any] | None:
        """The engine's latest stats snapshot (sent by the engine process when it changes), or None."""
        return self._snapshot

    # -- plumbing ---------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except (OSError, ValueError):  # the engine process is gone: nothing runs the request any more
            pass

    def _ask(self, kind: str, argument: Any) -> concurrent.futures.Future:
        future = _answer_future()
        if not self.is_running:
            future.set_exception(EngineStoppedError(f"the engine process is not running ({self._lost or 'stopped'})"))
            return future
        token = next(self._tokens)
        with self._lock:
            self._answers[token] = future
        self._send((kind, token, argument))
        return future

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "batch":
                    self._deliver(message[1])
                elif kind == "stats":
                    self._snapshot = message[1]
                elif kind == "lost":  # the engine thread died; its streams got the error already
                    self._lost = message[1]
                elif kind in ("accepted", "refused"):
                    with self._lock:
                        future = self._answers.pop(("add", message[1]), None)
                    if future is not None and not future.done():
                        future.set_result(None) if kind == "accepted" else future.set_exception(message[2])
                elif kind == "result":
                    with self._lock:
                        future = self._answers.pop(message[1], None)
                    if future is not None and not future.done():
                        future.set_result(message[2]) if message[3] is None else future.set_exception(message[3])
        except (EOFError, OSError):
            pass
        except BaseException:  # noqa: BLE001 - a protocol fault: fail what is in flight, say why
            logger.exception("engine process: reading its messages failed")
        finally:
            self._fail_all()

    def _deliver(self, batch: list[tuple]) -> None:
        """One ``call_soon_threadsafe`` per event loop with every item of the message, in order."""
        todo: dict[Any, list[Callable[[], None]]] = {}
        with self._lock:
            for item in batch:
                request_id = item[1]
                request = self._requests.get(request_id)
                if request is None:
                    continue
                target = request.target
                calls = todo.setdefault(target.loop, [])
                if item[0] == "done":
                    del self._requests[request_id]
                    if target.on_done is not None:
                        calls.append(target.on_done)
                    continue
                if item[0] == "out":  # put back what the engine process left out (_Outbox)
                    output = item[2]
                    output.prompt, output.prompt_token_ids = request.text, request.token_ids
                    if item[3]:
                        output.prompt_logprobs = request.prompt_logprobs
                    else:
                        request.prompt_logprobs = output.prompt_logprobs
                calls.append(functools.partial(target.queue.put_nowait, item[2]))
        hand_to_loops(todo)

    def _fail_all(self) -> None:
        """The engine process is gone: every open stream and pending answer fails with ``EngineStoppedError``;
        outside ``shutdown`` that is logged as an error with the process's exit code or signal."""
        self._process.join(timeout=2.0)  # its pipe closed: let it finish exiting, for the exit code
        code = self._process.exitcode
        how = ("" if code is None or code == 0 else f" (killed by signal {-code})" if code < 0
               else f" (exit code {code})")
        error = EngineStoppedError("the engine process stopped" + how)
        if self._running and self._lost is None:
            logger.error("engine process (pid %s) stopped%s: requests fail with 503 until the server is restarted",
                         self._process.pid, how)
        self._lost = self._lost or error
        with self._lock:
            requests, self._requests = self._requests, {}
            answers, self._answers = self._answers, {}
        for future in answers.values():
            if not future.done():
                future.set_exception(error)
        todo: dict[Any, list[Callable[[], None]]] = {}
        for request in requests.values():
            calls = todo.setdefault(request.target.loop, [])
            calls.append(functools.partial(request.target.queue.put_nowait, error))
            if request.target.on_done is not None:
                calls.append(request.target.on_done)
        hand_to_loops(todo)
