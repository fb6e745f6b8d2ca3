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
    gc.unfreeze()


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
    assert frozen == gc.get_freeze_count() > 0
    assert not _tracked(alive)  # the collections' walks skip it
    later = _Node()
    assert _tracked(later)  # objects made after the freeze are collected as before
    unfreeze_gc_heap()
    assert gc.get_freeze_count() == 0 and _tracked(alive)
