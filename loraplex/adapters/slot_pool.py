"""GPU adapter slots with a host-memory LRU cache behind them (S-LoRA, Sheng et al. 2023;
Punica, Chen et al. 2023; vLLM's ``LRUCacheWorkerLoRAManager``).

Three tiers: *registered* adapters (``add_lora``: path known, validated, ``version_id``
recorded), up to ``max_cpu_loras`` *cached* in host memory (LRU), and up to ``max_loras``
*resident* in a GPU slot. A running request *pins* its adapter's slot; only unpinned
slots are ever overwritten, so an adapter never changes under a running request.

Registration cost: with a declared ``LoRARequest.version_id`` only ``adapter_config.json``
and the safetensors header are read (every structural check runs; tensors are read at
first use). Without one, the files are read and hashed once (as the platform's upload
does) and the adapter is cached only if the host cache has room: registering never
evicts another adapter.

Content verification: the first read of a registration's tensors (into the host cache)
hashes them and compares with the registered ``version_id`` (``AdapterChangedError`` on a
mismatch: files changed on disk after they were validated); the files' stat signature
(size, mtime_ns) is then recorded, and later reads trust the ``version_id`` while it is
unchanged and re-hash otherwise.

Loads off the critical path: ``is_ready(id)`` says without side effects whether ``pin(id)``
will not touch the disk (resident or cached); ``ensure_ready(id)`` is True in that case;
otherwise it queues a background read (at most
``max_loads_in_flight`` queued or running, on ``num_loader_threads`` threads) and returns False.
Every finished read is moved into the host cache by the next ``ensure_ready`` of *any* adapter
(a completion queue), so reads that complete between steps are claimable at once and free their
place in the read queue. ``pin`` of an adapter that is not ready reads it
synchronously (waiting for its in-flight read if any). A failed read raises its
``AdapterError`` from the ``ensure_ready``/``pin`` call that claims it, once; the next
call starts a new read. With ``background_loads=False`` ``ensure_ready`` reads inline.

Host copies are ``SlotImage``s: the pool's page layout in the slot dtype, padded to the
adapter's own rank rounded up to the page rows, in ranges of a ``HostArena`` (chunks allocated
and, when slots live on CUDA, page-locked once; no allocation per read). An adapter takes a
slot and ``ceil(rank / page_rows)`` weight pages (``SlotTable``). Installing one alone (``pin``
outside a batch) is two copies per targeted module and run of consecutive pages and one for the
scalings, enqueued without waiting; inside ``batched_installs`` (one scheduler step) the pins'
slots and pages are assigned at once and written together at exit: one host-to-device copy per
image into a device staging buffer (kept between batches), then one ``torch._foreach_copy_`` per
group sharing a layout.

Slot tensors ``a``, ``b``, ``scaling`` (shapes and semantics): see
:mod:`loraplex.adapters.device_weights`.

The pool composes one owner per concept: ``AdapterRegistry`` (registration and version rules),
``AdapterLoader`` (reads, change detection, the host tier), ``SlotTable`` (which adapter is in
which slot, pins, LRU eviction; pure Python) and ``LoRADeviceWeights`` (the slot tensors and
their writes); its sizes come from one ``LoRAConfig``.

Not thread-safe: the engine calls it from its step loop. The loader thread only reads
files into new host tensors; all pool state is changed on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.errors import AdapterNotServedError, NoFreeSlotError, SlotPoolError
from loraplex.adapters.loader import AdapterLoader
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import adapter_files_signature
from loraplex.adapters.registry import AdapterRegistry, Registration
from loraplex.adapters.slot_image import SlotImage, image_rank
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.spec import BaseModelSpec


logger = logging.getLogger(__name__)


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
    - ``pending_removal``: lora names removed while requests hold or pin them (dropped when the last ends).
    - ``disk_loads``: adapters' tensors read from disk (``add_lora`` without a declared
      ``version_id``, first uses, reloads after a host-cache eviction); a header-only
      registration is not a load.
    - ``slot_loads``: adapters written into a GPU slot.
    - ``cpu_evictions``: adapters dropped from the host cache for capacity.
    - ``slot_evictions``: resident adapters overwritten by another adapter.
    - ``slot_memory_bytes``: device memory of the slot tensors.
    - ``loads_in_flight``: background reads queued or running and not yet in the host cache.
    - ``load_failures``: reads of registered adapters that failed (file gone, corrupt, changed).
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
    loads_in_flight: int = 0
    load_failures: int = 0


class LoRASlotPool:
    """GPU slots for up to ``max_loras`` adapters of rank <= ``max_lora_rank`` on model ``spec``.

    The sizes and policies are those of :class:`~loraplex.adapters.config.LoRAConfig` (see its
    fields); pass ``config=`` or the fields as arguments. ``dtype``: slot tensor dtype (fp16,
    bf16 or fp32); ``device``: where slots live. ``read_executor``: runs background reads
    (default: ``num_loader_threads`` threads); tests pass one that reads at submission.

    Raises ``ValueError`` naming the field for sizes < 1 or another dtype.
    """

    def __init__(
        self,
        spec: BaseModelSpec,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        config: LoRAConfig | None = None,
        background_loads: bool = True,
        max_loads_in_flight: int | None = None,
        num_loader_threads: int = 4,
        pin_host_cache: bool = True,
        read_executor: concurrent.futures.Executor | None = None,
        weights: LoRADeviceWeights | None = None,
    ) -> None:
        if config is None:
            config = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                                background_loads=background_loads, max_loads_in_flight=max_loads_in_flight,
                                num_loader_threads=num_loader_threads, pin_host_cache=pin_host_cache)
        self.config = config
        self.spec = spec
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        # ``weights``: slot tensors built by the caller (a tensor-parallel rank's slices); else full-size ones.
        self.weights = weights if weights is not None else LoRADeviceWeights(
            spec, config.max_loras, config.max_lora_rank, dtype, device, config.max_full_module_slots,
            page_rows=config.page_rows, num_pages=config.num_pages)
        self.dtype = dtype
        self.device = self.weights.device
        if self.device.type == "cuda":  # before the engine sizes the KV cache from the memory left
            reserved = self.weights.reserve_staging(config.install_staging_bytes)
            logger.info("LoRA install staging: %.1f MiB reserved on %s", reserved / 2**20, self.device)
        self.a, self.b, self.scaling = self.weights.a, self.weights.b, self.weights.scaling
        self.registry = AdapterRegistry()
        self.loader = AdapterLoader(
            spec, config.max_lora_rank, dtype, self.device, config.max_cpu_loras,
            background_loads=config.background_loads, max_loads_in_flight=config.max_loads_in_flight,
            num_loader_threads=config.num_loader_threads, pin_host_cache=config.pin_host_cache,
            executor=read_executor, host_arena_chunk_bytes=config.host_arena_chunk_bytes,
            page_rows=self.weights.page_rows,
        )
        self.slots = SlotTable(config.max_loras, self.weights.num_pages)
        self._page_needs: dict[int, int] = {}  # int id -> weight pages its image takes
        # slot -> (image, pages), inside ``batched_installs``
        self._pending_writes: dict[int, tuple[SlotImage, tuple[int, ...]]] | None = None
        self.install_batches = 0  # device write batches issued (one per ``batched_installs`` with installs)
        self._slot_loads = 0
        self._slot_evictions = 0
        # modules_to_save: full-module slots, each owned by the adapter slot using it (None: free), and the
        # modules each registered adapter replaces (absent: none).
        self._full_owner: list[int | None] = [None] * self.weights.max_full_module_slots
        self._full_needs: dict[int, tuple[str, ...]] = {}

    # Policies that may be switched on a running pool (they apply to new reads).
    @property
    def background_loads(self) -> bool:
        return self.loader.background_loads

    @background_loads.setter
    def background_loads(self, value: bool) -> None:
        self.loader.background_loads = value

    @property
    def pin_host_cache(self) -> bool:
        return self.loader.pin_host_cache

    @pin_host_cache.setter
    def pin_host_cache(self, value: bool) -> None:
        self.loader.pin_host_cache = value

    @property
    def max_loads_in_flight(self) -> int:
        return self.loader.max_loads_in_flight

    # ------------------------------------------------------------------ registry

    def add_lora(self, request: LoRARequest) -> bool:
        """Register ``request``'s adapter after validating it.

        With ``request.version_id`` declared, only ``adapter_config.json`` and the safetensors
        header are read (``inspect_peft_adapter``: every check but finite values); the tensors
        are read at first use. Without it the adapter is loaded and hashed now and cached
        in host memory if that evicts nothing.

        Returns True if newly registered, False if this exact request is already registered.
        The int id is the identity: one name may be registered under several ids (a
        re-uploaded adapter's new version gets a new id while requests on the old one finish).
        Raises ``AdapterConflictError`` if its int id is registered with another name, path or
        version id (or is being removed); any ``AdapterError`` of ``load_peft_adapter`` (the
        pool is then unchanged); ``AdapterUnsupportedError`` for a DoRA adapter where the slots
        cannot compute DoRA gains (``LoRADeviceWeights.check_dora``).
        """
        known = self.registry.get(request.lora_int_id)
        if known is not None:
            AdapterRegistry.check_same(known, request)
            return False
        signature = adapter_files_signature(request.lora_path)
        if request.version_id is not None:
            layout = self.loader.inspect(request.lora_path)
            self._check_vocab(request, bool(layout.vocab_lora), tuple(m for m, _ in layout.full_modules))
            if layout.config.use_dora:
                self.weights.check_dora(request.lora_name)
            registration = Registration(request, request.version_id, signature)
            registration.layout = layout
            self.registry.add(registration)
            self._set_full_needs(request.lora_int_id, tuple(m for m, _ in layout.full_modules))
            rank = image_rank([plan.hyper.rank for plan in layout.modules], self.max_lora_rank, self.weights.page_rows)
            self._page_needs[request.lora_int_id] = rank // self.weights.page_rows
            return True
        image = self.loader.load_new(request.lora_path)
        vocab = image.vocab
        full = tuple(vocab.full) if vocab is not None else ()
        self._check_vocab(request, vocab is not None and vocab.scaling.any().item(), full)
        if image.magnitude:
            self.weights.check_dora(request.lora_name)
        self.registry.add(Registration(request, image.version_id, signature, verified=True))
        self._set_full_needs(request.lora_int_id, full)
        self._page_needs[request.lora_int_id] = self.weights.pages_needed(image)
        self.loader.cache.put_if_room(request.lora_int_id, image)
        return True

    def _check_vocab(self, request: LoRARequest, has_lora: bool, full: tuple[str, ...]) -> None:
        """Refuse LoRA on ``embed_tokens`` / ``lm_head`` when the slots hold none, and ``modules_to_save``
        copies beyond ``max_full_module_slots`` (``AdapterNotServedError`` naming the setting)."""
        weights = self.weights
        if (has_lora or full) and not weights.has_vocab:
            reason = ("LoRA or modules_to_save on embed_tokens/lm_head is not served by this engine (not implemented "
                      "with tensor_parallel_size > 1)")
            raise AdapterNotServedError(f"adapter {request.lora_name!r}: {reason}", reason)
        if len(full) > weights.max_full_module_slots:
            spec = self.spec
            each = spec.vocab_size * spec.hidden_size * torch.empty((), dtype=self.dtype).element_size()
            reason = (f"modules_to_save={list(full)!r} needs {len(full)} full-module "
                      f"slot(s) but max_full_module_slots={weights.max_full_module_slots}; each slot holds one "
                      f"[vocab_size={spec.vocab_size}, hidden_size={spec.hidden_size}] matrix ({each / 2**20:.1f} MiB "
                      "of device memory, taken from the KV cache): raise --max-full-module-slots")
            raise AdapterNotServedError(f"adapter {request.lora_name!r}: {reason}", reason)

    def _set_full_needs(self, int_id: int, full: tuple[str, ...]) -> None:
        if full:
            self._full_needs[int_id] = full

    def remove_lora(self, int_id: int) -> bool:
        """Unregister ``int_id``. If accepted requests hold it (``hold``) or pin it, it accepts no new requests
        (``add_lora`` of it, ``hold``, ``preload``) and is dropped when the last of them ends (``release`` /
        ``unpin``); those requests are never disturbed: they may still pin it.

        Returns False if ``int_id`` is unknown or already being removed.
        """
        registration = self.registry.get(int_id)
        if registration is None or registration.pending_removal:
            return False
        if self.slots.pin_count(int_id) > 0 or registration.holds > 0:
            registration.pending_removal = True
            return True
        self._drop(int_id)
        return True

    def hold(self, int_id: int) -> None:
        """An accepted request on ``int_id`` (queued or running until its ``release``): a ``remove_lora`` keeps the
        adapter usable for it. Raises ``UnknownAdapterError`` (not registered, or being removed)."""
        self.registry.accepting(int_id).holds += 1

    def release(self, int_id: int) -> None:
        """The end of a request ``hold`` counted (finished, aborted or failed): a pending ``remove_lora`` completes
        when no request holds or pins the adapter any more. Raises ``SlotPoolError`` if it is not held."""
        registration = self.registry.get(int_id)
        if registration is None or registration.holds <= 0:
            raise SlotPoolError(f"lora_int_id={int_id!r} is not held by a request")
        registration.holds -= 1
        if registration.holds == 0 and registration.pending_removal and self.slots.pin_count(int_id) == 0:
            self._drop(int_id)

    def list_loras(self) -> list[LoRARequest]:
        """Registered adapters that accept new requests, by int id."""
        return [r.request for _, r in self.registry.items(pending_removal=False)]

    def version_id(self, int_id: int) -> str:
        """The registered ``version_id`` of ``int_id`` (for prefix-cache keys).

        Raises ``UnknownAdapterError`` if ``int_id`` is not registered.
        """
        return self.registry.version_id(int_id)

    # ------------------------------------------------------------------ host loads

    def ensure_ready(self, int_id: int) -> bool:
        """True when ``pin(int_id)`` will not touch the disk: the adapter is resident in a slot
        or cached in host memory (the cache entry becomes most recently used).

        First moves every finished background read into the host cache. Otherwise queues a
        background read (idempotent; not queued while ``max_loads_in_flight`` reads are
        queued or running) and returns False; the next call after it finished returns True. With
        ``background_loads=False`` the read happens inline and the result is True.

        Raises ``UnknownAdapterError`` (not registered, or being removed and held by no request) or the read's
        ``AdapterError`` (files gone, corrupt, invalid, ``AdapterChangedError``), once per
        failed read.
        """
        registration = self.registry.usable(int_id)
        loader = self.loader
        loader.poll()
        if self.slots.slot_of(int_id) is not None or loader.cached(int_id) is not None:
            return True
        loader.take_failure(int_id)
        if not loader.is_loading(int_id):
            if not loader.background_loads:
                loader.put(int_id, loader.read_now(registration))
                return True
            loader.start(registration)
            return False
        if not loader.is_done(int_id):
            return False
        loader.put(int_id, loader.claim(int_id))
        return True

    def is_ready(self, int_id: int) -> bool:
        """True when ``pin(int_id)`` will not touch the disk (resident, or in host memory after
        moving finished background reads there); False also for an unknown adapter or one being removed that no
        request holds. Starts no read and raises nothing (``ensure_ready`` does both); a cached adapter becomes the
        most recently used (it is about to be pinned)."""
        registration = self.registry.get(int_id)
        if registration is None or (registration.pending_removal and registration.holds == 0):
            return False
        self.loader.poll()
        return self.slots.slot_of(int_id) is not None or self.loader.cached(int_id) is not None

    def preload(self, int_id: int) -> None:
        """Read ``int_id`` into the host cache now (synchronously; the LRU entry is evicted if the
        cache is full) unless it is resident or cached already: an explicit warm-up.

        Raises ``UnknownAdapterError`` or the read's ``AdapterError``.
        """
        registration = self.registry.accepting(int_id)
        if self.slots.slot_of(int_id) is None:
            self.loader.host_copy(registration)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until one running background read finishes or ``timeout_s`` passes (at once if
        none runs; finished reads not yet claimed do not count)."""
        self.loader.wait(timeout_s)

    def close(self) -> None:
        """Stop the loader threads (reads not started are cancelled); the pool stays usable inline."""
        self.loader.close()

    # ------------------------------------------------------------------ slots

    def pin(self, int_id: int) -> int:
        """Make ``int_id`` resident in a GPU slot, increment its pin count and return the slot index.

        Placement (``SlotTable.plan``): its current slot if resident; else the lowest free
        slot, else the least recently used unpinned slot (its adapter is evicted), then more
        least recently used unpinned adapters evicted until its weight pages are free. The weights
        come from the host cache, else from its in-flight background read (waited for), else
        are read from disk now.

        Raises ``UnknownAdapterError`` (not registered, or being removed and held by no request),
        ``NoFreeSlotError`` (every slot, or the pages it needs, held by pinned adapters), ``AdapterChangedError``
        or another ``AdapterError`` if a read from disk fails; the slots are then unchanged.
        """
        registration = self.registry.usable(int_id)
        if self.slots.slot_of(int_id) is None:
            pages = self._page_needs.get(int_id, 0)
            placement = self.slots.plan(pages)
            if placement is None:
                request = registration.request
                if not self.slots.has_room():
                    raise NoFreeSlotError(
                        f"all max_loras={self.max_loras} adapter slots are pinned (lora_int_ids "
                        f"{self.slots.pinned_ids()}); adapter {request.lora_name!r} (lora_int_id={int_id}) "
                        f"must wait for an unpin"
                    )
                raise NoFreeSlotError(
                    f"adapter {request.lora_name!r} (lora_int_id={int_id}) needs {pages} weight pages of "
                    f"{self.weights.page_rows} rank rows; {self.slots.free_pages} of num_pages={self.weights.num_pages} "
                    f"are free and pinned adapters hold the others; it must wait for an unpin"
                )
            needs = self._full_needs.get(int_id, ())
            if len(needs) > self._freeable_full():
                request = registration.request
                raise NoFreeSlotError(
                    f"adapter {request.lora_name!r} (lora_int_id={int_id}) needs {len(needs)} of the "
                    f"max_full_module_slots={len(self._full_owner)} full-module slots (modules_to_save="
                    f"{list(needs)!r}) and adapters in use hold them; it must wait for an unpin"
                )
            image = self.loader.host_copy(registration)
            if self.weights.pages_needed(image) != pages:
                raise SlotPoolError(f"adapter {registration.request.lora_name!r}: its image takes "
                                    f"{self.weights.pages_needed(image)} pages, {pages} were planned")
            for victim in placement.evict:  # the slot's own occupant among them when the slot was not free
                self._evict(victim)
            self._install(placement.slot, int_id, image, pages)
            self._install_full(placement.slot, needs, image)
        return self.slots.pin(int_id)

    def _evict(self, int_id: int) -> None:
        """Empty the slot of unpinned resident ``int_id`` (its pages freed, its weights disabled)."""
        slot = self.slots.slot_of(int_id)
        self.slots.clear(slot)
        self._slot_evictions += 1
        if self._pending_writes is not None:
            self._pending_writes.pop(slot, None)
        self.weights.disable(slot)
        self._release_full(slot)

    def _freeable_full(self) -> int:
        """Full-module slots free or held by an adapter slot that is empty or unpinned."""
        return sum(owner is None or (self.slots.occupant(owner) or (0, 0))[1] == 0 for owner in self._full_owner)

    def _release_full(self, slot: int) -> None:
        """Free the full-module slots adapter slot ``slot`` holds; its rows use the base modules again."""
        self._full_owner = [None if owner == slot else owner for owner in self._full_owner]
        self.weights.clear_full(slot)

    def _install_full(self, slot: int, needs: tuple[str, ...], image: SlotImage) -> None:
        """Give adapter slot ``slot`` (just installed) full-module slots for ``needs`` and copy the matrices;
        when too few are free, unpinned adapters holding some are evicted, in full-slot order
        (``pin`` checked that enough can be freed)."""
        self._release_full(slot)
        if not needs:
            return
        free = [k for k, owner in enumerate(self._full_owner) if owner is None]
        holders = [owner for owner in dict.fromkeys(self._full_owner) if owner is not None]
        for victim in holders:
            if len(free) >= len(needs):
                break
            occupant = self.slots.occupant(victim)
            if occupant is None:
                self._release_full(victim)
            elif occupant[1] == 0:
                self._evict(occupant[0])
            free = [k for k, owner in enumerate(self._full_owner) if owner is None]
        for module, index in zip(needs, free, strict=False):
            self._full_owner[index] = slot
            self.weights.write_full(slot, module, index, image.vocab.full[module])

    @contextlib.contextmanager
    def batched_installs(self) -> Iterator[None]:
        """Inside it, ``pin`` assigns slots at once but defers the device writes; they are issued
        together at exit (``LoRADeviceWeights.write_many``: one host-to-device copy per adapter
        and one scatter per targeted module for all of them), before anything reads the slots.
        The scheduler wraps one step's admission in it. Nesting is refused (``SlotPoolError``).
        If the writes raise, their slots are emptied (pins included) and the error propagates."""
        if self._pending_writes is not None:
            raise SlotPoolError("batched_installs is already open")
        self._pending_writes = {}
        try:
            yield
        finally:
            pending, self._pending_writes = self._pending_writes, None
            if pending:
                self._flush(pending)

    def _flush(self, pending: dict[int, tuple[SlotImage, tuple[int, ...]]]) -> None:
        self.install_batches += 1
        try:
            self.weights.write_many([(slot, image, pages) for slot, (image, pages) in pending.items()],
                                    staging_bytes=self.config.install_staging_bytes)
        except Exception:
            for slot in pending:
                self.slots.clear(slot)  # partly overwritten: they hold no adapter now
            raise

    def unpin(self, int_id: int) -> None:
        """Release one pin of ``int_id``; at zero pins its slot may be reused (and a pending
        ``remove_lora`` completes if no request holds it either).

        Raises ``SlotPoolError`` if ``int_id`` is not pinned.
        """
        if self.slots.unpin(int_id) == 0:
            registration = self.registry.get(int_id)
            if registration.pending_removal and registration.holds == 0:
                self._drop(int_id)

    def slot_of(self, int_id: int) -> int:
        """The slot of a resident adapter (the model runner's token -> slot map).

        Raises ``KeyError`` if ``int_id`` is not in a slot.
        """
        slot = self.slots.slot_of(int_id)
        if slot is None:
            raise KeyError(f"lora_int_id={int_id!r} is not in a slot")
        return slot

    def full_modules_fit(self, int_id: int) -> bool:
        """Whether ``int_id``'s ``modules_to_save`` copies would get full-module slots now (resident, needing
        none, or enough slots free or held by unpinned adapters). Raises nothing."""
        if self.slots.slot_of(int_id) is not None:
            return True
        return len(self._full_needs.get(int_id, ())) <= self._freeable_full()

    def pages_fit(self, int_id: int) -> bool:
        """Whether ``int_id``'s weight pages would be found now (resident, or enough pages free or held by
        unpinned adapters, with a slot to put it in). Raises nothing."""
        return self.slots.slot_of(int_id) is not None or self.slots.has_room(self._page_needs.get(int_id, 0))

    def resources_fit(self, int_id: int) -> bool:
        """``pages_fit`` and ``full_modules_fit``: what the scheduler asks before admitting a request on a
        non-resident adapter (the slot count it keeps itself). Raises nothing."""
        return self.pages_fit(int_id) and self.full_modules_fit(int_id)

    def can_pin(self, int_id: int) -> bool:
        """Whether ``pin(int_id)`` would find a slot and its pages now (resident, a free slot, or an unpinned one).

        Raises ``UnknownAdapterError`` like ``pin``.
        """
        self.registry.usable(int_id)
        return self.resources_fit(int_id)

    @property
    def slot_loads(self) -> int:
        """Adapters written into a GPU slot so far (``stats().slot_loads`` without building the stats)."""
        return self._slot_loads

    def stats(self) -> SlotPoolStats:
        """A snapshot of slots, host cache and counters."""
        name = self.registry.name
        return SlotPoolStats(
            slots=[self._slot_info(i) for i in range(self.max_loras)],
            cpu_cache_lru=[name(i) for i in self.loader.cache.lru_order()],
            registered=[r.request.lora_name for _, r in self.registry.items(pending_removal=False)],
            pending_removal=[r.request.lora_name for _, r in self.registry.items(pending_removal=True)],
            disk_loads=self.loader.disk_loads,
            slot_loads=self._slot_loads,
            cpu_evictions=self.loader.cpu_evictions,
            slot_evictions=self._slot_evictions,
            slot_memory_bytes=self.weights.memory_bytes(),
            loads_in_flight=self.loader.loads_in_flight,
            load_failures=self.loader.load_failures,
        )

    # ------------------------------------------------------------------ internals

    def _install(self, slot: int, int_id: int, image: SlotImage, num_pages: int) -> None:
        """Put ``int_id`` into the empty ``slot`` with ``num_pages`` free pages and write ``image`` there (now, or at
        the end of ``batched_installs``)."""
        self.slots.assign(slot, int_id, num_pages)
        pages = self.slots.pages_of(slot)
        if self._pending_writes is not None:
            self._pending_writes[slot] = (image, pages)  # written at the end of ``batched_installs``
        else:
            try:
                self.weights.write(slot, image, pages)
            except Exception:
                self.slots.clear(slot)  # partly overwritten: it holds no adapter now
                raise
        self._slot_loads += 1

    def _drop(self, int_id: int) -> None:
        """Forget ``int_id``: registry, host cache, its read, and its slot (whose scaling is zeroed)."""
        self.registry.remove(int_id)
        self.loader.drop(int_id)
        self._full_needs.pop(int_id, None)
        self._page_needs.pop(int_id, None)
        slot = self.slots.slot_of(int_id)
        if slot is not None:
            self.slots.clear(slot)
            if self._pending_writes is not None:
                self._pending_writes.pop(slot, None)
            self.weights.disable(slot)
            self._release_full(slot)

    def _slot_info(self, slot: int) -> SlotInfo:
        occupant = self.slots.occupant(slot)
        if occupant is None:
            return SlotInfo(slot=slot, lora_name=None, lora_int_id=None, version_id=None, pin_count=0)
        int_id, pin_count = occupant
        registration = self.registry.get(int_id)
        return SlotInfo(slot=slot, lora_name=registration.request.lora_name, lora_int_id=int_id,
                        version_id=registration.version_id, pin_count=pin_count)
