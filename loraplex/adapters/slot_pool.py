"""GPU adapter slots with a host-memory LRU cache behind them (S-LoRA, Sheng et al. 2023;
Punica, Chen et al. 2023; vLLM's ``LRUCacheWorkerLoRAManager``).

Three tiers: *registered* adapters (``add_lora``: path known, validated, ``version_id``
recorded), up to ``max_cpu_loras`` *cached* in host memory (LRU), and up to ``max_loras``
*resident* in a GPU slot. A running request *pins* its adapter's slot; only unpinned
slots are ever overwritten, so an adapter never changes under a running request.

Slot tensors, per layer ``l`` and module ``m`` (S = max_loras, R = max_lora_rank):

- ``a[l][m]``: ``[S, R, in_features]`` in ``dtype`` (lora_A, rows ``r..R`` zero),
- ``b[l][m]``: ``[S, out_features, R]`` in ``dtype`` (lora_B, columns ``r..R`` zero),
- ``scaling[l][m]``: ``[S] fp32`` (0 where the slot's adapter does not target ``(l, m)``).

Semantics: ``y[t] += scaling[l][m][s] * (x[t] @ a[l][m][s].T) @ b[l][m][s].T`` for ``s = slot(t)``,
nothing when ``s == -1``. Zero padding makes the rank-R product equal the rank-r one.

Not thread-safe: the engine calls it from its step loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loraplex.adapters.adapter import LoRAAdapter, LoRAWeight
from loraplex.adapters.cpu_cache import AdapterLRUCache
from loraplex.adapters.errors import (
    AdapterChangedError,
    AdapterConflictError,
    NoFreeSlotError,
    SlotPoolError,
    UnknownAdapterError,
)
from loraplex.adapters.peft_format import load_peft_adapter
from loraplex.adapters.spec import BaseModelSpec
from loraplex.engine.lora_request import LoRARequest

_SLOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PerLayer = list[dict[str, torch.Tensor]]  # [layer][module] -> tensor


@dataclass(frozen=True)
class SlotInfo:
    """One GPU slot: which adapter holds it (None fields when empty) and how many requests pin it."""

    slot: int
    lora_name: str | None
    lora_int_id: int | None
    version_id: str | None
    pin_count: int


@dataclass(frozen=True)
class SlotPoolStats:
    """A snapshot of the pool.

    - ``slots``: one ``SlotInfo`` per slot index ``0..max_loras-1``.
    - ``cpu_cache_lru``: lora names in the host cache, least recently used first.
    - ``registered``: lora names accepting new requests, by int id.
    - ``pending_removal``: lora names removed while pinned (dropped at their last unpin).
    - ``disk_loads``: adapters read and validated from disk (``add_lora`` and reloads).
    - ``slot_loads``: adapters written into a GPU slot.
    - ``cpu_evictions``: adapters dropped from the host cache for capacity.
    - ``slot_evictions``: resident adapters overwritten by another adapter.
    - ``slot_memory_bytes``: device memory of the slot tensors.
    """

    slots: list[SlotInfo]
    cpu_cache_lru: list[str]
    registered: list[str]
    pending_removal: list[str]
    disk_loads: int
    slot_loads: int
    cpu_evictions: int
    slot_evictions: int
    slot_memory_bytes: int


@dataclass
class _Registration:
    request: LoRARequest
    version_id: str
    pending_removal: bool = False


@dataclass
class _Resident:
    int_id: int
    pin_count: int
    last_used: int


class LoRASlotPool:
    """GPU slots for up to ``max_loras`` adapters of rank <= ``max_lora_rank`` on model ``spec``.

    - ``max_cpu_loras``: adapters kept in host memory (pinned when ``device`` is CUDA);
      evicted ones are re-read from disk when needed.
    - ``dtype``: slot tensor dtype (fp16, bf16 or fp32); ``device``: where slots live.

    Raises ``ValueError`` naming the argument for sizes < 1 or another dtype.
    """

    def __init__(
        self,
        spec: BaseModelSpec,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        sizes = {"max_loras": max_loras, "max_lora_rank": max_lora_rank, "max_cpu_loras": max_cpu_loras}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRASlotPool.{name}={value!r}: must be an integer >= 1")
        if dtype not in _SLOT_DTYPES:
            raise ValueError(f"LoRASlotPool.dtype={dtype!r}: must be one of {list(_SLOT_DTYPES)}")
        self.spec = spec
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = torch.device(device)
        self.a, self.b, self.scaling = self._allocate()
        self._registry: dict[int, _Registration] = {}
        self._cpu = AdapterLRUCache(max_cpu_loras)
        self._slots: list[_Resident | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}
        self._tick = 0
        self._disk_loads = 0
        self._slot_loads = 0
        self._cpu_evictions = 0
        self._slot_evictions = 0

    # ------------------------------------------------------------------ registry

    def add_lora(self, request: LoRARequest) -> bool:
        """Register ``request``'s adapter: load and validate it from disk into the host cache.

        Returns True if newly registered, False if this exact request is already registered.
        The int id is the identity: one name may be registered under several ids (a
        re-uploaded adapter's new version gets a new id while requests on the old one finish).
        Raises ``AdapterConflictError`` if its int id is registered with another name or path
        (or is being removed); any ``AdapterError`` of ``load_peft_adapter`` (the pool is then unchanged).
        """
        known = self._registry.get(request.lora_int_id)
        if known is not None:
            return self._check_same(known, request)
        adapter = self._load(request.lora_path)
        self._registry[request.lora_int_id] = _Registration(request=request, version_id=adapter.version_id)
        self._cache(request.lora_int_id, adapter)
        return True

    def remove_lora(self, int_id: int) -> bool:
        """Unregister ``int_id``. If running requests pin it, it stops accepting new pins and is
        dropped at its last ``unpin``; running requests are never disturbed.

        Returns False if ``int_id`` is unknown or already being removed.
        """
        registration = self._registry.get(int_id)
        if registration is None or registration.pending_removal:
            return False
        slot = self._slot_of.get(int_id)
        if slot is not None and self._resident(slot).pin_count > 0:
            registration.pending_removal = True
            return True
        self._drop(int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        """Registered adapters that accept new requests, by int id."""
        return [r.request for _, r in sorted(self._registry.items()) if not r.pending_removal]

    def version_id(self, int_id: int) -> str:
        """The registered ``version_id`` of ``int_id`` (for prefix-cache keys).

        Raises ``UnknownAdapterError`` if ``int_id`` is not registered.
        """
        registration = self._registry.get(int_id)
        if registration is None:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is not registered")
        return registration.version_id

    # ------------------------------------------------------------------ slots

    def pin(self, int_id: int) -> int:
        """Make ``int_id`` resident in a GPU slot, increment its pin count and return the slot index.

        Slot choice: its current slot if resident; else the lowest free slot; else the
        least recently used unpinned slot (its adapter is evicted). The weights come
        from the host cache, or are re-read from disk if they were evicted from it.

        Raises ``UnknownAdapterError`` (not registered or being removed), ``NoFreeSlotError``
        (every slot pinned by other adapters), ``AdapterChangedError`` or another
        ``AdapterError`` if a re-read from disk fails; the pool is then unchanged.
        """
        registration = self._accepting(int_id)
        slot = self._slot_of.get(int_id)
        if slot is None:
            slot = self._choose_slot(registration.request)
            adapter = self._host_copy(int_id)
            self._install(slot, int_id, adapter)
        resident = self._resident(slot)
        resident.pin_count += 1
        resident.last_used = self._next_tick()
        return slot

    def unpin(self, int_id: int) -> None:
        """Release one pin of ``int_id``; at zero pins its slot may be reused (and a pending
        ``remove_lora`` completes).

        Raises ``SlotPoolError`` if ``int_id`` is not pinned.
        """
        slot = self._slot_of.get(int_id)
        if slot is None or self._resident(slot).pin_count == 0:
            raise SlotPoolError(f"unpin(lora_int_id={int_id!r}): the adapter is not pinned")
        resident = self._resident(slot)
        resident.pin_count -= 1
        resident.last_used = self._next_tick()
        if resident.pin_count == 0 and self._registry[int_id].pending_removal:
            self._drop(int_id)

    def can_pin(self, int_id: int) -> bool:
        """Whether ``pin(int_id)`` would find a slot now (resident, a free slot, or an unpinned one).

        Raises ``UnknownAdapterError`` like ``pin``.
        """
        self._accepting(int_id)
        return int_id in self._slot_of or any(s is None or s.pin_count == 0 for s in self._slots)

    def stats(self) -> SlotPoolStats:
        """A snapshot of slots, host cache and counters."""
        return SlotPoolStats(
            slots=[self._slot_info(i) for i in range(self.max_loras)],
            cpu_cache_lru=[self._name(i) for i in self._cpu.lru_order()],
            registered=[self._name(i) for i, r in sorted(self._registry.items()) if not r.pending_removal],
            pending_removal=[self._name(i) for i, r in sorted(self._registry.items()) if r.pending_removal],
            disk_loads=self._disk_loads,
            slot_loads=self._slot_loads,
            cpu_evictions=self._cpu_evictions,
            slot_evictions=self._slot_evictions,
            slot_memory_bytes=self._slot_memory_bytes(),
        )

    # ------------------------------------------------------------------ internals

    def _allocate(self) -> tuple[_PerLayer, _PerLayer, _PerLayer]:
        """Zeroed ``a [S, R, in]``, ``b [S, out, R]`` (``dtype``) and ``scaling [S] fp32`` per layer and module."""
        S, R = self.max_loras, self.max_lora_rank
        shapes = self.spec.module_shapes
        a = [{m: self._zeros(S, R, i) for m, (i, _) in shapes.items()} for _ in range(self.spec.num_layers)]
        b = [{m: self._zeros(S, o, R) for m, (_, o) in shapes.items()} for _ in range(self.spec.num_layers)]
        scaling = [{m: self._zeros(S, dtype=torch.float32) for m in shapes} for _ in range(self.spec.num_layers)]
        return a, b, scaling

    def _zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype or self.dtype, device=self.device)

    def _check_same(self, known: _Registration, request: LoRARequest) -> bool:
        if known.pending_removal:
            raise AdapterConflictError(
                f"LoRARequest.lora_int_id={request.lora_int_id} is being removed (still pinned by running requests)"
            )
        for field_name in ("lora_name", "lora_path"):
            old, new = getattr(known.request, field_name), getattr(request, field_name)
            if old != new:
                raise AdapterConflictError(
                    f"LoRARequest.{field_name}={new!r}: lora_int_id={request.lora_int_id} is already registered "
                    f"with {field_name}={old!r}"
                )
        return False

    def _accepting(self, int_id: int) -> _Registration:
        registration = self._registry.get(int_id)
        if registration is None:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is not registered")
        if registration.pending_removal:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is being removed and accepts no new requests")
        return registration

    def _load(self, path: str) -> LoRAAdapter:
        adapter = load_peft_adapter(path, self.spec, self.max_lora_rank)
        self._disk_loads += 1
        return self._to_host_memory(adapter)

    def _to_host_memory(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Pin the adapter's host tensors when slots live on CUDA (async host-to-device copies)."""
        if self.device.type != "cuda":
            return adapter
        pinned = {
            key: LoRAWeight(a=w.a.pin_memory(), b=w.b.pin_memory(), scaling=w.scaling)
            for key, w in adapter.weights.items()
        }
        return dataclasses.replace(adapter, weights=pinned)

    def _cache(self, int_id: int, adapter: LoRAAdapter) -> None:
        self._cpu_evictions += len(self._cpu.put(int_id, adapter))

    def _host_copy(self, int_id: int) -> LoRAAdapter:
        """The adapter from the host cache, re-read from disk (and re-cached) if it was evicted."""
        adapter = self._cpu.get(int_id)
        if adapter is not None:
            return adapter
        registration = self._registry[int_id]
        adapter = self._load(registration.request.lora_path)
        if adapter.version_id != registration.version_id:
            raise AdapterChangedError(
                f"adapter {registration.request.lora_name!r} at lora_path={registration.request.lora_path!r} changed "
                f"on disk: version_id {adapter.version_id} != registered {registration.version_id}"
            )
        self._cache(int_id, adapter)
        return adapter

    def _choose_slot(self, request: LoRARequest) -> int:
        for slot, resident in enumerate(self._slots):
            if resident is None:
                return slot
        unpinned = [(r.last_used, slot) for slot, r in enumerate(self._slots) if r is not None and r.pin_count == 0]
        if not unpinned:
            pinned_ids = sorted(r.int_id for r in self._slots if r is not None)
            raise NoFreeSlotError(
                f"all max_loras={self.max_loras} adapter slots are pinned (lora_int_ids {pinned_ids}); "
                f"adapter {request.lora_name!r} (lora_int_id={request.lora_int_id}) must wait for an unpin"
            )
        return min(unpinned)[1]

    def _install(self, slot: int, int_id: int, adapter: LoRAAdapter) -> None:
        previous = self._slots[slot]
        if previous is not None:
            del self._slot_of[previous.int_id]
            self._slot_evictions += 1
        self._write_slot(slot, adapter)
        self._slots[slot] = _Resident(int_id=int_id, pin_count=0, last_used=self._next_tick())
        self._slot_of[int_id] = slot
        self._slot_loads += 1

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Overwrite every layer and module of ``slot``: nothing of a previous adapter survives."""
        for layer in range(self.spec.num_layers):
            for module in self.spec.module_shapes:
                self._write_module(slot, layer, module, adapter.weights.get((layer, module)))

    def _write_module(self, slot: int, layer: int, module: str, weight: LoRAWeight | None) -> None:
        a_slot, b_slot = self.a[layer][module][slot], self.b[layer][module][slot]
        a_slot.zero_()
        b_slot.zero_()
        if weight is None:
            self.scaling[layer][module][slot] = 0.0
            return
        a_slot[: weight.rank].copy_(weight.a, non_blocking=True)
        b_slot[:, : weight.rank].copy_(weight.b, non_blocking=True)
        self.scaling[layer][module][slot] = weight.scaling

    def _drop(self, int_id: int) -> None:
        """Forget ``int_id``: registry, host cache, and its slot (whose scaling is zeroed)."""
        del self._registry[int_id]
        self._cpu.pop(int_id)
        slot = self._slot_of.pop(int_id, None)
        if slot is None:
            return
        self._slots[slot] = None
        for per_layer in self.scaling:
            for tensor in per_layer.values():
                tensor[slot] = 0.0

    def _resident(self, slot: int) -> _Resident:
        resident = self._slots[slot]
        assert resident is not None, f"slot {slot} is empty"
        return resident

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _name(self, int_id: int) -> str:
        return self._registry[int_id].request.lora_name

    def _slot_info(self, slot: int) -> SlotInfo:
        resident = self._slots[slot]
        if resident is None:
            return SlotInfo(slot=slot, lora_name=None, lora_int_id=None, version_id=None, pin_count=0)
        registration = self._registry[resident.int_id]
        return SlotInfo(
            slot=slot,
            lora_name=registration.request.lora_name,
            lora_int_id=resident.int_id,
            version_id=registration.version_id,
            pin_count=resident.pin_count,
        )

    def _slot_memory_bytes(self) -> int:
        tensors = [t for group in (self.a, self.b, self.scaling) for per_layer in group for t in per_layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
