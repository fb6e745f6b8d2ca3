"""The knobs of LoRA serving, validated once: :class:`LoRAConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """Sizes and policies of the adapter tiers (the engine's ``EngineConfig`` builds one).

    Raises ``ValueError`` naming the field for a size that is not an integer >= 1.
    """

    max_loras: int = 4
    """Adapter slots on the device: distinct adapters in one step, at most."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; slot tensors are padded to it."""
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
    more than this many bytes of them go in several rounds). The staging buffer is allocated at the
    first install and kept (grown to one image when a single image is larger), so up to this many
    device bytes stay reserved for the life of the pool, outside the KV cache budget."""
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
