"""Linear layer over FP8 (e4m3) weights with per-output-channel scales, 16/32-bit activations.

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

On Hopper GPUs, bf16 activations of up to :data:`SPLIT_MAX_TOKENS` tokens take a third path instead
(:data:`SPLIT_ACTIVATIONS`, :func:`default_activations`): the weights go to the e4m3 tensor cores unwidened, and each
token's activations, written once as two e4m3 terms ``s * (h + l / 16)`` (~2^-8 of each element, finer than bf16's own
rounding; :func:`split_activations`, or the kernel that made them: ``rms_norm`` / ``silu_and_mul`` with ``split=``),
with them: one e4m3 GEMM over the 2T rows of h and l (:func:`split_gemm`). At 32 tokens it reads a Llama-2-7B
layer's weights at 0.72 of the copy bandwidth, where widening them reads at 0.38 (RESULTS.md session 27).
"""

from __future__ import annotations

import dataclasses
import functools

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

# Split activations (Hopper, bf16 x, at most SPLIT_MAX_TOKENS tokens; :func:`default_activations`): the weights go to
# the e4m3 tensor cores as they are, and each token's activations, written once per call as two e4m3 terms, with them.
SPLIT_ACTIVATIONS = ("out[t, n] = scale[n] * s[t] * sum_k float(weight[n, k]) * (h[t, k] + l[t, k] / 16) + bias[n],  "
                     "s[t] = 2^ceil(log2(max_k |x[t, k]| / 448)), h = e4m3(x / s), l = e4m3(16 * (x / s - h))  "
                     "(nearest-even; a row holding NaN or inf: s = NaN, h = l = 0)")
SPLIT_MAX_TOKENS = 128
# Rows the producing kernels (rms_norm, silu_and_mul) split in the same program, held whole in registers; longer rows
# are split by split_activations after them.
SPLIT_FUSED_MAX = 16384


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
    _store_swapped(acc * UNSCALE, out_ptr, scale_ptr, bias_ptr, cols, rows, col_mask, row_mask, col_mask, stride_ot,
                   stride_os, HAS_BIAS, PARTIAL)


