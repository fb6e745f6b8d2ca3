"""Adapter reads from disk (inline or on loader threads) and the host-memory tier behind the slots.

Host copies are ``SlotImage``s: the pool's page layout in the slot dtype, padded to the adapter's own rank
rounded up to the page rows, in ranges of a ``HostArena`` (chunks allocated once, pinned when slots live on
CUDA), so a read allocates nothing once the chunks exist and installing one is one host-to-device copy of the
image and one multi-tensor device copy into its pages (``LoRADeviceWeights.write_many``).

Background reads: ``start`` queues a read (at most ``max_loads_in_flight`` queued or running,
on ``num_loader_threads`` threads, so the queue is deeper than the thread count). Each read
reports its completion on a thread-safe queue; ``poll`` (called by the pool on the caller's
thread at every readiness question) moves finished reads into the host cache at once, so a
read that completes between two steps is claimable by the next question and frees its place
in the queue without waiting for its own adapter to be asked again. A failed read is kept
and raised, once, by the next ``take_failure`` of its adapter.

Content verification: the first read of a registration's tensors hashes them and compares with
the registered ``version_id`` (``AdapterChangedError`` on a mismatch); the files' stat signature
is then recorded and later reads trust the ``version_id`` while it is unchanged.

Only ``_read`` runs on loader threads, and it touches no shared state; everything else runs
on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters import tensor_file
from loraplex.adapters.cpu_cache import AdapterLRUCache
from loraplex.adapters.errors import AdapterChangedError, AdapterError, AdapterFormatError
from loraplex.adapters.host_arena import HostArena
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import (
    AdapterLayout,
    FileSignature,
    adapter_files_signature,
    inspect_peft_adapter,
    unpack_layout,
    unpack_stored,
)
from loraplex.adapters.registry import Registration
from loraplex.adapters.slot_image import SlotImage, read_new_slot_image, read_slot_image
from loraplex.adapters.spec import BaseModelSpec
from loraplex.adapters.tensor_file import SAFETENSORS_NAME, StoredTensor


@dataclass(frozen=True)
class _Read:
    """A finished read: the adapter laid out for a slot in host memory, and the files'
    signature it was read under."""

    image: SlotImage
    signature: FileSignature | None
    stored: dict[str, StoredTensor] | None = None  # the header's tensors, parsed under ``signature``


class AdapterLoader:
    """Reads registered adapters into an LRU host cache of ``max_cpu_loras`` ``SlotImage``s.

    ``executor``: runs the background reads (default: a thread pool of ``num_loader_threads``
    threads, made at the first read); tests pass one that runs each read at submission.
    ``background_loads`` and ``pin_host_cache`` may be switched later (new reads).
    Every image lives in a ``HostArena`` (``host_arena_chunk_bytes`` chunks, page-locked when
    ``pin_host_cache`` and slots are on CUDA): no allocation per read once the chunks exist.
    """

    def __init__(self, spec: BaseModelSpec, max_lora_rank: int, dtype: torch.dtype, device: torch.device,
                 max_cpu_loras: int, *, background_loads: bool, max_loads_in_flight: int, num_loader_threads: int,
                 pin_host_cache: bool, executor: concurrent.futures.Executor | None = None,
                 host_arena_chunk_bytes: int = 256 << 20, page_rows: int | None = None) -> None:
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.page_rows = page_rows  # images padded to their own rank in pages of this many rows (None: max_lora_rank)
        self.dtype = dtype
        self.device = device
        self.background_loads = background_loads
        self.max_loads_in_flight = max_loads_in_flight
        self.num_loader_threads = num_loader_threads
        self.pin_host_cache = pin_host_cache
        self.cache: AdapterLRUCache[SlotImage] = AdapterLRUCache(max_cpu_loras)
        self.arenas = {pinned: HostArena(host_arena_chunk_bytes, pin_memory=pinned) for pinned in (False, True)}
        self._executor = executor
        self._owns_executor = executor is None
        self._loading: dict[int, concurrent.futures.Future[_Read]] = {}
        self._registrations: dict[int, Registration] = {}  # of the reads in ``_loading``
        self._completed: queue.SimpleQueue[tuple[int, concurrent.futures.Future[_Read]]] = queue.SimpleQueue()
        self._failed: dict[int, AdapterError] = {}
        self.disk_loads = 0
        self.cpu_evictions = 0
        self.load_failures = 0

    # ------------------------------------------------------------------ host tier

    def cached(self, int_id: int) -> SlotImage | None:
        """The host copy of ``int_id`` (it becomes most recently used), or None."""
        return self.cache.get(int_id)

    def put(self, int_id: int, image: SlotImage) -> None:
        """Cache ``image``, evicting least recently used entries if full."""
        self.cpu_evictions += len(self.cache.put(int_id, image))

    def host_copy(self, registration: Registration) -> SlotImage:
        """The adapter from the host cache, else from its background read (waited for), else read
        now; then cached. Raises a kept failure of its last read or the read's ``AdapterError``."""
        int_id = registration.request.lora_int_id
        image = self.cache.get(int_id)  # before ``poll``: finished reads put there must not evict it first
        if image is not None:
            return image
        self.poll()
        image = self.cache.get(int_id)
        if image is not None:
            return image
        self.take_failure(int_id)
        image = self.claim(int_id) if int_id in self._loading else self.read_now(registration)
        self.put(int_id, image)
        return image

    def drop(self, int_id: int) -> None:
        """Forget ``int_id``: host copy, kept failure, and its read (a running read finishes and is dropped)."""
        self.cache.pop(int_id)
        self._failed.pop(int_id, None)
        self._registrations.pop(int_id, None)
        future = self._loading.pop(int_id, None)
        if future is not None:
            future.cancel()

    # ------------------------------------------------------------------ reads

    def load_new(self, path: str) -> SlotImage:
        """Read, validate and hash the adapter at ``path`` (registration without a declared id)."""
        image, _ = self._read_new(path)
        self.disk_loads += 1
        return image

    def inspect(self, path: str) -> AdapterLayout:
        """The header checks of the adapter at ``path`` (``inspect_peft_adapter``)."""
        return inspect_peft_adapter(path, self.spec, self.max_lora_rank)

    @property
    def loads_in_flight(self) -> int:
        return len(self._loading)

    def is_loading(self, int_id: int) -> bool:
        return int_id in self._loading

    def is_done(self, int_id: int) -> bool:
        return self._loading[int_id].done()

    def start(self, registration: Registration) -> bool:
        """Queue a background read of the registration's adapter unless ``max_loads_in_flight``
        reads are queued or running; returns whether it was queued."""
        self.poll()
        if len(self._loading) >= self.max_loads_in_flight:
            return False
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.num_loader_threads, thread_name_prefix="loraplex-lora-loader"
            )
        int_id = registration.request.lora_int_id
        future = self._executor.submit(
            self._read, registration.request, registration.version_id, registration.signature,
            *registration.read_state(), registration.verified,
        )
        self._loading[int_id] = future
        self._registrations[int_id] = registration
        future.add_done_callback(lambda done, int_id=int_id: self._completed.put((int_id, done)))
        self.poll()
        return True

    def poll(self) -> None:
        """Move every read reported finished into the host cache (a failure is kept for
        ``take_failure``). Runs on the caller's thread."""
        while True:
            try:
                int_id, future = self._completed.get_nowait()
            except queue.Empty:
                return
            if self._loading.get(int_id) is not future:
                continue  # claimed already, or dropped
            try:
                image = self.claim(int_id)
            except AdapterError as exc:
                self._failed[int_id] = exc
                continue
            self.put(int_id, image)

    def take_failure(self, int_id: int) -> None:
        """Raise (once) the ``AdapterError`` of ``int_id``'s last read if it failed."""
        error = self._failed.pop(int_id, None)
        if error is not None:
            raise error

    def claim(self, int_id: int) -> SlotImage:
        """The result of ``int_id``'s background read (waiting for it); raises its ``AdapterError``."""
        future = self._loading.pop(int_id)
        registration = self._registrations.pop(int_id)
        try:
            read = future.result()
        except AdapterError:
            self.load_failures += 1
            raise
        return self._accept(registration, read)

    def read_now(self, registration: Registration) -> SlotImage:
        """Read the registration's adapter on this thread. Raises the read's ``AdapterError``."""
        try:
            read = self._read(registration.request, registration.version_id, registration.signature,
                              *registration.read_state(), registration.verified)
        except AdapterError:
            self.load_failures += 1
            raise
        return self._accept(registration, read)

    def wait(self, timeout_s: float) -> None:
        """Block until one running background read finishes or ``timeout_s`` passes (at once if
        none runs; finished reads not yet claimed do not count)."""
        running = [future for future in self._loading.values() if not future.done()]
        if running:
            concurrent.futures.wait(running, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the loader threads (reads not started are cancelled); reads then run inline."""
        if self._executor is not None and self._owns_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._loading.clear()
        self._registrations.clear()

    # ------------------------------------------------------------------ internals

    def _accept(self, registration: Registration, read: _Read) -> SlotImage:
        self.disk_loads += 1
        registration.signature = read.signature
        registration.verified = read.signature is not None  # hashed and matched under a stat later reads can check
        registration.stored = read.stored
        return read.image

    def _pin_images(self) -> bool:
        return self.pin_host_cache and self.device.type == "cuda"

    def _arena(self) -> HostArena:
        return self.arenas[self._pin_images()]

    def _read_new(self, path: str) -> tuple[SlotImage, dict[str, StoredTensor]]:
        """A first read: every check of ``load_peft_adapter``, the content hashed (``image.version_id``), the
        image built from the same read (``read_new_slot_image``); and the header's tensors."""
        return read_new_slot_image(path, self.spec, self.max_lora_rank, self.dtype, pin_memory=self._pin_images(),
                                   allocate=self._arena().empty, page_rows=self.page_rows)

    def _read_declared(self, path: str, version_id: str, layout: AdapterLayout | None,
                       check_finite: bool = True, stored: dict[str, StoredTensor] | None = None) -> SlotImage:
        """Header checks (unless ``layout`` holds them), then the tensors straight into a slot
        image; nothing hashed (``check_finite``, ``stored``: as ``read_slot_image``)."""
        layout = layout or inspect_peft_adapter(path, self.spec, self.max_lora_rank)
        return read_slot_image(layout, self.spec, self.max_lora_rank, self.dtype,
                               version_id=version_id, pin_memory=self._pin_images(), allocate=self._arena().empty,
                               check_finite=check_finite, page_rows=self.page_rows, stored=stored)

    def _read(self, request: LoRARequest, version_id: str, signature: FileSignature | None,
              packed_layout: tuple | None = None, packed_stored: tuple | None = None,
              verified: bool = False) -> _Read:
        """Read a registered adapter's tensors (runs on a loader thread: touches no shared state).
        ``packed_layout`` / ``packed_stored``: the registration's (``Registration.read_state``), unpacked here.

        Once ``verified``, while the files' stat signature equals ``signature`` (before and after
        the read) the registered ``version_id`` is trusted; otherwise (first read, or files
        touched since) the content is hashed and must match.
        Raises ``AdapterError`` (anything else the read raises is wrapped in ``AdapterFormatError``).
        """
        path = request.lora_path
        try:
            before = adapter_files_signature(path)
            if verified and before is not None and before == signature:
                # Verified: this content was hashed, matched and scanned for NaN/Inf (as self.dtype) when
                # first read, and the files' stat is unchanged since, so the scan is not repeated. Only this
                # path uses the registration's layout and header (a full read parses its own).
                layout = None if packed_layout is None else unpack_layout(packed_layout)
                stored = (unpack_stored(packed_stored) if packed_stored is not None
                          else tensor_file.stored_tensors(Path(path) / SAFETENSORS_NAME))
                image = self._read_declared(path, version_id, layout, check_finite=False, stored=stored)
                if adapter_files_signature(path) == before:
                    return _Read(image, before, stored)
            image, stored = self._read_new(path)
            if image.version_id != version_id:
                raise AdapterChangedError(
                    f"adapter {request.lora_name!r} at lora_path={path!r} changed on disk: "
                    f"version_id {image.version_id} != registered {version_id}"
                )
            # the signature later reads trust, and the header's offsets for them: only when the files' stat held
            # from before the read until after it (files replaced after the hash must not be trusted under it)
            after = adapter_files_signature(path)
            held = after is not None and after == before
            return _Read(image, after if held else None, stored if held else None)
        except AdapterError:
            raise
        except Exception as exc:  # an unreadable file is an adapter error, not an engine crash
            raise AdapterFormatError(
                f"adapter {request.lora_name!r} at lora_path={path!r} could not be read ({type(exc).__name__}: {exc})"
            ) from exc
