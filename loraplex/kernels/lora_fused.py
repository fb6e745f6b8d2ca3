"""Fused LoRA shrink+expand for decode-sized batches: one launch per LoRA'd (fused) linear.

Semantics: :data:`FUSED_LORA` (the same as :data:`~loraplex.kernels.lora_linear.ADD_LORA`).

At decode the two-kernel SGMV pair (shrink, then expand) is bound by launch
latency and by the dependent loads of each kernel, not by bytes (benchmarks/RESULTS.md:
~8 µs per LoRA linear at 1 token). Here each program does one token tile's whole
``x · Aᵀ · Bᵀ`` for its slot: it reduces ``x[tile] @ A_i[s].T`` over all of H into a
``[BLOCK_M, R]`` float32 tile held in registers, rounds it to B's dtype (as PEFT,
whose ``lora_B`` runs on ``lora_A``'s output in the weights' dtype), and multiplies it
by ``BLOCK_N * N_ITERS`` columns of ``B_i[s]``. Grid = ((segment, token tile) work item,
slice x column block); the column blocks of one (item, slice) each redo the small
shrink (re-reading A, mostly from L2) so that there are enough programs to fill the
device. All slices that share ``x`` (q/k/v, gate/up) run in this one launch.

Not the model's path: on an H200 it measured 2.2-3.6x slower than the two-kernel SGMV pair up to
128 tokens (benchmarks/RESULTS.md, session 7), so :data:`~loraplex.kernels.lora_linear.ADD_LORA`
launches it only with ``fused=True`` (benchmarks). Rectangles only (``[S, R, H]`` / ``[S, out_i, R]``): it has no
paged form, and ``ADD_LORA`` refuses ``fused=True`` with a ``page_table``.
"""

from __future__ import annotations

import torch