@triton.jit
def _store_swapped(y, out_ptr, scale_ptr, bias_ptr, cols, rows, col_mask, row_mask, scaled, stride_ot, stride_os,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Epilogue of the swapped-operand kernels (``y [BLOCK_N, BLOCK_T]`` fp32, the output's columns ``cols`` as rows):
    PARTIAL, ``y`` to this K split's fp32 partials ``out[split]``; else ``scale[n] * y + bias[n]`` to ``out [T, N]``,
    where ``scaled`` (the weight's columns; a folded shrink's columns past them take ``y`` as it is)."""
    mask = col_mask[:, None] & row_mask[None, :]
    if PARTIAL:
        out = out_ptr + tl.program_id(1) * stride_os + rows[None, :].to(tl.int64) * stride_ot + cols[:, None]
        tl.store(out, y, mask=mask)
    else:
        y = y * tl.load(scale_ptr + cols, mask=scaled, other=1.0)[:, None]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=scaled, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + rows[None, :].to(tl.int64) * stride_ot + cols[:, None]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_split_sum_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, numel, out_features, out_columns, split, stride_ps,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    # out[t, n] = scale[n] * sum_s part[s, t, n] + bias[n], the splits summed in order (deterministic); out has
    # out_columns columns, those past out_features (a folded shrink's) take the sum alone
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    col = idx % out_columns
    scaled = mask & (col < out_features)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(split):
        acc += tl.load(part_ptr + s * stride_ps + idx, mask=mask, other=0.0)
    acc = acc * tl.load(scale_ptr + col, mask=scaled, other=1.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=scaled, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_e4m3(v):
    """``v`` (fp32, ``|v| <= 448``) rounded to e4m3, nearest-even: ``(byte as int32, value as fp32)``, by integer and
    fp32 operations alone. Triton's own fp32 -> e4m3 conversion is not used: on the H200 (Triton 3.6) its result, read
    back in registers, gave 0 for every other element, and the CPU interpreter misrounds across binade carries."""
    a = tl.abs(v)
    u = a.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000  # 3 mantissa bits, nearest-even: e4m3's normal numbers
    normal_val = r.to(tl.float32, bitcast=True)
    normal_byte = ((r >> 20) - 960).to(tl.int32)  # exponent bias 127 -> 7: (120 << 3) off the top 11 bits
    sub_val = (a + 16384.0) - 16384.0  # multiples of 2^-9 (fp32's unit at 2^14), nearest-even: e4m3's subnormals
    sub_byte = (sub_val * 512.0).to(tl.int32)  # 8 (= 2^-6) is the first normal's byte too
    is_sub = a < 0.015625
    byte = tl.where(is_sub, sub_byte, normal_byte)
    val = tl.where(is_sub, sub_val, normal_val)
    neg = (v.to(tl.uint32, bitcast=True) >> 31) != 0  # the sign bit: -0.0 is 0x80, as torch's cast writes it
    return tl.where(neg, byte | 0x80, byte), tl.where(neg, -val, val)


@triton.jit
def _nonfinite(x):
    """1 where ``x`` (fp32) is NaN or infinite, else 0 (int32): ``tl.max`` and the clamps skip NaN."""
    return ((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32)


@triton.jit
def _split_scale(amax, nonfinite):
    """``(s, 1 / s)``: the power of two at or above ``max(amax, 1e-30) / 448`` and its exact reciprocal, so that
    ``x / s`` is the multiply ``x * (1 / s)`` (an IEEE division per element, div_rn, doubled the split kernel's time
    on the H200, and Triton's fp32 "/" is the approximate div.full there). The one division per row is div_rn:
    ``amax / 448`` must round as the reference's. A row holding NaN or inf (``nonfinite`` > 0): ``(NaN, 0)``, so its
    q is 0 and every output of the row NaN."""
    t_bits = tl.math.div_rn(tl.maximum(amax, 1e-30), 448.0).to(tl.uint32, bitcast=True)
    s_bits = (t_bits + 0x7FFFFF) & 0x7F800000  # round the (positive, normal) float up to a power of two
    bad = nonfinite > 0
    s = tl.where(bad, 0x7FC00000, s_bits).to(tl.float32, bitcast=True)
    inv_s = tl.where(bad, 0, (254 << 23) - s_bits).to(tl.float32, bitcast=True)
    return s, inv_s


@triton.jit
def _store_split(x, inv_s, q_ptr, t, cols, mask, in_features, stride_qt):
    """``q[t, 0, cols] = e4m3(x * inv_s)``, ``q[t, 1, cols] = e4m3(16 * (x * inv_s - q[t, 0, cols]))`` (fp32 ``x``;
    ``q_ptr``: the ``[T, 2, K]`` e4m3 buffer as bytes)."""
    v = tl.where(inv_s > 0, tl.minimum(tl.maximum(x * inv_s, -448.0), 448.0), 0.0)  # 0: a NaN/inf row, h = l = +0
    h_byte, h = _round_e4m3(v)
    l_byte, _ = _round_e4m3((v - h) * 16.0)
    tl.store(q_ptr + t * stride_qt + cols, h_byte.to(tl.uint8), mask=mask)
    tl.store(q_ptr + t * stride_qt + in_features + cols, l_byte.to(tl.uint8), mask=mask)


@triton.jit
def split_row(x, q_ptr, s_ptr, t, cols, mask, in_features, stride_qt):
    """:data:`SPLIT_ACTIVATIONS`' split of row ``t`` held whole in ``x`` (fp32, masked-off columns 0): ``s[t]`` and
    ``q[t]``. For the kernels that make an FP8 linear's input (``rms_norm``, ``silu_and_mul``) to write it alongside
    their output."""
    s, inv_s = _split_scale(tl.max(tl.abs(x), axis=0), tl.max(_nonfinite(x), axis=0))
    tl.store(s_ptr + t, s)
    _store_split(x, inv_s, q_ptr, t, cols, mask, in_features, stride_qt)


@triton.jit
def _split_activations_kernel(x_ptr, q_ptr, s_ptr, in_features, stride_xt, stride_qt, BLOCK: tl.constexpr,
                              ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    # One program per token (SPLIT_ACTIVATIONS): s[t] = 2^ceil(log2(max_k |x[t, k]| / 448)), q[t, 0] = e4m3(x / s),
    # q[t, 1] = e4m3(16 * (x / s - q[t, 0])). q_ptr: the [T, 2, K] e4m3 buffer as bytes. ONE_PASS (in_features <=
    # BLOCK): the row read once; else twice (amax, then the split) in BLOCK pieces.
    t = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < in_features
        split_row(tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32), q_ptr, s_ptr, t, cols,
                  mask, in_features, stride_qt)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        nonfinite = tl.zeros([BLOCK], tl.int32)
        for k0 in range(0, in_features, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + t * stride_xt + cols, mask=cols < in_features, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nonfinite = tl.maximum(nonfinite, _nonfinite(x))
        s, inv_s = _split_scale(tl.max(amax, axis=0), tl.max(nonfinite, axis=0))
        tl.store(s_ptr + t, s)
        for k0 in range(0, in_features, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = cols < in_features
            x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
            _store_split(x, inv_s, q_ptr, t, cols, mask, in_features, stride_qt)


@triton.jit
def _fp8_linear_split_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    scale_ptr,
    bias_ptr,
    a_ptr,
    x_ptr,
    out_ptr,
    num_tokens,
    out_features,
    a_rows,
    in_features,
    k_per_split,
    stride_wn,
    stride_an,
    stride_xt,
    stride_qr,
    stride_ot,
    stride_os,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split-K: write fp32 partial sums (out is [SPLIT, T, N] fp32), no scale/bias
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_A: tl.constexpr,  # a folded LoRA shrink's column tiles after the weight's
    BLOCK_A: tl.constexpr,  # a's rows per tile (16-bit: half the weight tile's rows, as many bytes)
    BLOCK_T: tl.constexpr,  # x's rows loaded per a tile: max(16, BLOCK_R // 2)
    DOT_DTYPE: tl.constexpr,  # of the a tiles' dot: a's dtype (dot_dtype)
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # SPLIT_ACTIVATIONS' GEMM: acc[n, r] = sum_k w[n, k] * q[r, k] over q's 2T rows (r = 2t: h, 2t + 1: l), e4m3 x
    # e4m3 on the tensor cores (the weight tile as the dot's M side, as in the swapped-operand kernel), then
    # out[t, n] = scale[n] * s[t] * (acc[n, 2t] + acc[n, 2t + 1] / 16) + bias[n]. Grid = (column tiles, K splits,
    # row tiles). The column tiles past the weight's (HAS_A: a folded LoRA shrink) take rows of the 16-bit
    # a [a_rows, K] times x itself instead: out[t, N + r] = sum_k a[r, k] * x[t, k].
    base_tiles = tl.cdiv(out_features, BLOCK_N)
    qrows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    qrow_mask = qrows < 2 * num_tokens
    k_first = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_first + k_per_split, in_features)
    if HAS_A and tl.program_id(0) >= base_tiles:
        # an a tile of BLOCK_A rows (as many bytes per K tile as a weight tile) times x itself (16-bit, no split):
        # out[t, N + r] = sum_k a[r, k] * x[t, k], for this row tile's BLOCK_R // 2 tokens (BLOCK_T >= 16 loaded)
        a_idx = (tl.program_id(0) - base_tiles) * BLOCK_A + tl.arange(0, BLOCK_A)
        a_mask = a_idx < a_rows
        t_idx = tl.program_id(2) * (BLOCK_R // 2) + tl.arange(0, BLOCK_T)
        t_mask = (t_idx < num_tokens) & (tl.arange(0, BLOCK_T) < BLOCK_R // 2)
        acc_a = tl.zeros([BLOCK_A, BLOCK_T], tl.float32)
        for k0 in range(k_first, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            a = tl.load(a_ptr + a_idx[:, None].to(tl.int64) * stride_an + k[None, :],
                        mask=a_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + t_idx[None, :].to(tl.int64) * stride_xt + k[:, None],
                        mask=k_mask[:, None] & t_mask[None, :], other=0.0)
            acc_a = tl.dot(a.to(DOT_DTYPE), x.to(DOT_DTYPE), acc_a, input_precision=PRECISION)
        pdl_trigger(USE_PDL)
        _store_swapped(acc_a, out_ptr, scale_ptr, bias_ptr, out_features + a_idx, t_idx, a_mask, t_mask, a_idx < 0,
                       stride_ot, stride_os, HAS_BIAS, PARTIAL)
    else:
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < out_features
        acc = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
        for k0 in range(k_first, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            q = tl.load(q_ptr + qrows[None, :].to(tl.int64) * stride_qr + k[:, None],
                        mask=k_mask[:, None] & qrow_mask[None, :], other=0.0)
            acc = tl.dot(w, q, acc)
        pdl_trigger(USE_PDL)
        acc_h, acc_l = tl.split(tl.reshape(acc, [BLOCK_N, BLOCK_R // 2, 2]))
        rows = tl.program_id(2) * (BLOCK_R // 2) + tl.arange(0, BLOCK_R // 2)
        row_mask = rows < num_tokens
        y = (acc_h + acc_l * 0.0625) * tl.load(s_ptr + rows, mask=row_mask, other=0.0)[None, :]
        _store_swapped(y, out_ptr, scale_ptr, bias_ptr, cols, rows, col_mask, row_mask, col_mask, stride_ot,
                       stride_os, HAS_BIAS, PARTIAL)


def _check_lora_a(x: torch.Tensor, lora_a: torch.Tensor) -> None:
    """``lora_a [R, K]``: x's dtype and device, last dim contiguous (KernelArgumentError)."""
    check_shape(_OP, "lora_a", lora_a, (None, x.shape[1]))
    check_same_dtype(_OP, "lora_a", lora_a, "x", x)
    check_device(_OP, "lora_a", lora_a, x.device)
    check_last_dim_contiguous(_OP, "lora_a", lora_a)


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
            target, scale, bias if bias is not None else scale, out, numel, out_features, out_features, split,
            target.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_args(x.device, _OP),
        )
    return out


def default_activations(dtype: torch.dtype, device: torch.device, num_tokens: int) -> str:
    """``"split"`` (:data:`SPLIT_ACTIVATIONS`: e4m3 x e4m3 tensor cores) for bf16 activations of 1 to
    :data:`SPLIT_MAX_TOKENS` tokens on CUDA devices of compute capability 9 (Hopper), where it was measured (H200,
    RESULTS.md session 27: a Llama-2-7B layer's four GEMMs at 32 tokens in 66 µs, against 126 µs widening the weights
    and 119 µs for cuBLAS bf16); otherwise ``"exact"`` (the weights widened to the activations' dtype). Not fp16: the
    split's ~8 bits are finer than bf16's rounding but coarser than fp16's (11). Not other devices: unmeasured, and
    the launch shapes need Hopper's shared memory (compute capability 12 has 99 KB)."""
    if (device.type == "cuda" and torch.version.hip is None and dtype == torch.bfloat16
            and 1 <= num_tokens <= SPLIT_MAX_TOKENS and _cuda_capability(device)[0] == 9):
        return "split"
    return "exact"


@functools.lru_cache(maxsize=16)
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device.index if device.index is not None else torch.cuda.current_device())


def _split_block_sizes(num_tokens: int, out_features: int, in_features: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_R, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) of the split-activation GEMM, BLOCK_R counting
    the 2T rows of h and l: from the H200 sweeps of RESULTS.md sessions 27 and 29 (``benchmarks/diag_fp8_split_act.py``,
    Llama-2-7B's linears at 1, 32 and 128 tokens, then 40, 48, 64, 80, 96 and 128). Up to 32 tokens one row tile and
    64-column weight tiles (256 long; 128 for wide outputs), down_proj's long reduction split in four (two from 17
    tokens); 33-64 tokens one 128-row tile, 128-column tiles for qkv-wide outputs, the reduction split in two for
    down_proj and o_proj-sized ones; 65-128 tokens 128-row tiles (256 for gate_up-wide outputs), unsplit."""
    rows = 2 * num_tokens
    if rows <= 64:
        block_r = max(16, triton.next_power_of_2(rows))
        if in_features > 8192:
            return (block_r, 64, 256, 4, 5, 2) if num_tokens > 16 else (block_r, 64, 256, 4, 3, 4)
        if out_features > 16384:
            return block_r, 64, 128, 4, 4, 1
        if out_features > 8192:
            return block_r, 128, 256, 4, 4, 1
        return block_r, 64, 256, 4, 5 if block_r == 64 else 4, 1
    if rows <= 128:  # 33-64 tokens: one 128-row tile
        if in_features > 8192:
            return 128, 64, 256, 4, 4, 2
        if out_features > 16384:
            return 128, 64, 128, 4, 3, 1
        if out_features > 8192:
            return 128, 128, 128, 4, 5, 1
        return 128, 64, 256, 4, 4, 2
    if in_features > 8192:  # 65-128 tokens
        return 128, 64, 256, 4, 4, 1
    if out_features > 16384:
        return 256, 64, 128, 4, 4, 1
    if out_features > 8192:
        return 128, 64, 128, 4, 3, 1
    return 128, 64, 256, 4, 4, 1


def _split_activations_launch(in_features: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps) of :func:`_split_activations_kernel`: on CUDA the whole row in one block up to 16384
    elements (read once), 8 warps past 4096; 64-element blocks in the interpreter."""
    if device.type != "cuda":
        return 64, 4
    block = min(triton.next_power_of_2(in_features), 16384)
    return block, 8 if block > 4096 else 4


@dataclasses.dataclass
class ActivationSplit:
    """:data:`SPLIT_ACTIVATIONS`' form of a ``[T, K]`` activation: ``q [T, 2, K] float8_e4m3fn`` (contiguous;
    ``q[t, 0]`` = h, ``q[t, 1]`` = l) and ``s [T] float32``. The kernel that makes an FP8 linear's input can write it
    (``rms_norm(..., split=)``, ``silu_and_mul(..., split=)``) and ``fp8_linear(..., split=)`` then reads it instead of
    splitting its x again."""

    q: torch.Tensor
    s: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, in_features: int, device: torch.device) -> ActivationSplit:
        return cls(torch.empty((num_tokens, 2, in_features), dtype=FP8_DTYPE, device=device),
                   torch.empty((num_tokens,), dtype=torch.float32, device=device))

    def values(self) -> torch.Tensor:
        """``s[t] * (h[t, k] + l[t, k] / 16)``, ``[T, K] float32``: the activations this split stands for."""
        return (self.q[:, 0].to(torch.float32) + self.q[:, 1].to(torch.float32) / 16.0) * self.s[:, None]


