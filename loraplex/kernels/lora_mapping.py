"""Per-step token -> adapter-slot grouping for the SGMV LoRA kernels.

Punica (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") groups the
tokens of a batch into segments that use the same adapter, so one program
reads an adapter's weights once for a whole tile of its tokens (SGMV). Here
the grouping is a stable sort of the tokens by slot::

    token_slots        [ 2, -1,  0,  2,  0, -1,  2]      (T = 7, slot -1 = no adapter)
    sorted_token_ids   [ 1,  5,  2,  4,  0,  3,  6]      (stable argsort by slot)
                         |-1 -1 | 0  0 | 2  2  2 |
    segment_starts                [ 2,     4      ]      (offsets into sorted_token_ids)
    segment_lens                  [ 2,     3      ]
    segment_slots                 [ 0,     2      ]

Tokens with slot -1 sort first and belong to no segment, so the kernels spend
nothing on them.

One builder for every path: :func:`plan_segments` computes the grouping on the host (no
device sort, no device-to-host sync); the eager step packs its tensors into the step's single
host-to-device copy (:meth:`LoRAMapping.from_plan`), and the CUDA-graph runner writes the
same plan, with one fixed segment per slot (``num_slots``), into its static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.kernels.errors import KernelArgumentError

_OP = "LoRAMapping"


@dataclass(frozen=True, eq=False)
class LoRAMapping:
    """Token grouping by adapter slot, built once per step from a :class:`SegmentPlan`.

    Device tensors (on the tokens' device):

    - ``token_slots``: ``[T] int32``, adapter slot of each token, -1 = none.
    - ``sorted_token_ids``: ``[T] int32``, token indices stably sorted by slot (slot -1 first).
    - ``segment_starts`` / ``segment_lens`` / ``segment_slots``: ``[G] int32`` each, one
      entry per distinct slot >= 0 in ascending slot order; segment g covers
      ``sorted_token_ids[segment_starts[g] : segment_starts[g] + segment_lens[g]]``.

    Host values: ``num_tokens`` (T), ``num_segments`` (G), ``max_segment_len``
    (tokens of the largest segment, 0 if none), ``has_lora`` (some token has a
    slot >= 0), and ``segment_starts_host`` / ``segment_lens_host`` /
    ``segment_slots_host`` lists (reference path, launch sizing, slot checks).

    Work items: the kernels launch one program row per (segment, token tile)
    from :meth:`tiles`, not a segments x max-tiles rectangle, so a decode batch
    of many 1-token segments starts no idle programs. CUDA graphs pass
    ``static_tiles`` (``[2, W] int32``, padded with idle items) built for
    ``static_tiles_block_m``-row tiles.
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    segment_starts: torch.Tensor
    segment_lens: torch.Tensor
    segment_slots: torch.Tensor
    num_tokens: int
    num_segments: int
    max_segment_len: int
    has_lora: bool
    segment_starts_host: list[int]
    segment_lens_host: list[int]
    segment_slots_host: list[int]
    static_tiles: torch.Tensor | None = None
    static_tiles_block_m: int = 0
    _tile_cache: dict = field(default_factory=dict, repr=False)

    def tiles(self, block_m: int) -> torch.Tensor:
        """``[2, W] int32`` work items: row 0 the segment, row 1 the token tile of ``block_m`` rows.

        Items with a tile past their segment's end are idle (the kernels return at once).
        """
        if self.static_tiles is not None and block_m == self.static_tiles_block_m:
            return self.static_tiles
        cached = self._tile_cache.get(block_m)
        if cached is None:
            cached = torch.tensor(tile_lists(self.segment_lens_host, block_m), dtype=torch.int32)
            cached = cached.to(self.token_slots.device, non_blocking=True)
            self._tile_cache[block_m] = cached
        return cached

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAMapping:
        """Group tokens by slot (:func:`plan_segments` on a host copy; one device-to-host copy
        when ``token_slots`` lives on a device).

        Args:
            token_slots: ``[T] int32`` adapter slot per token, -1 = no adapter.

        Raises:
            KernelArgumentError: not a 1-D int32 tensor, or a slot < -1.
        """
        plan = plan_segments(token_slots.cpu())
        device = token_slots.device
        tensors = [token_slots] + [t.to(device) for t in plan.host_tensors()[1:]]
        return cls.from_plan(plan, tensors)

    @classmethod
    def from_plan(cls, plan: SegmentPlan, tensors: list[torch.Tensor]) -> LoRAMapping:
        """The mapping of ``plan`` whose device copies are ``tensors`` (``plan.host_tensors()``
        moved to the device, same order)."""
        token_slots, sorted_token_ids, segment_starts, segment_lens, segment_slots = tensors
        return cls(
            token_slots=token_slots,
            sorted_token_ids=sorted_token_ids,
            segment_starts=segment_starts,
            segment_lens=segment_lens,
            segment_slots=segment_slots,
            num_tokens=plan.num_tokens,
            num_segments=len(plan.segment_lens),
            max_segment_len=max(plan.segment_lens, default=0),
            has_lora=any(plan.segment_lens),
            segment_starts_host=plan.segment_starts,
            segment_lens_host=plan.segment_lens,
            segment_slots_host=plan.segment_slots,
        )


@dataclass(frozen=True)
class SegmentPlan:
    """The token grouping of one step, on the host.

    ``token_slots`` / ``sorted_token_ids``: ``[T] int32`` CPU tensors (see the module
    docstring); ``segment_starts`` / ``segment_lens`` / ``segment_slots``: one entry per segment.
    """

    token_slots: torch.Tensor
    sorted_token_ids: torch.Tensor
    segment_starts: list[int]
    segment_lens: list[int]
    segment_slots: list[int]

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def host_tensors(self) -> list[torch.Tensor]:
        """``[token_slots, sorted_token_ids, segment_starts, segment_lens, segment_slots]``, int32, host."""
        ints = [torch.tensor(v, dtype=torch.int32) for v in (self.segment_starts, self.segment_lens, self.segment_slots)]
        return [self.token_slots, self.sorted_token_ids, *ints]


def plan_segments(token_slots: torch.Tensor, num_slots: int | None = None) -> SegmentPlan:
    """Group tokens by slot on the host: a stable sort by slot, then the segments.

    ``num_slots`` None: one segment per distinct slot >= 0, ascending (the eager path).
    ``num_slots`` given: exactly one segment per slot ``0..num_slots-1``, empty ones included
    (fixed shapes for CUDA graphs); the token order is the same.

    Args:
        token_slots: ``[T] int32`` CPU tensor, adapter slot per token, -1 = no adapter.

    Raises:
        KernelArgumentError: not a 1-D int32 tensor, a slot < -1, or a slot >= ``num_slots``.
    """
    if token_slots.dtype != torch.int32 or token_slots.dim() != 1:
        raise KernelArgumentError(
            f"{_OP}.from_token_slots: token_slots is {token_slots.dtype} {tuple(token_slots.shape)}, "
            "expected a 1-D int32 tensor"
        )
    order = torch.argsort(token_slots, stable=True)
    if num_slots is None:
        uniq, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        uniq_host, counts_host, starts_host = torch.stack((uniq.long(), counts, starts)).tolist()
        if uniq_host and uniq_host[0] < -1:
            raise KernelArgumentError(f"{_OP}.from_token_slots: token_slots contains {uniq_host[0]}, expected >= -1")
        first = 1 if uniq_host and uniq_host[0] == -1 else 0
        return SegmentPlan(token_slots, order.to(torch.int32), starts_host[first:], counts_host[first:],
                           uniq_host[first:])
    if token_slots.numel():
        low, high = token_slots.min().item(), token_slots.max().item()
        if low < -1 or high >= num_slots:
            bad = low if low < -1 else high
            raise KernelArgumentError(
                f"{_OP}.plan_segments: token_slots contains {bad}, expected -1 <= slot < num_slots={num_slots}"
            )
    used = token_slots[token_slots >= 0]
    counts = torch.bincount(used, minlength=num_slots)
    starts = (token_slots.numel() - used.numel()) + torch.cumsum(counts, 0) - counts
    return SegmentPlan(token_slots, order.to(torch.int32), starts.tolist(), counts.tolist(), list(range(num_slots)))


def tile_lists(segment_lens: list[int], block_m: int) -> list[list[int]]:
    """``[segments, tiles]``: one (segment g, tile m) item per ``block_m`` tokens of each segment."""
    segments: list[int] = []
    tiles: list[int] = []
    for g, length in enumerate(segment_lens):
        count = -(-length // block_m)
        segments += [g] * count
        tiles += range(count)
    return [segments, tiles]
