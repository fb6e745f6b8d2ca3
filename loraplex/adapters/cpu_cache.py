"""Host-memory LRU cache of loaded adapters (the "CPU cache" tier of S-LoRA / vLLM's LoRA manager)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class AdapterLRUCache(Generic[T]):
    """Up to ``capacity`` host copies of adapters (``T``: e.g. ``SlotImage``) keyed by LoRA
    int id, evicting the least recently used.

    ``get`` and ``put`` mark an entry as most recently used. Raises ``ValueError`` for capacity < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r}: must be >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[int, T] = OrderedDict()

    def __contains__(self, int_id: int) -> bool:
        return int_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, int_id: int) -> T | None:
        """The cached adapter (now most recently used), or None if not cached."""
        adapter = self._entries.get(int_id)
        if adapter is not None:
            self._entries.move_to_end(int_id)
        return adapter

    def put(self, int_id: int, adapter: T) -> list[int]:
        """Insert (or refresh) ``int_id``; returns the int ids evicted to stay within capacity, oldest first."""
        self._entries[int_id] = adapter
        self._entries.move_to_end(int_id)
        evicted = []
        while len(self._entries) > self.capacity:
            old_id, _ = self._entries.popitem(last=False)
            evicted.append(old_id)
        return evicted

    def put_if_room(self, int_id: int, adapter: T) -> bool:
        """Insert (or refresh) ``int_id`` only if that evicts nothing; returns whether it is cached."""
        if int_id not in self._entries and len(self._entries) >= self.capacity:
            return False
        self.put(int_id, adapter)
        return True

    def pop(self, int_id: int) -> None:
        """Drop ``int_id`` if cached."""
        self._entries.pop(int_id, None)

    def lru_order(self) -> list[int]:
        """Cached int ids, least recently used first."""
        return list(self._entries)