def check_split(op: str, split: ActivationSplit, x: torch.Tensor) -> None:
    """Raises KernelArgumentError unless ``split`` is an :class:`ActivationSplit` for a float tensor shaped and
    placed like ``x [T, K]``: ``q [T, 2, K]`` e4m3 and ``s [T]`` float32, both contiguous."""
    if not isinstance(split, ActivationSplit):
        raise KernelArgumentError(f"{op}: split must be an ActivationSplit, not {type(split).__name__}")
    check_dtype(op, "x", x, FLOAT_DTYPES)
    check_dtype(op, "split.q", split.q, (FP8_DTYPE,))
    check_shape(op, "split.q", split.q, (x.shape[0], 2, x.shape[1]))
    check_dtype(op, "split.s", split.s, (torch.float32,))
    check_shape(op, "split.s", split.s, (x.shape[0],))
    check_device(op, "split.q", split.q, x.device)
    check_device(op, "split.s", split.s, x.device)
    if not (split.q.is_contiguous() and split.s.is_contiguous()):
        raise KernelArgumentError(f"{op}: split.q and split.s must be contiguous")


def split_activations(x: torch.Tensor, split: ActivationSplit) -> None:
    """Write :data:`SPLIT_ACTIVATIONS`' split of ``x [T, K]`` (last dim contiguous) into ``split``. Launched
    under its own PDL name, ``fp8_split_activations`` (the "start" trigger: the GEMM after it launches and waits).

    Raises:
        KernelArgumentError: ``x`` not a float ``[T, K]`` with a contiguous last dim, or ``split`` not fitting it
            (:func:`check_split`).
    """
    require_triton("split_activations")
    check_shape("split_activations", "x", x, (None, None))
    check_last_dim_contiguous("split_activations", "x", x)
    check_split("split_activations", split, x)
    block, warps = _split_activations_launch(x.shape[1], x.device)
    _split_activations_kernel[(x.shape[0],)](
        x, split.q.view(torch.uint8), split.s, x.shape[1], x.stride(0), split.q.stride(0), BLOCK=block,
        ONE_PASS=x.shape[1] <= block, num_warps=warps, **pdl_args(x.device, "fp8_split_activations"),
    )


