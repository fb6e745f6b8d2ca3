"""LoRA shrink (SGMV, Punica: Chen et al. 2023): project tokens onto their adapter's LoRA A.

Semantics: :data:`LORA_SHRINK` (``v`` in float32).

Several slices (e.g. q/k/v or gate/up, all reading the same ``x``) run in one
launch. Grid = ((segment, token tile) work item, slice x split-K chunk): the tokens of one
segment share every load of the adapter's A tile. Adapters of lower rank are
zero-padded to R; an optional ``ranks [S]`` lets the kernel skip padded rows.
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
    next_pow2,
    num_sms,
    pointer_table,
    require_triton,
    tl,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import DECODE_BLOCK_M, DECODE_MAX_TOKENS
from loraplex.kernels.lora_mapping import LoRAMapping, max_tiles
from loraplex.kernels.op import Op

_OP = "lora_shrink"
_MAX_SPLIT_K = 16
_MAX_PARTIAL_SPLIT_K = 32
# On CUDA the H reduction is split into chunks of this many elements (see shrink_partials):
# many short programs instead of a few long serial loops. Tuned on an H200 with 256-element K
# tiles (benchmarks/bench_lora_kernels.py --sweep-sgmv, RESULTS.md session 8: one Llama-2-7B
# layer at 32 adapters, 1 token 48.1 -> 42.0 us with 256 instead of 512, 32 tokens best at 512,
# 512 tokens best at 1024).
SHRINK_K_PER_SPLIT = 256
# Past DECODE_MAX_TOKENS the split-K partials ([SPLIT, n_slices, T, R] float32, read again by every
# expand column tile) are kept under this many bytes: a long prompt chunk with a high rank already
# fills the device and would only move more bytes (measured up to 512 tokens at r=16 only).
PROMPT_PARTIALS_MAX_BYTES = 32 << 20


def shrink_k_per_split(num_tokens: int) -> int:
    """H elements per shrink program on CUDA: 256 up to 8 tokens, 512 up to 256, else 1024."""
    if num_tokens <= 8:
        return SHRINK_K_PER_SPLIT
    return 2 * SHRINK_K_PER_SPLIT if num_tokens <= DECODE_MAX_TOKENS else 4 * SHRINK_K_PER_SPLIT


# Per-step ints are not specialised (no recompile when a count becomes 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_tiles", "split_k"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptrs,
    out_ptr,
    tiles_ptr,
    num_tiles,
    sorted_token_ids_ptr,
    segment_starts_ptr,
    segment_lens_ptr,
    segment_slots_ptr,
    ranks_ptr,
    hidden_size,
    max_rank,
    k_per_split,
    stride_xt,
    stride_a_slot,
    stride_a_rank,
    stride_o_split,
    stride_o_slice,
    stride_ot,
    split_k,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seg = tl.load(tiles_ptr + tl.program_id(0))
    m_tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    slice_id = tl.program_id(1) // split_k
    k_split = tl.program_id(1) % split_k
    seg_len = tl.load(segment_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
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
    a_base = tl.load(a_ptrs + slice_id).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_row = a_base + slot * stride_a_slot + r * stride_a_rank

    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_start = k_split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_row[:, None] + k[None, :], mask=(r[:, None] < rank) & k_mask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), input_precision=PRECISION)

    o_ptrs = out_ptr + k_split * stride_o_split + slice_id * stride_o_slice + tok[:, None] * stride_ot + r[None, :]
    tl.store(o_ptrs, acc, mask=row_mask[:, None] & (r[None, :] < max_rank))


def _check_args(x: torch.Tensor, lora_a: list[torch.Tensor], mapping: LoRAMapping, ranks: torch.Tensor | None) -> None:
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_shape(_OP, "x", x, (None, None))
    check_weight_list(_OP, "lora_a", lora_a, x, x.shape[1])
    check_mapping(_OP, mapping, x.shape[0], lora_a[0].shape[0], x.device)
    check_ranks(_OP, ranks, lora_a[0].shape[0], x.device)
    if len({a.shape[1] for a in lora_a}) != 1:
        raise KernelArgumentError(f"{_OP}: lora_a ranks differ: {[a.shape[1] for a in lora_a]}; pad them to one R")


def _block_sizes(mapping: LoRAMapping, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): GPU-sized on CUDA, small under the CPU interpreter."""
    if device.type != "cuda":
        return 16, 32
    if mapping.num_tokens <= DECODE_MAX_TOKENS:
        return DECODE_BLOCK_M, 256
    return 64, 256


# Bytes of one A tile ([BLOCK_R, BLOCK_K]) at most: ranks up to 256 (and fp32) take shorter K tiles so
# that the pipelined x and A tiles fit in shared memory (sm_90: 227 KiB per block).
_MAX_A_TILE_BYTES = 32768


