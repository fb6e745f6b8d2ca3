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
