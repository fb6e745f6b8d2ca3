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
from loraplex.kernels._triton import (LAUNCH_COUNTERS, cdiv, launch_counters, next_pow2, pdl_args, pdl_wait,
                                      require_triton, tl, triton)
from loraplex.kernels.lora_delta import (CONSUMER_PAGES, LoRADelta, block_r, check_delta, delta_args,
                                         lora_delta_cols, lora_delta_ref, lora_row_programs, row_split, slot_pages,
                                         tile_columns)
from loraplex.kernels.fp8_linear import (SPLIT_FUSED_MAX, ActivationSplit, check_split, split_activations,
                                         split_row, write_split_ref)
from loraplex.kernels.op import Op

_OP = "rms_norm"


@triton.jit
def _add_residual(x, residual_ptr, residual_out_ptr, t, cols, mask, stride_rt, stride_rot, HAS_RESIDUAL: tl.constexpr):
    """``s = x + residual`` rounded to x's dtype and stored to ``residual_out`` (x itself without a residual)."""
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + t * stride_rot + cols, x, mask=mask)
    return x


@triton.jit
def _store_normed(out_ptr, weight_ptr, t, cols, mask, s, inv, stride_ot):
    """``out = w * (s * inv)`` with HF's roundings (the normed value to s's dtype, the product to out's); returns
    what it stored."""
    normed = (s.to(tl.float32) * inv).to(s.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    q_ptr,
    s_ptr,
    hidden_size,
    eps,
    stride_xt,
    stride_rt,
    stride_ot,
    stride_rot,
    stride_qt,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # One program per row; the whole row fits in one BLOCK_H tile. SPLIT: out's split for an FP8 linear too
    # (fp8_linear.split_row; q_ptr the [T, 2, H] e4m3 buffer as bytes, s_ptr [T]).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    x = _add_residual(x, residual_ptr, residual_out_ptr, t, cols, mask, stride_rt, stride_rot, HAS_RESIDUAL)
    xf = x.to(tl.float32)
    out = _store_normed(out_ptr, weight_ptr, t, cols, mask, x, tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden_size + eps),
                        stride_ot)
    if SPLIT:
        split_row(tl.where(mask, out.to(tl.float32), 0.0), q_ptr, s_ptr, t, cols, mask, hidden_size, stride_qt)


# With a LoRA delta: rows up to this many columns in one tile, longer ones in two passes over pieces of _LORA_CHUNK
# (a [CHUNK, R] B tile per piece; both narrowed for ranks above 16, lora_delta.tile_columns).
_LORA_ONE_PASS_MAX = 4096
_LORA_CHUNK = 1024


