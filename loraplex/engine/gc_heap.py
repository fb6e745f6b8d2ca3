"""Keep Python's cyclic garbage collector off the serving loop's long-lived objects.

A full (generation-2) collection walks every object the collector tracks. In a serving process those are
mostly the model, the tokenizer, the imported libraries and the app, built once at start-up: on an H200 host
one full collection during a Llama-2-7B-shaped benchmark run took **302 ms**, i.e. one engine step stalled for
that long, 76 ms after :func:`freeze_gc_heap` (benchmarks/RESULTS.md, session 15). ``gc.freeze()`` moves every
object alive now into a permanent generation that collections skip (Python docs, ``gc.freeze``); vLLM does
the same after its start-up (``vllm/utils/gc_utils.py``, ``freeze_gc_heap``). Objects created later (requests,
adapters registered while serving) are still collected as before.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0  # freeze_gc_heap calls not yet undone: the heap stays frozen while any holder remains


def freeze_gc_heap() -> int:
    """Collect (so that no garbage of start-up is kept for good), then freeze every object alive now.

    Call once the process's long-lived state is built: after the engine's start-up and warm-up. Returns the
    number of frozen objects (``gc.get_freeze_count()``). Each call holds the heap frozen until its
    :func:`unfreeze_gc_heap` (two servers in one process: the first to stop does not unfreeze the other's).
    """
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1
        return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo one :func:`freeze_gc_heap`; the last holder (or a call with none) returns the frozen objects to the
    oldest generation, so that what became garbage since (an engine closed, an app shut down) is collected."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()
