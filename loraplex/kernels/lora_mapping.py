"""Per-step token -> adapter-slot grouping for the SGMV LoRA kernels, built on the device.

Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") groups the
tokens of a batch into segments that use the same adapter, so one program
reads an adapter's weights once for a whole tile of its tokens (SGMV). Here
there is one segment per adapter slot ``0..S-1`` (empty ones included, so every
shape depends only on T and S), and the grouping is a stable sort of the tokens
by slot::

    token_slots        [ 2, -1,  0,  2,  0, -1,  2]      (T = 7, S = 4, slot -1 = no adapter)
    sorted_token_ids   [ 1,  5,  2,  4,  0,  3,  6]      (stable sort by slot)
                         |-1 -1 | 0  0 | 2  2  2 |
    segment_starts                [ 2,  4,  4,  7]      (offsets into sorted_token_ids, one per slot)
    segment_lens                  [ 2,  0,  3,  0]

Tokens with slot -1 sort first and belong to no segment, so the kernels spend
nothing on them.

One builder for every path: :func:`plan_segments` runs a handful of torch ops on
the tokens' device (a sort, a search, no device-to-host copy, no host sort), so
the eager step calls it on the uploaded ``token_slots`` and the CUDA-graph runner
calls it inside the captured forward (a replay rebuilds the grouping from the
static ``token_slots`` buffer). Work items for the kernels (:meth:`LoRAMapping.tiles`)
are built the same way, with a fixed count per (T, S, block size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.kernels.errors import KernelArgumentError

_OP = "LoRAMapping"


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Bound on (segment, ``block_m``-token tile) work items of ``num_tokens`` tokens over ``num_slots``
    segments: ``ceil(T / block_m) + min(T, S)`` (each non-empty segment adds at most one partial tile)."""
    return -(-num_tokens // block_m) + min(num_tokens, num_slots)


@dataclass(frozen=True, eq=False)
class LoRAMapping:
    """Token grouping by adapter slot (one segment per slot), built once per step by :func:`plan_segments`.

    Device tensors (on the tokens' device), all int32:

    - ``token_slots``: ``[T]``, adapter slot of each token, -1 = none.
    - ``sorted_token_ids``: ``[T]``, token indices stably sorted by slot (slot -1 first).
    - ``segment_starts`` / ``segment_lens``: ``[S]``; segment (= slot) s covers
      ``sorted_token_ids[segment_starts[s] : segment_starts[s] + segment_lens[s]]``.
    - ``segment_slots``: ``[S]``, ``arange(S)`` (the slot of segment s).

    Host values: ``num_tokens`` (T), ``num_slots`` (S), ``has_lora`` (some token has a slot >= 0;
    the launchers return at once when False).

    Work items: the kernels launch one program row per (segment, token tile) from
    :meth:`tiles`; the list has :func:`max_tiles` entries, the unused ones idle.
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    segment_starts: torch.Tensor
    segment_lens: torch.Tensor
    segment_slots: torch.Tensor
    num_tokens: int
    num_slots: int
    has_lora: bool
    _tile_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_segments(self) -> int:
        """Segments (one per slot): S."""
        return self.num_slots

    def tiles(self, block_m: int) -> torch.Tensor:
        """``[2, W] int32`` work items (W = :func:`max_tiles`): row 0 the segment, row 1 the token tile of
        ``block_m`` rows. Used items come first, in segment order; an item whose tile starts past its
        segment's end is idle (the kernels return at once). Built on the device, cached per ``block_m``.
        """
        cached = self._tile_cache.get(block_m)
        if cached is None:
            cached = _device_tiles(self.segment_lens, self.num_tokens, block_m)
            self._tile_cache[block_m] = cached
        return cached

    def segments_host(self) -> list[tuple[int, int, int]]:
        """``(slot, start, length)`` of every non-empty segment, ascending slot (one device-to-host copy;
        for the torch references and tests, not the kernel path)."""
        starts, lens = self.segment_starts.tolist(), self.segment_lens.tolist()
        return [(s, st, n) for s, (st, n) in enumerate(zip(starts, lens)) if n]

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor, num_slots: int | None = None) -> LoRAMapping:
        """:func:`plan_segments` with ``num_slots`` defaulting to ``max(token_slots) + 1`` (a device-to-host
        copy; tests and benchmarks)."""
        if num_slots is None:
            num_slots = int(token_slots.max().item()) + 1 if token_slots.numel() else 0
            num_slots = max(num_slots, 0)
        return plan_segments(token_slots, num_slots)


def _device_tiles(segment_lens: torch.Tensor, num_tokens: int, block_m: int) -> torch.Tensor:
    """Work item w -> (segment g, tile w - first item of g): a cumulative sum and a search, no host copy."""
    device = segment_lens.device
    num_slots = segment_lens.shape[0]
    width = max_tiles(num_tokens, num_slots, block_m)
    if num_slots == 0:
        return torch.zeros((2, width), dtype=torch.int32, device=device)
    counts = (segment_lens + (block_m - 1)) // block_m
    inclusive = torch.cumsum(counts, 0, dtype=torch.int32)
    items = torch.arange(width, dtype=torch.int32, device=device)
    seg = torch.searchsorted(inclusive, items, right=True, out_int32=True).clamp_(max=num_slots - 1)
    # past the last used item: seg clamps to S-1 and tile >= counts[S-1], i.e. idle
    tile = items - (inclusive[seg] - counts[seg])
    return torch.stack((seg, tile))


def plan_segments(token_slots: torch.Tensor, num_slots: int, *, has_lora: bool | None = None) -> LoRAMapping:
    """Group tokens by slot on their device: one segment per slot ``0..num_slots-1``.

    Device work only (a stable sort of ``slot + 1``, a search for the segment bounds), so it runs
    inside a captured CUDA graph and needs no host copy when ``has_lora`` is given.

    Args:
        token_slots: ``[T] int32`` adapter slot per token, -1 = no adapter.
        num_slots: S, the adapter slots of the weights the kernels will read.
        has_lora: whether some token has a slot >= 0, when the caller knows it (else one device-to-host copy).

    Raises:
        KernelArgumentError: not a 1-D int32 tensor; for a CPU tensor also a slot outside ``-1..S-1``
            (on a device the caller guarantees the range: a slot outside it belongs to no segment).
    """
    if not isinstance(token_slots, torch.Tensor) or token_slots.dtype != torch.int32 or token_slots.dim() != 1:
        raise KernelArgumentError(
            f"{_OP}.plan_segments: token_slots is {getattr(token_slots, 'dtype', type(token_slots))} "
            f"{tuple(getattr(token_slots, 'shape', ()))}, expected a 1-D int32 tensor"
        )
    if num_slots < 0:
        raise KernelArgumentError(f"{_OP}.plan_segments: num_slots={num_slots}, expected >= 0")
    device = token_slots.device
    if device.type == "cpu" and token_slots.numel():
        low, high = token_slots.min().item(), token_slots.max().item()
        if low < -1 or high >= num_slots:
            bad = low if low < -1 else high
            raise KernelArgumentError(
                f"{_OP}.plan_segments: token_slots contains {bad}, expected -1 <= slot < num_slots={num_slots}"
            )
    keys, order = torch.sort(token_slots, stable=True)
    bounds = torch.searchsorted(
        keys, torch.arange(num_slots + 1, dtype=torch.int32, device=device), out_int32=True
    )  # bounds[s] = first sorted position with slot >= s
    if has_lora is None:
        has_lora = bool((token_slots >= 0).any().item())
    return LoRAMapping(
        token_slots=token_slots,
        sorted_token_ids=order.to(torch.int32),
        segment_starts=bounds[:-1],
        segment_lens=bounds[1:] - bounds[:-1],
        segment_slots=torch.arange(num_slots, dtype=torch.int32, device=device),
        num_tokens=token_slots.shape[0],
        num_slots=num_slots,
        has_lora=has_lora,
    )
