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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.errors import KernelArgumentError

_OP = "LoRAMapping"


@dataclass(frozen=True, eq=False)
class LoRAMapping:
    """Token grouping by adapter slot, built once per step by :meth:`from_token_slots`.

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

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAMapping:
        """Group tokens by slot with torch ops only (one small device-to-host copy, no per-token loop).

        Args:
            token_slots: ``[T] int32`` adapter slot per token, -1 = no adapter.

        Raises:
            KernelArgumentError: not a 1-D int32 tensor, or a slot < -1.
        """
        if token_slots.dtype != torch.int32 or token_slots.dim() != 1:
            raise KernelArgumentError(
                f"{_OP}.from_token_slots: token_slots is {token_slots.dtype} {tuple(token_slots.shape)}, "
                "expected a 1-D int32 tensor"
            )
        order = torch.argsort(token_slots, stable=True)
        uniq, counts = torch.unique_consecutive(token_slots[order], return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        uniq_host, counts_host, starts_host = torch.stack((uniq.long(), counts, starts)).tolist()
        if uniq_host and uniq_host[0] < -1:
            raise KernelArgumentError(f"{_OP}.from_token_slots: token_slots contains {uniq_host[0]}, expected >= -1")
        first = 1 if uniq_host and uniq_host[0] == -1 else 0
        device = token_slots.device
        segment_lens_host = counts_host[first:]
        return cls(
            token_slots=token_slots,
            sorted_token_ids=order.to(torch.int32),
            segment_starts=starts[first:].to(torch.int32),
            segment_lens=counts[first:].to(torch.int32),
            segment_slots=uniq[first:].to(device=device, dtype=torch.int32),
            num_tokens=token_slots.shape[0],
            num_segments=len(segment_lens_host),
            max_segment_len=max(segment_lens_host, default=0),
            has_lora=bool(segment_lens_host),
            segment_starts_host=starts_host[first:],
            segment_lens_host=segment_lens_host,
            segment_slots_host=uniq_host[first:],
        )