def write_split_ref(y: torch.Tensor, split: ActivationSplit) -> None:
    """Plain torch: write :data:`SPLIT_ACTIVATIONS`' split of ``y [T, K]`` into ``split`` (the reference kernels'
    counterpart of :func:`split_row`)."""
    s, h, lo = _split_terms(y)
    split.q[:, 0].copy_(h)
    split.q[:, 1].copy_(lo)
    split.s.copy_(s[:, 0])


def split_gemm(weight: torch.Tensor, split: ActivationSplit, scale: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor, config: tuple[int, int, int, int, int, int],
               lora_a: torch.Tensor | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
    """``out [T, N]`` = :data:`SPLIT_ACTIVATIONS`' product of ``weight [N, K]`` e4m3 (``scale [N]`` fp32, ``bias``
    ``[N]`` or None) with an activation ``split``; the K reduction split in ``config[5]`` chunks when above 1 (fp32
    partial sums, added in order by :func:`_fp8_split_sum_kernel`). ``config``: (BLOCK_R, BLOCK_N, BLOCK_K,
    num_warps, num_stages, SPLIT_K). With ``lora_a [R, K]`` and the activations ``x [T, K]`` the split stands for
    (x's dtype, last dims contiguous), ``out`` is ``[T, N + R]`` and its last R columns ``x @ lora_a.T`` (no scale,
    no bias; column tiles after the weight's, in the same launch).

    Raises:
        KernelArgumentError: ``lora_a`` without ``x``, or an ``out`` that is not ``[T, N + R]``."""
    block_r, block_n, block_k, num_warps, num_stages, split_k = config
    q, s = split.q, split.s
    num_tokens, _, in_features = q.shape
    out_features = weight.shape[0]
    a_rows = 0 if lora_a is None else lora_a.shape[0]
    if lora_a is not None and x is None:
        raise KernelArgumentError(f"{_OP}: split_gemm with lora_a needs x, the activations the split stands for")
    check_shape(_OP, "out", out, (num_tokens, out_features + a_rows))
    columns = out_features + a_rows
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_per_split)
    target = out if split_k == 1 else torch.empty((split_k, num_tokens, columns), dtype=torch.float32,
                                                  device=out.device)
    block_a = max(16, block_n // 2)
    a_dtype = torch.bfloat16 if lora_a is None else lora_a.dtype
    grid = (triton.cdiv(out_features, block_n) + triton.cdiv(a_rows, block_a), split_k,
            triton.cdiv(2 * num_tokens, block_r))
    _fp8_linear_split_kernel[grid](
        weight, q, s, scale, bias if bias is not None else scale, lora_a if lora_a is not None else weight,
        x if lora_a is not None else weight, target, num_tokens, out_features, a_rows, in_features, k_per_split,
        weight.stride(0), lora_a.stride(0) if lora_a is not None else 0, x.stride(0) if lora_a is not None else 0,
        in_features, target.stride(-2), target.stride(0) if split_k > 1 else 0,
        HAS_BIAS=bias is not None, PARTIAL=split_k > 1, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_A=lora_a is not None, BLOCK_A=block_a, BLOCK_T=max(16, block_r // 2),
        DOT_DTYPE=dot_dtype(a_dtype, out.device), PRECISION=dot_precision(a_dtype, out.device),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(out.device, _OP),
    )
    if split_k > 1:
        numel = num_tokens * columns
        block = 1024 if out.device.type == "cuda" else 64
        _fp8_split_sum_kernel[(triton.cdiv(numel, block),)](
            target, scale, bias if bias is not None else scale, out, numel, out_features, columns, split_k,
            target.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_args(out.device, _OP),
        )
    return out


def _launch_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, split: ActivationSplit | None = None,
                       lora_a: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
                       widen: int | None = None, activations: str | None = None) -> torch.Tensor:
    """Triton launch of :func:`fp8_linear_ref`. ``activations``: ``"exact"`` (the weights widened, W8A16) or
    ``"split"`` (:data:`SPLIT_ACTIVATIONS`, within :func:`fp8_linear_split_ref`'s rounding of x);
    default :func:`default_activations`; a given ``split`` (of x, written by the kernel that made x) is used as it
    is. ``config``, exact: (BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages)
    override of the token-major kernel, or (BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for the
    swapped-operand kernel (benchmarks/bench_fp8_linear.py sweeps both); split: (BLOCK_R, BLOCK_N, BLOCK_K, num_warps,
    num_stages, SPLIT_K) (:func:`_split_block_sizes`). ``widen``: how the exact kernels widen the weight tile
    (:data:`WIDEN_EXPONENT`'s comment; default :func:`default_widen`). ``lora_a`` (a folded LoRA shrink,
    ``[T, N + R]`` out): split activations only; its columns are ``x @ lora_a.T`` (x's dtype on the tensor cores),
    column tiles after the weight's in the same launch.

    Raises:
        KernelArgumentError: bad arguments (:func:`fp8_linear_ref`, :func:`check_split`), ``activations`` not one
            of the two, a config of the other path's length, a bad ``widen``, or ``lora_a`` with the weights widened.
    """
    require_triton(_OP)
    _check_args(x, weight, scale, bias)
    check_last_dim_contiguous(_OP, "x", x)
    check_last_dim_contiguous(_OP, "weight", weight)
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    if lora_a is not None:
        _check_lora_a(x, lora_a)
    out = torch.empty((num_tokens, out_features + (0 if lora_a is None else lora_a.shape[0])), dtype=x.dtype,
                      device=x.device)
    if num_tokens == 0:
        return out
    if split is None and activations is None:
        activations = default_activations(x.dtype, x.device, num_tokens)
    if split is None and activations != "split" and lora_a is not None:
        raise KernelArgumentError(f"{_OP}: lora_a (a folded shrink) takes split activations, not "
                                  f"activations={activations!r} ({num_tokens} tokens of {x.dtype} on {x.device})")
    if split is not None or activations == "split":
        if config is not None and len(config) != 6:
            raise KernelArgumentError(f"{_OP}: config {config} with split activations: (BLOCK_R, BLOCK_N, BLOCK_K, "
                                      "num_warps, num_stages, SPLIT_K)")
        if split is None:
            split = ActivationSplit.empty(num_tokens, in_features, x.device)
            split_activations(x, split)
        else:
            check_split(_OP, split, x)
        return split_gemm(weight, split, scale, bias, out,
                          config or _split_block_sizes(num_tokens, out_features, in_features), lora_a, x)
    if activations != "exact":
        raise KernelArgumentError(f"{_OP}: activations={activations!r} (\"exact\" or \"split\")")
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
                   bias: torch.Tensor | None = None, *, split: ActivationSplit | None = None,
                   lora_a: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` over an FP8 weight (plain torch, fp32 math).

    Args:
        x: ``[T, K]`` fp16/bf16/fp32 activations (last dim stride 1 for Triton).
        weight: ``[N, K]`` ``torch.float8_e4m3fn`` quantized weight.
        scale: ``[N]`` float32 per-output-channel scale (dequantized ``W = weight * scale``).
        bias: optional ``[N]`` bias in x.dtype.
        split: optional :class:`ActivationSplit` of ``x``, which then stands for x (:data:`SPLIT_ACTIVATIONS`).
        lora_a: optional ``[R, K]`` in x.dtype: a LoRA shrink folded into the GEMM (every slot's A rows,
            ``LinearWithLoRA.fold_lora_a``); its R columns follow the weight's: ``x @ lora_a.T`` (x itself, not its
            split), no scale, no bias.

    Returns:
        ``[T, N]`` (with ``lora_a``: ``[T, N + R]``) in x.dtype (accumulated in fp32).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, weight, scale, bias)
    if split is not None:
        check_split(_OP, split, x)
    if lora_a is not None:
        _check_lora_a(x, lora_a)
    xf = x.to(torch.float32) if split is None else split.values()
    out = (xf @ weight.to(torch.float32).T) * scale
    if bias is not None:
        out = out + bias.to(torch.float32)
    if lora_a is not None:
        out = torch.cat([out, x.to(torch.float32) @ lora_a.to(torch.float32).T], dim=1)
    return out.to(x.dtype)


def fp8_linear_split_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """:data:`SPLIT_ACTIVATIONS` in plain torch (fp32 math, torch's nearest-even e4m3 casts): ``x`` as
    ``s * (h + l / 16)``, then :func:`fp8_linear_ref`'s product. ``[T, K]`` ``x`` -> ``[T, N]`` in x.dtype.
    The split holds x to about 2^-8 of each element (two 3-bit mantissas), finer than x's own bf16 rounding but not
    fp16's (relative output error at K = 4096: ~1e-7 for bf16 x, 6.7e-4 for fp16 x). The GPU kernel adds its tensor
    cores' e4m3 accumulation (Triton's sm_90 default: the whole K loop in their reduced-precision accumulator): on
    the H200 the bf16 output's error against the exact product is 1.8e-3 at K = 4096 and 3.1e-3 at 11008, against
    1.65e-3 for W8A16's (its bf16 rounding; RESULTS.md session 27).

    Raises:
        KernelArgumentError: as :func:`fp8_linear_ref`.
    """
    _check_args(x, weight, scale, bias)
    bias = None if bias is None else bias.to(torch.float32)
    return fp8_linear_ref(split_activations_ref(x), weight, scale, bias).to(x.dtype)


def split_scale(amax: torch.Tensor) -> torch.Tensor:
    """:data:`SPLIT_ACTIVATIONS`' ``s``: the least power of two at or above ``max(amax, 1e-30) / 448`` (float32);
    NaN where ``amax`` is NaN or inf (a row holding either)."""
    t = amax.to(torch.float32).clamp_min(1e-30) / 448.0
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2^exponent, mantissa in [0.5, 1)
    s = torch.where(mantissa == 0.5, t, torch.ldexp(torch.ones_like(t), exponent))
    return torch.where(torch.isfinite(t), s, torch.full_like(t, float("nan")))


def _split_terms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s [T, 1], h [T, K], l [T, K])`` of :data:`SPLIT_ACTIVATIONS` in torch (h, l e4m3; 0 in a NaN-s row)."""
    xf = x.to(torch.float32)
    s = split_scale(xf.abs().amax(dim=1, keepdim=True))
    v = (xf / s).clamp(-448.0, 448.0)
    v = torch.where(torch.isnan(s), torch.zeros_like(v), v)
    h = v.to(FP8_DTYPE)
    return s, h, ((v - h.to(torch.float32)) * 16.0).to(FP8_DTYPE)


def split_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """``s[t] * (h[t, k] + l[t, k] / 16)`` in float32 (:data:`SPLIT_ACTIVATIONS`'s representation of ``x [T, K]``)."""
    s, h, lo = _split_terms(x)
    return (h.to(torch.float32) + lo.to(torch.float32) / 16.0) * s


FP8_LINEAR = Op(
    name=_OP,
    semantics="out[t, n] = scale[n] * sum_k x[t, k] * float(weight[n, k]) + bias[n]  (weight e4m3, fp32 accumulation);"
    " with lora_a: out[t, N + r] = sum_k x[t, k] * lora_a[r, k]",
    reference=fp8_linear_ref,
    triton=_launch_fp8_linear,
)
