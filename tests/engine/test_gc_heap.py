"""engine/gc_heap.py: start-up objects frozen out of the collector's walks, start-up garbage not kept."""

import gc
import weakref

import pytest

from loraplex.engine.gc_heap import freeze_gc_heap, unfreeze_gc_heap


class _Node:
    pass


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    while gc.get_freeze_count():
        unfreeze_gc_heap()


def _tracked(obj) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_freeze_collects_garbage_first_then_freezes_what_lives():
    garbage = _Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    alive = _Node()
    assert _tracked(alive)
    frozen = freeze_gc_heap()
    assert dead() is None  # collected, not frozen for good
    assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects freed by refcount leave the count)
    assert not _tracked(alive)  # the collections' walks skip it
    later = _Node()
    assert _tracked(later)  # objects made after the freeze are collected as before
    unfreeze_gc_heap()
    assert gc.get_freeze_count() == 0 and _tracked(alive)


def test_the_heap_stays_frozen_until_every_holder_unfreezes():
    """Two servers in one process: the first to shut down leaves the other's heap frozen."""
    first = _Node()
    freeze_gc_heap()
    freeze_gc_heap()
    unfreeze_gc_heap()
    assert gc.get_freeze_count() > 0 and not _tracked(first)
    unfreeze_gc_heap()
    assert gc.get_freeze_count() == 0 and _tracked(first)
    unfreeze_gc_heap()  # more unfreezes than freezes: nothing held, nothing breaks
    assert gc.get_freeze_count() == 0