from loraplex.kernels._checks import check_last_dim_contiguous
from loraplex.kernels._triton import (
    cdiv,
    dot_dtype,
    dot_precision,
    int32_table,
    next_pow2,
    num_sms,
    pdl_args,
    pdl_wait,
    pointer_table,
    require_triton,
    tl,
    tl_dtype,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import DECODE_BLOCK_M, lora_expand_ref
from loraplex.kernels.lora_expand import _check_args as _check_expand_args
from loraplex.kernels.lora_mapping import LoRAMapping, max_tiles
from loraplex.kernels.lora_shrink import _check_args as _check_shrink_args
from loraplex.kernels.lora_shrink import lora_shrink_ref
from loraplex.kernels.op import Op

_OP = "fused_lora"
# Launch shapes on CUDA, chosen by reasoning for H100/H200 (no tuning run yet; benchmarks/bench_lora_kernels.py
# --sweep times the alternatives):
#
# | H (reduction) | BLOCK_M | BLOCK_K | BLOCK_N | warps | stages | programs aimed at |
# |---|---|---|---|---|---|---|
# | <= 4096       | 16      | 256     | 64      | 4     | 3      | 4 per SM          |
# | > 4096        | 16      | 512     | 64      | 4     | 3      | 4 per SM          |
# (BLOCK_K shrinks for ranks above 32 so an A tile stays at 16K elements: 128 at r=128, 64 at r=256.)
#
# BLOCK_M 16 is the smallest tensor-core tile (decode segments hold 1-2 tokens); BLOCK_K 256 is vLLM's
# shrink default, doubled for long reductions (down_proj, H = 11008) because the fused kernel cannot
# split K: each program walks all of H, so fewer, larger loads shorten its serial chain; 3 stages keep
# 2 tile loads in flight at ~32 KB of shared memory per stage at most. At decode the kernel is latency-
# bound, so columns are split over programs until ~4 per SM run (the redundant shrinks read A from L2).
_PROGRAMS_PER_SM = 4
_NUM_STAGES = 3


@triton.jit(do_not_specialize=["num_tiles", "n_col_blocks"])
def _fused_lora_kernel(
    x_ptr,
    a_ptrs,
    b_ptrs,
    scaling_ptrs,
    slice_widths_ptr,
    slice_offsets_ptr,
    y_ptr,
    tiles_ptr,
    num_tiles,
    sorted_token_ids_ptr,
    segment_starts_ptr,
    segment_lens_ptr,
    segment_slots_ptr,
    ranks_ptr,
    hidden_size,
    max_rank,
    n_col_blocks,
    stride_xt,
    stride_yt,
    HAS_RANKS: tl.constexpr,
    B_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    seg = tl.load(tiles_ptr + tl.program_id(0))
    m_tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    slice_id = tl.program_id(1) // n_col_blocks
    n_first = (tl.program_id(1) % n_col_blocks) * (BLOCK_N * N_ITERS)
    width = tl.load(slice_widths_ptr + slice_id)
    seg_len = tl.load(segment_lens_ptr + seg)
    if (m_tile * BLOCK_M >= seg_len) | (n_first >= width):
        return
    slot = tl.load(segment_slots_ptr + seg).to(tl.int64)
    rank = max_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    seg_start = tl.load(segment_starts_ptr + seg)
    tok = tl.load(sorted_token_ids_ptr + seg_start + rows, mask=row_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank

    # shrink: v = x[tok] @ A_i[slot].T over all of H; A_i is a contiguous [S, R, H] tensor.
    a_base = tl.load(a_ptrs + slice_id).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_row = a_base + slot * max_rank * hidden_size + r.to(tl.int64) * hidden_size
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden_size
        x = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_row[:, None] + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), input_precision=PRECISION)
    v = acc.to(B_DTYPE).to(DOT_DTYPE)

    # expand: y[tok, off + cols] += scale * v @ B_i[slot][cols].T; B_i is a contiguous [S, width, R] tensor.
    y_dtype = y_ptr.dtype.element_ty
    b_base = tl.load(b_ptrs + slice_id).to(tl.pointer_type(B_DTYPE))
    scale_ptr = tl.load(scaling_ptrs + slice_id).to(tl.pointer_type(tl.float32))
    scale = tl.load(scale_ptr + slot)
    offset = tl.load(slice_offsets_ptr + slice_id)
    for it in tl.static_range(N_ITERS):
        cols = n_first + it * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < width
        b = tl.load(
            b_base + slot * width * max_rank + cols[:, None] * max_rank + r[None, :],
            mask=col_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        delta = tl.dot(v, tl.trans(b.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        y_ptrs = y_ptr + tok[:, None] * stride_yt + offset + cols[None, :]
        y_mask = row_mask[:, None] & col_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_dtype), mask=y_mask)


def _check_args(x, lora_a, lora_b, scaling, y, mapping, ranks) -> None:
    _check_shrink_args(x, lora_a, mapping, ranks)
    if not isinstance(lora_b, (list, tuple)) or len(lora_b) != len(lora_a):
        raise KernelArgumentError(f"{_OP}: lora_b must be a list of {len(lora_a)} tensors like lora_a")
    # the expand's checks want its v: a zero-memory stand-in of v's shape
    v_like = torch.empty((), dtype=torch.float32, device=y.device).expand(len(lora_a), x.shape[0], lora_a[0].shape[1])
    _check_expand_args(v_like, lora_b, scaling, y, mapping, ranks)


def fused_launch_shape(
    mapping: LoRAMapping, widths: list[int], device: torch.device, block_m: int, block_n: int
) -> tuple[int, int]:
    """(N_ITERS, column blocks): the fewest columns per program that give about
    ``_PROGRAMS_PER_SM`` programs per SM (N_ITERS a power of two)."""
    rows = max_tiles(mapping.num_tokens, mapping.num_slots, block_m) * len(widths)
    col_tiles = cdiv(max(widths), block_n)
    wanted = min(col_tiles, max(1, cdiv(_PROGRAMS_PER_SM * num_sms(device), rows)))
    n_iters = next_pow2(cdiv(col_tiles, wanted))
    return n_iters, cdiv(max(widths), block_n * n_iters)


# Elements of one A tile ([BLOCK_R, BLOCK_K]) at most: high ranks (up to 256) take shorter K tiles so
# that the pipelined tiles stay within shared memory.
_MAX_A_TILE = 16384


def _block_sizes(hidden_size: int, max_rank: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_N) from the table above on CUDA, BLOCK_K capped so that
    ``BLOCK_R * BLOCK_K <= 16384``; small under the CPU interpreter."""
    if device.type != "cuda":
        return 16, 32, 16
    block_k = 256 if hidden_size <= 4096 else 512
    return DECODE_BLOCK_M, min(block_k, _MAX_A_TILE // max(16, next_pow2(max_rank))), 64


def _launch_fused_lora(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    blocks: tuple[int, int, int, int] | None = None,
    num_warps: int = 4,
    num_stages: int = _NUM_STAGES,
) -> None:
    """Triton launch of :func:`fused_lora_ref` (one kernel).

    ``blocks``: (BLOCK_M, BLOCK_K, BLOCK_N, N_ITERS) override; ``num_warps`` / ``num_stages``:
    Triton launch options (benchmarks sweep them). Default: :func:`_block_sizes` and
    :func:`fused_launch_shape`.
    """
    require_triton(_OP)
    _check_args(x, lora_a, lora_b, scaling, y, mapping, ranks)
    check_last_dim_contiguous(_OP, "x", x)
    check_last_dim_contiguous(_OP, "y", y)
    max_rank = lora_a[0].shape[1]
    if not mapping.has_lora or max_rank == 0:
        return
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    if blocks is None:
        block_m, block_k, block_n = _block_sizes(x.shape[1], max_rank, x.device)
        n_iters, n_col_blocks = fused_launch_shape(mapping, widths, x.device, block_m, block_n)
    else:
        block_m, block_k, block_n, n_iters = blocks
        n_col_blocks = cdiv(max(widths), block_n * n_iters)
    tiles = mapping.tiles(block_m)
    _fused_lora_kernel[(tiles.shape[1], len(lora_a) * n_col_blocks)](
        x,
        pointer_table(lora_a),
        pointer_table(lora_b),
        pointer_table(scaling),
        int32_table(widths, y.device),
        int32_table(offsets, y.device),
        y,
        tiles,
        tiles.shape[1],
        mapping.sorted_token_ids,
        mapping.segment_starts,
        mapping.segment_lens,
        mapping.segment_slots,
        ranks if ranks is not None else mapping.segment_slots,
        x.shape[1],
        max_rank,
        n_col_blocks,
        x.stride(0),
        y.stride(0),
        HAS_RANKS=ranks is not None,
        B_DTYPE=tl_dtype(lora_b[0].dtype),
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        BLOCK_N=block_n,
        N_ITERS=n_iters,
        BLOCK_R=max(16, next_pow2(max_rank)),
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
        PRECISION=dot_precision(x.dtype, x.device),
        num_warps=num_warps,
        num_stages=num_stages, **pdl_args(x.device, _OP),
    )


def fused_lora_ref(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> None:
    """One LoRA linear's batched delta, in place on ``y``: the shrink rounded to B's dtype, then the expand
    (plain torch, float32 matmuls per segment).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 layer input (last dim stride 1 for Triton).
        lora_a: ``n_slices`` contiguous ``[S, R, H]`` tensors, dtype of ``x``.
        lora_b: ``n_slices`` contiguous ``[S, out_i, R]`` tensors, dtype of ``y`` (or any float dtype when
            ``y`` is float32).
        scaling: ``n_slices`` ``[S]`` float32 tensors.
        y: ``[T, sum(out_i)]`` base-layer output (or a float32 delta buffer), updated in place
            (last dim stride 1 for Triton).
        mapping: the step's :class:`LoRAMapping` (``num_tokens == T``, ``num_slots <= S``).
        ranks: optional ``[S] int32`` upper bounds of each slot's rank.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, slice counts that differ, widths not summing
            to ``y.shape[1]``, or a mapping with more slots than the weights.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, lora_a, lora_b, scaling, y, mapping, ranks)
    v = lora_shrink_ref(x, lora_a, mapping, ranks=ranks)
    v = v.to(lora_b[0].dtype).float()
    lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks)


FUSED_LORA = Op(
    name=_OP,
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * round_B(x[t] @ A_i[s].T) @ B_i[s].T, s = slot[t]; "
    "none for s == -1 (one launch; round_B = rounding to B's dtype)",
    reference=fused_lora_ref,
    triton=_launch_fused_lora,
)