def cap_block_k(block_k: int, max_rank: int, itemsize: int) -> int:
    """``block_k`` shortened (a power of two, >= 16) until ``BLOCK_R * BLOCK_K * itemsize <= 32 KiB``."""
    block_r = max(16, next_pow2(max_rank))
    return max(16, min(block_k, _MAX_A_TILE_BYTES // (block_r * itemsize)))


def choose_split_k(num_programs: int, hidden_size: int, block_k: int, device: torch.device) -> int:
    """Split the H reduction when segments x tiles x slices cannot fill the device (decode batches)."""
    sms = num_sms(device)
    if 2 * num_programs >= sms:  # half the SMs busy: splitting costs two extra kernels (zero + sum)
        return 1
    return max(1, min(cdiv(2 * sms, num_programs), cdiv(hidden_size, 4 * block_k), _MAX_SPLIT_K))


def _launch_lora_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`lora_shrink_ref`; returns ``out``, a new zeroed ``[n_slices, T, R] fp32`` by default.

    Only rows of LoRA tokens are written: with ``split_k == 1`` rows of slot -1
    tokens in a given ``out`` are left untouched; with ``split_k > 1`` partial
    sums go to a zeroed scratch buffer that is summed (in a fixed order, so
    results are deterministic) into every row of ``out``. ``split_k``: 1..16,
    default by batch and device size.
    """
    require_triton(_OP)
    _check_args(x, lora_a, mapping, ranks)
    num_tokens, hidden_size = x.shape
    max_rank = lora_a[0].shape[1]
    if out is None:
        out = torch.zeros((len(lora_a), num_tokens, max_rank), dtype=torch.float32, device=x.device)
    check_shape(_OP, "out", out, (len(lora_a), num_tokens, max_rank))
    check_dtype(_OP, "out", out, (torch.float32,))
    check_device(_OP, "out", out, x.device)
    check_last_dim_contiguous(_OP, "x", x)
    if not out.is_contiguous():
        raise KernelArgumentError(f"{_OP}: out must be contiguous, got stride()={out.stride()}")
    if split_k is not None and not 1 <= split_k <= _MAX_SPLIT_K:
        raise KernelArgumentError(f"{_OP}: split_k={split_k}, expected 1..{_MAX_SPLIT_K}")
    if not mapping.has_lora or max_rank == 0:
        return out
    block_m, block_k = _block_sizes(mapping, x.device)
    block_k = cap_block_k(block_k, max_rank, x.element_size())
    programs = max_tiles(mapping.num_tokens, mapping.num_slots, block_m) * len(lora_a)
    split = split_k or choose_split_k(programs, hidden_size, block_k, x.device)
    k_per_split = cdiv(cdiv(hidden_size, split), block_k) * block_k
    split = cdiv(hidden_size, k_per_split)
    target = out if split == 1 else torch.zeros((split, *out.shape), dtype=torch.float32, device=x.device)
    _run_kernel(x, lora_a, mapping, target, ranks, k_per_split, (block_m, block_k))
    if split > 1:
        torch.sum(target, dim=0, out=out)
    return out


def _run_kernel(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    target: torch.Tensor,
    ranks: torch.Tensor | None,
    k_per_split: int,
    blocks: tuple[int, int],
) -> None:
    """Launch over ``target`` = ``[n_slices, T, R]`` (one split) or ``[SPLIT, n_slices, T, R]`` fp32."""
    block_m, block_k = blocks
    split = target.shape[0] if target.dim() == 4 else 1
    tiles = mapping.tiles(block_m)
    _lora_shrink_kernel[(tiles.shape[1], len(lora_a) * split)](
        x,
        pointer_table(lora_a),
        target,
        tiles,
        tiles.shape[1],
        mapping.sorted_token_ids,
        mapping.segment_starts,
        mapping.segment_lens,
        mapping.segment_slots,
        ranks if ranks is not None else mapping.segment_slots,
        x.shape[1],
        lora_a[0].shape[1],
        k_per_split,
        x.stride(0),
        lora_a[0].stride(0),
        lora_a[0].stride(1),
        target.stride(0) if split > 1 else 0,
        target.stride(-3),
        target.stride(-2),
        split,
        HAS_RANKS=ranks is not None,
        BLOCK_M=block_m,
        BLOCK_R=max(16, next_pow2(lora_a[0].shape[1])),
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
        PRECISION=dot_precision(x.dtype, x.device),
        num_warps=4,
    )


def partial_split_k(mapping: LoRAMapping, hidden_size: int, n_slices: int, device: torch.device,
                    max_rank: int) -> int:
    """SPLIT for :func:`shrink_partials`: on CUDA, H in :func:`shrink_k_per_split` chunks (past 256 tokens no
    more splits than keep the partials under ``PROMPT_PARTIALS_MAX_BYTES``); elsewhere as
    :func:`choose_split_k` (1 once segments x tiles x slices fill the device)."""
    block_m, block_k = _block_sizes(mapping, device)
    if device.type == "cuda":
        split = min(cdiv(hidden_size, shrink_k_per_split(mapping.num_tokens)), _MAX_PARTIAL_SPLIT_K)
        if mapping.num_tokens > DECODE_MAX_TOKENS:
            per_split = n_slices * mapping.num_tokens * max(1, max_rank) * 4
            split = max(1, min(split, PROMPT_PARTIALS_MAX_BYTES // per_split))
        return split
    programs = max_tiles(mapping.num_tokens, mapping.num_slots, block_m) * n_slices
    return choose_split_k(programs, hidden_size, block_k, device)


def shrink_partials(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    ranks: torch.Tensor | None = None,
    split_k: int | None = None,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Split-K shrink without the reduction: ``p[k, i, t] = x[t, Hk] @ A_i[slot[t]][:, Hk].T``.

    ``sum_k p[k]`` is :data:`LORA_SHRINK`'s ``v`` on rows of LoRA tokens; the
    expand kernel forms that sum while loading (so there is no zero-fill and no
    sum kernel). Rows of slot -1 tokens are left unwritten (uninitialised).

    Args:
        x, lora_a, mapping, ranks: as :func:`lora_shrink_ref`.
        split_k: number of H chunks (``1..32``); default :func:`partial_split_k`.
        blocks: (BLOCK_M, BLOCK_K) override (benchmarks sweep it).

    Returns:
        ``[SPLIT, n_slices, T, R]`` float32 (SPLIT may be smaller than asked when H is small).

    Raises:
        KernelArgumentError: as :func:`lora_shrink_ref`, or ``split_k`` out of range.
        TritonUnavailableError: triton is not installed.
    """
    require_triton(_OP)
    _check_args(x, lora_a, mapping, ranks)
    check_last_dim_contiguous(_OP, "x", x)
    num_tokens, hidden_size = x.shape
    split = split_k or partial_split_k(mapping, hidden_size, len(lora_a), x.device, lora_a[0].shape[1])
    if not 1 <= split <= _MAX_PARTIAL_SPLIT_K:
        raise KernelArgumentError(f"{_OP}: split_k={split}, expected 1..{_MAX_PARTIAL_SPLIT_K}")
    block_m, block_k = blocks or _block_sizes(mapping, x.device)
    if blocks is None:
        block_k = cap_block_k(block_k, lora_a[0].shape[1], x.element_size())
    k_per_split = cdiv(cdiv(hidden_size, split), block_k) * block_k
    split = cdiv(hidden_size, k_per_split)
    out = torch.empty((split, len(lora_a), num_tokens, lora_a[0].shape[1]), dtype=torch.float32, device=x.device)
    if mapping.has_lora and lora_a[0].shape[1] > 0:
        _run_kernel(x, lora_a, mapping, out, ranks, k_per_split, (block_m, block_k))
    return out


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGMV shrink for several LoRA A slices (plain torch: a float32 matmul per segment, not per token).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 activations (last dim stride 1 for Triton).
        lora_a: list of ``n_slices`` contiguous ``[S, R, H]`` tensors, dtype of ``x``
            (lower-rank adapters zero-padded to R).
        mapping: :class:`LoRAMapping` of the step (``num_tokens == T``).
        ranks: optional ``[S] int32``; ``ranks[s]`` >= the true rank of every slice of slot s.
            Rows r >= ranks[s] are treated as zero and not read.

    Returns:
        ``v`` ``[n_slices, T, R]`` float32.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, or a slot >= S.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, lora_a, mapping, ranks)
    out = torch.zeros((len(lora_a), x.shape[0], lora_a[0].shape[1]), dtype=torch.float32, device=x.device)
    rank_host = ranks.tolist() if ranks is not None else None
    for slot, start, length in mapping.segments_host():
        tokens = mapping.sorted_token_ids[start : start + length].long()
        xs = x[tokens].float()
        for i, a in enumerate(lora_a):
            weight = a[slot].to(torch.float32, copy=True)
            if rank_host is not None:
                weight[rank_host[slot] :] = 0.0
            out[i, tokens] = xs @ weight.T
    return out


LORA_SHRINK = Op(
    name=_OP,
    semantics="v[i, t] = x[t] @ A_i[slot[t]].T, and v[i, t] = 0 where slot[t] == -1",
    reference=lora_shrink_ref,
    triton=_launch_lora_shrink,
)
