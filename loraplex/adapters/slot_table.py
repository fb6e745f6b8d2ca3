"""Which adapter is in which device slot, pin counts and LRU eviction (pure Python, no tensors).

The slot table is the one map from adapter int id to slot: the pool writes weights into the
slot it chooses, and the model runner asks it for the slot of each running adapter.

Choice of a slot for a new adapter: the lowest free slot; else the least recently used
unpinned one (its adapter is evicted); none when every slot is pinned. "Used" means
installed, pinned or unpinned (a logical clock, no wall time).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.errors import SlotPoolError


@dataclass
class _Resident:
    int_id: int
    pin_count: int
    last_used: int


class SlotTable:
    """``num_slots`` adapter slots, each empty or holding one adapter int id with a pin count."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: list[_Resident | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}
        self._tick = 0

    def slot_of(self, int_id: int) -> int | None:
        """The slot holding ``int_id``, or None when it is not resident."""
        return self._slot_of.get(int_id)

    def occupant(self, slot: int) -> tuple[int, int] | None:
        """``(int_id, pin_count)`` of ``slot``, or None when it is empty."""
        resident = self._slots[slot]
        return None if resident is None else (resident.int_id, resident.pin_count)

    def pin_count(self, int_id: int) -> int:
        """Pins of ``int_id`` (0 when unpinned or not resident)."""
        slot = self._slot_of.get(int_id)
        return 0 if slot is None else self._slots[slot].pin_count

    def choose(self) -> int | None:
        """The slot a new adapter should take (lowest free, else LRU unpinned), None if all are pinned."""
        for slot, resident in enumerate(self._slots):
            if resident is None:
                return slot
        unpinned = [(r.last_used, slot) for slot, r in enumerate(self._slots) if r.pin_count == 0]
        return min(unpinned)[1] if unpinned else None

    def has_room(self) -> bool:
        """Whether some slot is free or unpinned."""
        return any(r is None or r.pin_count == 0 for r in self._slots)

    def pinned_ids(self) -> list[int]:
        """Int ids of the resident adapters, ascending (for error messages)."""
        return sorted(self._slot_of)

    def assign(self, slot: int, int_id: int) -> int | None:
        """Put ``int_id`` (not resident) unpinned into ``slot``; returns the evicted int id, if any.

        Raises ``SlotPoolError`` if ``int_id`` is resident already or ``slot`` is pinned.
        """
        if int_id in self._slot_of:
            raise SlotPoolError(f"lora_int_id={int_id} is already in slot {self._slot_of[int_id]}")
        previous = self._slots[slot]
        if previous is not None and previous.pin_count:
            raise SlotPoolError(f"slot {slot} is pinned by lora_int_id={previous.int_id}")
        if previous is not None:
            del self._slot_of[previous.int_id]
        self._slots[slot] = _Resident(int_id, 0, self._next_tick())
        self._slot_of[int_id] = slot
        return None if previous is None else previous.int_id

    def pin(self, int_id: int) -> int:
        """One more pin on resident ``int_id``; returns its slot. Raises ``SlotPoolError`` if not resident."""
        slot = self._slot_of.get(int_id)
        if slot is None:
            raise SlotPoolError(f"pin(lora_int_id={int_id!r}): the adapter is not in a slot")
        resident = self._slots[slot]
        resident.pin_count += 1
        resident.last_used = self._next_tick()
        return slot

    def unpin(self, int_id: int) -> int:
        """Release one pin of ``int_id``; returns the pins left. Raises ``SlotPoolError`` if not pinned."""
        slot = self._slot_of.get(int_id)
        if slot is None or self._slots[slot].pin_count == 0:
            raise SlotPoolError(f"unpin(lora_int_id={int_id!r}): the adapter is not pinned")
        resident = self._slots[slot]
        resident.pin_count -= 1
        resident.last_used = self._next_tick()
        return resident.pin_count

    def clear(self, slot: int) -> int | None:
        """Empty ``slot`` (whatever its pins); returns the int id it held, if any."""
        resident = self._slots[slot]
        if resident is None:
            return None
        del self._slot_of[resident.int_id]
        self._slots[slot] = None
        return resident.int_id

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick
