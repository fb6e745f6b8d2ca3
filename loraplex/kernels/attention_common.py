"""The paged K/V gather + online-softmax inner loop shared by the decode and prefill attention kernels.

Semantics of :func:`attend_kv_range`, for every row r of a query tile (row r is one (token, head) pair at
position ``q_pos[r]``) over the positions ``n`` in ``[start, end)`` that the row may see (all of them, or with
``CAUSAL`` those ``<= q_pos[r]``, and with ``SLIDING`` those ``> q_pos[r] - window``)::

    m'[r] = max(m[r], max_n s[r, n]),  s[r, n] = cap(scale * q[r] . K[n]) * log2(e)
    l'[r] = l[r] * 2^(m[r] - m'[r]) + sum_n 2^(s[r, n] - m'[r])
    acc'[r] = acc[r] * 2^(m[r] - m'[r]) + sum_n 2^(s[r, n] - m'[r]) * V[n]

(base-2 online softmax, Milakov & Gimelshein 2018 / FlashAttention, Dao et al. 2022), where position n of the
sequence lives at offset ``n % PAGE`` of physical block ``block_table_row[n // PAGE]`` of the paged caches
``[num_blocks, PAGE, Hkv, D]``. ``acc / l`` is then the attention output of the rows over that range.
"""

from __future__ import annotations

from loraplex.kernels._triton import tl, triton


@triton.jit
def attend_kv_range(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    bt_row,
    start,
    end,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    qk_scale,
    softcap,
    window,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold positions ``[start, end)`` into the running ``(m_i, l_i, acc)`` of the rows of ``q``.

    ``q``: ``[BLOCK_M, BLOCK_D]`` (zero in padding columns); ``q_pos``: ``[BLOCK_M]`` int32 (read only with
    ``CAUSAL``); ``k_base``/``v_base``: the caches offset to the KV head; ``bt_row``: the sequence's block
    table row. ``USE_DOT`` False (one-row tiles, MHA decode) uses FMA reductions instead of ``tl.dot``,
    which needs 16 rows. With ``CAUSAL`` or ``SLIDING`` a row may see no position of a tile; its maximum
    stays ``-inf`` and it gains nothing (no NaN).
    """
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_i, acc = attend_kv_tile(q, q_pos, m_i, l_i, acc, k_base, v_base, bt_row, n0, end, stride_kb, stride_ks,
                                       stride_vb, stride_vs, qk_scale, softcap, window, PAGE, HEAD_DIM, BLOCK_D,
                                       BLOCK_N, DOT_DTYPE, PRECISION, USE_DOT, CAUSAL, SLIDING, SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def attend_kv_tile(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    bt_row,
    n0,
    end,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    qk_scale,
    softcap,
    window,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One step of :func:`attend_kv_range`: the positions ``[n0, min(n0 + BLOCK_N, end))`` (the body of every
    software-pipelined K/V loop: the range's, and the decode kernel's over several heads)."""
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        d_mask = d < BLOCK_D  # all true; folded away
    else:
        d_mask = d < HEAD_DIM
    pos = n0 + tl.arange(0, BLOCK_N)
    p_mask = pos < end
    blk = tl.load(bt_row + pos // PAGE, mask=p_mask, other=0).to(tl.int64)
    off = (pos % PAGE).to(tl.int64)
    kv_mask = p_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
    if USE_DOT:
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
    else:  # one row: [1, D] * [N, D] summed over D, as a [1, N] row
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1)[None, :] * qk_scale
    if SOFTCAP:  # cap * tanh(s / cap), tanh(z) = 2 sigmoid(2z) - 1; then to base 2
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0) * 1.4426950408889634
    valid = p_mask[None, :]
    if CAUSAL:
        valid = valid & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            valid = valid & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if CAUSAL:  # a row that has seen nothing yet keeps m = -inf: use 0 so that 2^(-inf - 0) = 0, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    else:
        pv = tl.sum(tl.trans(p) * v.to(tl.float32), 0)[None, :]
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
