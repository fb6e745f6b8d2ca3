"""Host memory of the adapter host cache: chunks allocated once, carved into slot images.

Without it every adapter read took a new page-locked buffer from torch's pinned allocator,
which locks a new power-of-two block per adapter (a 16.8 MB image takes 32 MiB, and the
page locking costs more than the read itself: 10.5 ms against 2.5 ms per q/v adapter on
the H200 host). Here an image takes a range of a chunk that was locked once; when the
image dies (evicted from the host cache, dropped, or a failed read) its range returns to
the chunk and the next image reuses it.

::

    chunk 0 (chunk_bytes, pinned once): | image 7 | free | image 9 | image 2 | free ...... |
    chunk 1 (allocated when no free range of chunk 0 fits)

Reuse is safe against asynchronous copies: on CUDA a dying image's range is kept until an
event recorded at its death (after every copy enqueued from it on the current stream) has
completed. Thread-safe: loader threads take ranges; whichever thread drops an image's last
reference gives its range back.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

_ALIGN_BYTES = 512


@dataclass
class _Chunk:
    buffer: torch.Tensor  # [chunk bytes] uint8
    free: list[tuple[int, int]] = field(default_factory=list)  # (start, end) byte ranges, sorted, coalesced


class HostArena:
    """Slot-image memory from chunks of ``chunk_bytes`` (or one image, if larger), page-locked
    when ``pin_memory``, allocated on demand and never freed while the arena lives.

    ``chunk_allocations`` counts the chunks allocated (the only allocations: none per image);
    ``images`` counts the ranges handed out. Raises ``ValueError`` for ``chunk_bytes`` < 1.
    """

    def __init__(self, chunk_bytes: int, *, pin_memory: bool) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes!r}: must be >= 1")
        self.chunk_bytes = chunk_bytes
        self.pin_memory = pin_memory
        self.chunk_allocations = 0
        self.images = 0
        self._chunks: list[_Chunk] = []
        self._in_flight: list[tuple[torch.cuda.Event, int, int, int]] = []  # (event, chunk, start, end)
        self._lock = threading.RLock()

    @property
    def capacity_bytes(self) -> int:
        """Bytes of all chunks allocated so far."""
        return sum(chunk.buffer.numel() for chunk in self._chunks)

    def free_bytes(self) -> int:
        """Bytes of free ranges (ranges waiting for their copies not counted)."""
        with self._lock:
            return sum(end - start for chunk in self._chunks for start, end in chunk.free)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised ``[numel]`` tensor of ``dtype`` in the arena; its range returns to the
        arena when the tensor is garbage (no other tensor may view it beyond its life: slot images
        take views only while copying from it)."""
        nbytes = max(_ALIGN_BYTES, -(-numel * dtype.itemsize // _ALIGN_BYTES) * _ALIGN_BYTES)
        with self._lock:
            place = self._take(nbytes)
            if place is None:
                self._reclaim(wait=True)
                place = self._take(nbytes)
            if place is None:
                place = self._grow(nbytes)
            index, start = place
            self.images += 1
            raw = self._chunks[index].buffer[start : start + nbytes]
        tensor = raw[: numel * dtype.itemsize].view(dtype)
        weakref.finalize(tensor, self._give_back, index, start, start + nbytes)
        return tensor

    # ------------------------------------------------------------------ internals

    def _take(self, nbytes: int) -> tuple[int, int] | None:
        """First fit among the free ranges (after reclaiming those whose copies are done)."""
        self._reclaim(wait=False)
        for index, chunk in enumerate(self._chunks):
            for i, (start, end) in enumerate(chunk.free):
                if end - start >= nbytes:
                    if end - start == nbytes:
                        del chunk.free[i]
                    else:
                        chunk.free[i] = (start + nbytes, end)
                    return index, start
        return None

    def _grow(self, nbytes: int) -> tuple[int, int]:
        size = max(self.chunk_bytes, nbytes)
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.chunk_allocations += 1
        self._chunks.append(_Chunk(buffer, [(nbytes, size)] if size > nbytes else []))
        return len(self._chunks) - 1, 0

    def _give_back(self, index: int, start: int, end: int) -> None:
        event = None
        if self.pin_memory and torch.cuda.is_available():
            try:
                event = torch.cuda.Event()
                event.record()  # after every copy from this range enqueued on the current stream so far
            except RuntimeError:  # no CUDA context left (interpreter shutdown): nothing can be in flight
                event = None
        with self._lock:
            if event is None:
                self._insert_free(index, start, end)
            else:
                self._in_flight.append((event, index, start, end))

    def _reclaim(self, *, wait: bool) -> None:
        keep = []
        for event, index, start, end in self._in_flight:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._insert_free(index, start, end)
            else:
                keep.append((event, index, start, end))
        self._in_flight = keep

    def _insert_free(self, index: int, start: int, end: int) -> None:
        free = self._chunks[index].free
        free.append((start, end))
        free.sort()
        merged = [free[0]]
        for lo, hi in free[1:]:
            if lo == merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        free[:] = merged
