"""The LoRA delta of one (fused) linear layer for a mixed-adapter batch.

Semantics: :data:`ADD_LORA`.

Every batch takes the SGMV pair, two launches and no other kernel: the shrink writes split-K partial sums
(:func:`~loraplex.kernels.lora_shrink.shrink_partials`) into an uninitialised
buffer and the expand adds them up, in a fixed order, as it loads ``v``. At
decode (one token per adapter segment) the H reduction is what limits the
shrink, so it is split into many short programs; see benchmarks/RESULTS.md. The fused
shrink+expand kernel (:mod:`loraplex.kernels.lora_fused`, ``fused=True``) measured 2.2-3.6x
slower up to 128 tokens on an H200 (one layer, Llama-2-7B shapes: 140 vs 40 us at 1 token,
325 vs 105 us at 32 tokens x 32 adapters; RESULTS.md, session 7), so it is not the default.
Punica (Chen et al. 2023) and S-LoRA (Sheng et al. 2023) describe the SGMV
shrink/expand pair.

A linear can instead fold the shrink into its base GEMM (``LinearWithLoRA.fold_lora_a``): one cuBLAS GEMM over
``[W; every slot's A]`` (an FP8 weight: its Triton split-activation GEMM, with A's column tiles after the weight's,
``fp8_linear(..., lora_a=)``) gives the base output and every slot's shrink, and the expand reads each token's own
slot's columns (:data:`~loraplex.kernels.lora_expand.LORA_EXPAND_SLOT_ROWS`): one launch per linear instead of two,
for the bytes of every slot's A whatever the batch uses. :func:`fold_shrink_pays` and :data:`FOLD_MAX_TOKENS` are
when that measured faster.

The slot weights are rectangles (``[S, R, H]`` / ``[S, out_i, R]``, lower ranks zero-padded) or, with a
``page_table``, pages of a paged pool (``[P, PAGE, H]`` / ``[P, out_i, PAGE]``; S-LoRA's unified paging), where
each adapter's work and memory follow its own rank. The fused kernel takes rectangles only.
"""

from __future__ import annotations

import torch

from loraplex.kernels._lora_checks import check_same_pages
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import _launch_lora_expand, lora_expand_ref
from loraplex.kernels.lora_fused import _launch_fused_lora
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import lora_shrink_ref, shrink_partials
from loraplex.kernels.op import Op


_OP = "add_lora"

# The shrink folded into the base GEMM, measured on an H200 (benchmarks/diag_folded_shrink.py, Llama-2-7B layer,
# r=16, bf16, CUDA-graph replay, cold L2; RESULTS.md, session 17), LoRA us per layer over the base GEMMs, SGMV pair ->
# folded GEMM + expand launch: 32 slots (A rows 12.5% of each linear's base rows): 1 token 35.5 -> 28.4, 32 tokens x
# 8 adapters 65.0 -> 38.9, 32 x 32 95.0 -> 58.3, 128 x 32 108.1 -> 67.7; 64 slots (25%): 32 x 32 95.4 -> 64.2. A q/v
# pool of 256 slots (the qkv linear's A rows 100% of its base rows): 32 x 32 20.8 -> 34.2, 256 x 16 34.1 -> 58.2,
# 256 x 256 97.6 -> 94.8. With each expand then applied by the kernel after the linear (lora_delta), the expand
# launch is gone too: the 512-adapter scaling row (256 slots, q/v, ~246 adapters per decode step) took +1.36 ms per
# decode step over the base model folded against +2.75 unfolded (0.87 of base against 0.85). A pool of 100% whose
# batches use few of its slots pays the extra bytes for nothing (e.g. 100 MB of A per layer at 256 q/v slots, ~0.8 ms
# per Llama-2-7B step, where the SGMV pair of one adapter costs ~0.5 ms): lora_fold_shrink="off" serves such loads.
FOLD_MAX_LORA_ROWS_FRACTION = 1.0
"""A linear folds its shrink (``lora_fold_shrink="auto"``) when its pool's A rows (slices x pages x rank) are at
most this fraction of its base weight's rows."""
FOLD_MAX_TOKENS = 512
"""Steps of more tokens take the SGMV pair even in a folded linear (the folded GEMM's extra columns are computed
for every token and every slot). Measured: 256 tokens x 32 adapters 136.3 -> 87.1 us per layer, 512 x 32 145.9 ->
90.5 (32 slots); longer steps were not measured folded."""


FOLD_MAX_RANK = 16
"""The fold was measured with pages of at most 16 rank rows; ``auto`` leaves pools of larger pages unfolded."""


