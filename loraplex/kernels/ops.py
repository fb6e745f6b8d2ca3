"""The kernel entry points the engine calls: Triton on CUDA tensors, the plain-torch reference otherwise.

Backend choice (:func:`set_backend`):

- ``"auto"`` (default): Triton when the op's first tensor is on CUDA and
  ``triton`` imports, the reference otherwise (CPU runs, no Triton).
- ``"triton"``: always Triton, also for CPU tensors (only meaningful under the
  Triton CPU interpreter, ``TRITON_INTERPRET=1`` set before Triton is
  imported; this is how the CPU tests run the kernels).
- ``"reference"``: always the reference.

This module imports without Triton installed; the Triton path then raises
:class:`~loraplex.kernels.errors.TritonUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from loraplex.kernels import activation, attention, rotary
from loraplex.kernels import lora_expand as _expand
from loraplex.kernels import lora_linear as _lora_linear
from loraplex.kernels import lora_shrink as _shrink
from loraplex.kernels import reshape_and_cache as _cache
from loraplex.kernels import rms_norm as _norm
from loraplex.kernels._triton import HAS_TRITON, require_triton
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.rotary import compute_cos_sin_cache

Backend = Literal["auto", "triton", "reference"]
_BACKENDS: tuple[Backend, ...] = ("auto", "triton", "reference")
_backend: Backend = "auto"

__all__ = [
    "AttentionMetadata",
    "Backend",
    "LoRAMapping",
    "compute_cos_sin_cache",
    "gelu_tanh_and_mul",
    "get_backend",
    "add_lora",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
    "use_backend",
]


def set_backend(name: Backend) -> None:
    """Select the backend for every later call ("auto", "triton" or "reference").

    Raises:
        KernelArgumentError: unknown name.
        TritonUnavailableError: "triton" requested but triton is not installed.
    """
    global _backend
    if name not in _BACKENDS:
        raise KernelArgumentError(f"set_backend: name={name!r}, expected one of {_BACKENDS}")
    if name == "triton":
        require_triton("set_backend")
    _backend = name


def get_backend() -> Backend:
    """The backend selected by :func:`set_backend` ("auto" unless changed)."""
    return _backend


@contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Context manager: :func:`set_backend` for the block, then restore the previous backend."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "auto":
        return HAS_TRITON and t.is_cuda
    return _backend == "triton"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V into the paged cache in place (see :func:`loraplex.kernels.reshape_and_cache.reshape_and_cache`).

    Semantics: ``key_cache[s // bs, s % bs] = key[t]`` (and value), ``s = slot_mapping[t]``, skip ``s == -1``.
    Shapes: key/value ``[T, Hkv, D]``, caches ``[N, bs, Hkv, D]``, slot_mapping ``[T] int64``.
    """
    fn = _cache.reshape_and_cache if _use_triton(key) else _cache.reshape_and_cache_ref
    fn(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
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
    """Causal attention of a prefill/extend/decode batch over the paged cache (see :mod:`loraplex.kernels.attention`).

    Semantics: ``out[t, h] = softmax(scale * q[t, h] @ K_b[lo:p+1, h // G].T) @ V_b[lo:p+1, h // G]``, p = token
    position, ``lo = 0`` or ``max(0, p - sliding_window + 1)``; with ``softcap`` the scores ``scale * q . k``
    become ``softcap * tanh(scores / softcap)`` (Gemma 2).
    Shapes: query/out ``[T, Hq, D]``, caches ``[N, bs, Hkv, D]``; returns ``[T, Hq, D]`` in the query dtype.
    """
    fn = attention.paged_attention if _use_triton(query) else attention.paged_attention_ref
    return fn(query, key_cache, value_cache, meta, scale, out=out, sliding_window=sliding_window, softcap=softcap)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF-Llama RMSNorm with optional fused residual add (see :mod:`loraplex.kernels.rms_norm`).

    Semantics: ``s = x + residual``; ``out = w * (s * rsqrt(mean(s^2) + eps))``; returns ``out`` or ``(out, s)``.
    Shapes: x/residual ``[T, H]``, weight ``[H]``.
    """
    fn = _norm.rms_norm if _use_triton(x) else _norm.rms_norm_ref
    return fn(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> None:
    """RoPE in place on query and key, rotate_half style (see :mod:`loraplex.kernels.rotary`).

    Semantics: per head ``[x1, x2] <- [x1*cos - x2*sin, x2*cos + x1*sin]``, ``cos, sin = cache[pos].chunk(2)``.
    Shapes: positions ``[T] int64``, query ``[T, Hq*D]``, key ``[T, Hkv*D]``, cache ``[max_pos, D] fp32``.
    """
    fn = rotary.rotary_embedding if _use_triton(query) else rotary.rotary_embedding_ref
    fn(positions, query, key, cos_sin_cache, head_dim)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU gate (see :mod:`loraplex.kernels.activation`).

    Semantics: ``out[t] = silu(x[t, :I]) * x[t, I:]``. Shapes: x ``[T, 2I]`` -> ``[T, I]``.
    """
    fn = activation.silu_and_mul if _use_triton(x) else activation.silu_and_mul_ref
    return fn(x, out=out)


def gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU gate, tanh-approximated gelu (see :mod:`loraplex.kernels.activation`).

    Semantics: ``out[t] = gelu_tanh(x[t, :I]) * x[t, I:]``. Shapes: x ``[T, 2I]`` -> ``[T, I]``.
    """
    fn = activation.gelu_tanh_and_mul if _use_triton(x) else activation.gelu_tanh_and_mul_ref
    return fn(x, out=out)


def lora_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGMV shrink (see :mod:`loraplex.kernels.lora_shrink`).

    Semantics: ``v[i, t] = x[t] @ A_i[slot[t]].T`` (0 where slot = -1).
    Shapes: x ``[T, H]``, lora_a ``list of [S, R, H]``, ranks ``[S] int32``; returns ``[n_slices, T, R] fp32``.
    """
    fn = _shrink.lora_shrink if _use_triton(x) else _shrink.lora_shrink_ref
    return fn(x, lora_a, mapping, ranks=ranks)


def lora_expand(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> None:
    """SGMV expand, in place on ``y`` (see :mod:`loraplex.kernels.lora_expand`).

    Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * v[i, t] @ B_i[s].T``, s = slot[t], nothing for s = -1.
    Shapes: v ``[n_slices, T, R] fp32``, lora_b ``list of [S, out_i, R]``, scaling ``list of [S] fp32``,
    y ``[T, sum out_i]``.
    """
    fn = _expand.lora_expand if _use_triton(y) else _expand.lora_expand_ref
    fn(v, lora_b, scaling, y, mapping, ranks=ranks)


def add_lora(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
) -> None:
    """One LoRA linear's batched delta, in place on ``y`` (see :mod:`loraplex.kernels.lora_linear`).

    Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``, s = slot[t], nothing for s = -1.
    Shapes: x ``[T, H]``, lora_a ``list of [S, R, H]``, lora_b ``list of [S, out_i, R]``,
    scaling ``list of [S] fp32``, y ``[T, sum out_i]``.
    """
    fn = _lora_linear.add_lora if _use_triton(x) else _lora_linear.add_lora_ref
    fn(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
