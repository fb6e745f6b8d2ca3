"""Paged prefill / extend attention: many query tokens per sequence, causal, variable lengths.

Semantics: :data:`~loraplex.kernels.attention.PAGED_ATTENTION` (sliding window and soft-cap included).

Covers full prefill (no cached prefix), chunked prefill and prefix-cache hits
(a cached prefix of ``seq_lens[b] - q_len[b]`` positions), and mixed batches
where some sequences decode (``q_len == 1``). All K/V, including this step's,
are read from the paged cache, so ``reshape_and_cache`` must run first.

Design: FlashAttention-2 (Dao 2023) forward with online softmax in float32;
one program per (query tile of ``BLOCK_M`` tokens, sequence, query head); the
KV loop stops at the causal frontier of the tile and, with a window, starts at the
window's start for the tile's first query.
"""

from __future__ import annotations

import torch

from loraplex.kernels._attention_checks import check_attention_args, check_attention_layout, prepare_out
from loraplex.kernels._triton import cdiv, dot_dtype, dot_precision, next_pow2, require_triton, tl, triton
from loraplex.kernels.attention_metadata import AttentionMetadata

_OP = "paged_prefill_attention"
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    block_size,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    m_tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_mask = (rows[:, None] < q_len) & (d[None, :] < HEAD_DIM)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q_pos = ctx_len + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    kv_end = tl.minimum(seq_len, ctx_len + (m_tile + 1) * BLOCK_M)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len + m_tile * BLOCK_M - window + 1, 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < kv_end
        blk = tl.load(bt_row + pos // block_size, mask=p_mask, other=0).to(tl.int64)
        off = pos % block_size
        kv_mask = p_mask[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(
            k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(z) = 2 sigmoid(2z) - 1; then to base 2
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0) * 1.4426950408889634
        causal = p_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            causal = causal & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Without a window every row sees position 0 in the first tile, so m_new is finite from then on;
        # with one, a row may see no key of a tile before its window starts (m_new = -inf: p = alpha = 0).
        m_use = m_new
        if SLIDING:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    if SLIDING:  # padding rows past q_len may see no key at all (not stored)
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _block_sizes(head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): GPU-sized on CUDA, small under the CPU interpreter."""
    if device.type != "cuda":
        return 16, 16, 4
    if head_dim <= 128:
        return 64, 64, 4
    return 32, 32, 4


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
    """Triton launch of :func:`~loraplex.kernels.attention.paged_attention_ref` for any ``meta.max_query_len``."""
    require_triton(_OP)
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    out = prepare_out(query, meta, out)
    check_attention_layout(_OP, query, key_cache, value_cache, out)
    if meta.num_seqs == 0:
        return out
    _, num_q_heads, head_dim = query.shape
    group = num_q_heads // key_cache.shape[2]
    block_m, block_n, num_warps = _block_sizes(head_dim, query.device)
    grid = (cdiv(meta.max_query_len, block_m), meta.num_seqs, num_q_heads)
    _paged_prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        scale if softcap is not None else scale * _LOG2E,  # with a cap the kernel converts to base 2 after tanh
        key_cache.shape[1],
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
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(query.dtype, query.device),
        PRECISION=dot_precision(query.dtype, query.device),
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        num_warps=num_warps,
    )
    return out

