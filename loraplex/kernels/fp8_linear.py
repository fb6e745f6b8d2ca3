"""Linear layer over FP8 (e4m3) weights with per-output-channel scales, 16/32-bit activations (W8A16).

Semantics: :data:`FP8_LINEAR`. The weight is read as 1 byte per element (half the bytes of
bf16: a decode step, bound by weight reads, moves half as much), widened to the activation
dtype inside the kernel (every e4m3 value is exact in bf16, fp16 and fp32), multiplied on
tensor cores with fp32 accumulation, and rescaled per output channel in the epilogue. With bf16
on CUDA the widening moves bits instead of converting (:func:`_widen_e4m3`, the idea of Marlin's
FP8 dequantization in vLLM): the e4m3 value times 2^-120, exactly, and 2^120 in the epilogue. The
format is the one of vLLM's and compressed-tensors' per-channel FP8 (``float8_e4m3fn``,
``scale = amax(|W[n, :]|) / 448``); activations are not quantized.

Two kernels compute it: the token-major one (a token tile times a weight tile transposed, up to 64 and past 128
tokens) and, from 65 to 128 tokens, the swapped-operand one (the weight tile as the dot's 64-row side, the tokens as
its other side; for long reductions split over K, the fp32 partial sums added in a fixed order by a second kernel).
:func:`_block_sizes` picks by token count and shape (H200 sweeps, benchmarks/RESULTS.md sessions 7, 13 and 18).
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
from loraplex.kernels._triton import (
    dot_dtype,
    dot_precision,
    max_shared_memory,
    pdl_args,
    pdl_trigger,
    pdl_wait,
    require_triton,
    tl,
    tl_dtype,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.op import Op

_OP = "fp8_linear"
FP8_DTYPE = torch.float8_e4m3fn

# WIDEN: how a kernel turns the e4m3 weight tile into the dot's operand dtype.
#   0: Triton's conversion (exact; on sm_90 one cvt per two values to fp16, then fp16 -> bf16 one value each).
#   1: bit operations giving value * 2^-E exactly (E = WIDEN_EXPONENT[dtype]): the sign and the 7 exponent/mantissa bits
#      move into the wide format's positions unchanged, so e4m3's exponent bias (7) stands in for the wide one's (127 or
#      15); subnormal e4m3 values become subnormal wide values. The epilogue multiplies by 2^E.
#   2: as 1, in inline PTX over four bytes per 32-bit register (CUDA, bf16 only).
# 1 and 2 read e4m3's NaN (0x7F / 0xFF) as +-480 where 0 gives NaN (a quantizer never writes NaN; a corrupt
# checkpoint would show as large values, not NaN). The fp32 accumulator holds sums 2^-120 low: products under
# 2^-126 become fp32 subnormals (held exactly on the H200: every-byte test), as in Marlin.
WIDEN_EXPONENT = {torch.bfloat16: 120, torch.float16: 8, torch.float32: 120}


@triton.jit
def _widen_e4m3(w, WIDE: tl.constexpr, WIDEN: tl.constexpr):
    """e4m3 ``w`` -> ``WIDE`` (bf16, fp16 or fp32): ``float(w)`` (WIDEN 0) or ``float(w) * 2^-E`` (1, 2)."""
    if WIDEN == 0:
        return w.to(WIDE)
    elif WIDEN == 1:
        b = w.to(tl.uint8, bitcast=True)
        if WIDE == tl.float32:
            v = b.to(tl.uint32)
            return (((v & 0x7F) << 20) | ((v & 0x80) << 24)).to(tl.float32, bitcast=True)
        elif WIDE == tl.float16:
            v = b.to(tl.uint16)
            return (((v & 0x7F) << 7) | ((v & 0x80) << 8)).to(tl.float16, bitcast=True)
        else:
            v = b.to(tl.uint16)
            return (((v & 0x7F) << 4) | ((v & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
    else:
        # bytes [e0 e1 e2 e3] -> {e0 << 8, e1 << 8}, {e2 << 8, e3 << 8} (prmt), then per 16-bit half
        # (v & 0x8000) | ((v >> 4) & 0x07F0): the bf16 bits of e * 2^-120.
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a<2>, b<2>;
            prmt.b32 a0, 0, $2, 0x5040;
            prmt.b32 a1, 0, $2, 0x7060;
            shr.b32 b0, a0, 4;
            shr.b32 b1, a1, 4;
            and.b32 b0, b0, 0x07f007f0;
            and.b32 b1, b1, 0x07f007f0;
            lop3.b32 $0, a0, 0x80008000, b0, 0xea;
            lop3.b32 $1, a1, 0x80008000, b1, 0xea;
            }""",
            constraints="=r,=r,r",
            args=[w.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )


def default_widen(dtype: torch.dtype, device: torch.device) -> int:
    """2 (inline PTX) for bf16 activations on CUDA, where Triton's conversion costs three instructions per two
    weights and the PTX two per weight on the integer pipes (H200, session 18: a Llama-2-7B layer's four linears
    at 32 tokens in 133 µs against 170 µs, each swept); otherwise 0 (exact conversion)."""
    return 2 if device.type == "cuda" and torch.version.hip is None and dtype == torch.bfloat16 else 0


