"""Rotary position embedding (RoPE, Su et al. 2021 "RoFormer"), GPT-NeoX / HF-Llama "rotate_half" style.

Semantics: :data:`ROTARY_EMBEDDING` (``x1``, ``x2``: the halves of each head vector).

HF computes ``q*cos + rotate_half(q)*sin`` in the activation dtype with cos/sin
already cast to it; the kernel reproduces those roundings (each product and the
sum are rounded to the activation dtype), so bf16/fp16 results match HF.
``compute_cos_sin_cache`` reproduces HF's ``inv_freq`` (default, "linear",
"llama3") operation by operation, so fp32 results match HF.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from loraplex.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_same_dtype,
    check_shape,
)
from loraplex.kernels._triton import next_pow2, require_triton, tl, triton
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.op import Op

_OP = "rotary_embedding"


@triton.jit
def _rotate_heads(
    x_ptr, stride_xt, t, cos, sin, num_heads, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    # Rotates all heads of one token in place; cos/sin are [BLOCK_HALF] fp32 rounded to x's dtype.
    h = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (i[None, :] < HALF)
    p1 = x_ptr + t * stride_xt + h[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * cos[None, :]).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin[None, :]).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos[None, :]).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin[None, :]).to(dt).to(tl.float32)
    tl.store(p1, (a1 - b1).to(dt), mask=mask)
    tl.store(p1 + HALF, (a2 + b2).to(dt), mask=mask)


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
):
    # One program per token: rotates all query and key heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0)
    dt = q_ptr.dtype.element_ty
    cos = cos.to(dt).to(tl.float32)
    sin = sin.to(dt).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, t, cos, sin, num_q_heads, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, t, cos, sin, num_kv_heads, HALF, BLOCK_KH, BLOCK_HALF)


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
        num_warps=4 if num_q_heads * half >= 1024 else 1,
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
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < cos_sin_cache.shape[0]:
        raise KernelArgumentError(
            f"{_OP}: positions span [{int(positions.min())}, {int(positions.max())}], "
            f"expected within [0, {cos_sin_cache.shape[0]})"
        )
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


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """RoPE table ``[max_position, head_dim] fp32``: ``cache[p] = cat(cos(p * f), sin(p * f))``, ``f = inv_freq [D/2]``.

    ``inv_freq`` is computed as HF transformers does.

    ``rope_scaling`` follows HF's ``rope_scaling`` / ``rope_parameters`` dict:
    ``None`` or ``rope_type`` "default" = plain RoPE; "linear" (``factor``,
    positions divided by it, Chen et al. 2023 "position interpolation");
    "llama3" (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``, as HF ``_compute_llama3_parameters``).
    The key ``type`` is accepted for ``rope_type`` (older HF configs).

    Raises:
        KernelArgumentError: odd head_dim, non-positive sizes/base, unknown rope type or missing key.
    """
    if head_dim < 2 or head_dim % 2:
        raise KernelArgumentError(f"compute_cos_sin_cache: head_dim={head_dim}, expected an even number >= 2")
    if max_position < 1:
        raise KernelArgumentError(f"compute_cos_sin_cache: max_position={max_position}, expected >= 1")
    if not base > 0:
        raise KernelArgumentError(f"compute_cos_sin_cache: base={base}, expected > 0")
    inv_freq = _inv_freq(head_dim, float(base), rope_scaling).to(device)
    positions = torch.arange(max_position, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, D/2], as HF's inv_freq @ position_ids
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def _inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """HF's inverse frequencies ``[D/2] fp32``, op for op (``1 / base ** (arange(0, D, 2) / D)``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in ("default", None):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(_param(rope_scaling, "factor"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise KernelArgumentError(
        f"compute_cos_sin_cache: rope_scaling rope_type={rope_type!r}, expected 'default', 'linear' or 'llama3'"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling, transcribed from HF ``_compute_llama3_parameters``."""
    factor = _param(rope_scaling, "factor")
    low_freq_factor = _param(rope_scaling, "low_freq_factor")
    high_freq_factor = _param(rope_scaling, "high_freq_factor")
    old_context_len = _param(rope_scaling, "original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _param(rope_scaling: dict[str, Any], name: str) -> Any:
    if name not in rope_scaling:
        raise KernelArgumentError(f"compute_cos_sin_cache: rope_scaling={rope_scaling!r} lacks {name!r}")
    value = rope_scaling[name]
    if not isinstance(value, (int, float)) or value <= 0:
        raise KernelArgumentError(f"compute_cos_sin_cache: rope_scaling[{name!r}]={value!r}, expected a number > 0")
    return value
