"""The slot table alone (pure Python): exact slot ids, pins, LRU eviction order, and random
operation sequences checked against a plain model of the same rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.adapters.errors import SlotPoolError
from loraplex.adapters.slot_table import SlotTable


def install_and_pin(table: SlotTable, int_id: int) -> int:
    """What the pool does on ``pin``: reuse the adapter's slot or take ``choose()``'s."""
    if table.slot_of(int_id) is None:
        slot = table.choose()
        assert slot is not None
        table.assign(slot, int_id)
    return table.pin(int_id)


def test_lowest_free_slot_first_then_resident_reuse():
    table = SlotTable(3)
    assert [install_and_pin(table, i) for i in (10, 20, 30)] == [0, 1, 2]
    assert install_and_pin(table, 20) == 1
    assert [table.occupant(s) for s in range(3)] == [(10, 1), (20, 2), (30, 1)]
    assert table.choose() is None and not table.has_room()


def test_lru_unpinned_slot_is_evicted_in_unpin_order():
    table = SlotTable(3)
    for i in (10, 20, 30):
        install_and_pin(table, i)
    assert table.unpin(30) == 0
    assert table.unpin(10) == 0
    assert table.choose() == 2  # 30 was released first
    assert table.assign(2, 40) == 30
    table.pin(40)
    assert table.choose() == 0
    assert table.assign(0, 50) == 10
    assert table.slot_of(10) is None and table.slot_of(30) is None
    assert [table.occupant(s) for s in range(3)] == [(50, 0), (20, 1), (40, 1)]


def test_freed_slot_is_taken_before_an_unpinned_one():
    table = SlotTable(3)
    for i in (10, 20, 30):
        install_and_pin(table, i)
        table.unpin(i)
    assert table.clear(1) == 20
    assert table.choose() == 1
    assert table.clear(1) is None


def test_protocol_errors():
    table = SlotTable(2)
    with pytest.raises(SlotPoolError, match=r"unpin\(lora_int_id=7\): the adapter is not pinned"):
        table.unpin(7)
    with pytest.raises(SlotPoolError, match=r"pin\(lora_int_id=7\): the adapter is not in a slot"):
        table.pin(7)
    install_and_pin(table, 7)
    with pytest.raises(SlotPoolError, match="slot 0 is pinned by lora_int_id=7"):
        table.assign(0, 8)
    with pytest.raises(SlotPoolError, match="lora_int_id=7 is already in slot 0"):
        table.assign(1, 7)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin"]), st.integers(1, 6)), max_size=60))
def test_random_operations_match_a_plain_model(ops):
    """Model: slots as a list, LRU by a counter; the table must give the same slot for every pin."""
    num_slots = 3
    table = SlotTable(num_slots)
    slots: list[int | None] = [None] * num_slots
    pins: dict[int, int] = {}
    last_used: dict[int, int] = {}
    clock = 0
    for op, int_id in ops:
        clock += 1
        if op == "pin":
            if int_id in slots:
                expected = slots.index(int_id)
            elif None in slots:
                expected = slots.index(None)
            else:
                unpinned = [s for s in range(num_slots) if pins.get(slots[s], 0) == 0]
                if not unpinned:
                    assert table.choose() is None
                    continue
                expected = min(unpinned, key=lambda s: last_used[slots[s]])
            assert install_and_pin(table, int_id) == expected
            if slots[expected] != int_id:
                slots[expected] = int_id
            pins[int_id] = pins.get(int_id, 0) + 1
            last_used[int_id] = clock
        elif pins.get(int_id, 0) > 0:
            assert table.unpin(int_id) == pins[int_id] - 1
            pins[int_id] -= 1
            last_used[int_id] = clock
        else:
            with pytest.raises(SlotPoolError):
                table.unpin(int_id)
        assert [table.occupant(s) and table.occupant(s)[0] for s in range(num_slots)] == slots
        assert all(table.pin_count(i) == n for i, n in pins.items() if i in slots)


def test_pages_exact_ids_runs_and_frees():
    """Pages lowest first, a contiguous run when one is free, freed with the slot."""
    table = SlotTable(4, num_pages=10)
    for int_id, pages in ((1, 1), (2, 4), (3, 2)):
        table.assign(table.choose(pages), int_id, pages)
    assert [table.pages_of(s) for s in range(4)] == [(0,), (1, 2, 3, 4), (5, 6), ()]
    assert table.free_pages == 3
    assert table.clear(0) == 1 and table.free_pages == 4
    table.assign(0, 4, 3)  # free: 0, 7, 8, 9 -> the run 7..9, not 0, 7, 8
    assert table.pages_of(0) == (7, 8, 9)
    table.clear(2)  # frees 5, 6
    table.assign(2, 5, 3)  # free: 0, 5, 6 -> no run of 3: the lowest three
    assert table.pages_of(2) == (0, 5, 6) and table.free_pages == 0
    with pytest.raises(SlotPoolError, match="lora_int_id=6 needs 1 pages, 0 of 10 are free"):
        table.assign(3, 6, 1)


def test_plan_evicts_lru_unpinned_adapters_until_enough_pages():
    table = SlotTable(4, num_pages=8)
    for int_id, pages in ((1, 2), (2, 2), (3, 2), (4, 2)):
        table.assign(table.choose(pages), int_id, pages)
    table.pin(3)
    for int_id in (2, 4, 1):  # LRU order of the unpinned: 2, 4, 1
        table.pin(int_id)
        table.unpin(int_id)
    placement = table.plan(5)
    assert placement is not None and placement.slot == 1 and placement.evict == (2, 4, 1)
    assert table.plan(1).evict == (2,)  # the slot's occupant alone frees enough
    assert table.plan(7) is None  # 3 holds 2 of the 8 pages, pinned
    assert table.plan(9) is None  # more than the pool
    assert table.has_room(6) and not table.has_room(7)


def test_a_table_without_pages_ignores_page_counts():
    table = SlotTable(2)
    table.assign(0, 1, 5)
    assert table.pages_of(0) == () and table.plan(100).slot == 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pin", "unpin"]), st.integers(1, 7)), max_size=60))
def test_random_paged_operations_keep_pages_disjoint_and_pinned_adapters_resident(ops):
    """Adapter i needs ``1 + i % 4`` pages of 8; after every operation pages are disjoint, the free count adds
    up, every pinned adapter keeps its slot and pages, and a placement is refused only when the unpinned
    adapters' pages and the free ones are too few (or every slot is pinned)."""
    table = SlotTable(3, num_pages=8)
    pins: dict[int, int] = {}

    def need(int_id: int) -> int:
        return 1 + int_id % 4

    for op, int_id in ops:
        if op == "pin":
            if table.slot_of(int_id) is None:
                pinned_slots = {table.slot_of(i) for i, n in pins.items() if n}
                pinned_pages = sum(len(table.pages_of(s)) for s in pinned_slots)
                possible = len(pinned_slots) < 3 and 8 - pinned_pages >= need(int_id)
                placement = table.plan(need(int_id))
                assert (placement is not None) == possible
                if placement is None:
                    continue
                before = {i: (table.slot_of(i), table.pages_of(table.slot_of(i))) for i, n in pins.items() if n}
                for victim in placement.evict:
                    assert pins.get(victim, 0) == 0
                    if table.slot_of(victim) != placement.slot:
                        table.clear(table.slot_of(victim))
                table.assign(placement.slot, int_id, need(int_id))
                assert all((table.slot_of(i), table.pages_of(table.slot_of(i))) == where
                           for i, where in before.items())
            table.pin(int_id)
            pins[int_id] = pins.get(int_id, 0) + 1
        elif pins.get(int_id, 0):
            table.unpin(int_id)
            pins[int_id] -= 1
        held = [p for s in range(3) for p in table.pages_of(s)]
        assert len(held) == len(set(held)) and len(held) + table.free_pages == 8
        assert all(len(table.pages_of(table.slot_of(i))) == need(i) for i in table.pinned_ids())
