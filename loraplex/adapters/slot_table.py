"""Which adapter is in which device slot, which weight pages it holds, pin counts and LRU eviction
(pure Python, no tensors).

The slot table is the one map from adapter int id to slot and pages: the pool writes weights into
the slot and pages it assigns, and the model runner asks it for the slot of each running adapter.

Slots bound the distinct adapters of one step; pages bound the memory of their weights: an adapter
of rank ``r`` holds ``ceil(r / page_rows)`` pages of the pool (S-LoRA, Sheng et al. 2023, "unified
paging"; here a pool of adapter pages beside the KV cache, not shared with it). A table built
without ``num_pages`` tracks no pages (every adapter needs 0).

Placement of a new adapter needing ``n`` pages (:meth:`SlotTable.plan`): the lowest free slot, else
the slot of the least recently used unpinned adapter (evicted); then, while fewer than ``n`` pages
are free, the next least recently used unpinned adapters are evicted too; none when that cannot
free enough. Pages are given lowest first, a contiguous run when one is free (a contiguous run is
one copy per module at install). "Used" means installed, pinned or unpinned (a logical clock, no
wall time).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.errors import SlotPoolError


@dataclass
class _Resident:
    int_id: int
    pin_count: int
    last_used: int
    pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where a new adapter goes: ``slot``, after evicting the adapters ``evict`` (int ids, least recently
    used first; the slot's own occupant among them when the slot is not free)."""

    slot: int
    evict: tuple[int, ...]


class SlotTable:
    """``num_slots`` adapter slots, each empty or holding one adapter int id with a pin count and its
    pages of a pool of ``num_pages`` (``None``: pages not tracked)."""

    def __init__(self, num_slots: int, num_pages: int | None = None) -> None:
        self.num_slots = num_slots
        self.num_pages = num_pages
        self._slots: list[_Resident | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}
        self._free_pages: set[int] = set(range(num_pages or 0))
        self._tick = 0

    def slot_of(self, int_id: int) -> int | None:
        """The slot holding ``int_id``, or None when it is not resident."""
        return self._slot_of.get(int_id)

    def occupant(self, slot: int) -> tuple[int, int] | None:
        """``(int_id, pin_count)`` of ``slot``, or None when it is empty."""
        resident = self._slots[slot]
        return None if resident is None else (resident.int_id, resident.pin_count)

    def pages_of(self, slot: int) -> tuple[int, ...]:
        """The pages ``slot``'s adapter holds, in rank order (empty for an empty slot)."""
        resident = self._slots[slot]
        return () if resident is None else resident.pages

    @property
    def free_pages(self) -> int:
        """Pages no adapter holds."""
        return len(self._free_pages)

    def pin_count(self, int_id: int) -> int:
        """Pins of ``int_id`` (0 when unpinned or not resident)."""
        slot = self._slot_of.get(int_id)
        return 0 if slot is None else self._slots[slot].pin_count

    def plan(self, pages: int = 0) -> Placement | None:
        """Where an adapter needing ``pages`` pages would go (module docstring), or None: every slot pinned,
        or the unpinned adapters' pages and the free ones together too few."""
        if self.num_pages is None:
            pages = 0
        elif pages > self.num_pages:
            return None
        slot = next((s for s, r in enumerate(self._slots) if r is None), None)
        if slot is not None and len(self._free_pages) >= pages:  # nothing to evict: no LRU order needed
            return Placement(slot, ())
        unpinned = sorted((r.last_used, r.int_id) for r in self._slots if r is not None and r.pin_count == 0)
        lru = [int_id for _, int_id in unpinned]
        evict: list[int] = []
        if slot is None:
            if not lru:
                return None
            evict.append(lru.pop(0))
            slot = self._slot_of[evict[0]]
        free = len(self._free_pages) + sum(len(self._slots[self._slot_of[i]].pages) for i in evict)
        while free < pages:
            if not lru:
                return None
            evict.append(lru.pop(0))
            free += len(self._slots[self._slot_of[evict[-1]]].pages)
        return Placement(slot, tuple(evict))

    def choose(self, pages: int = 0) -> int | None:
        """The slot :meth:`plan` gives, or None."""
        placement = self.plan(pages)
        return None if placement is None else placement.slot

    def has_room(self, pages: int = 0) -> bool:
        """Whether an adapter needing ``pages`` pages could be placed now (:meth:`plan` is not None)."""
        return self.plan(pages) is not None

    def pinned_ids(self) -> list[int]:
        """Int ids of the resident adapters, ascending (for error messages)."""
        return sorted(self._slot_of)

    def assign(self, slot: int, int_id: int, pages: int = 0) -> int | None:
        """Put ``int_id`` (not resident) unpinned into ``slot`` with ``pages`` free pages (lowest first, a
        contiguous run when one is free; see :meth:`pages_of`); returns the evicted occupant of ``slot``,
        if any (its pages are freed first).

        Raises ``SlotPoolError`` if ``int_id`` is resident already, ``slot`` is pinned, or fewer than
        ``pages`` pages are free once the slot's occupant is gone (evict :meth:`plan`'s others first).
        """
        if int_id in self._slot_of:
            raise SlotPoolError(f"lora_int_id={int_id} is already in slot {self._slot_of[int_id]}")
        previous = self._slots[slot]
        if previous is not None and previous.pin_count:
            raise SlotPoolError(f"slot {slot} is pinned by lora_int_id={previous.int_id}")
        if self.num_pages is None:
            pages = 0
        held = len(previous.pages) if previous is not None else 0
        if pages > len(self._free_pages) + held:
            raise SlotPoolError(f"lora_int_id={int_id} needs {pages} pages, {len(self._free_pages) + held} of "
                                f"{self.num_pages} are free")
        if previous is not None:
            self.clear(slot)
        given = self._take_pages(pages)
        self._slots[slot] = _Resident(int_id, 0, self._next_tick(), given)
        self._slot_of[int_id] = slot
        return None if previous is None else previous.int_id

    def _take_pages(self, count: int) -> tuple[int, ...]:
        """``count`` free pages: the lowest contiguous run of that length if one exists, else the lowest ones."""
        if count == 0:
            return ()
        free = sorted(self._free_pages)
        run_start = 0
        for i in range(len(free)):
            if i > 0 and free[i] != free[i - 1] + 1:
                run_start = i
            if i - run_start + 1 == count:
                taken = tuple(free[run_start : i + 1])
                break
        else:
            taken = tuple(free[:count])
        self._free_pages.difference_update(taken)
        return taken

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
        """Empty ``slot`` (whatever its pins) and free its pages; returns the int id it held, if any."""
        resident = self._slots[slot]
        if resident is None:
            return None
        del self._slot_of[resident.int_id]
        self._slots[slot] = None
        self._free_pages.update(resident.pages)
        return resident.int_id

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick
