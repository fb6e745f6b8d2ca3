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

Loads off the critical path: ``ensure_ready(id)`` is True when ``pin(id)`` will not
touch the disk (resident or cached); otherwise it starts a background read (at most
``max_loads_in_flight`` at once, each on its own worker thread) and returns False, and a later call moves
the finished read into the host cache. ``pin`` of an adapter that is not ready reads it
synchronously (waiting for its in-flight read if any). A failed read raises its
``AdapterError`` from the ``ensure_ready``/``pin`` call that claims it, once; the next
call starts a new read. With ``background_loads=False`` ``ensure_ready`` reads inline.

Host copies are ``SlotImage``s: the slot's layout in the slot dtype, already padded to
rank R (pinned when slots live on CUDA), so installing one is two contiguous copies per
targeted module and one for the scalings, enqueued without waiting.

Slot tensors, per layer ``l`` and module ``m`` (S = max_loras, R = max_lora_rank):

- ``a[l][m]``: ``[S, R, in_features]`` in ``dtype`` (lora_A, rows ``r..R`` zero),
- ``b[l][m]``: ``[S, out_features, R]`` in ``dtype`` (lora_B, columns ``r..R`` zero),
- ``scaling[l][m]``: ``[S] fp32`` (0 where the slot's adapter does not target ``(l, m)``).

Semantics: ``y[t] += scaling[l][m][s] * (x[t] @ a[l][m][s].T) @ b[l][m][s].T`` for ``s = slot(t)``,
nothing when ``s == -1``. Zero padding makes the rank-R product equal the rank-r one.

Not thread-safe: the engine calls it from its step loop. The loader thread only reads
files into new host tensors; all pool state is changed on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from loraplex.adapters.adapter import LoRAAdapter
from loraplex.adapters.cpu_cache import AdapterLRUCache
from loraplex.adapters.errors import (
    AdapterChangedError,
    AdapterConflictError,
    AdapterError,
    AdapterFormatError,
    NoFreeSlotError,
    SlotPoolError,
    UnknownAdapterError,
)
from loraplex.adapters.peft_format import (
    AdapterLayout,
    FileSignature,
    adapter_files_signature,
    inspect_peft_adapter,
    load_peft_adapter,
)
from loraplex.adapters.slot_image import ModuleKey, SlotImage, read_slot_image, slot_image_from_adapter
from loraplex.adapters.spec import BaseModelSpec
from loraplex.adapters.lora_request import LoRARequest

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
    - ``disk_loads``: adapters' tensors read from disk (``add_lora`` without a declared
      ``version_id``, first uses, reloads after a host-cache eviction); a header-only
      registration is not a load.
    - ``slot_loads``: adapters written into a GPU slot.
    - ``cpu_evictions``: adapters dropped from the host cache for capacity.
    - ``slot_evictions``: resident adapters overwritten by another adapter.
    - ``slot_memory_bytes``: device memory of the slot tensors.
    - ``loads_in_flight``: background reads started and not yet claimed.
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


@dataclass
class _Registration:
    """``signature``: the files' stat when registered or last verified (``None``: could not stat);
    ``layout``: the header checks' result, reused by reads while the signature holds;
    ``verified``: the content was hashed and matched ``version_id`` under ``signature``."""

    request: LoRARequest
    version_id: str
    signature: FileSignature | None
    layout: AdapterLayout | None = None
    pending_removal: bool = False
    verified: bool = False


