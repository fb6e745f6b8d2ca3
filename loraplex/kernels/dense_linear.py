"""Dense linear over bf16 weights at decode-sized token counts: a Triton GEMM where it reads the weights faster than
cuBLAS, cuBLAS (``F.linear``) everywhere else.

Semantics: :data:`DENSE_LINEAR`. A decode step reads every weight once for a handful of tokens, so these GEMMs are
bound by weight bytes; on an H200 cuBLAS reads Llama-2-7B's linears at ~0.85 of copy bandwidth at 1-32 tokens
(issue 16, benchmarks/RESULTS.md session 18). Three kernels:

- tiled (``kind`` ``"tm"``, token-major: a 16-64-token tile times a weight tile transposed; ``"swap"``: the weight
  tile times the token tile transposed, so that the weight tile is the dot's 64/128-row side), ``tl.dot`` with
  fp32 accumulation, one program per (column tile, token tile), or per (column tile, token tile, K split) with a
  config's ``split_k``: serial split-K (CUTLASS's "split-K serial"), each split's fp32 partial through a workspace
  and the last program of a tile (a counter per tile, set back to zero) adding them in split order, so the result
  does not depend on which program finishes last;
- GEMV (``"gemv"``, one token): fp32 products on CUDA cores, summed along K per column;
- stream-K (``"streamk"``, ``"streamk_tma"``: swapped tiles through pointer or TMA loads), a persistent grid of a
  config's ``programs`` that splits the launch's (output tile, K tile) iterations into equal contiguous ranges
  (Osama et al., PPoPP 2023), so that every SM streams the same weight bytes however few output tiles there are
  (4096 output columns are 32-64 tiles on 132 SMs); partial tiles go through a workspace and are summed in program
  order by the program that completes them (a counter per tile), so the result is deterministic too.

Which one runs, and with which tiles, comes from :data:`MEASURED_CONFIGS`: the best of an H200 sweep
(``benchmarks/diag_dense_linear.py``) per token bucket and weight shape, kept only where it beat cuBLAS in the same
run. Any other device, dtype or shape, and every step over 128 tokens, takes ``F.linear``: that is the measured
choice there, not a fallback from an error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels._checks import check_device, check_dtype, check_last_dim_contiguous, check_same_dtype, check_shape
from loraplex.kernels._triton import (LAUNCH_COUNTERS, device_name, dot_dtype, dot_precision, launch_counters,
                                      max_shared_memory, pdl_args, pdl_prefetch, pdl_prefetch_columns, pdl_trigger,
                                      pdl_wait, require_triton, tl, triton)
from loraplex.kernels.activation import _gated, gelu_tanh_and_mul_ref, silu_and_mul_ref
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.op import Op
from loraplex.kernels.rms_norm import rms_norm_ref

_OP = "dense_linear"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _load_input(ptrs, in_features, norm_ptrs, mask, k_mask, sumsq, EVEN: tl.constexpr, NORM: tl.constexpr,
                ACT: tl.constexpr, GELU_TANH: tl.constexpr, AXIS: tl.constexpr):
    """A tile of the GEMM's input ``u`` (:data:`DENSE_LINEAR`) at ``ptrs`` into x, in x's dtype, and ``sumsq`` plus
    the tile's sums of squares along ``AXIS`` (NORM): the activation of the gate half times the up half
    ``in_features`` columns on (ACT), or x times the norm weight at ``norm_ptrs`` (NORM; the rows' rsqrt scales the
    output), or x itself. ``EVEN``: no masks (every row and column in range)."""
    if EVEN:
        x = tl.load(ptrs)
        if ACT:
            x = _gated(x, tl.load(ptrs + in_features), GELU_TANH)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
        if ACT:
            x = _gated(x, tl.load(ptrs + in_features, mask=mask, other=0.0), GELU_TANH)
    if NORM:
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=AXIS)
        nw = tl.load(norm_ptrs) if EVEN else tl.load(norm_ptrs, mask=k_mask, other=0.0)
        x = (xf * nw.to(tl.float32)).to(x.dtype)
    return x, sumsq


@triton.jit
def _prefetch_weights(w_ptr, cols, k_first, out_features, in_features, stride_wn, PREFETCH_K: tl.constexpr,
                      LINE: tl.constexpr):
    """Before the PDL wait: ``PREFETCH_K`` columns from ``k_first`` of the tile's weight rows ``cols`` into L2, one
    request per ``LINE`` elements (128 bytes); nothing where ``PREFETCH_K`` is 0."""
    if PREFETCH_K > 0:
        k = k_first + tl.arange(0, PREFETCH_K // LINE) * LINE
        pdl_prefetch(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                     (cols[:, None] < out_features) & (k[None, :] < in_features), w_ptr, True)


@triton.jit
def _store_swapped_tile(acc, rows, cols, bias_ptr, residual_ptr, out_ptr, num_tokens, out_features, stride_rt,
                        stride_ot, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Epilogue of a swapped tile ``acc[n, t]`` (fp32, ``[BLOCK_N, BLOCK_T]``) of output columns ``cols`` and token
    rows ``rows``: plus ``bias[n]`` and ``residual[t, n]``, rounded to out's dtype, stored in range."""
    col_mask = cols < out_features
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    mask = col_mask[:, None] & (rows < num_tokens)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + rows[None, :].to(tl.int64) * stride_rt + cols[:, None], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_ot + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _dense_linear_kernel(x_ptr, w_ptr, bias_ptr, norm_w_ptr, residual_ptr, out_ptr, ws_ptr, counter_ptr, num_tokens,
                         out_features, in_features, k_per_split, stride_xt, stride_wn, stride_rt, stride_ot, eps,
                         HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr, GELU_TANH: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
                         PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64, SPLIT_K: tl.constexpr = 1):
    # out[t, n] = sum_k u[t, k] * w[n, k] (* inv_rms[t]) + bias[n] + residual[t, n] (DENSE_LINEAR); grid (column
    # tiles, token tiles, K splits). Token-major: acc[t, n] = u_tile @ w_tile^T; SWAP: acc[n, t] = w_tile @ u_tile^T
    # (the weight tile as the dot's M side: Hopper's wgmma takes 64-row M tiles, and a 16/32-token tile is its N).
    # SPLIT_K > 1: each program sums k_per_split columns of K; the last program of a tile to finish adds the splits'
    # fp32 partials (in split order) and runs the epilogue (serial split-K: a counter per output tile).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_first = tl.program_id(2) * k_per_split
    _prefetch_weights(w_ptr, cols, k_first, out_features, in_features, stride_wn, PREFETCH_K, LINE)
    pdl_wait(USE_PDL)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    col_mask = cols < out_features
    row_mask = rows < num_tokens
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    k_end = tl.minimum(k_first + k_per_split, in_features)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & k_mask[None, :]
        w_mask = col_mask[:, None] if EVEN_K else col_mask[:, None] & k_mask[None, :]
        x, sumsq = _load_input(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :], in_features,
                               norm_w_ptr + k[None, :], x_mask, k_mask[None, :], sumsq, False, NORM, ACT, GELU_TANH, 1)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :], mask=w_mask, other=0.0)
        if SWAP:
            acc += tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), input_precision=PRECISION)
        else:
            acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    pdl_trigger(USE_PDL)
    if SPLIT_K > 1:
        if SWAP:
            offsets = rows[None, :].to(tl.int64) * out_features + cols[:, None]
            tile_mask = col_mask[:, None] & row_mask[None, :]
        else:
            offsets = rows[:, None].to(tl.int64) * out_features + cols[None, :]
            tile_mask = row_mask[:, None] & col_mask[None, :]
        split_stride = tl.cast(out_features, tl.int64) * num_tokens
        tl.store(ws_ptr + tl.program_id(2) * split_stride + offsets, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial stored before the counter says so (the atomic releases them)
        counter = counter_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") != SPLIT_K - 1:
            return
        # the last of the tile's programs: every partial is visible (acquire); read them past L1
        acc = tl.load(ws_ptr + offsets, mask=tile_mask, other=0.0, cache_modifier=".cg")
        for split in range(1, SPLIT_K):
            acc += tl.load(ws_ptr + split * split_stride + offsets, mask=tile_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch (or graph replay)
    inv = tl.math.rsqrt(sumsq / in_features + eps)  # used with NORM only
    if SWAP:
        if NORM:
            acc *= inv[None, :]
        _store_swapped_tile(acc, rows, cols, bias_ptr, residual_ptr, out_ptr, num_tokens, out_features, stride_rt,
                            stride_ot, HAS_BIAS, HAS_RESIDUAL)
    else:
        if NORM:
            acc *= inv[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(residual_ptr + rows[:, None].to(tl.int64) * stride_rt + cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _dense_streamk_kernel(x_ptr, w_ptr, x_desc, w_desc, bias_ptr, residual_ptr, out_ptr, ws_ptr, counter_ptr,
                          num_tokens, out_features, in_features, stride_xt, stride_wn, stride_rt, stride_ot,
                          HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_N: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
    # out[t, n] = sum_k x[t, k] * w[n, k] + bias[n] + residual[t, n] (DENSE_LINEAR), stream-K (Osama et al., "Stream-K:
    # Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on the GPU", PPoPP 2023): the
    # launch's (output tile, K tile) iterations, K fastest, then column tiles, then token tiles, are split into P
    # contiguous ranges of equal length (+-1), one per program of a grid of P, so every program streams the same
    # weight bytes whatever the tile count. A range covers whole tiles (stored directly) and at most two partial
    # ones: its first segment (workspace slot (p, 0)) and its last (slot (p, 1)). The program that completes a
    # tile's K tiles (a counter per tile adds each segment's K tiles) sums the tile's partials in program order, so
    # the result does not depend on which program finishes last. Tiles are swapped (acc[n, t] = w_tile @ x_tile^T);
    # TMA: both tiles through Hopper's tensor memory accelerator (host descriptors), else pointer loads. Epilogues
    # run SUB_N (BLOCK_N or half of it) output columns at a time.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    col_tiles = tl.cdiv(out_features, BLOCK_N)
    k_tiles = tl.cdiv(in_features, BLOCK_K)
    total = (col_tiles * tl.cdiv(num_tokens, BLOCK_T)).to(tl.int64) * k_tiles
    first = (pid.to(tl.int64) * total // programs).to(tl.int32)
    end = ((pid + 1).to(tl.int64) * total // programs).to(tl.int32)
    tile_offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    pdl_wait(USE_PDL)
    it = first
    while it < end:
        tile = it // k_tiles
        k_first = it - tile * k_tiles
        k_count = tl.minimum(k_tiles - k_first, end - it)
        col0 = (tile % col_tiles) * BLOCK_N
        row0 = (tile // col_tiles) * BLOCK_T
        cols = col0 + tl.arange(0, BLOCK_N)
        rows = row0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
        for kt in tl.range(k_first, k_first + k_count):
            if TMA:  # out-of-range rows and columns read as zeros
                w = w_desc.load([col0, kt * BLOCK_K])
                x = x_desc.load([row0, kt * BLOCK_K])
            else:
                k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
                w_mask = (cols < out_features)[:, None]
                x_mask = (rows < num_tokens)[:, None]
                if not EVEN_K:
                    w_mask = w_mask & (k < in_features)[None, :]
                    x_mask = x_mask & (k < in_features)[None, :]
                w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :], mask=w_mask, other=0.0)
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :], mask=x_mask, other=0.0)
            acc += tl.dot(w.to(DOT_DTYPE), tl.trans(x.to(DOT_DTYPE)), input_precision=PRECISION)
        if it + k_count == end:  # the program's last K loop: the "late" trigger, before its last epilogue
            pdl_trigger(USE_PDL)
        if k_count == k_tiles:  # the whole tile in this program
            if SUB_N == BLOCK_N:
                _store_swapped_tile(acc, rows, cols, bias_ptr, residual_ptr, out_ptr, num_tokens, out_features,
                                    stride_rt, stride_ot, HAS_BIAS, HAS_RESIDUAL)
            else:  # in two halves of SUB_N columns (fewer live registers than a whole 256-column tile)
                lo, hi = tl.split(tl.permute(tl.reshape(acc, [2, SUB_N, BLOCK_T]), [1, 2, 0]))
                _store_swapped_tile(lo, rows, col0 + tl.arange(0, SUB_N), bias_ptr, residual_ptr, out_ptr,
                                    num_tokens, out_features, stride_rt, stride_ot, HAS_BIAS, HAS_RESIDUAL)
                _store_swapped_tile(hi, rows, col0 + SUB_N + tl.arange(0, SUB_N), bias_ptr, residual_ptr, out_ptr,
                                    num_tokens, out_features, stride_rt, stride_ot, HAS_BIAS, HAS_RESIDUAL)
        else:  # a partial tile: through the workspace
            slot = (pid * 2 + tl.where(it == first, 0, 1)).to(tl.int64) * (BLOCK_N * BLOCK_T)
            tl.store(ws_ptr + slot + tile_offsets, acc)
            tl.debug_barrier()  # every thread's partial stored before the counter says so (the atomic releases them)
            if tl.atomic_add(counter_ptr + tile, k_count, sem="acq_rel", scope="gpu") + k_count == k_tiles:
                # the tile's last segment: every partial is visible (acquire); read them past L1, SUB_N columns
                # at a time, and store the sums
                tile_first = tile.to(tl.int64) * k_tiles
                q_first = ((tile_first + 1) * programs - 1) // total  # the program whose range holds tile_first
                q_last = ((tile_first + k_tiles) * programs - 1) // total
                for sub in tl.static_range(BLOCK_N // SUB_N):
                    sub_cols = sub * SUB_N + tl.arange(0, SUB_N)
                    part = tl.zeros([SUB_N, BLOCK_T], tl.float32)
                    for q in range(q_first, q_last + 1):
                        # q's partial of this tile is its first segment unless q began in an earlier tile
                        q_slot = (q * 2 + tl.where(q * total // programs >= tile_first, 0, 1)) * (BLOCK_N * BLOCK_T)
                        part += tl.load(ws_ptr + q_slot + sub_cols[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :],
                                        cache_modifier=".cg")
                    _store_swapped_tile(part, rows, col0 + sub_cols, bias_ptr, residual_ptr, out_ptr, num_tokens,
                                        out_features, stride_rt, stride_ot, HAS_BIAS, HAS_RESIDUAL)
                tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        it += k_count


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, norm_w_ptr, residual_ptr, out_ptr, out_features, in_features,
                       stride_wn, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, ACT: tl.constexpr,
                       GELU_TANH: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
                       PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64):
    # out[0, n] = sum_k u[0, k] * w[n, k] (* inv_rms) + bias[n] + residual[0, n]: products and sums in fp32 on CUDA
    # cores, one column tile each
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _prefetch_weights(w_ptr, cols, 0, out_features, in_features, stride_wn, PREFETCH_K, LINE)
    pdl_wait(USE_PDL)
    col_mask = cols < out_features
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sumsq = tl.sum(tl.zeros([BLOCK_K], tl.float32), axis=0)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        x, sumsq = _load_input(x_ptr + k, in_features, norm_w_ptr + k, k_mask, k_mask, sumsq, EVEN_K, NORM, ACT,
                               GELU_TANH, 0)
        if EVEN_K:
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :], mask=col_mask[:, None],
                        other=0.0)
        else:
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    pdl_trigger(USE_PDL)
    out = tl.sum(acc, axis=1)
    if NORM:
        out *= tl.math.rsqrt(sumsq / in_features + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        out += tl.load(residual_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


# (kind, BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k | programs]); kind "tm", "swap", "gemv",
# "streamk" or "streamk_tma". tm and swap: split_k (default 1) splits K over that many programs per output tile;
# streamk kinds (swapped tiles, pointer or TMA loads): the programs of the persistent grid (required; at most the
# launch's tile x K-tile iterations are launched). Neither splitting kind takes an input norm or activation.
DenseConfig = tuple[str, int, int, int, int, int] | tuple[str, int, int, int, int, int, int]
STREAMK_KINDS = ("streamk", "streamk_tma")
KINDS = ("tm", "swap", "gemv", *STREAMK_KINDS)

# Measured on an H200 (bf16, benchmarks/diag_dense_linear.py): {(device name, token bucket, out_features,
# in_features): config} where the config beat cuBLAS in a CUDA graph of 32 layers. Token buckets: 1, 16, 32, 64, 128
# (a step's token count rounded up to the next of them).
_H200 = "NVIDIA H200"
MEASURED_CONFIGS: dict[tuple[str, int, int, int], DenseConfig] = {
    # Session 19 (benchmarks/RESULTS.md): Llama-2-7B's and Llama-3-8B's linears and head, µs per call in a
    # 32-layer CUDA graph, cuBLAS's in brackets. Shapes where cuBLAS was within 2% are left out (Llama-2 gate_up and
    # o at 64 tokens, Llama-3 gate_up at 32, folded qkv at 32), and so is every shape at 128 tokens (cuBLAS fastest
    # for all five).
    # Llama-2-7B: qkv 12288 x 4096, o 4096 x 4096, gate_up 22016 x 4096, down 4096 x 11008, head 32000 x 4096
    (_H200, 1, 12288, 4096): ("swap", 16, 64, 128, 4, 4),  # 24.9 (27.9)
    (_H200, 1, 4096, 4096): ("gemv", 1, 4, 512, 4, 3),  # 10.9 (13.2)
    (_H200, 1, 22016, 4096): ("swap", 16, 64, 128, 4, 3),  # 42.6 (44.6)
    (_H200, 1, 4096, 11008): ("gemv", 1, 4, 512, 4, 3),  # 23.5 (27.7)
    (_H200, 1, 32000, 4096): ("swap", 16, 128, 128, 4, 3),  # 60.4 (63.5)
    (_H200, 16, 12288, 4096): ("swap", 16, 64, 128, 4, 4),  # 25.7 (27.3)
    (_H200, 16, 4096, 4096): ("tm", 16, 32, 512, 4, 4),  # 11.3 (13.6)
    (_H200, 16, 22016, 4096): ("swap", 16, 64, 128, 4, 3),  # 43.4 (44.7)
    (_H200, 16, 4096, 11008): ("tm", 16, 32, 512, 4, 4),  # 24.3 (28.2)
    (_H200, 16, 32000, 4096): ("swap", 16, 128, 128, 4, 3),  # 61.3 (64.1)
    (_H200, 32, 12288, 4096): ("swap", 32, 128, 128, 4, 4),  # 26.5 (28.2)
    (_H200, 32, 4096, 4096): ("tm", 32, 32, 256, 4, 4),  # 11.9 (13.0); Llama-3 run 11.6 (13.8)
    (_H200, 32, 22016, 4096): ("swap", 32, 64, 64, 4, 4),  # 44.3 (45.1)
    (_H200, 32, 4096, 11008): ("tm", 32, 32, 256, 4, 4),  # 25.9 (26.9)
    (_H200, 32, 32000, 4096): ("swap", 32, 64, 64, 4, 3),  # 62.4 (65.4)
    (_H200, 64, 12288, 4096): ("tm", 64, 128, 128, 4, 4),  # 27.4 (28.5)
    (_H200, 64, 4096, 11008): ("tm", 64, 32, 256, 4, 4),  # 26.5 (29.5)
    (_H200, 64, 32000, 4096): ("swap", 64, 128, 64, 8, 3),  # 65.5 (67.6)
    # Llama-3-8B: qkv 6144 x 4096, o as Llama-2's, gate_up 28672 x 4096, down 4096 x 14336, head 128256 x 4096
    (_H200, 1, 6144, 4096): ("gemv", 1, 8, 512, 4, 1),  # 14.2 (16.0)
    (_H200, 1, 28672, 4096): ("gemv", 1, 16, 256, 4, 3),  # 54.1 (55.7)
    (_H200, 1, 4096, 14336): ("tm", 16, 32, 512, 4, 4),  # 29.3 (31.5)
    (_H200, 1, 128256, 4096): ("gemv", 1, 16, 256, 4, 3),  # 230.4 (238.3)
    (_H200, 32, 6144, 4096): ("swap", 32, 64, 256, 4, 4),  # 15.5 (16.1)
    (_H200, 32, 4096, 14336): ("tm", 32, 32, 256, 4, 4),  # 32.2 (33.1)
    (_H200, 32, 128256, 4096): ("tm", 32, 128, 128, 4, 3),  # 240.8 (255.0)
    # Llama-2-7B's folded LoRA linears ([W; A pages], the shrink in the base GEMM) of a pool of 32 r=16 slots:
    # qkv 12288 + 3 x 512 rows, o 4096 + 512, gate_up 22016 + 2 x 512, down 4096 + 512 (K 11008)
    (_H200, 1, 13824, 4096): ("swap", 16, 64, 128, 4, 4),  # 27.8 (30.5)
    (_H200, 1, 4608, 4096): ("gemv", 1, 4, 512, 4, 1),  # 11.5 (15.0)
    (_H200, 1, 23040, 4096): ("swap", 16, 64, 128, 4, 3),  # 44.3 (48.1)
    (_H200, 1, 4608, 11008): ("gemv", 1, 4, 512, 4, 1),  # 25.8 (30.3)
    (_H200, 32, 4608, 4096): ("swap", 32, 64, 256, 4, 4),  # 12.5 (12.9)
    (_H200, 32, 23040, 4096): ("swap", 32, 64, 128, 4, 3),  # 46.2 (48.1)
    (_H200, 32, 4608, 11008): ("swap", 32, 64, 256, 4, 4),  # 28.0 (31.9)
}
TOKEN_BUCKETS = (1, 16, 32, 64, 128)


def configs_to_json(table: dict[tuple[str, int, int, int], DenseConfig]) -> str:
    """:data:`MEASURED_CONFIGS`-shaped ``table`` as JSON (a list of rows), as benchmarks write it."""
    import json

    return json.dumps([{"device": d, "tokens": t, "out_features": n, "in_features": k, "config": list(c)}
                       for (d, t, n, k), c in table.items()], indent=1)


def configs_from_json(text: str) -> dict[tuple[str, int, int, int], DenseConfig]:
    """Inverse of :func:`configs_to_json`. Raises ``ValueError`` for a row that is not a config
    (:func:`check_dense_config`) or a token count that is not a bucket."""
    import json

    table = {}
    for row in json.loads(text):
        config = tuple(row["config"])
        if len(config) not in (6, 7) or row["tokens"] not in TOKEN_BUCKETS:
            raise ValueError(f"dense_linear: bad table row {row}")
        try:
            check_dense_config(config, row["tokens"])
        except KernelArgumentError as exc:
            raise ValueError(str(exc)) from exc
        tiles = -(-row["out_features"] // config[2]) * -(-row["tokens"] // config[1])
        if splits_k(config) and tiles > LAUNCH_COUNTERS:
            raise ValueError(f"dense_linear: bad table row {row}: {tiles} split-K tiles (at most {LAUNCH_COUNTERS})")
        table[(row["device"], row["tokens"], row["out_features"], row["in_features"])] = config
    return table


def token_bucket(num_tokens: int) -> int | None:
    """The :data:`TOKEN_BUCKETS` entry ``num_tokens`` falls in (the least one at or above it); None above 128."""
    for bucket in TOKEN_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return None


# The decode layer's fusions (``fusion_name``): qkv_proj and gate_up_proj take a norm, o_proj a residual add,
# down_proj the gated activation and a residual add.
FUSIONS = ("norm", "residual", "gated+residual")

# Measured on an H200 (bf16, benchmarks/diag_fused_linear.py): {(device name, token bucket, out_features, in_features,
# fusion): config} where the fused launch beat the table's plain launch plus the separate kernel it replaces.
MEASURED_FUSED_CONFIGS: dict[tuple[str, int, int, int, str], DenseConfig] = {}


def fusion_name(norm_weight: torch.Tensor | None, activation: str | None, residual: torch.Tensor | None) -> str | None:
    """The :data:`FUSIONS`-style name of a call's input transform and residual (``"gated"``, ``"norm+residual"`` for
    the combinations no table holds), None for a plain GEMM."""
    parts = ["norm"] if norm_weight is not None else ["gated"] if activation is not None else []
    parts += ["residual"] if residual is not None else []
    return "+".join(parts) or None


def fused_configs_to_json(table: dict[tuple[str, int, int, int, str], DenseConfig]) -> str:
    """:data:`MEASURED_FUSED_CONFIGS`-shaped ``table`` as JSON (a list of rows), as benchmarks write it."""
    import json

    return json.dumps([{"device": d, "tokens": t, "out_features": n, "in_features": k, "fusion": f, "config": list(c)}
                       for (d, t, n, k, f), c in table.items()], indent=1)


def fused_configs_from_json(text: str) -> dict[tuple[str, int, int, int, str], DenseConfig]:
    """Inverse of :func:`fused_configs_to_json`. Raises ``ValueError`` for a bad row (as :func:`configs_from_json`) or
    a fusion not in :data:`FUSIONS`."""
    import json

    table = {}
    for row in json.loads(text):
        if row.get("fusion") not in FUSIONS:
            raise ValueError(f"dense_linear: fused table row {row}: fusion not one of {FUSIONS}")
        plain = {k: v for k, v in row.items() if k != "fusion"}
        ((key, config),) = configs_from_json(json.dumps([plain])).items()
        if splits_k(config) and row["fusion"] != "residual":
            raise ValueError(f"dense_linear: fused table row {row}: split-K with an input {row['fusion']} (whole rows "
                             "needed; only the residual fusion splits)")
        table[(*key, row["fusion"])] = config
    return table


_active: dict[tuple[str, int, int, int], DenseConfig] = MEASURED_CONFIGS
_active_fused: dict[tuple[str, int, int, int, str], DenseConfig] = MEASURED_FUSED_CONFIGS


def use_configs(table: dict[tuple[str, int, int, int], DenseConfig]) -> dict[tuple[str, int, int, int], DenseConfig]:
    """Make ``table`` (:data:`MEASURED_CONFIGS`-shaped) the one :func:`dense_linear_config` reads, for benchmarks
    and tests (``{}``: cuBLAS everywhere); returns the table it replaces. Launches captured in CUDA graphs keep the
    config they were captured with."""
    global _active
    previous, _active = _active, table
    return previous


def use_fused_configs(table: dict[tuple[str, int, int, int, str], DenseConfig],
                      ) -> dict[tuple[str, int, int, int, str], DenseConfig]:
    """:func:`use_configs` for the fused launches (:data:`MEASURED_FUSED_CONFIGS`-shaped; ``{}``: no GEMM fuses)."""
    global _active_fused
    previous, _active_fused = _active_fused, table
    return previous


def dense_linear_config(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype,
                        device: torch.device, fusion: str | None = None) -> DenseConfig | None:
    """The measured Triton launch for this GEMM, or None where ``F.linear`` (cuBLAS) is the faster or the only
    measured choice: off CUDA, for dtypes other than bf16, above 128 tokens and for shapes not in the table
    (:data:`MEASURED_CONFIGS`, or :func:`use_configs`'). Shapes match exactly: a tensor-parallel shard or a folded
    LoRA linear (``[W; A pages]``) takes a launch only where its own shape was measured. With ``fusion``
    (:func:`fusion_name`) the launch comes from :data:`MEASURED_FUSED_CONFIGS`: None there means the fused call is
    not the faster one (or not measured)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    bucket = token_bucket(num_tokens)
    if bucket is None:
        return None
    if fusion is not None:
        return _active_fused.get((device_name(device), bucket, out_features, in_features, fusion))
    return _active.get((device_name(device), bucket, out_features, in_features)) if _active else None


MAX_SPLIT_K = 16
MAX_STREAMK_PROGRAMS = 4096


def split_k_of(config: DenseConfig) -> int:
    """The serial K splits of a tm/swap launch config: its seventh entry, 1 for the six-entry configs and for the
    other kinds."""
    return config[6] if len(config) > 6 and config[0] not in STREAMK_KINDS else 1


def programs_of(config: DenseConfig) -> int | None:
    """The persistent grid of a stream-K launch config (its seventh entry), None for the other kinds."""
    return config[6] if config[0] in STREAMK_KINDS and len(config) > 6 else None


def splits_k(config: DenseConfig) -> bool:
    """Whether a launch may sum an output tile over several programs (serial split-K or stream-K): it then needs a
    tile counter per output tile and cannot take an input norm or activation (whole rows)."""
    return split_k_of(config) > 1 or config[0] in STREAMK_KINDS


def check_dense_config(config: DenseConfig, num_tokens: int) -> None:
    """Raise :class:`KernelArgumentError` for a launch config the kernels cannot run."""
    if len(config) not in (6, 7):
        raise KernelArgumentError(f"{_OP}: bad config {config}: (kind, BLOCK_T, BLOCK_N, BLOCK_K, warps, stages"
                                  "[, split_k | programs])")
    kind, block_t, block_n, block_k, warps, stages = config[:6]
    problems = []
    if kind in STREAMK_KINDS:
        programs = programs_of(config)
        if not (isinstance(programs, int) and 1 <= programs <= MAX_STREAMK_PROGRAMS):
            problems.append(f"programs={programs!r} (1..{MAX_STREAMK_PROGRAMS}, required for {kind})")
        if kind == "streamk_tma" and max(block_t, block_n, block_k) > 256:
            problems.append(f"tiles {block_t}x{block_n}x{block_k} (a TMA box is at most 256 per dimension)")
    else:
        split_k = split_k_of(config)
        if not (isinstance(split_k, int) and 1 <= split_k <= MAX_SPLIT_K):
            problems.append(f"split_k={split_k!r} (1..{MAX_SPLIT_K})")
        elif split_k > 1 and kind == "gemv":
            problems.append("split_k with gemv (the tiled kernels split K)")
    if kind not in KINDS:
        problems.append(f"kind={kind!r} (one of {', '.join(KINDS)})")
    if kind == "gemv" and num_tokens != 1:
        problems.append(f"gemv with {num_tokens} tokens (one)")
    if kind != "gemv" and (block_t < 16 or block_n < 16 or block_k < 16):
        problems.append(f"tiles {block_t}x{block_n}x{block_k} (tl.dot needs >= 16 each)")
    if any(b & (b - 1) for b in (block_t, block_n, block_k)):
        problems.append(f"tiles {block_t}x{block_n}x{block_k} (powers of two)")
    if warps not in (1, 2, 4, 8) or not 1 <= stages <= 6:
        problems.append(f"num_warps={warps}, num_stages={stages}")
    if problems:
        raise KernelArgumentError(f"{_OP}: bad config {config}: " + "; ".join(problems))


ACTIVATIONS = ("silu", "gelu_tanh")


def _check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                norm_eps: float, activation: str | None, residual: torch.Tensor | None) -> None:
    check_dtype(_OP, "x", x, _DTYPES)
    check_shape(_OP, "x", x, (None, None))
    if activation is not None and activation not in ACTIVATIONS:
        raise KernelArgumentError(f"{_OP}: activation={activation!r}, expected one of {ACTIVATIONS} or None")
    if activation is not None and norm_weight is not None:
        raise KernelArgumentError(f"{_OP}: norm_weight and activation together (one input transform per GEMM)")
    in_features = x.shape[1] // 2 if activation is not None else x.shape[1]
    if activation is not None and x.shape[1] % 2:
        raise KernelArgumentError(f"{_OP}: x has {x.shape[1]} columns; activation {activation!r} takes gate/up halves")
    check_shape(_OP, "weight", weight, (None, in_features))
    check_same_dtype(_OP, "weight", weight, "x", x)
    check_device(_OP, "weight", weight, x.device)
    for name, tensor, shape in (("bias", bias, (weight.shape[0],)), ("norm_weight", norm_weight, (in_features,)),
                                ("residual", residual, (x.shape[0], weight.shape[0]))):
        if tensor is not None:
            check_shape(_OP, name, tensor, shape)
            check_same_dtype(_OP, name, tensor, "x", x)
            check_device(_OP, name, tensor, x.device)
    if norm_weight is not None and not norm_eps > 0:
        raise KernelArgumentError(f"{_OP}: norm_eps={norm_eps} (> 0)")


def _gated_stages(block_t: int, block_n: int, block_k: int, stages: int, elem_bytes: int,
                  shared_memory_bytes: int) -> int:
    """Pipeline stages for a tiled launch whose input is gated (two x tiles, gate and up, per K step): the measured
    config's, less one at a time (down to 2) until ``(2 * BLOCK_T + BLOCK_N) * BLOCK_K`` elements per stage fit 7/8
    of the device's shared memory (the rest left to the epilogue and the compiler's layouts)."""
    per_stage = (2 * block_t + block_n) * block_k * elem_bytes
    while stages > 2 and per_stage * stages > shared_memory_bytes * 7 // 8:
        stages -= 1
    return stages


def _launch_dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                         activation: str | None = None, residual: torch.Tensor | None = None,
                         config: DenseConfig | None = None) -> torch.Tensor:
    """Triton launch of :func:`dense_linear_ref` with ``config`` (benchmarks and tests), else with
    :func:`dense_linear_config`'s measured one (the fused table's for a call with an input transform or a residual).
    Where there is none: ``F.linear`` itself, unchecked (bad arguments
    then raise ``F.linear``'s ``RuntimeError``: the checks cost host time on every eager step's linears), or, with an
    input transform or residual, :func:`dense_linear_ref`'s composition of separate ops (the engine fuses only where
    the fused table has a launch: ``loraplex.engine.models.llama``)."""
    if config is None:
        fusion = fusion_name(norm_weight, activation, residual)
        config = dense_linear_config(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device, fusion)
        if config is None:
            if fusion is not None:
                return dense_linear_ref(x, weight, bias, norm_weight=norm_weight, norm_eps=norm_eps,
                                        activation=activation, residual=residual)
            return F.linear(x, weight, bias)
    require_triton(_OP)
    _check_args(x, weight, bias, norm_weight, norm_eps, activation, residual)
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                         ("residual", residual)):
        if tensor is not None:
            check_last_dim_contiguous(_OP, name, tensor)
    num_tokens, in_features = x.shape[0], weight.shape[1]
    out_features = weight.shape[0]
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if out.numel() == 0:  # no tokens or no output columns: nothing to launch (a TMA descriptor takes no empty dim)
        return out
    check_dense_config(config, num_tokens)
    kind, block_t, block_n, block_k, warps, stages = config[:6]
    if in_features == 0 and kind != "gemv":  # no K tile: the tiled grid has no split, stream-K no iteration
        raise KernelArgumentError(f"{_OP}: in_features=0 with config {config} (the tiled and stream-K kernels take "
                                  "at least one K tile)")
    if splits_k(config) and (norm_weight is not None or activation is not None):
        raise KernelArgumentError(f"{_OP}: config {config} splits K; an input norm or activation needs whole rows")
    if kind in STREAMK_KINDS:
        _launch_streamk(x, weight, bias, residual, out, config)
        return out
    split_k = split_k_of(config)
    if activation is not None and kind != "gemv":
        stages = _gated_stages(block_t, block_n, block_k, stages, x.element_size(), max_shared_memory(x.device))
    bias_arg = bias if bias is not None else out
    norm_arg = norm_weight if norm_weight is not None else out
    residual_arg = residual if residual is not None else out
    flags = dict(HAS_BIAS=bias is not None, NORM=norm_weight is not None, ACT=activation is not None,
                 GELU_TANH=activation == "gelu_tanh", HAS_RESIDUAL=residual is not None,
                 EVEN_K=in_features % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                 num_stages=stages)
    pdl = pdl_args(x.device, _OP)
    flags.update(PREFETCH_K=pdl_prefetch_columns(pdl["USE_PDL"], in_features), LINE=128 // weight.element_size())
    if kind == "gemv":
        _dense_gemv_kernel[(triton.cdiv(out_features, block_n),)](
            x, weight, bias_arg, norm_arg, residual_arg, out, out_features, in_features, weight.stride(0),
            float(norm_eps), **flags, **pdl)
        return out
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k  # whole K tiles per split
    split_k = triton.cdiv(in_features, k_per_split)  # no empty split
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(num_tokens, block_t), split_k)
    if split_k > 1:
        ws = torch.empty((split_k, num_tokens, out_features), dtype=torch.float32, device=x.device)
        counters = launch_counters(_OP, x.device, grid[0] * grid[1])
    else:
        ws = counters = out
    _dense_linear_kernel[grid](
        x, weight, bias_arg, norm_arg, residual_arg, out, ws, counters, num_tokens, out_features, in_features,
        k_per_split, x.stride(0), weight.stride(0), residual_arg.stride(0), out.stride(0), float(norm_eps),
        SWAP=kind == "swap", BLOCK_T=block_t, DOT_DTYPE=dot_dtype(x.dtype, x.device),
        PRECISION=dot_precision(x.dtype, x.device), SPLIT_K=split_k, **flags, **pdl)
    return out


def _check_tma_operand(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`KernelArgumentError` unless ``tensor`` (2-D, last dim stride 1) can back a TMA descriptor: base
    address and row stride multiples of 16 bytes (CUDA's ``cuTensorMapEncodeTiled``)."""
    if tensor.data_ptr() % 16 or (tensor.stride(0) * tensor.element_size()) % 16:
        raise KernelArgumentError(f"{_OP}: {name} at address {tensor.data_ptr():#x} with a row stride of "
                                  f"{tensor.stride(0) * tensor.element_size()} bytes cannot be read by TMA (both must "
                                  "be multiples of 16 bytes); use a 'streamk' config")


def _launch_streamk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                    out: torch.Tensor, config: DenseConfig) -> None:
    """Launch :func:`_dense_streamk_kernel` for ``out = x @ weight.T + bias + residual`` with a checked stream-K
    ``config``: a grid of ``min(programs, iterations)`` programs, an fp32 workspace of two ``[BLOCK_N, BLOCK_T]``
    partial tiles per program and a counter per output tile (the device's launch counters, zero before and
    after). Raises :class:`KernelArgumentError` for more output tiles than counters, or for a TMA config whose
    operands are not 16-byte aligned."""
    kind, block_t, block_n, block_k, warps, stages, programs = config
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    tiles = triton.cdiv(out_features, block_n) * triton.cdiv(num_tokens, block_t)
    grid = (min(programs, tiles * triton.cdiv(in_features, block_k)),)
    counters = launch_counters(_OP, x.device, tiles)
    ws = torch.empty(grid[0] * 2 * block_n * block_t, dtype=torch.float32, device=x.device)
    if kind == "streamk_tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        _check_tma_operand("x", x)
        _check_tma_operand("weight", weight)
        x_desc = TensorDescriptor.from_tensor(x, [block_t, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    else:
        x_desc, w_desc = x, weight  # unused
    _dense_streamk_kernel[grid](
        x, weight, x_desc, w_desc, bias if bias is not None else out, residual if residual is not None else out, out,
        ws, counters, num_tokens, out_features, in_features, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else out.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, EVEN_K=in_features % block_k == 0, TMA=kind == "streamk_tma",
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, SUB_N=block_n // 2 if block_n > 128 else block_n,
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
        PRECISION=dot_precision(x.dtype, x.device), num_warps=warps, num_stages=stages, **pdl_args(x.device, _OP))


def dense_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                     activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``u @ weight.T + bias (+ residual)`` with ``u`` x itself, ``rms_norm(x)`` or ``act(gate) * up`` (plain torch:
    ``F.linear`` after HF's RMSNorm or gated activation, then the residual add, each rounded to x's dtype).

    A decode layer's norms, activation and residual adds ride in its GEMMs this way (no kernel of their own); the
    Triton kernels multiply x by the norm weight before the dot and the output rows by ``rsqrt(mean(x^2) + eps)``
    after it (the sum of squares gathered along the K loop), so they round once where HF rounds twice.

    Args:
        x: ``[T, K]`` bf16/fp16/fp32 activations, ``[T, 2K]`` (gate, then up) with ``activation`` (last dim stride 1
            for Triton).
        weight: ``[N, K]`` in x's dtype (last dim stride 1 for Triton).
        bias: optional ``[N]`` in x's dtype.
        norm_weight: optional ``[K]`` RMSNorm weight (Zhang & Sennrich 2019; HF ``LlamaRMSNorm``): ``u = rms_norm(x)``.
        norm_eps: its variance epsilon (> 0).
        activation: optional ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU): ``u = act(x[:, :K]) * x[:, K:]``.
        residual: optional ``[T, N]`` in x's dtype, added to the output (the residual stream's add).

    Returns:
        ``[T, N]`` in x's dtype (fp32 accumulation).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, ``norm_eps <= 0``, an unknown activation, norm and
            activation together, or a bad launch config (a Triton launch; where the Triton backend calls
            ``F.linear``, that function's ``RuntimeError``).
        TritonUnavailableError: a Triton launch without triton installed.
    """
    _check_args(x, weight, bias, norm_weight, norm_eps, activation, residual)
    if activation is not None:
        x = (silu_and_mul_ref if activation == "silu" else gelu_tanh_and_mul_ref)(x)
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, norm_eps)
    out = F.linear(x, weight, bias)
    return out if residual is None else out + residual


DENSE_LINEAR = Op(
    name=_OP,
    semantics="u = x | rms_norm(x, norm_weight) | act(x[:, :K]) * x[:, K:]; "
    "out[t, n] = sum_k u[t, k] * weight[n, k] + bias[n] + residual[t, n]  (fp32 accumulation)",
    reference=dense_linear_ref,
    triton=_launch_dense_linear,
)
