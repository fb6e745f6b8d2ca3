"""The LoRA delta of one (fused) linear layer for a mixed-adapter batch.

Semantics: :data:`ADD_LORA`.

Decode-sized batches take the SGMV pair, two launches and no other kernel: the shrink writes split-K partial sums
(:func:`~loraplex.kernels.lora_shrink.shrink_partials`) into an uninitialised
buffer and the expand adds them up, in a fixed order, as it loads ``v``. At
decode (one token per adapter segment) the H reduction is what limits the
shrink, so it is split into many short programs; see benchmarks/RESULTS.md. The fused
shrink+expand kernel (:mod:`loraplex.kernels.lora_fused`, ``fused=True``) measured 2.2-3.6x
slower up to 128 tokens on an H200 (one layer, Llama-2-7B shapes: 140 vs 40 us at 1 token,
325 vs 105 us at 32 tokens x 32 adapters; RESULTS.md, session 7), so it is not the default.
Prompt-sized chunks (more than 256 tokens) with a small slot table (``S * R <= 1024``) replace the
shrink by one cuBLAS GEMM per slice against every slot (:func:`dense_shrink`); the expand then reads
each token's own slot's R columns of that product. Punica (Chen et al. 2023) and S-LoRA (Sheng et
al. 2023) describe the SGMV shrink/expand pair.
"""

from __future__ import annotations

import torch

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import (
    DECODE_MAX_TOKENS,
    _launch_lora_expand,
    _launch_lora_expand_all_slots,
    lora_expand_ref,
)
from loraplex.kernels.lora_fused import _launch_fused_lora
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import _check_args as _check_shrink_args
from loraplex.kernels.lora_shrink import lora_shrink_ref, shrink_partials
from loraplex.kernels.op import Op


# The dense shrink reads every slot's A and multiplies T x (S * R) x H: it pays for prompt-sized chunks
# while S * R stays small (H200, one Llama-2-7B layer, 512 tokens, 32 slots x r16 = 512 rows: the SGMV
# shrinks take 125 us of the layer's 225 us; cuBLAS over all 512 rows takes a few us per slice;
# RESULTS.md session 8). Compute grows with S * R, so larger slot tables keep the SGMV shrink.
DENSE_SHRINK_MIN_TOKENS = DECODE_MAX_TOKENS + 1
DENSE_SHRINK_MAX_SLOT_ROWS = 1024


def use_dense_shrink(mapping: LoRAMapping, lora_a: list[torch.Tensor], device: torch.device) -> bool:
    """Whether :func:`_launch_add_lora` computes ``v`` with one cuBLAS GEMM per slice over every slot: on CUDA,
    for more than 256 tokens, when ``S * R <= 1024``."""
    slots, rank, _ = lora_a[0].shape
    return (device.type == "cuda" and mapping.num_tokens >= DENSE_SHRINK_MIN_TOKENS
            and slots * rank <= DENSE_SHRINK_MAX_SLOT_ROWS)


def dense_shrink(x: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``v_all[i] = x @ A_i.view(S * R, H).T`` for every slice: ``[n_slices, T, S * R]`` in x's dtype (cuBLAS,
    float32 accumulation, rounded once to x's dtype, as the expand rounds ``v`` to B's dtype anyway)."""
    slots, rank, hidden = lora_a[0].shape
    v_all = torch.empty((len(lora_a), x.shape[0], slots * rank), dtype=x.dtype, device=x.device)
    for i, a in enumerate(lora_a):
        torch.matmul(x, a.view(slots * rank, hidden).t(), out=v_all[i])
    return v_all


def _launch_add_lora(
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
    fused: bool = False,
    dense: bool | None = None,
) -> None:
    """Triton launch of :func:`add_lora_ref`: split-K shrink partials summed by the expand as it loads
    them; for prompt-sized chunks with a small slot table (:func:`use_dense_shrink`) the shrink is instead
    one cuBLAS GEMM per slice over every slot (:func:`dense_shrink`) and the expand picks each token's slot
    columns; or the fused kernel with ``fused=True`` (benchmarks; slower at every decode size measured).

    ``split_k``, ``shrink_blocks``, ``expand_blocks``: launch overrides of the two-kernel path (benchmarks);
    with ``fused=True`` they raise ``KernelArgumentError``. ``dense``: force the dense shrink on (True) or
    off (False) instead of :func:`use_dense_shrink` (tests, benchmarks); True with ``split_k`` /
    ``shrink_blocks`` or ``fused`` raises ``KernelArgumentError``.
    """
    two_kernel_overrides = (split_k, shrink_blocks, expand_blocks) != (None, None, None)
    if fused and (two_kernel_overrides or dense):
        raise KernelArgumentError("add_lora: split_k / shrink_blocks / expand_blocks / dense apply to the two-kernel "
                                  "path (fused=False), not to the fused kernel")
    if dense and (split_k, shrink_blocks) != (None, None):
        raise KernelArgumentError("add_lora: split_k / shrink_blocks are SGMV shrink overrides; dense=True has none")
    if fused:
        _launch_fused_lora(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
        return
    if not mapping.has_lora:
        return
    if dense is None:
        dense = (split_k, shrink_blocks) == (None, None) and use_dense_shrink(mapping, lora_a, x.device)
    if dense:
        _check_dense_args(x, lora_a, mapping)
        _launch_lora_expand_all_slots(dense_shrink(x, lora_a), lora_b, scaling, y, mapping, ranks=ranks,
                                      blocks=expand_blocks)
        return
    partials = shrink_partials(x, lora_a, mapping, ranks, split_k, shrink_blocks)
    _launch_lora_expand(partials, lora_b, scaling, y, mapping, ranks=ranks, blocks=expand_blocks)


def _check_dense_args(x: torch.Tensor, lora_a: list[torch.Tensor], mapping: LoRAMapping) -> None:
    """The shrink's own checks (x against A, the mapping); the expand checks the rest."""
    _check_shrink_args(x, lora_a, mapping, None)


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
    """One LoRA linear's batched delta, in place on ``y`` (plain torch: float32 matmuls per segment).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 layer input (last dim stride 1 for Triton).
        lora_a: ``n_slices`` contiguous ``[S, R, H]`` tensors, dtype of ``x``.
        lora_b: ``n_slices`` contiguous ``[S, out_i, R]`` tensors, dtype of ``y``.
        scaling: ``n_slices`` ``[S]`` float32 tensors.
        y: ``[T, sum(out_i)]`` base-layer output (or a float32 delta buffer), updated in place.
        mapping: the step's :class:`LoRAMapping`.
        ranks: optional ``[S] int32`` upper bounds of each slot's rank.

    Raises:
        KernelArgumentError: as :func:`~loraplex.kernels.lora_shrink.lora_shrink_ref` and
            :func:`~loraplex.kernels.lora_expand.lora_expand_ref`.
        TritonUnavailableError: Triton backend without triton installed.
    """
    v = lora_shrink_ref(x, lora_a, mapping, ranks=ranks)
    lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks)


ADD_LORA = Op(
    name="add_lora",
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T, s = slot[t]; none for s == -1",
    reference=add_lora_ref,
    triton=_launch_add_lora,
)
