"""Argument checks shared by the paged-attention launchers and the reference."""

from __future__ import annotations

import torch

from loraplex.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_positive,
    check_same_dtype,
    check_shape,
)
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError


def check_attention_args(
    op: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Shapes, dtypes, devices and metadata lengths of a paged-attention call; the window (None or >= 1)
    and the logit soft-cap (None or > 0).

    Raises :class:`KernelArgumentError` naming the argument and value.
    """
    if not isinstance(meta, AttentionMetadata):
        raise KernelArgumentError(f"{op}: meta has type {type(meta).__name__}, expected AttentionMetadata")
    check_dtype(op, "query", query, FLOAT_DTYPES)
    check_shape(op, "query", query, (None, None, None))
    num_tokens, num_q_heads, head_dim = query.shape
    check_shape(op, "key_cache", key_cache, (None, None, None, head_dim))
    check_shape(op, "value_cache", value_cache, tuple(key_cache.shape))
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise KernelArgumentError(
            f"{op}: query has {num_q_heads} heads, not a multiple of key_cache's {num_kv_heads} KV heads"
        )
    check_positive(op, "scale", scale)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise KernelArgumentError(f"{op}: sliding_window={sliding_window!r}, expected None or an int >= 1")
    if softcap is not None and not softcap > 0:
        raise KernelArgumentError(f"{op}: softcap={softcap!r}, expected None or > 0")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_same_dtype(op, name, t, "query", query)
        check_device(op, name, t, query.device)
    check_device(op, "meta.query_start_loc", meta.query_start_loc, query.device)
    if meta.num_actual_tokens > num_tokens:
        raise KernelArgumentError(
            f"{op}: meta.query_start_loc_host[-1]={meta.num_actual_tokens} exceeds query's {num_tokens} tokens"
        )
    capacity = meta.block_tables.shape[1] * key_cache.shape[1]
    if meta.max_seq_len > capacity:
        raise KernelArgumentError(
            f"{op}: meta.max_seq_len={meta.max_seq_len} exceeds block_tables width "
            f"{meta.block_tables.shape[1]} x block_size {key_cache.shape[1]}"
        )
    if out is not None:
        check_shape(op, "out", out, tuple(query.shape))
        check_same_dtype(op, "out", out, "query", query)
        check_device(op, "out", out, query.device)


def check_attention_layout(
    op: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor
) -> None:
    """The kernels need stride 1 along head_dim (every other stride is passed in)."""
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        check_last_dim_contiguous(op, name, t)


def prepare_out(query: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None) -> torch.Tensor:
    """Allocate ``out`` if needed and zero its padding rows (tokens >= ``meta.num_actual_tokens``)."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if meta.num_actual_tokens < query.shape[0]:
        out[meta.num_actual_tokens :].zero_()
    return out
