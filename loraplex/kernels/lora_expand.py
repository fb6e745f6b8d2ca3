"""LoRA expand (SGMV, Punica: Chen et al. 2023): add each token's scaled ``v @ B.T`` into its output slice.

Semantics: :data:`LORA_EXPAND`.

Slices may have different widths (fused q/k/v with GQA, gate/up) and all run
in one launch; ``off_i = out_0 + ... + out_{i-1}``. Grid = ((segment, token
tile) work item, slice x output tiles): a segment's tokens share every load of the
adapter's B tile. The sum is formed in float32 and rounded once into ``y``;
on tensor cores ``v`` is rounded to B's dtype first (as PEFT computes in it).
"""

from __future__ import annotations

import torch

from loraplex.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
)
from loraplex.kernels._lora_checks import check_mapping, check_ranks, check_weight_list
from loraplex.kernels._triton import (
    cdiv,
    dot_dtype,
    dot_precision,
    int32_table,
    next_pow2,
    pointer_table,
    require_triton,
    tl_dtype,
    tl,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.op import Op

_OP = "lora_expand"
# Batches of at most this many tokens use the shrink's decode launch shapes (lora_shrink._block_sizes).
DECODE_MAX_TOKENS = 256
DECODE_BLOCK_M = 16  # token rows per program: the expand at every size, the shrink up to DECODE_MAX_TOKENS


# Per-step ints are not specialised (no recompile when a count becomes 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_tiles", "split_k"])
def _lora_expand_kernel(
    v_ptr,
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
    max_rank,
    n_tiles,
    stride_v_split,
    stride_v_slice,
    stride_vt,
    stride_yt,
    split_k,
    HAS_RANKS: tl.constexpr,
    B_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.load(tiles_ptr + tl.program_id(0))
    m_tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    slice_id = tl.program_id(1) // n_tiles
    n_first = (tl.program_id(1) % n_tiles) * (BLOCK_N * N_ITERS)
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
    # v is the sum of split_k partial shrink results, added in a fixed order (deterministic).
    v_ptrs = v_ptr + slice_id * stride_v_slice + tok[:, None] * stride_vt + r[None, :]
    v_mask = row_mask[:, None] & r_mask[None, :]
    v = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for split in range(split_k):
        v += tl.load(v_ptrs + split * stride_v_split, mask=v_mask, other=0.0)
    y_dtype = y_ptr.dtype.element_ty
    v = v.to(B_DTYPE).to(DOT_DTYPE)
    b_base = tl.load(b_ptrs + slice_id).to(tl.pointer_type(B_DTYPE))
    scale_ptr = tl.load(scaling_ptrs + slice_id).to(tl.pointer_type(tl.float32))
    scale = tl.load(scale_ptr + slot)
    offset = tl.load(slice_offsets_ptr + slice_id)
    for it in tl.static_range(N_ITERS):
        cols = n_first + it * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < width
        # B_i is a contiguous [S, width, max_rank] tensor.
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


def _check_args(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    ranks: torch.Tensor | None,
) -> None:
    check_dtype(_OP, "y", y, FLOAT_DTYPES)
    check_shape(_OP, "y", y, (None, None))
    check_dtype(_OP, "v", v, (torch.float32,))
    # y is the layer output (B's dtype) or a float32 delta buffer.
    like = lora_b[0] if y.dtype == torch.float32 and isinstance(lora_b, (list, tuple)) and lora_b else y
    check_weight_list(_OP, "lora_b", lora_b, like, v.shape[-1] if v.dim() == 3 else None)
    check_device(_OP, "y", y, lora_b[0].device)
    num_slots = lora_b[0].shape[0]
    check_shape(_OP, "v", v, (len(lora_b), y.shape[0], lora_b[0].shape[2]))
    check_device(_OP, "v", v, y.device)
    if not isinstance(scaling, (list, tuple)) or len(scaling) != len(lora_b):
        raise KernelArgumentError(f"{_OP}: scaling must be a list of {len(lora_b)} tensors, got {scaling!r}")
    for i, s in enumerate(scaling):
        check_shape(_OP, f"scaling[{i}]", s, (num_slots,))
        check_dtype(_OP, f"scaling[{i}]", s, (torch.float32,))
        check_device(_OP, f"scaling[{i}]", s, y.device)
    widths = [b.shape[1] for b in lora_b]
    if sum(widths) != y.shape[1]:
        raise KernelArgumentError(f"{_OP}: y.shape[1]={y.shape[1]} != sum of lora_b widths {widths}")
    check_mapping(_OP, mapping, y.shape[0], num_slots, y.device)
    check_ranks(_OP, ranks, num_slots, y.device)


# Bytes of one B tile ([BLOCK_N, BLOCK_R]) at most for the 256-column tiles: ranks above 64 (32 in fp32)
# keep the 128-column tiles every rank used before those tiles were measured (session 8).
_MAX_B_TILE_BYTES = 32768


def cap_block_n(block_n: int, max_rank: int, itemsize: int) -> int:
    """``block_n`` (from :func:`_block_sizes`) lowered to 128 when a ``[block_n, BLOCK_R]`` B tile would exceed
    32 KiB."""
    block_r = max(16, next_pow2(max_rank))
    return block_n if block_n <= 128 or block_n * block_r * itemsize <= _MAX_B_TILE_BYTES else 128


def _block_sizes(mapping: LoRAMapping, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, N_ITERS): GPU-sized on CUDA, small under the CPU interpreter.

    16-row tiles at every size; one 128-column tile per program up to 8 tokens, one 256-column tile beyond
    (:func:`cap_block_n` lowers it for big ranks). ``N_ITERS`` > 1 (a program covering ``BLOCK_N * N_ITERS``
    columns, loading ``v`` once for them) is a benchmark override only.
    """
    if device.type != "cuda":
        return 16, 16, 2
    # Tuned on an H200 (benchmarks/bench_lora_kernels.py --sweep-sgmv, RESULTS.md session 8): one
    # 128-column tile per program for a handful of tokens, one 256-column tile beyond (32 tokens x 32
    # adapters: 112.6 -> 103.8 us per layer; 512 tokens: 16-row tiles instead of 64, 522 -> 305 us).
    if mapping.num_tokens <= 8:
        return DECODE_BLOCK_M, 128, 1
    return DECODE_BLOCK_M, 256, 1


def _launch_lora_expand(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    blocks: tuple[int, int, int] | None = None,
) -> None:
    """Triton launch of :func:`lora_expand_ref`; ``v`` may also be ``[SPLIT, n_slices, T, R]`` partial sums.

    Rows of ``v`` for tokens without an adapter are never read. ``blocks``:
    (BLOCK_M, BLOCK_N, N_ITERS) override (benchmarks sweep it).
    """
    require_triton(_OP)
    split = v.shape[0] if v.dim() == 4 else 1
    v3 = v[0] if v.dim() == 4 else v
    _check_args(v3, lora_b, scaling, y, mapping, ranks)
    check_last_dim_contiguous(_OP, "y", y)
    for i, s in enumerate(scaling):
        check_last_dim_contiguous(_OP, f"scaling[{i}]", s)
    if not v.is_contiguous():
        raise KernelArgumentError(f"{_OP}: v must be contiguous, got stride()={v.stride()}")
    max_rank = lora_b[0].shape[2]
    if not mapping.has_lora or max_rank == 0:
        return
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    block_m, block_n, n_iters = blocks or _block_sizes(mapping, y.device)
    if blocks is None:
        block_n = cap_block_n(block_n, max_rank, lora_b[0].element_size())
    n_tiles = cdiv(max(widths), block_n * n_iters)
    tiles = mapping.tiles(block_m)
    _lora_expand_kernel[(tiles.shape[1], len(lora_b) * n_tiles)](
        v,
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
        max_rank,
        n_tiles,
        v.stride(0) if split > 1 else 0,
        v3.stride(0),
        v3.stride(1),
        y.stride(0),
        split,
        HAS_RANKS=ranks is not None,
        B_DTYPE=tl_dtype(lora_b[0].dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        N_ITERS=n_iters,
        BLOCK_R=max(16, next_pow2(max_rank)),
        DOT_DTYPE=dot_dtype(lora_b[0].dtype, y.device),
        PRECISION=dot_precision(lora_b[0].dtype, y.device),
        num_warps=4,
    )


def lora_expand_ref(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> None:
    """SGMV expand for several LoRA B slices, in place on ``y`` (plain torch: a float32 matmul per segment and slice).

    Args:
        v: ``[n_slices, T, R]`` float32, contiguous (the output of :data:`~loraplex.kernels.lora_shrink.LORA_SHRINK`).
        lora_b: list of ``n_slices`` contiguous ``[S, out_i, R]`` tensors, dtype of ``y``.
        scaling: list of ``n_slices`` ``[S]`` float32 tensors (``alpha / r``; 0 for untargeted modules).
        y: ``[T, sum(out_i)]`` base-layer output (dtype of B), or a float32 delta buffer (last dim stride 1
            for Triton); updated in place.
        mapping: :class:`LoRAMapping` of the step (``num_tokens == T``).
        ranks: optional ``[S] int32``; ``ranks[s]`` >= the true rank of every slice of slot s.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, widths not summing to ``y.shape[1]``, or a slot >= S.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(v, lora_b, scaling, y, mapping, ranks)
    rank_host = ranks.tolist() if ranks is not None else None
    scaling_host = [s.tolist() for s in scaling]
    for slot, start, length in mapping.segments_host():
        tokens = mapping.sorted_token_ids[start : start + length].long()
        offset = 0
        for i, b in enumerate(lora_b):
            weight = b[slot].to(torch.float32, copy=True)  # [out_i, R]
            if rank_host is not None:
                weight[:, rank_host[slot] :] = 0.0
            width = weight.shape[0]
            delta = scaling_host[i][slot] * (v[i, tokens] @ weight.T)
            y[tokens, offset : offset + width] = (y[tokens, offset : offset + width].float() + delta).to(y.dtype)
            offset += width


LORA_EXPAND = Op(
    name=_OP,
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * v[i, t] @ B_i[s].T, s = slot[t]; nothing for s == -1",
    reference=lora_expand_ref,
    triton=_launch_lora_expand,
)
