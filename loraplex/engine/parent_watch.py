"""Child processes that end when the process that started them is gone.

A tensor-parallel worker rank or the platform's engine process can be left running when its parent is killed
(SIGKILL, an OOM kill, a crash): while it loads a model or waits for a rendezvous with a rank that will never come,
nothing else tells it. :func:`exit_when_parent_exits` starts a daemon thread that polls ``os.getppid()`` and ends
the process (``os._exit(1)``, one line on stderr) once the parent it started under has exited (the process is
then re-parented to init or a subreaper). The parent it started under is multiprocessing's record of it
(``multiprocessing.parent_process()``), not ``os.getppid()`` at the call: a parent killed while the child was
still importing, before the call, had already re-parented it.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading

POLL_S = 0.5


def exit_when_parent_exits(process_name: str, poll_s: float = POLL_S) -> threading.Thread:
    """Watch this process's parent from now on; returns the (daemon) watching thread.

    ``process_name``: how the exit line names this process (e.g. ``tensor-parallel rank 1``); ``poll_s``: seconds
    between two checks (the exit follows the parent's by at most about that).
    """
    parent = starting_parent_pid()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                print(f"loraplex: {process_name}: parent process {parent} exited; exiting", file=sys.stderr,
                      flush=True)
                os._exit(1)

    thread = threading.Thread(target=watch, name="loraplex-parent-watch", daemon=True)
    thread.start()
    return thread


def starting_parent_pid() -> int:
    """The pid of the process that started this one: ``multiprocessing.parent_process().pid`` in a multiprocessing
    child (right even when that parent has died since), else ``os.getppid()``."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()
