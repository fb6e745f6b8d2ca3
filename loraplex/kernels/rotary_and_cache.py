"""RoPE on q and k plus the paged-KV-cache write of k and v, in one launch (one program per token does both:
the ``rotary_embedding`` and ``reshape_and_cache`` launches of every layer become one).

Semantics: :data:`ROTARY_AND_CACHE`, where ``rope(x, p)`` is :data:`~loraplex.kernels.rotary.ROTARY_EMBEDDING`
per head (rotate_half style, the table row ``cache[p]``) and the cache write is
:data:`~loraplex.kernels.reshape_and_cache.RESHAPE_AND_CACHE`. It is exactly their composition
(:func:`rotary_embedding_ref` on q and a copy of k, then :func:`reshape_and_cache_ref`), rounding for rounding:
the kernel rotates with the rotary kernel's own :func:`~loraplex.kernels.rotary.rotate_heads`.

What it covers is what the two ops cover: every RoPE table :func:`~loraplex.kernels.rotary.compute_cos_sin_cache`
builds (default, linear, dynamic, yarn, llama3; the engine refuses partial rotary and has no GPT-J interleaved
style), GQA (any ``Hq``, ``Hkv``), and a KV cache in the activation dtype (fp16/bf16/fp32; there is no FP8 KV
cache). Per-head q/k RMSNorm (Qwen3, Gemma 3) runs before RoPE, as in HF: it stays a separate launch before
this one (the model passes the normed q/k).

Differences from the two launches: ``key`` and ``value`` are only read (the rotated k goes to the cache
alone: nothing else reads it), and q may be written to ``out`` instead of in place. Rows with slot -1
(padding) still get their q rotated; nothing of them is written to the cache.
"""

from __future__ import annotations

import torch

from loraplex.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
)
from loraplex.kernels._triton import next_pow2, pdl_args, pdl_wait, require_triton, tl, triton
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_delta import (CONSUMER_PAGES, LoRADelta, block_r, check_delta, delta_args, lora_delta_cols,
                                         lora_delta_pair, lora_delta_ref, paired, slot_pages, tile_columns)
from loraplex.kernels.op import Op
from loraplex.kernels.reshape_and_cache import check_slots_in_cache, reshape_and_cache_ref
from loraplex.kernels.rotary import (check_positions_in_table, load_cos_sin, rope_halves, rotary_embedding_ref,
                                     rotate_heads)

_OP = "rotary_and_cache"