@dataclass(frozen=True)
class _Read:
    """A finished read: the adapter laid out for a slot in host memory, and the files'
    signature it was read under."""

    image: SlotImage
    signature: FileSignature | None


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
    - ``pin_host_cache``: host images in pinned memory when slots live on CUDA (installs are
      asynchronous copies; a first read pays the page locking) or pageable (installs
      block the caller while the driver stages the copy); may be switched later (new reads).
    - ``background_loads``: ``ensure_ready`` reads adapters on a worker thread (True) or
      inline (False: deterministic, for CPU tests).
    - ``max_loads_in_flight``: background reads started and not yet claimed, at most (also
      the number of reader threads).

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
        *,
        background_loads: bool = True,
        max_loads_in_flight: int = 4,
        pin_host_cache: bool = True,
    ) -> None:
        sizes = {
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
            "max_cpu_loras": max_cpu_loras,
            "max_loads_in_flight": max_loads_in_flight,
        }
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
        self.background_loads = background_loads
        self.max_loads_in_flight = max_loads_in_flight
        self.pin_host_cache = pin_host_cache
        self._scaling_table = self._zeros(spec.num_layers, len(spec.module_shapes), max_loras, dtype=torch.float32)
        self.a, self.b, self.scaling = self._allocate()
        self._written: list[frozenset[ModuleKey]] = [frozenset()] * max_loras  # (layer, module)s non-zero per slot
        self._registry: dict[int, _Registration] = {}
        self._cpu = AdapterLRUCache(max_cpu_loras)
        self._slots: list[_Resident | None] = [None] * max_loras
        self._slot_of: dict[int, int] = {}
        self._loading: dict[int, concurrent.futures.Future[_Read]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._tick = 0
        self._disk_loads = 0
        self._slot_loads = 0
        self._cpu_evictions = 0
        self._slot_evictions = 0
        self._load_failures = 0

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
        pool is then unchanged).
        """
        known = self._registry.get(request.lora_int_id)
        if known is not None:
            return self._check_same(known, request)
        signature = adapter_files_signature(request.lora_path)
        if request.version_id is not None:
            layout = inspect_peft_adapter(request.lora_path, self.spec, self.max_lora_rank)
            self._registry[request.lora_int_id] = _Registration(request, request.version_id, signature, layout)
            return True
        image = self._load(request.lora_path)
        self._registry[request.lora_int_id] = _Registration(request, image.version_id, signature, verified=True)
        self._cpu.put_if_room(request.lora_int_id, image)
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

    # ------------------------------------------------------------------ host loads

    def ensure_ready(self, int_id: int) -> bool:
        """True when ``pin(int_id)`` will not touch the disk: the adapter is resident in a slot
        or cached in host memory (the cache entry becomes most recently used).

        Otherwise starts a background read (idempotent; not started while
        ``max_loads_in_flight`` reads are unclaimed) and returns False; the call that finds
        the read finished moves it into the host cache and returns True. With
        ``background_loads=False`` the read happens inline and the result is True.

        Raises ``UnknownAdapterError`` (not registered or being removed) or the read's
        ``AdapterError`` (files gone, corrupt, invalid, ``AdapterChangedError``), once per
        failed read.
        """
        registration = self._accepting(int_id)
        if int_id in self._slot_of or self._cpu.get(int_id) is not None:
            return True
        future = self._loading.get(int_id)
        if future is None and not self.background_loads:
            self._cache(int_id, self._read_now(registration))
            return True
        if future is None:
            self._start_load(int_id, registration)
            return False
        if not future.done():
            return False
        self._cache(int_id, self._claim(int_id, registration))
        return True

    def preload(self, int_id: int) -> None:
        """Read ``int_id`` into the host cache now (synchronously; the LRU entry is evicted if the
        cache is full) unless it is resident or cached already: an explicit warm-up.

        Raises ``UnknownAdapterError`` or the read's ``AdapterError``.
        """
        registration = self._accepting(int_id)
        if int_id not in self._slot_of:
            self._host_copy(int_id, registration)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until one running background read finishes or ``timeout_s`` passes (at once if
        none runs; finished reads not yet claimed do not count)."""
        running = [future for future in self._loading.values() if not future.done()]
        if running:
            concurrent.futures.wait(running, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the loader thread (reads not started are cancelled); the pool stays usable inline."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._loading.clear()

    # ------------------------------------------------------------------ slots

    def pin(self, int_id: int) -> int:
        """Make ``int_id`` resident in a GPU slot, increment its pin count and return the slot index.

        Slot choice: its current slot if resident; else the lowest free slot; else the
        least recently used unpinned slot (its adapter is evicted). The weights come
        from the host cache, else from its in-flight background read (waited for), else
        are read from disk now.

        Raises ``UnknownAdapterError`` (not registered or being removed), ``NoFreeSlotError``
        (every slot pinned by other adapters), ``AdapterChangedError`` or another
        ``AdapterError`` if a read from disk fails; the slots are then unchanged.
        """
        registration = self._accepting(int_id)
        slot = self._slot_of.get(int_id)
        if slot is None:
            slot = self._choose_slot(registration.request)
            image = self._host_copy(int_id, registration)
            self._install(slot, int_id, image)
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
            loads_in_flight=len(self._loading),
            load_failures=self._load_failures,
        )

    # ------------------------------------------------------------------ internals

    def _allocate(self) -> tuple[_PerLayer, _PerLayer, _PerLayer]:
        """Zeroed ``a [S, R, in]``, ``b [S, out, R]`` (``dtype``) per layer and module, and ``scaling``
        ``[S] fp32`` views of the ``[L, M, S]`` scaling table (one copy writes a slot's scalings)."""
        S, R = self.max_loras, self.max_lora_rank
        shapes = self.spec.module_shapes
        a = [{m: self._zeros(S, R, i) for m, (i, _) in shapes.items()} for _ in range(self.spec.num_layers)]
        b = [{m: self._zeros(S, o, R) for m, (_, o) in shapes.items()} for _ in range(self.spec.num_layers)]
        scaling = [{m: self._scaling_table[layer, i] for i, m in enumerate(shapes)} for layer in range(self.spec.num_layers)]
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
        if request.version_id is not None and request.version_id != known.version_id:
            raise AdapterConflictError(
                f"LoRARequest.version_id={request.version_id!r}: lora_int_id={request.lora_int_id} is already "
                f"registered with version_id={known.version_id!r}"
            )
        return False

    def _accepting(self, int_id: int) -> _Registration:
        registration = self._registry.get(int_id)
        if registration is None:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is not registered")
        if registration.pending_removal:
            raise UnknownAdapterError(f"lora_int_id={int_id!r} is being removed and accepts no new requests")
        return registration

    def _load(self, path: str) -> SlotImage:
        """Read, validate and hash the adapter at ``path`` (registration without a declared id)."""
        image = self._image_of(load_peft_adapter(path, self.spec, self.max_lora_rank, serving_dtype=self.dtype))
        self._disk_loads += 1
        return image

    def _pin_images(self) -> bool:
        return self.pin_host_cache and self.device.type == "cuda"

    def _image_of(self, adapter: LoRAAdapter) -> SlotImage:
        return slot_image_from_adapter(
            adapter, self.spec, self.max_lora_rank, self.dtype, pin_memory=self._pin_images()
        )

    def _read_declared(self, path: str, version_id: str, layout: AdapterLayout | None) -> SlotImage:
        """Header checks (unless ``layout`` holds them), then the tensors straight into a slot
        image; nothing hashed."""
        layout = layout or inspect_peft_adapter(path, self.spec, self.max_lora_rank)
        return read_slot_image(
            layout, self.spec, self.max_lora_rank, self.dtype,
            version_id=version_id, pin_memory=self._pin_images(),
        )

    def _read(
        self,
        request: LoRARequest,
        version_id: str,
        signature: FileSignature | None,
        layout: AdapterLayout | None = None,
        verified: bool = False,
    ) -> _Read:
        """Read a registered adapter's tensors (runs on the loader thread: touches no pool state).

        Once ``verified``, while the files' stat signature equals ``signature`` (before and after
        the read) the registered ``version_id`` is trusted; otherwise (first read, or files
        touched since) the content is hashed and must match.
        Raises ``AdapterError`` (anything else the read raises is wrapped in ``AdapterFormatError``).
        """
        path = request.lora_path
        try:
            before = adapter_files_signature(path)
            if verified and before is not None and before == signature:
                image = self._read_declared(path, version_id, layout)
                if adapter_files_signature(path) == before:
                    return _Read(image, before)
            adapter = load_peft_adapter(path, self.spec, self.max_lora_rank, serving_dtype=self.dtype)
            if adapter.version_id != version_id:
                raise AdapterChangedError(
                    f"adapter {request.lora_name!r} at lora_path={path!r} changed on disk: "
                    f"version_id {adapter.version_id} != registered {version_id}"
                )
            return _Read(self._image_of(adapter), adapter_files_signature(path))
        except AdapterError:
            raise
        except Exception as exc:  # an unreadable file is an adapter error, not an engine crash
            raise AdapterFormatError(
                f"adapter {request.lora_name!r} at lora_path={path!r} could not be read ({type(exc).__name__}: {exc})"
            ) from exc

    def _start_load(self, int_id: int, registration: _Registration) -> None:
        """Queue a background read of ``int_id`` unless ``max_loads_in_flight`` reads are unclaimed
        (finished reads nobody asked for again are then cached if there is room, or dropped)."""
        if len(self._loading) >= self.max_loads_in_flight:
            self._reap_finished()
        if len(self._loading) >= self.max_loads_in_flight:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.max_loads_in_flight, thread_name_prefix="loraplex-lora-loader"
            )
        request = registration.request
        self._loading[int_id] = self._executor.submit(
            self._read, request, registration.version_id, registration.signature, registration.layout,
            registration.verified,
        )

    def _reap_finished(self) -> None:
        for int_id in [i for i, future in self._loading.items() if future.done()]:
            try:
                image = self._claim(int_id, self._registry[int_id])
            except AdapterError:
                continue  # reported again by the next read of this adapter
            self._cpu.put_if_room(int_id, image)

    def _claim(self, int_id: int, registration: _Registration) -> SlotImage:
        """The result of ``int_id``'s background read (waiting for it); raises its ``AdapterError``."""
        future = self._loading.pop(int_id)
        try:
            read = future.result()
        except AdapterError:
            self._load_failures += 1
            raise
        return self._accept_read(registration, read)

    def _read_now(self, registration: _Registration) -> SlotImage:
        try:
            read = self._read(
                registration.request, registration.version_id, registration.signature, registration.layout,
                registration.verified,
            )
        except AdapterError:
            self._load_failures += 1
            raise
        return self._accept_read(registration, read)

    def _accept_read(self, registration: _Registration, read: _Read) -> SlotImage:
        self._disk_loads += 1
        registration.signature = read.signature
        registration.verified = True
        return read.image

    def _cache(self, int_id: int, image: SlotImage) -> None:
        self._cpu_evictions += len(self._cpu.put(int_id, image))

    def _host_copy(self, int_id: int, registration: _Registration) -> SlotImage:
        """The adapter from the host cache, else from its background read, else read now; then cached."""
        image = self._cpu.get(int_id)
        if image is not None:
            return image
        image = self._claim(int_id, registration) if int_id in self._loading else self._read_now(registration)
        self._cache(int_id, image)
        return image

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

    def _install(self, slot: int, int_id: int, image: SlotImage) -> None:
        previous = self._slots[slot]
        try:
            self._write_slot(slot, image)
        except Exception:
            self._vacate(slot)  # partly overwritten: it holds no adapter now
            raise
        if previous is not None:
            del self._slot_of[previous.int_id]
            self._slot_evictions += 1
        self._slots[slot] = _Resident(int_id=int_id, pin_count=0, last_used=self._next_tick())
        self._slot_of[int_id] = slot
        self._slot_loads += 1

    def _vacate(self, slot: int) -> None:
        """Empty ``slot`` whose contents are unknown: no adapter, scalings zero, all modules to re-zero."""
        resident = self._slots[slot]
        if resident is not None:
            del self._slot_of[resident.int_id]
            self._slots[slot] = None
        self._scaling_table[:, :, slot] = 0.0
        self._written[slot] = frozenset((layer, m) for layer in range(self.spec.num_layers) for m in self.spec.module_shapes)

    def _write_slot(self, slot: int, image: SlotImage) -> None:
        """Overwrite ``slot`` with ``image``: two contiguous copies per targeted module (already
        rank-padded), zeros for modules an earlier occupant wrote and this one does not
        target, one copy for all scalings. Nothing of a previous adapter survives."""
        for layer, module in self._written[slot] - image.offsets.keys():
            self.a[layer][module][slot].zero_()
            self.b[layer][module][slot].zero_()
        keys = list(image.offsets)
        destinations = [self.a[l][m][slot] for l, m in keys] + [self.b[l][m][slot] for l, m in keys]
        sources = [image.a(key) for key in keys] + [image.b(key) for key in keys]
        torch._foreach_copy_(destinations, sources, non_blocking=True)  # one call, not 2 per module
        self._scaling_table[:, :, slot].copy_(image.scaling, non_blocking=True)
        self._written[slot] = frozenset(image.offsets)

    def _drop(self, int_id: int) -> None:
        """Forget ``int_id``: registry, host cache, and its slot (whose scaling is zeroed)."""
        del self._registry[int_id]
        self._cpu.pop(int_id)
        future = self._loading.pop(int_id, None)
        if future is not None:
            future.cancel()  # a read already running finishes on the loader thread and is dropped
        slot = self._slot_of.pop(int_id, None)
        if slot is None:
            return
        self._slots[slot] = None
        self._scaling_table[:, :, slot] = 0.0

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