@triton.jit
def _lora_piece(x_ptr, residual_ptr, out_ptr, residual_out_ptr, stride_xt, stride_rt, stride_ot, stride_rot, t, cols,
                mask, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp, b_ptr, width, col0,
                scale_ptr, rank_rows, HAS_RESIDUAL: tl.constexpr, STORE_S: tl.constexpr, BLOCK_R: tl.constexpr,
                SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr):
    """``s = (x + delta) + residual`` over columns ``cols`` of row ``t``, each sum rounded to the dtype; stored to
    residual_out (with a residual) or, ``STORE_S``, to out as scratch. Returns s."""
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    delta = lora_delta_cols(t, cols, mask, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp,
                            b_ptr, width, col0, scale_ptr, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
    x = (x.to(tl.float32) + delta).to(x.dtype)
    x = _add_residual(x, residual_ptr, residual_out_ptr, t, cols, mask, stride_rt, stride_rot, HAS_RESIDUAL)
    if STORE_S and not HAS_RESIDUAL:
        tl.store(out_ptr + t * stride_ot + cols, x, mask=mask)
    return x


@triton.jit
def _store_normed_stored(out_ptr, weight_ptr, residual_out_ptr, t, hidden_size, inv, stride_ot, stride_rot,
                         HAS_RESIDUAL: tl.constexpr, PIECE: tl.constexpr, N_PIECES: tl.constexpr,
                         CACHE: tl.constexpr):
    """The normed row ``t`` from the s that :func:`_lora_piece` stored (residual_out, or out as scratch), read back
    in ``N_PIECES`` pieces of ``PIECE`` columns with load cache modifier ``CACHE``."""
    for c in tl.static_range(N_PIECES):
        cols = c * PIECE + tl.arange(0, PIECE)
        mask = cols < hidden_size
        if HAS_RESIDUAL:
            s = tl.load(residual_out_ptr + t * stride_rot + cols, mask=mask, other=0.0, cache_modifier=CACHE)
        else:
            s = tl.load(out_ptr + t * stride_ot + cols, mask=mask, other=0.0, cache_modifier=CACHE)
        _store_normed(out_ptr, weight_ptr, t, cols, mask, s, inv, stride_ot)


@triton.jit
def _lora_row(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt, stride_rt,
              stride_ot, stride_rot, t, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp, b_ptr,
              width, col0, scale_ptr, rank_rows, q_ptr, s_ptr, stride_qt, HAS_RESIDUAL: tl.constexpr,
              CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr,
              PAGES_AT_ONCE: tl.constexpr, WRITE_SPLIT: tl.constexpr):
    """Row ``t`` in one program: s = (x + delta) + residual, each sum rounded to the dtype. The row in one tile
    (N_CHUNKS 1: s stays in registers; WRITE_SPLIT: out's activation split too, ``fp8_linear.split_row``), or two
    passes over CHUNK-column pieces: s written out (to residual_out, or to out as scratch) with the sum of squares,
    then the norm of s read back."""
    acc = tl.zeros([CHUNK], tl.float32)
    for c in tl.static_range(N_CHUNKS):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < hidden_size
        x = _lora_piece(x_ptr, residual_ptr, out_ptr, residual_out_ptr, stride_xt, stride_rt, stride_ot, stride_rot, t,
                        cols, mask, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp, b_ptr,
                        width, col0, scale_ptr, rank_rows, HAS_RESIDUAL, N_CHUNKS > 1, BLOCK_R, SLOT_PAGES,
                        PAGES_AT_ONCE)
        xf = x.to(tl.float32)
        acc += xf * xf
    inv = tl.math.rsqrt(tl.sum(acc, 0) / hidden_size + eps)
    if N_CHUNKS == 1:
        out = _store_normed(out_ptr, weight_ptr, t, cols, mask, x, inv, stride_ot)
        if WRITE_SPLIT:
            split_row(tl.where(mask, out.to(tl.float32), 0.0), q_ptr, s_ptr, t, cols, mask, hidden_size, stride_qt)
    else:
        tl.debug_barrier()  # the first pass's stores are read back by other threads of the program
        _store_normed_stored(out_ptr, weight_ptr, residual_out_ptr, t, hidden_size, inv, stride_ot, stride_rot,
                             HAS_RESIDUAL, CHUNK, N_CHUNKS, "")


@triton.jit
def _rms_norm_lora_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt, stride_rt, stride_ot,
    stride_rot, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp, b_ptr, width, col0, scale_ptr,
    rank_rows, ws_ptr, counter_ptr, q_ptr, s_ptr, stride_qt, HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr,
    SPLIT: tl.constexpr = 1, SPLIT_RANK: tl.constexpr = 16, TILE: tl.constexpr = 16, N_TILES: tl.constexpr = 1,
    WRITE_SPLIT: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # grid (T, SPLIT): one program per row, or under the row split (lora_delta.row_split) up to SPLIT. WRITE_SPLIT
    # (SPLIT 1, N_CHUNKS 1): out's activation split for an FP8 linear too (q_ptr the [T, 2, H] e4m3 bytes, s_ptr [T])
    t = tl.program_id(0).to(tl.int64)
    if SPLIT == 1:
        _lora_row(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt, stride_rt,
                  stride_ot, stride_rot, t, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp,
                  b_ptr, width, col0, scale_ptr, rank_rows, q_ptr, s_ptr, stride_qt, HAS_RESIDUAL, CHUNK, N_CHUNKS,
                  BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, WRITE_SPLIT)
    else:
        _lora_row_split(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt,
                        stride_rt, stride_ot, stride_rot, t, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr,
                        stride_vt, stride_vp, b_ptr, width, col0, scale_ptr, rank_rows, ws_ptr, counter_ptr,
                        HAS_RESIDUAL, CHUNK, N_CHUNKS, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, SPLIT, SPLIT_RANK, TILE,
                        N_TILES)


@triton.jit
def _lora_row_split(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt,
                    stride_rt, stride_ot, stride_rot, t, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt,
                    stride_vp, b_ptr, width, col0, scale_ptr, rank_rows, ws_ptr, counter_ptr,
                    HAS_RESIDUAL: tl.constexpr, CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
                    SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr, SPLIT: tl.constexpr,
                    SPLIT_RANK: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr):
    """Row ``t`` under the row split (program ``program_id(1)`` of the row's ``n``, :func:`lora_row_programs`):
    one program (the first) over the whole row when ``n`` is 1, else each over its column tiles, the last to finish
    normalising the row."""
    p = tl.program_id(1)
    n = lora_row_programs(t, token_slots_ptr, ranks_ptr, SPLIT, SPLIT_RANK)
    if n == 1:
        if p == 0:
            _lora_row(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden_size, eps, stride_xt,
                      stride_rt, stride_ot, stride_rot, t, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr,
                      stride_vt, stride_vp, b_ptr, width, col0, scale_ptr, rank_rows, v_ptr, v_ptr, 0, HAS_RESIDUAL,
                      CHUNK, N_CHUNKS, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, False)
    elif p < n:
        # program p of n: column tiles p, p + n, ... of the row; s written out (to residual_out, or to out as
        # scratch), the tiles' sum of squares to the workspace [T, SPLIT]
        acc = tl.zeros([TILE], tl.float32)
        for tile in range(p, N_TILES, n):
            cols = tile * TILE + tl.arange(0, TILE)
            x = _lora_piece(x_ptr, residual_ptr, out_ptr, residual_out_ptr, stride_xt, stride_rt, stride_ot,
                            stride_rot, t, cols, cols < hidden_size, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr,
                            stride_vt, stride_vp, b_ptr, width, col0, scale_ptr, rank_rows, HAS_RESIDUAL, True,
                            BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
            xf = x.to(tl.float32)
            acc += xf * xf
        tl.store(ws_ptr + t * SPLIT + p, tl.sum(acc, 0))
        tl.debug_barrier()  # every thread's stores made before the counter says so (the atomic releases them)
        counter = counter_ptr + t
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1:
            # the row's last program: every program's s and sum of squares are visible (acquire); read past L1
            j = tl.arange(0, SPLIT)
            sumsq = tl.sum(tl.load(ws_ptr + t * SPLIT + j, mask=j < n, other=0.0, cache_modifier=".cg"), 0)
            inv = tl.math.rsqrt(sumsq / hidden_size + eps)
            _store_normed_stored(out_ptr, weight_ptr, residual_out_ptr, t, hidden_size, inv, stride_ot, stride_rot,
                                 HAS_RESIDUAL, TILE, N_TILES, ".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch (or replay)


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


def _lora_launch(x: torch.Tensor, lora: LoRADelta, lora_blocks: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(columns per piece, num_warps, programs per row, the row split's rank) of :func:`_rms_norm_lora_kernel`."""
    hidden_size = x.shape[1]
    chunk = max(16, tile_columns(next_pow2(hidden_size) if hidden_size <= _LORA_ONE_PASS_MAX else _LORA_CHUNK, lora))
    warps = min(max(chunk // 256, 1), 16)
    if lora_blocks is not None:
        chunk, warps = lora_blocks
    programs, split_rank = row_split(lora, _OP)
    if x.shape[0] > LAUNCH_COUNTERS:  # the split takes a launch counter per row
        programs = 1
    return chunk, warps, programs, split_rank


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    lora: LoRADelta | None = None, split: ActivationSplit | None = None, lora_blocks: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launch of :func:`rms_norm_ref` (one program per row; with ``lora`` the row in one tile up to
    :data:`_LORA_ONE_PASS_MAX` columns, else two passes over 1024-column pieces, and over a paged pool a high-rank
    slot's row split over several programs, :func:`row_split`). ``split``: written by the same program (rows of up to
    :data:`SPLIT_FUSED_MAX` columns; with ``lora``, where the row is one tile of one program), else by
    ``fp8_linear.split_activations`` after. ``lora_blocks``: (columns per piece, num_warps) override (benchmarks)."""
    require_triton(_OP)
    _check_args(x, weight, eps, residual)
    if split is not None:
        check_split(_OP, split, x)
    if lora is not None:
        check_delta(_OP, lora, x)
        chunk, warps, programs, split_rank = _lora_launch(x, lora, lora_blocks)
    if split is not None and (next_pow2(x.shape[1]) > SPLIT_FUSED_MAX
                              or (lora is not None and (programs > 1 or chunk < x.shape[1]))):
        result = _launch_rms_norm(x, weight, eps, residual, lora=lora, lora_blocks=lora_blocks)
        split_activations(result if residual is None else result[0], split)
        return result
    check_last_dim_contiguous(_OP, "x", x)
    check_last_dim_contiguous(_OP, "weight", weight)
    if residual is not None:
        check_last_dim_contiguous(_OP, "residual", residual)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if num_tokens == 0:
        return out if residual_out is None else (out, residual_out)
    if lora is not None:
        tile = max(16, min(next_pow2(cdiv(hidden_size, programs)), chunk))
        ws = torch.empty((num_tokens, programs), dtype=torch.float32, device=x.device) if programs > 1 else out
        counters = launch_counters(_OP, x.device, num_tokens) if programs > 1 else out
        _rms_norm_lora_kernel[(num_tokens, programs)](
            x, residual if residual is not None else x, weight, out, residual_out if residual_out is not None else out,
            hidden_size, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            residual_out.stride(0) if residual_out is not None else 0, *delta_args(lora, x, 0, hidden_size), ws,
            counters, split.q.view(torch.uint8) if split is not None else out,
            split.s if split is not None else out, split.q.stride(0) if split is not None else 0,
            HAS_RESIDUAL=residual is not None, CHUNK=chunk, N_CHUNKS=cdiv(hidden_size, chunk),
            BLOCK_R=block_r(lora), SLOT_PAGES=slot_pages(lora), PAGES_AT_ONCE=CONSUMER_PAGES[_OP], SPLIT=programs,
            SPLIT_RANK=split_rank, TILE=tile, N_TILES=cdiv(hidden_size, tile), WRITE_SPLIT=split is not None,
            num_warps=warps, **pdl_args(x.device, _OP),
        )
        return out if residual_out is None else (out, residual_out)
    block_h = next_pow2(hidden_size)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        split.q.view(torch.uint8) if split is not None else out,
        split.s if split is not None else out,
        hidden_size,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        split.q.stride(0) if split is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        SPLIT=split is not None,
        num_warps=min(max(block_h // 256, 1), 16), **pdl_args(x.device, _OP),
    )
    return out if residual_out is None else (out, residual_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    lora: LoRADelta | None = None, split: ActivationSplit | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add (plain torch: HF ``LlamaRMSNorm.forward`` after the add).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 (row stride free; last dim stride 1 for Triton).
        weight: ``[H]``, dtype of ``x``.
        eps: variance epsilon (> 0).
        residual: optional ``[T, H]`` residual stream, dtype of ``x``.
        lora: optional expand of the folded linear that made ``x`` (:class:`~loraplex.kernels.lora_delta.LoRADelta`,
            one slice of H columns): ``x`` is first replaced by ``x + delta`` rounded to its dtype.
        split: optional :class:`~loraplex.kernels.fp8_linear.ActivationSplit` ``[T, 2, H]`` / ``[T]``, filled with
            out's split (``fp8_linear.SPLIT_ACTIVATIONS``) for the FP8 linear that reads out.

    Returns:
        ``out [T, H]`` when ``residual`` is None, else ``(out, x + residual)``; new ``[T, H]`` tensors in x.dtype.

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout or ``eps <= 0``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(x, weight, eps, residual)
    if lora is not None:
        check_delta(_OP, lora, x)
        x = lora_delta_ref(lora, x)
    s = x if residual is None else x + residual
    sf = s.to(torch.float32)
    variance = sf.pow(2).mean(-1, keepdim=True)
    out = weight * (sf * torch.rsqrt(variance + eps)).to(x.dtype)
    if split is not None:
        check_split(_OP, split, x)
        write_split_ref(out, split)
    return out if residual is None else (out, s)


RMS_NORM = Op(
    name=_OP,
    semantics="s = (x + delta) + residual (without: s = x + delta; delta = 0 without lora); "
    "out = w * (s * rsqrt(mean(s^2) + eps)); returns out or (out, s); split <- SPLIT_ACTIVATIONS of out",
    reference=rms_norm_ref,
    triton=_launch_rms_norm,
)