def widen_unscale(dtype: torch.dtype, widen: int) -> float:
    """The factor the epilogue multiplies by after :func:`_widen_e4m3` mode ``widen`` (2^E, or 1)."""
    return 1.0 if widen == 0 else float(2 ** WIDEN_EXPONENT[dtype])


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    stride_xt,
    stride_wn,
    stride_ot,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDE: tl.constexpr,
    WIDEN: tl.constexpr,
    UNSCALE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # One program per (token tile, output-column tile); the K loop streams the fp8 weight tile.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_tokens
    col_mask = cols < out_features
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        w = _widen_e4m3(w, WIDE, WIDEN)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    pdl_trigger(USE_PDL)
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    acc = (acc * UNSCALE) * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _fp8_linear_swap_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    out_features,
    in_features,
    k_per_split,
    stride_xt,
    stride_wn,
    stride_ot,
    stride_os,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split-K: write fp32 partial sums (out is [SPLIT, T, N] fp32), no scale/bias
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDE: tl.constexpr,
    WIDEN: tl.constexpr,
    UNSCALE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # "Swap AB" for small token counts (65-128 in _block_sizes): acc[n, t] = W[n, k] @ x[t, k]^T, so the weight tile
    # is the dot's M operand (64+ rows: Hopper's wgmma) and the tokens its N. Grid = (column tiles, K splits, token
    # tiles). Same semantics as _fp8_linear_kernel (FP8_LINEAR); with PARTIAL each K split's fp32 sums go to out[split].
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    col_mask = cols < out_features
    k_first = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_first + k_per_split, in_features)
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xt + k[:, None],
                    mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        w = _widen_e4m3(w, WIDE, WIDEN)
        acc += tl.dot(w.to(DOT_DTYPE), x.to(DOT_DTYPE), input_precision=PRECISION)
    pdl_trigger(USE_PDL)
    acc = acc * UNSCALE
    mask = col_mask[:, None] & row_mask[None, :]
    if PARTIAL:
        out = out_ptr + tl.program_id(1) * stride_os + rows[None, :].to(tl.int64) * stride_ot + cols[:, None]
        tl.store(out, acc, mask=mask)
    else:
        acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + rows[None, :].to(tl.int64) * stride_ot + cols[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_split_sum_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, numel, out_features, split, stride_ps,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    # out[t, n] = scale[n] * sum_s part[s, t, n] + bias[n], the splits summed in order (deterministic)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    col = idx % out_features
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + s * stride_ps + idx, mask=mask, other=0.0)
    acc = acc * tl.load(scale_ptr + col, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_shape(_OP, "x", x, (None, None))
    check_dtype(_OP, "weight", weight, (FP8_DTYPE,))
    check_shape(_OP, "weight", weight, (None, x.shape[1]))
    check_device(_OP, "weight", weight, x.device)
    check_dtype(_OP, "scale", scale, (torch.float32,))
    check_shape(_OP, "scale", scale, (weight.shape[0],))
    check_device(_OP, "scale", scale, x.device)
    if bias is not None:
        check_shape(_OP, "bias", bias, (weight.shape[0],))
        check_same_dtype(_OP, "bias", bias, "x", x)
        check_device(_OP, "bias", bias, x.device)


def _block_sizes(num_tokens: int, out_features: int, in_features: int,
                 device: torch.device) -> tuple[int, ...]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages) of the token-major kernel, or those and SPLIT_K
    (a 6-tuple) for the swapped-operand kernel.

    On CUDA, from sweeps on an H200 (benchmarks/bench_fp8_linear.py; RESULTS.md, sessions 7, 13 and 18) over
    Llama-2-7B's linears: up to 32 tokens (session 18, with the PTX widening) the smallest token tile that holds
    them, 32-column tiles and 512-long K tiles for outputs of <= 8192 columns (256 for wider ones), 4 stages; 33-64
    tokens narrow column tiles for narrow outputs and 64-column tiles for wide ones; from 65 to 128 tokens the
    swapped-operand kernel (weight tile as the dot's 64-row side, 128 tokens as its other side; split over K for
    long reductions) except for narrow outputs of short reductions (o_proj: two 64-token tiles); prefill-sized
    counts take square-ish tiles. The launcher shrinks BLOCK_K where the tiles exceed the device's shared memory
    (:func:`_fit_shared_memory`)."""
    if device.type != "cuda":
        return 16, 32, 32, 4, 3
    narrow = out_features <= 8192
    if num_tokens <= 32:  # session 18's sweep with the PTX widening (widen 2)
        block_t = 16 if num_tokens <= 16 else 32
        return (block_t, 32, 512, 4, 4) if narrow else (block_t, 32, 256, 4, 4)
    if num_tokens <= 64:
        return (64, 16, 256, 4, 4) if narrow else (64, 64, 256, 4, 3)
    if num_tokens <= 128:
        if in_features > 8192:
            return 128, 64, 128, 4, 3, 4
        return (64, 16, 256, 4, 3) if narrow else (128, 64, 128, 4, 3, 1)
    return 128, 128, 64, 8, 3


def _fit_shared_memory(config: tuple[int, ...], x_bytes: int, budget_bytes: int) -> tuple[int, ...]:
    """``config`` with BLOCK_K halved until its pipelined x and weight tiles, ``(BLOCK_T * x_bytes + BLOCK_N) *
    BLOCK_K * num_stages`` bytes, fit ``budget_bytes`` (the shapes are swept on an H200 with 16-bit activations;
    fp32 ones take twice the x tile, and other GPUs have less shared memory)."""
    block_t, block_n, block_k, _, stages = config[:5]
    while (block_t * x_bytes + block_n) * block_k * stages > budget_bytes and block_k > 32:
        block_k //= 2
    return (block_t, block_n, block_k, *config[3:])


def shared_memory_budget(device: torch.device) -> int:
    """Bytes :func:`_fit_shared_memory` fits the tiles in: 7/8 of the device's limit (200 KB on an H200), the rest
    left to the epilogue and the compiler's layouts (its own count of these tiles runs below this model's)."""
    return max_shared_memory(device) * 7 // 8


def _widen_args(x: torch.Tensor, widen: int) -> dict:
    return {"WIDE": tl_dtype(x.dtype), "WIDEN": widen, "UNSCALE": widen_unscale(x.dtype, widen)}


def _launch_swap(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor, config: tuple[int, int, int, int, int, int], widen: int = 0) -> torch.Tensor:
    """The swapped-operand kernel (weight tile as the dot's M side), split over K when ``config[5] > 1``."""
    block_t, block_n, block_k, num_warps, num_stages, split = config
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
    split = triton.cdiv(in_features, k_per_split)
    target = out if split == 1 else torch.empty((split, num_tokens, out_features), dtype=torch.float32,
                                                device=x.device)
    grid = (triton.cdiv(out_features, block_n), split, triton.cdiv(num_tokens, block_t))
    _fp8_linear_swap_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, target,
        num_tokens, out_features, in_features, k_per_split,
        x.stride(0), weight.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, PARTIAL=split > 1,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device), PRECISION=dot_precision(x.dtype, x.device), **_widen_args(x, widen),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device, _OP),
    )
    if split > 1:
        numel = num_tokens * out_features
        block = 1024 if x.device.type == "cuda" else 64
        _fp8_split_sum_kernel[(triton.cdiv(numel, block),)](
            target, scale, bias if bias is not None else scale, out, numel, out_features, split, target.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_args(x.device, _OP),
        )
    return out