@triton.jit
def _rotary_and_cache_kernel(
    positions_ptr,
    q_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qot,
    stride_kt,
    stride_vt,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_cs,
    block_size,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # One program per token: rotates its query heads into q_out, then (slot >= 0) its rotated key heads and
    # its value heads into the cache slot. Heads are D = 2 * HALF contiguous values inside a row.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, 2 * HALF, 2 * HALF, cos, sin, num_q_heads,
                 HALF, BLOCK_QH, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        rotate_heads(k_ptr + t * stride_kt, key_cache_ptr + blk * stride_kcb + off * stride_kcs, 2 * HALF, stride_kch,
                     cos, sin, num_kv_heads, HALF, BLOCK_KH, BLOCK_HALF)
        i = tl.arange(0, BLOCK_HALF)
        hk = tl.arange(0, BLOCK_KH)
        kv_mask = (hk[:, None] < num_kv_heads) & (i[None, :] < HALF)
        v_src = v_ptr + t * stride_vt + hk[:, None] * (2 * HALF) + i[None, :]
        vc = value_cache_ptr + blk * stride_vcb + off * stride_vcs + hk[:, None] * stride_vch + i[None, :]
        tl.store(vc, tl.load(v_src, mask=kv_mask), mask=kv_mask)
        tl.store(vc + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


# With a LoRA delta: heads per program (grid = tokens x head groups of q, then k, then v; fewer for high ranks).
_LORA_HEADS = 4


@triton.jit
def _heads_plus_delta(src, cols, mask, t, slots_ptr, table_ptr, ranks_ptr, d_v, d_svt, d_svp, d_b, d_width, d_col0,
                      d_scale, rank_rows, HALF: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr,
                      PAGES_AT_ONCE: tl.constexpr, PAIR: tl.constexpr):
    """Both halves of a ``[heads, HALF]`` tile of heads (``src + cols``, ``cols`` their columns in the slice) plus
    their LoRA delta, each rounded to the dtype (as the expand rounds its sum into y)."""
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    if PAIR:  # both halves' pages in one loop
        d1, d2 = lora_delta_pair(t, cols, mask, cols + HALF, mask, slots_ptr, table_ptr, ranks_ptr, d_v, d_svt, d_svp,
                                 d_b, d_width, d_col0, d_scale, d_v, d_svt, d_svp, d_b, d_width, d_col0, d_scale,
                                 rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, True)
    else:
        d1 = lora_delta_cols(t, cols, mask, slots_ptr, table_ptr, ranks_ptr, d_v, d_svt, d_svp, d_b, d_width, d_col0,
                             d_scale, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
        d2 = lora_delta_cols(t, cols + HALF, mask, slots_ptr, table_ptr, ranks_ptr, d_v, d_svt, d_svp, d_b, d_width,
                             d_col0, d_scale, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
    return (x1.to(tl.float32) + d1).to(x1.dtype), (x2.to(tl.float32) + d2).to(x2.dtype)


@triton.jit
def _rotary_and_cache_lora_kernel(
    positions_ptr, q_ptr, q_out_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, cos_sin_ptr,
    stride_qt, stride_qot, stride_kt, stride_vt, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
    stride_vch, stride_cs, block_size, num_q_heads, num_kv_heads,
    slots_ptr, table_ptr, ranks_ptr,
    qd_v, qd_svt, qd_svp, qd_b, qd_width, qd_col0, qd_scale,
    kd_v, kd_svt, kd_svp, kd_b, kd_width, kd_col0, kd_scale,
    vd_v, vd_svt, vd_svp, vd_b, vd_width, vd_col0, vd_scale, rank_rows,
    HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr, PAIR: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # Program (t, g): HEADS heads of token t's q (g < n_q), k (next n_kv groups) or v (last n_kv): their rows plus
    # the LoRA delta, then q rotated in place, k rotated into the cache slot, v copied into it.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    n_q = tl.cdiv(num_q_heads, HEADS)
    n_kv = tl.cdiv(num_kv_heads, HEADS)
    i = tl.arange(0, BLOCK_HALF)
    slot = tl.load(slot_mapping_ptr + t)
    blk = slot // block_size
    off = slot % block_size
    if g < n_q:
        h = g * HEADS + tl.arange(0, HEADS)
        mask = (h[:, None] < num_q_heads) & (i[None, :] < HALF)
        cols = h[:, None] * (2 * HALF) + i[None, :]
        x1, x2 = _heads_plus_delta(q_ptr + t * stride_qt + cols, cols, mask, t, slots_ptr, table_ptr, ranks_ptr, qd_v,
                                   qd_svt, qd_svp, qd_b, qd_width, qd_col0, qd_scale, rank_rows, HALF, BLOCK_R,
                                   SLOT_PAGES, PAGES_AT_ONCE, PAIR)
        cos, sin = load_cos_sin(cos_sin_ptr, tl.load(positions_ptr + t), stride_cs, q_ptr.dtype.element_ty, HALF,
                                BLOCK_HALF)
        o1, o2 = rope_halves(x1, x2, cos, sin)
        dst = q_out_ptr + t * stride_qot + cols
        tl.store(dst, o1, mask=mask)
        tl.store(dst + HALF, o2, mask=mask)
    elif slot >= 0:
        is_k = g < n_q + n_kv
        h = (g - n_q - tl.where(is_k, 0, n_kv)) * HEADS + tl.arange(0, HEADS)
        mask = (h[:, None] < num_kv_heads) & (i[None, :] < HALF)
        cols = h[:, None] * (2 * HALF) + i[None, :]
        if is_k:
            x1, x2 = _heads_plus_delta(k_ptr + t * stride_kt + cols, cols, mask, t, slots_ptr, table_ptr, ranks_ptr,
                                       kd_v, kd_svt, kd_svp, kd_b, kd_width, kd_col0, kd_scale, rank_rows, HALF,
                                       BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, PAIR)
            cos, sin = load_cos_sin(cos_sin_ptr, tl.load(positions_ptr + t), stride_cs, q_ptr.dtype.element_ty,
                                    HALF, BLOCK_HALF)
            x1, x2 = rope_halves(x1, x2, cos, sin)
            dst = key_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + i[None, :]
        else:
            x1, x2 = _heads_plus_delta(v_ptr + t * stride_vt + cols, cols, mask, t, slots_ptr, table_ptr, ranks_ptr,
                                       vd_v, vd_svt, vd_svp, vd_b, vd_width, vd_col0, vd_scale, rank_rows, HALF,
                                       BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, PAIR)
            dst = value_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + i[None, :]
        tl.store(dst, x1, mask=mask)
        tl.store(dst + HALF, x2, mask=mask)


def _check_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    check_dtype(_OP, "positions", positions, (torch.int64,))
    check_shape(_OP, "positions", positions, (None,))
    num_tokens = positions.shape[0]
    check_dtype(_OP, "query", query, FLOAT_DTYPES)
    check_shape(_OP, "query", query, (num_tokens, None))
    check_shape(_OP, "key_cache", key_cache, (None, None, None, None))
    _, _, num_kv_heads, head_dim = key_cache.shape
    if head_dim < 2 or head_dim % 2:
        raise KernelArgumentError(f"{_OP}: key_cache.shape[3]={head_dim} (head_dim), expected an even number >= 2")
    if query.shape[1] % head_dim:
        raise KernelArgumentError(f"{_OP}: query.shape[1]={query.shape[1]} is not a multiple of head_dim={head_dim}")
    check_shape(_OP, "key", key, (num_tokens, num_kv_heads * head_dim))
    check_shape(_OP, "value", value, (num_tokens, num_kv_heads * head_dim))
    check_shape(_OP, "value_cache", value_cache, tuple(key_cache.shape))
    check_shape(_OP, "slot_mapping", slot_mapping, (num_tokens,))
    check_dtype(_OP, "slot_mapping", slot_mapping, (torch.int64,))
    check_dtype(_OP, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_shape(_OP, "cos_sin_cache", cos_sin_cache, (None, head_dim))
    tensors = [("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)]
    if out is not None:
        check_shape(_OP, "out", out, tuple(query.shape))
        tensors.append(("out", out))
    for name, t in tensors:
        check_same_dtype(_OP, name, t, "query", query)
    for name, t in (*tensors, ("positions", positions), ("slot_mapping", slot_mapping),
                    ("cos_sin_cache", cos_sin_cache)):
        check_device(_OP, name, t, query.device)


def _launch_rotary_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    lora: LoRADelta | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`rotary_and_cache_ref` (one program per token; with ``lora`` one per token and
    group of 4 heads of q, k or v; positions and slots unchecked: no sync)."""
    require_triton(_OP)
    _check_args(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, out)
    if lora is not None:
        _check_lora(lora, query, key, value)
    q_out = query if out is None else out
    for name, t in (("query", query), ("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("cos_sin_cache", cos_sin_cache), ("out", q_out),
                    ("positions", positions), ("slot_mapping", slot_mapping)):
        check_last_dim_contiguous(_OP, name, t)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q_out
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    half = head_dim // 2
    num_q_heads = query.shape[1] // head_dim
    if lora is not None:
        q_size, kv_size = query.shape[1], key.shape[1]
        parts = [delta_args(lora, query, start, width)
                 for start, width in ((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size))]
        heads = max(1, tile_columns(_LORA_HEADS * next_pow2(half), lora) // next_pow2(half))
        groups = -(-num_q_heads // heads) + 2 * -(-num_kv_heads // heads)
        _rotary_and_cache_lora_kernel[(num_tokens, groups)](
            positions, query, q_out, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache,
            query.stride(0), q_out.stride(0), key.stride(0), value.stride(0), key_cache.stride(0),
            key_cache.stride(1), key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
            value_cache.stride(2), cos_sin_cache.stride(0), block_size, num_q_heads, num_kv_heads,
            *parts[0][:3], *parts[0][3:10], *parts[1][3:10], *parts[2][3:10], parts[0][10],
            HALF=half, HEADS=heads, BLOCK_HALF=next_pow2(half), BLOCK_R=block_r(lora),
            SLOT_PAGES=slot_pages(lora), PAGES_AT_ONCE=CONSUMER_PAGES[_OP], PAIR=paired(lora, _OP),
            num_warps=4, **pdl_args(query.device, _OP),
        )
        return q_out
    _rotary_and_cache_kernel[(num_tokens,)](
        positions,
        query,
        q_out,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        cos_sin_cache,
        query.stride(0),
        q_out.stride(0),
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        cos_sin_cache.stride(0),
        block_size,
        num_q_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_QH=next_pow2(num_q_heads),
        BLOCK_KH=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        num_warps=4 if num_q_heads * half >= 1024 else 1, **pdl_args(query.device, _OP),
    )
    return q_out


def rotary_and_cache_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    lora: LoRADelta | None = None,
) -> torch.Tensor:
    """RoPE on query (in place, or into ``out``) and key, then rotated key and value into the paged cache
    (plain torch: :func:`rotary_embedding_ref` then :func:`reshape_and_cache_ref`).

    Args:
        positions: ``[T] int64`` token positions (< ``max_pos``).
        query: ``[T, Hq*D]`` fp16/bf16/fp32 (row stride free, e.g. a view of fused qkv; last dim stride 1
            for Triton); rotated in place when ``out`` is None.
        key, value: ``[T, Hkv*D]``, dtype of ``query``, row strides free; read only.
        key_cache, value_cache: ``[N, block_size, Hkv, D]``, dtype of ``query`` (D even; last dim stride 1
            for Triton).
        slot_mapping: ``[T] int64`` flat slots ``block * block_size + offset``; -1 = padding, not cached.
        cos_sin_cache: ``[max_pos, D]`` fp32, ``cat(cos, sin)`` halves
            (:func:`~loraplex.kernels.rotary.compute_cos_sin_cache`).
        out: ``[T, Hq*D]`` of query's dtype for the rotated query, or None (in place).
        lora: optional expand of the folded q/k/v linear that made query, key and value
            (:class:`~loraplex.kernels.lora_delta.LoRADelta` over their ``Hq*D + 2*Hkv*D`` columns, in that order):
            each is first replaced by itself plus its delta, rounded to its dtype (key and value stay unwritten:
            the cache gets them).

    Returns:
        The rotated query: ``out``, or ``query`` itself.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, odd head_dim, or (reference only: Triton would
            need a device sync) a position outside ``[0, max_pos)`` or a slot outside ``[-1, N * block_size)``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(positions, query, key, value, key_cache, value_cache, slot_mapping, cos_sin_cache, out)
    check_positions_in_table(_OP, positions, cos_sin_cache)
    check_slots_in_cache(_OP, slot_mapping, key_cache)
    num_tokens, num_kv_heads, head_dim = positions.shape[0], key_cache.shape[2], key_cache.shape[3]
    if lora is not None:
        _check_lora(lora, query, key, value)
        qkv = lora_delta_ref(lora, torch.cat([query, key, value], dim=1))
        source, key, value = qkv.split([query.shape[1], key.shape[1], value.shape[1]], dim=1)
        q_out = (query if out is None else out).copy_(source)
    else:
        q_out = query if out is None else out.copy_(query)
    rotated_key = key.clone()
    rotary_embedding_ref(positions, q_out, rotated_key, cos_sin_cache, head_dim)
    reshape_and_cache_ref(rotated_key.reshape(num_tokens, num_kv_heads, head_dim),
                          value.reshape(num_tokens, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping)
    return q_out


def _check_lora(lora: LoRADelta, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """``lora`` covers query, key and value side by side, each inside one of its slices."""
    q_size, kv_size = query.shape[1], key.shape[1]
    check_delta(_OP, lora, query, q_size + 2 * kv_size)
    for start, width in ((0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)):
        delta_args(lora, query, start, width)


ROTARY_AND_CACHE = Op(
    name=_OP,
    semantics="q[t] <- rope(q'[t], p); key_cache[s // bs, s % bs] = rope(k'[t], p), value_cache[...] = v'[t], "
    "p = positions[t], s = slot_mapping[t], [q' k' v'] = [q k v] + delta ([q k v] without lora); rows with s == -1 "
    "write no cache",
    reference=rotary_and_cache_ref,
    triton=_launch_rotary_and_cache,
)
