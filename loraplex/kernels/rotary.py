"""Rotary position embedding (RoPE, Su et al. 2021 "RoFormer"), GPT-NeoX / HF-Llama "rotate_half" style.

Semantics: :data:`ROTARY_EMBEDDING` (``x1``, ``x2``: the halves of each head vector).

HF computes ``q*cos + rotate_half(q)*sin`` in the activation dtype with cos/sin
already cast to it; the kernel reproduces those roundings (each product and the
sum are rounded to the activation dtype), so bf16/fp16 results match HF.
``compute_cos_sin_cache`` builds the table from inverse frequencies the caller
takes from HF (``transformers.modeling_rope_utils``), as HF's rotary ``forward`` does.
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
from loraplex.kernels.op import Op

_OP = "rotary_embedding"


@triton.jit
def rope_halves(x1, x2, cos, sin):
    """``(x1*cos - x2*sin, x2*cos + x1*sin)`` with HF's roundings: each product and the sum rounded to
    x's dtype; ``x1``/``x2`` ``[heads, half]`` tiles, ``cos``/``sin`` ``[half]`` fp32 already rounded to it.
    Shared (through :func:`rotate_heads`) by :mod:`loraplex.kernels.rotary_and_cache`, so the fused kernel
    rounds exactly as this one."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * cos[None, :]).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin[None, :]).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos[None, :]).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin[None, :]).to(dt).to(tl.float32)
    return (a1 - b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def load_cos_sin(cos_sin_ptr, pos, stride_cs, dt, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Row ``pos`` of the cos/sin table as two ``[BLOCK_HALF]`` fp32 vectors rounded to ``dt`` (HF casts the
    table to the activation dtype); lanes beyond ``HALF`` are 0."""
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0)
    return cos.to(dt).to(tl.float32), sin.to(dt).to(tl.float32)


@triton.jit
def rotate_heads(
    src_ptr, dst_ptr, stride_src_h, stride_dst_h, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates ``num_heads`` heads of one token, read at ``src_ptr + h * stride_src_h`` and written at
    ``dst_ptr + h * stride_dst_h`` (the same place for in place; a KV-cache slot in
    :mod:`loraplex.kernels.rotary_and_cache`); cos/sin are [BLOCK_HALF] fp32 rounded to the dtype."""
    h = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    src = src_ptr + h[:, None] * stride_src_h + i[None, :]
    dst = dst_ptr + h[:, None] * stride_dst_h + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    o1, o2 = rope_halves(x1, x2, cos, sin)
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_kt,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # One program per token: rotates all query and key heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs, q_ptr.dtype.element_ty, HALF, BLOCK_HALF)
    q_row, k_row = q_ptr + t * stride_qt, k_ptr + t * stride_kt
    rotate_heads(q_row, q_row, 2 * HALF, 2 * HALF, cos, sin, num_q_heads, HALF, BLOCK_QH, BLOCK_HALF)
    rotate_heads(k_row, k_row, 2 * HALF, 2 * HALF, cos, sin, num_kv_heads, HALF, BLOCK_KH, BLOCK_HALF)


def _check_args(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> None:
    check_dtype(_OP, "positions", positions, (torch.int64,))
    check_shape(_OP, "positions", positions, (None,))
    num_tokens = positions.shape[0]
    check_dtype(_OP, "query", query, FLOAT_DTYPES)
    check_shape(_OP, "query", query, (num_tokens, None))
    check_shape(_OP, "key", key, (num_tokens, None))
    check_same_dtype(_OP, "key", key, "query", query)
    if head_dim < 2 or head_dim % 2:
        raise KernelArgumentError(f"{_OP}: head_dim={head_dim}, expected an even number >= 2")
    for name, t in (("query", query), ("key", key)):
        if t.shape[1] % head_dim:
            raise KernelArgumentError(f"{_OP}: {name}.shape[1]={t.shape[1]} is not a multiple of head_dim={head_dim}")
    check_dtype(_OP, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_shape(_OP, "cos_sin_cache", cos_sin_cache, (None, head_dim))
    for name, t in (("positions", positions), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_device(_OP, name, t, query.device)


def _launch_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> None:
    """Triton launch of :func:`rotary_embedding_ref` (one program per token; positions unchecked: no sync)."""
    require_triton(_OP)
    _check_args(positions, query, key, cos_sin_cache, head_dim)
    for name, t in (("positions", positions), ("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(_OP, name, t)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return
    half = head_dim // 2
    num_q_heads = query.shape[1] // head_dim
    num_kv_heads = key.shape[1] // head_dim
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        key.stride(0),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_QH=next_pow2(num_q_heads),
        BLOCK_KH=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        num_warps=4 if num_q_heads * half >= 1024 else 1, **pdl_args(query.device, _OP),
    )


def check_positions_in_table(op: str, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Every position indexes a row of the table (reads the values: a device sync, references only).

    Raises:
        KernelArgumentError: a position outside ``[0, max_pos)``.
    """
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < cos_sin_cache.shape[0]:
        raise KernelArgumentError(
            f"{op}: positions span [{int(positions.min())}, {int(positions.max())}], "
            f"expected within [0, {cos_sin_cache.shape[0]})"
        )


def rotary_embedding_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> None:
    """RoPE, in place on ``query`` and ``key``, rotate_half style (plain torch: HF ``apply_rotary_pos_emb``).

    Args:
        positions: ``[T] int64`` token positions (< ``max_pos``).
        query: ``[T, Hq*D]`` fp16/bf16/fp32 (row stride free, e.g. a view of fused qkv; last dim stride 1 for Triton).
        key: ``[T, Hkv*D]``, dtype of ``query``.
        cos_sin_cache: ``[max_pos, D]`` fp32, ``cat(cos, sin)`` halves (see :func:`compute_cos_sin_cache`).
        head_dim: D (even).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, odd head_dim, or (reference only: Triton would need a
            device sync) a position outside ``[0, max_pos)``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(positions, query, key, cos_sin_cache, head_dim)
    check_positions_in_table(_OP, positions, cos_sin_cache)
    half = head_dim // 2
    cos_half, sin_half = cos_sin_cache[positions].to(query.dtype).split(half, dim=-1)
    cos = torch.cat((cos_half, cos_half), dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat((sin_half, sin_half), dim=-1)[:, None, :]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim)
        x1, x2 = heads[..., :half], heads[..., half:]
        rotated = torch.cat((-x2, x1), dim=-1)
        heads.copy_(heads * cos + rotated * sin)


ROTARY_EMBEDDING = Op(
    name=_OP,
    semantics="per head [x1, x2] <- [x1*cos - x2*sin, x2*cos + x1*sin], (cos, sin) = cache[positions[t]].chunk(2)",
    reference=rotary_embedding_ref,
    triton=_launch_rotary,
)


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``[D/2] fp32 = 1 / base ** (arange(0, D, 2) / D)``, op for op as HF's
    default rope (other rope types: ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``).

    Raises:
        KernelArgumentError: odd head_dim or non-positive base.
    """
    if head_dim < 2 or head_dim % 2:
        raise KernelArgumentError(f"rope_inv_freq: head_dim={head_dim}, expected an even number >= 2")
    if not base > 0:
        raise KernelArgumentError(f"rope_inv_freq: base={base}, expected > 0")
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))


def compute_cos_sin_cache(
    inv_freq: torch.Tensor,
    max_position: int,
    attention_scaling: float = 1.0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """RoPE table ``[max_position, D] fp32 = cat(cos(p * inv_freq), sin(p * inv_freq)) * attention_scaling``.

    Semantics: ``cache[p] = cat(cos(p * f), sin(p * f)) * s`` with ``f = inv_freq [D/2] fp32`` and
    ``s = attention_scaling``, as HF's rotary embedding ``forward`` computes them in fp32
    (``inv_freq``/``s`` from :func:`rope_inv_freq` or HF's ``ROPE_INIT_FUNCTIONS``).

    Raises:
        KernelArgumentError: ``inv_freq`` not 1-D fp32, or non-positive sizes.
    """
    check_dtype("compute_cos_sin_cache", "inv_freq", inv_freq, (torch.float32,))
    check_shape("compute_cos_sin_cache", "inv_freq", inv_freq, (None,))
    if inv_freq.shape[0] < 1:
        raise KernelArgumentError("compute_cos_sin_cache: inv_freq is empty, expected [head_dim / 2]")
    if max_position < 1:
        raise KernelArgumentError(f"compute_cos_sin_cache: max_position={max_position}, expected >= 1")
    inv_freq = inv_freq.to(device)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2], as HF's position_ids.float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return torch.cat((cos, sin), dim=-1).contiguous()
