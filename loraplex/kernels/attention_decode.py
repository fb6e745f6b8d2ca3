"""Paged decode attention: one query token per sequence (``max_query_len == 1``).

Semantics: :data:`~loraplex.kernels.attention.PAGED_ATTENTION` with ``p = seq_lens[b] - 1`` (with a sliding
window of W tokens, positions before ``seq_lens[b] - W`` are skipped).

Design (after vLLM's Triton decode attention and FlashDecoding, Dao et al. 2023
"Flash-Decoding for long-context inference"):

- One program per (sequence, KV head, split). All ``G`` query heads that share
  a KV head are processed together as a ``[G, D]`` tile, so each K/V block is
  read once per KV head (GQA).
- Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022)
  in float32 with base-2 exponentials.
- Split-K: when ``B * Hkv`` programs cannot fill the GPU, the context is cut
  into ``num_splits`` chunks; each program writes a normalised partial output
  and its log-sum-exp, and a reduce kernel merges them.
"""

from __future__ import annotations

import torch

from loraplex.kernels._attention_checks import check_attention_args, check_attention_layout, prepare_out
from loraplex.kernels._triton import cdiv, dot_dtype, dot_precision, next_pow2, num_sms, require_triton, tl, triton
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError

_OP = "paged_decode_attention"
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
# Smallest chunk of context worth a split of its own.
_MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    block_size,
    tokens_per_split,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + b)
    tok = tl.load(query_start_loc_ptr + b).to(tl.int64)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if SLIDING:  # positions before the window are skipped (a split wholly before it stays empty)
        start = tl.maximum(start, seq_len - window)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
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
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # An empty split (start >= seq_len) stores lse = -inf and a zero partial.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (b * num_q_heads + heads) * tl.num_programs(2) + split
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=q_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Merge split partials: out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max).
    b = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + b).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * tl.num_programs(1) + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _block_n(head_dim: int, device: torch.device) -> int:
    """KV positions per loop iteration: GPU-sized on CUDA, small under the CPU interpreter."""
    if device.type != "cuda":
        return 16
    return 64 if head_dim <= 128 else 32


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K factor: 1 when ``B * Hkv`` programs fill the device, else enough splits for ~2 waves.

    Each split keeps at least ``_MIN_TOKENS_PER_SPLIT`` positions of context.
    """
    sms = num_sms(device)
    if num_programs >= sms:
        return 1
    wanted = cdiv(2 * sms, num_programs)
    return max(1, min(wanted, cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`~loraplex.kernels.attention.paged_attention_ref` for ``meta.max_query_len == 1``.

    ``num_splits``: split-K factor (1..64); ``None`` picks one from the batch and GPU size.

    Raises:
        KernelArgumentError: as the reference, or ``meta.max_query_len != 1``.
        TritonUnavailableError: triton is not installed.
    """
    require_triton(_OP)
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    if meta.max_query_len != 1:
        raise KernelArgumentError(f"{_OP}: meta.max_query_len={meta.max_query_len}, the decode kernel needs 1")
    if num_splits is not None and not 1 <= num_splits <= _MAX_SPLITS:
        raise KernelArgumentError(f"{_OP}: num_splits={num_splits}, expected 1..{_MAX_SPLITS}")
    out = prepare_out(query, meta, out)
    check_attention_layout(_OP, query, key_cache, value_cache, out)
    num_seqs = meta.num_seqs
    if num_seqs == 0:
        return out
    _, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_n = _block_n(head_dim, query.device)
    splits = num_splits or choose_num_splits(num_seqs * num_kv_heads, meta.max_seq_len, query.device)
    tokens_per_split = cdiv(cdiv(meta.max_seq_len, splits), block_n) * block_n
    splits = cdiv(meta.max_seq_len, tokens_per_split)
    if splits > 1:
        part_out = torch.empty((num_seqs, num_q_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_seqs, num_q_heads, splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused by the kernel when SPLIT is False
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        part_out,
        part_lse,
        scale if softcap is not None else scale * _LOG2E,  # with a cap the kernel converts to base 2 after tanh
        key_cache.shape[1],
        tokens_per_split,
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
        BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        DOT_DTYPE=dot_dtype(query.dtype, query.device),
        PRECISION=dot_precision(query.dtype, query.device),
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        num_warps=4,
    )
    if splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_out,
            part_lse,
            meta.query_start_loc,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            BLOCK_S=next_pow2(splits),
            HEAD_DIM=head_dim,
            BLOCK_D=next_pow2(head_dim),
            num_warps=4 if head_dim >= 128 else 1,
        )
    return out