def fold_shrink_pays(base_rows: int, lora_rows: int, rank: int, *, fp8: bool = False) -> bool:
    """Whether folding a linear's shrink into its base GEMM measured faster: ``lora_rows <=``
    :data:`FOLD_MAX_LORA_ROWS_FRACTION` ``* base_rows`` and ``rank <=`` :data:`FOLD_MAX_RANK` (``base_rows``: the
    weight's output rows; ``lora_rows``: its pool's A rows over every slice, page and rank row; ``rank``: the
    pool's rank rows per page, max_lora_rank in a pool of one page per adapter). ``fp8``: an e4m3 weight, whose
    rows hold half the bytes of the 16-bit A rows: the rule is applied to bytes, ``2 * lora_rows`` (measured at 32
    slots of r=16 on every module, 25% of the bytes: RESULTS.md session 28; larger pools by this extrapolation)."""
    return (2 if fp8 else 1) * lora_rows <= FOLD_MAX_LORA_ROWS_FRACTION * base_rows and rank <= FOLD_MAX_RANK


def _launch_add_lora(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    split_k: int | None = None,
    shrink_blocks: tuple[int, ...] | None = None,
    expand_blocks: tuple[int, ...] | None = None,
    fused: bool = False,
) -> None:
    """Triton launch of :func:`add_lora_ref`: split-K shrink partials summed by the expand as it loads
    them, or the fused kernel with ``fused=True`` (benchmarks; slower at every decode size measured).

    ``split_k``, ``shrink_blocks`` ``(BLOCK_M, BLOCK_K[, num_warps[, num_stages]])``, ``expand_blocks``
    ``(BLOCK_M, BLOCK_N, N_ITERS[, num_warps[, num_stages]])``: launch overrides of the two-kernel path (benchmarks);
    with ``fused=True`` they raise ``KernelArgumentError``, and so does a ``page_table`` (the fused kernel is
    benchmark-only and takes rectangles only).
    """
    two_kernel_overrides = (split_k, shrink_blocks, expand_blocks) != (None, None, None)
    if fused and two_kernel_overrides:
        raise KernelArgumentError(f"{_OP}: split_k / shrink_blocks / expand_blocks apply to the two-kernel path "
                                  "(fused=False), not to the fused kernel")
    if fused and page_table is not None:
        raise KernelArgumentError(f"{_OP}: fused=True is a benchmark-only kernel, rectangles only: no page_table")
    if fused:
        _launch_fused_lora(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
        return
    if page_table is not None:
        check_same_pages(_OP, lora_a, lora_b)
    if not mapping.has_lora:
        return
    partials = shrink_partials(x, lora_a, mapping, ranks, split_k, shrink_blocks, page_table=page_table,
                               scaling=scaling)
    _launch_lora_expand(partials, lora_b, scaling, y, mapping, ranks=ranks, page_table=page_table,
                        blocks=expand_blocks)


def add_lora_ref(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> None:
    """One LoRA linear's batched delta, in place on ``y`` (plain torch: float32 matmuls per segment).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 layer input (last dim stride 1 for Triton).
        lora_a: ``n_slices`` contiguous tensors, dtype of ``x``: ``[S, R, H]`` rectangles, or with ``page_table``
            ``[P, PAGE, H]`` pages.
        lora_b: ``n_slices`` contiguous tensors, dtype of ``y``: ``[S, out_i, R]``, or with ``page_table``
            ``[P, out_i, PAGE]`` (the P and PAGE of ``lora_a``).
        scaling: ``n_slices`` ``[S]`` float32 tensors.
        y: ``[T, sum(out_i)]`` base-layer output (or a float32 delta buffer), updated in place.
        mapping: the step's :class:`LoRAMapping`.
        ranks: ``[S] int32`` upper bounds of each slot's rank; optional for rectangles, required with pages.
        page_table: optional ``[S, max_pages] int32``: slot s's rank row r < ranks[s] is row ``r % PAGE`` of page
            ``page_table[s, r // PAGE]`` in every A and B slice (see
            :func:`~loraplex.kernels.lora_shrink.lora_shrink_ref`).

    Raises:
        KernelArgumentError: as :func:`~loraplex.kernels.lora_shrink.lora_shrink_ref` and
            :func:`~loraplex.kernels.lora_expand.lora_expand_ref`; with pages also A and B of different
            (P, PAGE); in the Triton launcher ``fused=True`` with a ``page_table``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    if page_table is not None:
        check_same_pages(_OP, lora_a, lora_b)
    v = lora_shrink_ref(x, lora_a, mapping, ranks=ranks, page_table=page_table)
    lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks, page_table=page_table)


ADD_LORA = Op(
    name=_OP,
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T, s = slot[t]; none for s == -1 "
    "or scaling_i[s] == 0; "
    "with pages A_i[s] / B_i[s] = rank rows r < ranks[s] of pages page_table[s] (page_table[s, r // PAGE], "
    "row r % PAGE)",
    reference=add_lora_ref,
    triton=_launch_add_lora,
)
