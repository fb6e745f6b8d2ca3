"""The knobs of LoRA serving, validated once: :class:`LoRAConfig`."""

from __future__ import annotations

from dataclasses import dataclass


def pages_per_adapter(rank: int, page_rows: int) -> int:
    """Weight pages an adapter of ``rank`` takes in a pool of ``page_rows`` rank rows per page: ``ceil(rank /
    page_rows)`` (LoRAConfig's and LoRADeviceWeights' page-count rules; EngineConfig.validate writes it out: the
    settings import it without torch, which ``loraplex.adapters`` imports)."""
    return -(-rank // page_rows)


@dataclass(frozen=True)
class LoRAConfig:
    """Sizes and policies of the adapter tiers (the engine's ``EngineConfig`` builds one).

    Raises ``ValueError`` naming the field for a size that is not an integer >= 1.
    """

    max_loras: int = 4
    """Adapter slots on the device: distinct adapters in one step, at most."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted."""
    page_rows: int | None = None
    """Rank rows per page of the adapter weight pool (a power of two <= ``max_lora_rank``): an adapter of rank
    ``r`` takes ``ceil(r / page_rows)`` pages, device memory in proportion to its own rank. None:
    ``max_lora_rank`` (one page per adapter, every adapter padded to ``max_lora_rank``)."""
    num_pages: int | None = None
    """Pages in the adapter weight pool (``loraplex.adapters.device_weights``), at least one max-rank adapter's.
    None: ``max_loras * ceil(max_lora_rank / page_rows)``, so every slot can hold a max-rank adapter; fewer pages
    hold fewer high-rank adapters at once (an adapter whose pages cannot be freed waits, with the scheduler's
    aging bound, like one without a slot)."""
    max_cpu_loras: int = 4
    """Adapters kept in the host-memory LRU cache (``SlotImage``s); evicted ones are re-read from disk."""
    background_loads: bool = True
    """``ensure_ready`` reads adapters on loader threads (True) or inline (False: deterministic, for CPU tests)."""
    max_loads_in_flight: int | None = None
    """Background reads queued or running and not yet in the host cache, at most (``None``: ``max_cpu_loras``).
    Deeper than ``num_loader_threads`` so that a burst of new adapters is queued at once; at most the host
    cache size so that finished prefetches never evict each other before they are pinned."""
    num_loader_threads: int = 4
    """Threads reading adapter files (the disk's useful parallelism)."""
    install_staging_bytes: int = 512 << 20
    """Device staging of one batch of slot installs, at most (``LoRASlotPool.batched_installs``: the
    adapters admitted in one step are copied whole to the device, then scattered into their slots;
    more than this many bytes of them go in several rounds). On CUDA the staging buffer is allocated when
    the pool is built, before the engine sizes the KV cache (which leaves room for it), at
    ``min(this, max_loras x the largest image)`` bytes, or one image if that is larger
    (``LoRADeviceWeights.staging_bound``), and kept for the life of the pool."""
    host_arena_chunk_bytes: int = 256 << 20
    """Host-cache memory is taken in chunks of this size (or one adapter, if larger), each allocated
    (and page-locked) once and reused by later images (``loraplex.adapters.host_arena``)."""
    max_full_module_slots: int = 0
    """Device slots for ``modules_to_save`` copies of ``embed_tokens`` / ``lm_head``, one
    ``[vocab_size, hidden_size]`` matrix each (0: such adapters are refused)."""
    pin_host_cache: bool = True
    """Host images in page-locked memory when slots live on CUDA (installs are asynchronous copies; a first
    read pays the page locking) or pageable (installs block the caller while the driver stages the copy)."""

    def __post_init__(self) -> None:
        if self.max_loads_in_flight is None:
            object.__setattr__(self, "max_loads_in_flight", self.max_cpu_loras)
        sizes = {
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
            "max_loads_in_flight": self.max_loads_in_flight,
            "num_loader_threads": self.num_loader_threads,
            "install_staging_bytes": self.install_staging_bytes,
            "host_arena_chunk_bytes": self.host_arena_chunk_bytes,
        }
        if isinstance(self.max_full_module_slots, bool) or not isinstance(self.max_full_module_slots, int) \
                or self.max_full_module_slots < 0:
            raise ValueError(
                f"LoRAConfig.max_full_module_slots={self.max_full_module_slots!r}: must be an integer >= 0")
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoRAConfig.{name}={value!r}: must be an integer >= 1")
        for name in ("page_rows", "num_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"LoRAConfig.{name}={value!r}: must be None or an integer >= 1")
        if self.page_rows is not None and self.page_rows != self.max_lora_rank and (
                self.page_rows & (self.page_rows - 1) or self.page_rows > self.max_lora_rank):
            raise ValueError(f"LoRAConfig.page_rows={self.page_rows}: must be a power of two <= "
                             f"max_lora_rank={self.max_lora_rank}")
        max_pages = pages_per_adapter(self.max_lora_rank, self.page_rows or self.max_lora_rank)
        if self.num_pages is not None and self.num_pages < max_pages:
            raise ValueError(f"LoRAConfig.num_pages={self.num_pages}: an adapter of max_lora_rank={self.max_lora_rank} "
                             f"takes {max_pages} pages of {self.page_rows} rank rows; give at least {max_pages} "
                             "(or lower max_lora_rank)")
