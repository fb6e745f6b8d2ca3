"""Child processes started without Ctrl-C.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the server and every process it
started. The server shuts down gracefully and stops its children itself; a child that is still importing
(the engine process, the upload checkers' forkserver: seconds of torch and transformers imports) would
instead die of a ``KeyboardInterrupt`` and print its traceback. :func:`sigint_blocked` starts them with
SIGINT blocked (the mask is inherited across fork and exec); each ignores SIGINT once it runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in the calling thread inside the block, so processes started there inherit the mask. Only
    this thread: a SIGINT to the process meanwhile is taken by another thread that does not block it (Python then
    runs its handler in the main thread as usual). No-op where signal masks do not exist (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing's resource tracker, started by the first Process.start() or forkserver, unblocks SIGINT in
    # the starting thread once it runs (it starts itself with signals blocked): so it is started before the block.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def python_ctrl_c() -> None:
    """Python's own SIGINT handler (``KeyboardInterrupt``) back, unless SIGINT is ignored. Called just before a
    server runs: uvicorn saves the handler it finds, handles Ctrl-C itself (a graceful shutdown) and at the end
    restores that handler and raises the signal again, which must then be the ``KeyboardInterrupt`` that ``serve``
    treats as a normal end, not the CLI's exit-now handler of the preparation (``loraplex.cli._interrupted``)."""
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.default_int_handler):
        signal.signal(signal.SIGINT, signal.default_int_handler)


FORCED_EXIT = "loraplex: interrupted again: exiting now (open requests and streams are cut)"
"""The one line a second Ctrl-C during the graceful shutdown prints (exit status 130)."""


def uvicorn_server(config):
    """A ``uvicorn.Server`` for ``config`` whose second Ctrl-C during the graceful shutdown ends the process at once:
    one line (:data:`FORCED_EXIT`), the processes this one started (the engine process) terminated, exit status 130.
    uvicorn's own forced exit cancels every task instead: tracebacks of each cancelled stream and of the lifespan,
    whose shutdown never runs (``loraplex serve`` and the demo run servers through this)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if sig == signal.SIGINT and self.should_exit:
                exit_now(FORCED_EXIT)
            super().handle_exit(sig, frame)

    return _Server(config)


def exit_now(line: str) -> NoReturn:
    """Print ``line`` on stderr, terminate the processes this one started (the engine process) and exit with
    status 130 at once (``os._exit``: no ``KeyboardInterrupt``, no cleanup; the Ctrl-C paths of ``loraplex``)."""
    print(line, file=sys.stderr, flush=True)
    for child in multiprocessing.active_children():
        child.terminate()
    os._exit(130)
