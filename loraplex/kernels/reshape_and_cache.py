"""Write this step's new K/V into the paged KV cache (vLLM's ``reshape_and_cache``).

Semantics: :data:`RESHAPE_AND_CACHE`. Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
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

_OP = "reshape_and_cache"


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # One program per token: copies all KV heads of its key and value.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = key_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = value_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_dtype(_OP, "key", key, FLOAT_DTYPES)
    check_shape(_OP, "key", key, (None, None, None))
    num_tokens, num_kv_heads, head_dim = key.shape
    check_shape(_OP, "value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape(_OP, "key_cache", key_cache, (None, None, num_kv_heads, head_dim))
    check_shape(_OP, "value_cache", value_cache, tuple(key_cache.shape))
    check_shape(_OP, "slot_mapping", slot_mapping, (num_tokens,))
    check_dtype(_OP, "slot_mapping", slot_mapping, (torch.int64,))
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_same_dtype(_OP, name, t, "key", key)
    for name, t in (
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        check_device(_OP, name, t, key.device)


def _launch_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton launch of :func:`reshape_and_cache_ref` (one program per token; slots beyond the cache unchecked)."""
    require_triton(_OP)
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(_OP, name, t)
    check_last_dim_contiguous(_OP, "slot_mapping", slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1, **pdl_args(key.device, _OP),
    )


def check_slots_in_cache(op: str, slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Every slot is -1 or a slot of the cache (reads the values: a device sync, references only).

    Raises:
        KernelArgumentError: a slot outside ``[-1, N * block_size)``.
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_slots:
            raise KernelArgumentError(f"{op}: slot_mapping values span [{lo}, {hi}], expected within [-1, {num_slots})")


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into the paged cache, in place (plain torch).

    Args:
        key, value: ``[T, Hkv, D]`` fp16/bf16/fp32 (last dim stride 1 for Triton; other strides free,
            e.g. views into a fused qkv output).
        key_cache, value_cache: ``[N, block_size, Hkv, D]``, same dtype (last dim stride 1 for Triton).
        slot_mapping: ``[T] int64`` flat slots ``block * block_size + offset``; -1 = skip.

    Raises:
        KernelArgumentError: wrong shape, dtype, device or layout, or (reference only: Triton would need a
            device sync) a slot outside ``[-1, N * block_size)``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    check_slots_in_cache(_OP, slot_mapping, key_cache)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key[valid]
    value_cache[slots // block_size, slots % block_size] = value[valid]


RESHAPE_AND_CACHE = Op(
    name=_OP,
    semantics="key_cache[s // bs, s % bs] = key[t] (value alike), s = slot_mapping[t]; tokens with s == -1 skipped",
    reference=reshape_and_cache_ref,
    triton=_launch_reshape_and_cache,
)
