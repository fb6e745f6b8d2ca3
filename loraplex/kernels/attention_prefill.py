"""Paged prefill / extend attention: many query tokens per sequence, causal, variable lengths.

Semantics: :data:`~loraplex.kernels.attention.PAGED_ATTENTION` (sliding window and soft-cap included) for the
sequences with ``q_len[b] > 1`` when ``skip_decode`` (a mixed batch whose 1-token rows the decode kernel
takes), else for every sequence.

Covers full prefill (no cached prefix), chunked prefill and prefix-cache hits
(a cached prefix of ``seq_lens[b] - q_len[b]`` positions). All K/V, including this step's,
are read from the paged cache, so ``reshape_and_cache`` must run first.

Design: FlashAttention-2 (Dao 2023) forward with online softmax in float32, the inner loop being
:func:`~loraplex.kernels.attention_common.attend_kv_range` (shared with the decode kernel). One program per
(query block, KV head): a query block is ``BLOCK_Q`` tokens of one sequence times the ``G`` query heads of the
KV head (``BLOCK_M = BLOCK_Q * G`` rows, rows ordered token-major), so K/V are read once per KV head (GQA).
Query blocks are numbered flatly over the batch (sequence b's start at ``query_start_loc[b] // BLOCK_Q + b``,
found by binary search), so the grid, ``T // BLOCK_Q + B`` blocks, depends only on the token and sequence
counts: a CUDA graph captured for T tokens serves any batch of at most T tokens. The KV loop stops at the
causal frontier of the block's last token and, with a window, starts at the window of its first.
"""

from __future__ import annotations

import torch

from loraplex.kernels._attention_checks import check_attention_args, check_attention_layout, prepare_out
from loraplex.kernels._triton import dot_dtype, dot_precision, next_pow2, pdl_args, pdl_wait, require_triton, tl, triton
from loraplex.kernels.attention_common import attend_kv_range
from loraplex.kernels.attention_metadata import AttentionMetadata

_OP = "paged_prefill_attention"
_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence b whose query blocks start at or before ``block_idx``: max b, qsl[b] // BLOCK_Q + b <= idx."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    num_seqs,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    block_idx = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_seq(query_start_loc_ptr, block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    q_block = block_idx - (q_start // BLOCK_Q + b)
    if q_block * BLOCK_Q >= q_len:  # past the sequence's last block (or an empty padding sequence)
        return
    if SKIP_DECODE:
        if q_len == 1:  # the decode kernel's row
            return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    i = q_block * BLOCK_Q + r // GROUP  # token index in the sequence's query
    heads = kvh * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (i < q_len)
    d = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    tok = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q_pos = ctx_len + i

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0)
    m_i, l_i, acc = attend_kv_range(
        q.to(DOT_DTYPE), q_pos, m_i, l_i, acc,
        k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh, block_tables_ptr + b * stride_bt,
        kv_start, kv_end, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, softcap, window,
        PAGE, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_DTYPE, PRECISION, True, True, SLIDING, SOFTCAP,
    )
    l_i = tl.where(l_i > 0, l_i, 1.0)  # padding rows may see no key at all (not stored)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tiles(group: int, head_dim: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages): 64-row tiles of ``64 // G`` tokens x ``G`` heads
    on CUDA (32 rows for head_dim > 128), 16-row tiles under the CPU interpreter."""
    if device.type != "cuda":
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif head_dim <= 128:
        block_m, block_n, warps, stages = 64, 64, 4, 2
    else:
        block_m, block_n, warps, stages = 32, 32, 4, 2
    block_m = max(block_m, next_pow2(group))
    return block_m // group, block_m, block_n, warps, stages


def launch_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    skip_decode: bool,
) -> None:
    """Launch the prefill kernel over every query block of the batch (``T // BLOCK_Q + B`` programs per KV
    head, T = ``query.shape[0]``); with ``skip_decode`` sequences with ``q_len == 1`` are left to the decode
    kernel. Arguments are checked by the caller."""
    _, num_q_heads, head_dim = query.shape
    page, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_q, block_m, block_n, num_warps, num_stages = prefill_tiles(group, head_dim, query.device)
    if block_n % page and page % block_n:
        block_n = page if page > block_n else block_n
    grid = (query.shape[0] // block_q + meta.num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        meta.num_seqs,
        scale if softcap is not None else scale * _LOG2E,  # with a cap the kernel converts to base 2 after tanh
        sliding_window or 0,
        softcap or 0.0,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_STAGES=num_stages,
        DOT_DTYPE=dot_dtype(query.dtype, query.device),
        PRECISION=dot_precision(query.dtype, query.device),
        SKIP_DECODE=skip_decode,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        num_warps=num_warps, **pdl_args(query.device, _OP),
    )


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`~loraplex.kernels.attention.paged_attention_ref` for any ``meta.max_query_len``
    (every sequence through prefill tiles; :data:`~loraplex.kernels.attention.PAGED_ATTENTION` sends 1-token
    rows to the decode kernel instead)."""
    require_triton(_OP)
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    out = prepare_out(query, meta, out)
    check_attention_layout(_OP, query, key_cache, value_cache, out)
    if meta.num_seqs:
        launch_prefill(query, key_cache, value_cache, meta, scale, out, sliding_window, softcap, skip_decode=False)
    return out
