"""RMSNorm (Zhang & Sennrich 2019) with an optional fused residual add, matching HF ``LlamaRMSNorm``.

Semantics: :data:`RMS_NORM`; ``s`` is rounded to x.dtype and the norm computed in fp32.

HF casts to fp32, normalises, casts back to the input dtype and *then*
multiplies by the weight in the input dtype; the kernel reproduces those
roundings, so bf16/fp16 outputs match HF up to the last-ulp rsqrt difference.
"""

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
from loraplex.kernels._triton import next_pow2, require_triton, tl, triton
from loraplex.kernels.op import Op

_OP = "rms_norm"


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    hidden_size,
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    stride_rot,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per row; the whole row fits in one BLOCK_H tile.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + t * stride_rot + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / hidden_size
    normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_shape(_OP, "x", x, (None, None))
    check_shape(_OP, "weight", weight, (x.shape[1],))
    check_same_dtype(_OP, "weight", weight, "x", x)
    check_device(_OP, "weight", weight, x.device)
    check_positive(_OP, "eps", eps)
    if residual is not None:
        check_shape(_OP, "residual", residual, tuple(x.shape))
        check_same_dtype(_OP, "residual", residual, "x", x)
        check_device(_OP, "residual", residual, x.device)


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launch of :func:`rms_norm_ref` (one program per row)."""
    require_triton(_OP)
    _check_args(x, weight, eps, residual)
    check_last_dim_contiguous(_OP, "x", x)
    check_last_dim_contiguous(_OP, "weight", weight)
    if residual is not None:
        check_last_dim_contiguous(_OP, "residual", residual)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if num_tokens == 0:
        return out if residual_out is None else (out, residual_out)
    block_h = next_pow2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        hidden_size,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        num_warps=min(max(block_h // 256, 1), 16),
    )
    return out if residual_out is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add (plain torch: HF ``LlamaRMSNorm.forward`` after the add).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 (row stride free; last dim stride 1 for Triton).
        weight: ``[H]``, dtype of ``x``.
        eps: variance epsilon (> 0).
        residual: optional ``[T, H]`` residual stream, dtype of ``x``.

    Returns:
        ``out [T, H]`` when ``residual`` is None, else ``(out, x + residual)``; new ``[T, H]`` tensors in x.dtype.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout or ``eps <= 0``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, weight, eps, residual)
    s = x if residual is None else x + residual
    sf = s.to(torch.float32)
    variance = sf.pow(2).mean(-1, keepdim=True)
    out = weight * (sf * torch.rsqrt(variance + eps)).to(x.dtype)
    return out if residual is None else (out, s)


RMS_NORM = Op(
    name=_OP,
    semantics="s = x + residual (s = x without); out = w * (s * rsqrt(mean(s^2) + eps)); returns out or (out, s)",
    reference=rms_norm_ref,
    triton=_launch_rms_norm,
)
