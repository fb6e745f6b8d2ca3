"""The LoRA delta of one (fused) linear layer for a mixed-adapter batch: SGMV shrink, then expand.

Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``, ``s = slot[t]``; nothing for ``s == -1``.

Two launches and no other kernel: the shrink writes split-K partial sums
(:func:`~loraplex.kernels.lora_shrink.shrink_partials`) into an uninitialised
buffer and the expand adds them up, in a fixed order, as it loads ``v``. At
decode (one token per adapter segment) the H reduction is what limits the
shrink, so it is split into many short programs; see benchmarks/RESULTS.md.
Punica (Chen et al. 2023) and S-LoRA (Sheng et al. 2023) describe the SGMV
shrink/expand pair.
"""

from __future__ import annotations

import torch

from loraplex.kernels.lora_expand import _launch_lora_expand, lora_expand_ref
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import lora_shrink_ref, shrink_partials


def add_lora(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    split_k: int | None = None,
    shrink_blocks: tuple[int, int] | None = None,
    expand_blocks: tuple[int, int, int] | None = None,
) -> None:
    """Triton shrink + expand of every slice, accumulating into ``y`` in place.

    Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``, ``s = slot[t]``.

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 layer input, last dim stride 1.
        lora_a: ``n_slices`` contiguous ``[S, R, H]`` tensors, dtype of ``x``.
        lora_b: ``n_slices`` contiguous ``[S, out_i, R]`` tensors, dtype of ``y``.
        scaling: ``n_slices`` ``[S]`` float32 tensors.
        y: ``[T, sum(out_i)]`` base-layer output, updated in place.
        mapping: the step's :class:`LoRAMapping`.
        ranks: optional ``[S] int32`` upper bounds of each slot's rank.
        split_k, shrink_blocks, expand_blocks: launch overrides (benchmarks); defaults by batch size.

    Raises:
        KernelArgumentError: as :func:`~loraplex.kernels.lora_shrink.lora_shrink` and
            :func:`~loraplex.kernels.lora_expand.lora_expand`.
        TritonUnavailableError: triton is not installed.
    """
    if not mapping.has_lora:
        return
    partials = shrink_partials(x, lora_a, mapping, ranks, split_k, shrink_blocks)
    _launch_lora_expand(partials, lora_b, scaling, y, mapping, ranks, expand_blocks)


def add_lora_ref(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> None:
    """Plain-torch reference of :func:`add_lora` (float32 matmuls per segment).

    Raises:
        KernelArgumentError: as the shrink/expand references.
    """
    v = lora_shrink_ref(x, lora_a, mapping, ranks=ranks)
    lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks)
