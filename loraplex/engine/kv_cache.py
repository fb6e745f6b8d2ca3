"""KV cache tensors and their sizing.

Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Per-token bytes = 2 (K and V) x num_layers x num_kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.engine.host_copy import host_to_device
from loraplex.engine.kv_cache_manager import BlockCopies
from loraplex.adapters.model_spec import ModelSpec

logger = logging.getLogger(__name__)

_CPU_DEFAULT_CAP_BYTES = 2 << 30


class KVCacheTooSmallError(ValueError):
    """The KV cache cannot hold one sequence of ``max_model_len`` tokens."""


@dataclass(frozen=True)
class KVCacheSizing:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    @property
    def max_concurrency(self) -> float:
        """Sequences of ``max_model_len`` tokens that fit at once."""
        return self.capacity_tokens / self.max_model_len


def size_kv_cache(spec: ModelSpec, dtype: torch.dtype, device: torch.device, *, block_size: int,
                  max_model_len: int, max_num_seqs: int, num_kv_blocks: int | None,
                  kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                  activation_bytes: int = 0, sliding_window: int | None = None,
                  max_num_batched_tokens: int | None = None) -> KVCacheSizing:
    """Number of KV blocks: explicit count, explicit bytes, or what is left of
    ``gpu_memory_utilization`` x device memory after weights and activations
    and ``activation_bytes`` (CUDA), or enough for ``max_num_seqs`` full sequences capped at 2 GiB (CPU).

    With ``sliding_window`` (every layer attends to the last W tokens; the manager frees blocks outside
    the window) one sequence needs at most the blocks of a step's chunk of ``max_num_batched_tokens``
    tokens plus the W - 1 positions before it: ``ceil((W - 1 + max_num_batched_tokens) / block_size) + 1``
    (over a block boundary), when that is fewer than ``max_model_len``'s.

    Raises:
        KVCacheTooSmallError: one sequence (``max_model_len`` tokens, or its window as above) does not fit;
            the message names the numbers.
    """
    per_token = spec.kv_bytes_per_token(dtype)
    per_block = per_token * block_size
    if num_kv_blocks is not None:
        blocks = num_kv_blocks
    elif kv_cache_memory_bytes is not None:
        blocks = kv_cache_memory_bytes // per_block
    elif device.type == "cuda":
        blocks = max(0, _free_cuda_bytes(device, gpu_memory_utilization) - activation_bytes) // per_block
    else:
        blocks = min(max_num_seqs * max_model_len * per_token, _CPU_DEFAULT_CAP_BYTES) // per_block
    sizing = KVCacheSizing(int(blocks), block_size, per_token, max_model_len)
    needed = -(-max_model_len // block_size)
    what = f"max_model_len={max_model_len}"
    if sliding_window is not None and max_num_batched_tokens is not None:
        windowed = -(-(sliding_window - 1 + max_num_batched_tokens) // block_size) + 1
        if windowed < needed:
            needed = windowed
            what = f"sliding_window={sliding_window} and max_num_batched_tokens={max_num_batched_tokens}"
    if sizing.num_blocks < needed:
        raise KVCacheTooSmallError(
            f"KV cache has {sizing.num_blocks} blocks x {block_size} tokens = {sizing.capacity_tokens} tokens "
            f"({sizing.total_bytes / 2**20:.1f} MiB at {per_token} bytes/token), but one sequence of "
            f"{what} needs {needed} blocks; lower max_model_len or give the cache more memory")
    logger.info("KV cache: %d blocks, %d tokens, %.1f MiB; max concurrency at max_model_len=%d: %.2fx",
                sizing.num_blocks, sizing.capacity_tokens, sizing.total_bytes / 2**20, max_model_len,
                sizing.max_concurrency)
    return sizing


def _free_cuda_bytes(device: torch.device, utilization: float) -> int:
    """Bytes the KV cache may take: utilization x total minus what is in use
    (weights, LoRA slots, and the peak of a profiling forward pass)."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return max(0, int(total * utilization) - used - peak_extra)


class KVCache:
    """The per-layer paged K/V tensors on the device, plus host swap space."""

    def __init__(self, spec: ModelSpec, sizing: KVCacheSizing, dtype: torch.dtype, device: torch.device,
                 num_swap_blocks: int = 0) -> None:
        shape = (sizing.num_blocks, sizing.block_size, spec.num_kv_heads, spec.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(spec.num_layers)]
        self.num_swap_blocks = num_swap_blocks
        swap_shape = (num_swap_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.swap = [(torch.zeros(swap_shape, dtype=dtype, pin_memory=pin), torch.zeros(swap_shape, dtype=dtype, pin_memory=pin))
                     for _ in range(spec.num_layers)] if num_swap_blocks else []

    def apply(self, copies: BlockCopies) -> None:
        """Perform swap-out, swap-in and copy-on-write block moves, in that order."""
        if copies.swap_out:
            self._move(copies.swap_out, self.layers, self.swap)
        if copies.swap_in:
            self._move(copies.swap_in, self.swap, self.layers)
        if copies.copy:
            self._move(copies.copy, self.layers, self.layers)

    @staticmethod
    def _move(pairs: list[tuple[int, int]], src_layers, dst_layers) -> None:
        src_dev = src_layers[0][0].device
        dst_dev = dst_layers[0][0].device
        src = host_to_device([p[0] for p in pairs], torch.int64, src_dev)
        dst = host_to_device([p[1] for p in pairs], torch.int64, dst_dev)
        # Into host memory (swap-out) the copy must be complete before the CPU's index_copy_ reads it: a
        # non-blocking device-to-host copy returns before its bytes arrive. Device-bound copies stay
        # non-blocking (stream-ordered).
        non_blocking = dst_dev.type != "cpu"
        for (sk, sv), (dk, dv) in zip(src_layers, dst_layers):
            dk.index_copy_(0, dst, sk.index_select(0, src).to(dst_dev, non_blocking=non_blocking))
            dv.index_copy_(0, dst, sv.index_select(0, src).to(dst_dev, non_blocking=non_blocking))