def _launch_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *,
                       config: tuple[int, ...] | None = None, widen: int | None = None) -> torch.Tensor:
    """Triton launch of :func:`fp8_linear_ref`. ``config``: (BLOCK_T, BLOCK_N, BLOCK_K, num_warps,
    num_stages) override of the token-major kernel, or (BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages,
    SPLIT_K) for the swapped-operand kernel (benchmarks/bench_fp8_linear.py sweeps both). ``widen``: how the
    weight tile is widened (:data:`WIDEN_EXPONENT`'s comment; default :func:`default_widen`)."""
    require_triton(_OP)
    _check_args(x, weight, scale, bias)
    check_last_dim_contiguous(_OP, "x", x)
    check_last_dim_contiguous(_OP, "weight", weight)
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if config is None:
        config = _fit_shared_memory(_block_sizes(num_tokens, out_features, in_features, x.device), x.element_size(),
                                    shared_memory_budget(x.device))
    if widen is None:
        widen = default_widen(x.dtype, x.device)
    if widen not in (0, 1, 2) or (widen == 2 and x.dtype != torch.bfloat16):
        raise KernelArgumentError(f"{_OP}: widen={widen} with {x.dtype} activations (0, 1, or 2 for bf16 on CUDA)")
    if len(config) == 6:
        return _launch_swap(x, weight, scale, bias, out, config, widen)
    block_t, block_n, block_k, num_warps, num_stages = config
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(out_features, block_n))
    _fp8_linear_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out,
        num_tokens, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device), PRECISION=dot_precision(x.dtype, x.device), **_widen_args(x, widen),
        num_warps=num_warps,
        num_stages=num_stages, **pdl_args(x.device, _OP),
    )
    return out


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` over an FP8 weight (plain torch, fp32 math).

    Args:
        x: ``[T, K]`` fp16/bf16/fp32 activations (last dim stride 1 for Triton).
        weight: ``[N, K]`` ``torch.float8_e4m3fn`` quantized weight.
        scale: ``[N]`` float32 per-output-channel scale (dequantized ``W = weight * scale``).
        bias: optional ``[N]`` bias in x.dtype.

    Returns:
        ``[T, N]`` in x.dtype (accumulated in fp32).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, weight, scale, bias)
    out = (x.to(torch.float32) @ weight.to(torch.float32).T) * scale
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


FP8_LINEAR = Op(
    name=_OP,
    semantics="out[t, n] = scale[n] * sum_k x[t, k] * float(weight[n, k]) + bias[n]  (weight e4m3, fp32 accumulation)",
    reference=fp8_linear_ref,
    triton=_launch_fp8_linear,
)
