"""SwiGLU and GeGLU gates (Shazeer 2020 "GLU Variants Improve Transformer"): ``act(gate) * up`` on a fused
gate/up output.

Semantics: :data:`SILU_AND_MUL`, with ``silu(g) = g * sigmoid(g)`` (Llama); :data:`GELU_TANH_AND_MUL`, with
``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`` (Gemma's ``gelu_pytorch_tanh``).

Rounding matches HF ``act_fn(gate_proj(x)) * up_proj(x)``: silu is computed in
fp32 and rounded to the input dtype, then the product is rounded again.
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
from loraplex.kernels._triton import cdiv, next_pow2, pdl_args, pdl_wait, require_triton, tl, triton
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.fp8_linear import (SPLIT_FUSED_MAX, ActivationSplit, check_split, split_activations, split_row,
                                         write_split_ref)
from loraplex.kernels.lora_delta import (CONSUMER_PAGES, LoRADelta, block_r, check_delta, delta_args,
                                         lora_delta_cols, lora_delta_pair, lora_delta_ref, lora_row_programs, paired,
                                         row_split, slice_of_columns, slot_pages, tile_columns)
from loraplex.kernels.op import Op

_OP = "silu_and_mul"
_BLOCK = 1024


@triton.jit
def _gated(gate, up, GELU_TANH: tl.constexpr):
    """``act(gate) * up`` rounded as HF: the activation in fp32 rounded to the dtype, then the product."""
    g = gate.to(tl.float32)
    if GELU_TANH:  # tanh(z) = 2 sigmoid(2z) - 1
        # sqrt(2 / pi) written out: a @triton.jit body may read only constexpr globals (GPU compile error)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))).to(gate.dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, s_ptr, inter_size, stride_xt, stride_ot, stride_qt, BLOCK: tl.constexpr,
                         GELU_TANH: tl.constexpr = False, SPLIT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    # grid (T, column tiles); SPLIT: one tile holds the whole row, whose split for an FP8 linear the program writes
    # too (fp8_linear.split_row; q_ptr the [T, 2, I] e4m3 buffer as bytes, s_ptr [T])
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter_size + cols, mask=mask, other=0.0)
    out = _gated(gate, up, GELU_TANH)
    tl.store(out_ptr + t * stride_ot + cols, out, mask=mask)
    if SPLIT:
        split_row(tl.where(mask, out.to(tl.float32), 0.0), q_ptr, s_ptr, t, cols, mask, inter_size, stride_qt)


_LORA_BLOCK = 256  # columns per program with a LoRA delta (two [BLOCK, R] B tiles; fewer for ranks above 16)


@triton.jit
def _act_and_mul_lora_cols(
    x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, cols,
    slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr,
    uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows,
    GELU_TANH: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr,
    PAIR: tl.constexpr,
):
    """Columns ``cols`` of token ``t``: gate and up plus their deltas, gated."""
    mask = cols < inter_size
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + inter_size + cols, mask=mask, other=0.0)
    if PAIR:  # gate's and up's pages in one loop
        dg, du = lora_delta_pair(t, cols, mask, cols, mask, slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt,
                                 g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr, uv_ptr, u_stride_vt, u_stride_vp,
                                 ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE,
                                 True)
    else:
        dg = lora_delta_cols(t, cols, mask, slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr,
                             g_width, g_col0, g_scale_ptr, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
        du = lora_delta_cols(t, cols, mask, slots_ptr, table_ptr, ranks_ptr, uv_ptr, u_stride_vt, u_stride_vp, ub_ptr,
                             u_width, u_col0, u_scale_ptr, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE)
    gate = (gate.to(tl.float32) + dg).to(gate.dtype)
    up = (up.to(tl.float32) + du).to(up.dtype)
    tl.store(out_ptr + t * stride_ot + cols, _gated(gate, up, GELU_TANH), mask=mask)


@triton.jit
def _act_and_mul_lora_kernel(
    x_ptr, out_ptr, inter_size, stride_xt, stride_ot,
    slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr,
    uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows,
    BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr,
    PAGES_AT_ONCE: tl.constexpr, SPLIT: tl.constexpr = 1, SPLIT_RANK: tl.constexpr = 16, PAIR: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # grid (T, column tiles, SPLIT): program (t, g, 0) the tile's BLOCK columns, or under the row split
    # (lora_delta.row_split) programs p < n each its pieces p, p + n, ... of the tile's SPLIT pieces
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    p = tl.program_id(2)
    if SPLIT == 1:
        _act_and_mul_lora_cols(x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, g * BLOCK + tl.arange(0, BLOCK),
                               slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width,
                               g_col0, g_scale_ptr, uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0,
                               u_scale_ptr, rank_rows, GELU_TANH, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, PAIR)
    else:
        _act_and_mul_lora_split(x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, g, p, slots_ptr, table_ptr,
                                ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr,
                                uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows,
                                BLOCK, GELU_TANH, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, SPLIT, SPLIT_RANK, PAIR)


@triton.jit
def _act_and_mul_lora_split(
    x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, g, p,
    slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr,
    uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows,
    BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr,
    PAGES_AT_ONCE: tl.constexpr, SPLIT: tl.constexpr, SPLIT_RANK: tl.constexpr, PAIR: tl.constexpr,
):
    """Tile ``g`` of token ``t`` under the row split: program ``p`` of the token's ``n`` (:func:`lora_row_programs`);
    the first over the whole tile when ``n`` is 1."""
    n = lora_row_programs(t, slots_ptr, ranks_ptr, SPLIT, SPLIT_RANK)
    if n == 1:
        if p == 0:
            _act_and_mul_lora_cols(x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, g * BLOCK + tl.arange(0, BLOCK),
                                   slots_ptr, table_ptr, ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width,
                                   g_col0, g_scale_ptr, uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0,
                                   u_scale_ptr, rank_rows, GELU_TANH, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, PAIR)
    elif p < n:
        for piece in range(p, SPLIT, n):
            cols = g * BLOCK + piece * (BLOCK // SPLIT) + tl.arange(0, BLOCK // SPLIT)
            _act_and_mul_lora_cols(x_ptr, out_ptr, inter_size, stride_xt, stride_ot, t, cols, slots_ptr, table_ptr,
                                   ranks_ptr, gv_ptr, g_stride_vt, g_stride_vp, gb_ptr, g_width, g_col0, g_scale_ptr,
                                   uv_ptr, u_stride_vt, u_stride_vp, ub_ptr, u_width, u_col0, u_scale_ptr, rank_rows,
                                   GELU_TANH, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, PAIR)


def _check_args(x: torch.Tensor) -> None:
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_shape(_OP, "x", x, (None, None))
    if x.shape[1] % 2:
        raise KernelArgumentError(f"{_OP}: x.shape[1]={x.shape[1]} must be even ([T, 2 * intermediate_size])")


def _check_halves(lora: LoRADelta, x: torch.Tensor) -> None:
    """``lora`` fits ``x``, and gate and up each lie in one of its slices."""
    check_delta(_OP, lora, x)
    half = x.shape[1] // 2
    slice_of_columns(lora, 0, half)
    slice_of_columns(lora, half, half)


def _check_out(x: torch.Tensor, out: torch.Tensor) -> None:
    check_shape(_OP, "out", out, (x.shape[0], x.shape[1] // 2))
    check_same_dtype(_OP, "out", out, "x", x)
    check_device(_OP, "out", out, x.device)


def _launch_silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, lora: LoRADelta | None = None,
                         split: ActivationSplit | None = None, gelu_tanh: bool = False,
                         lora_blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """Triton launch of :func:`silu_and_mul_ref` (one program per token and 1024 columns, 256 with ``lora``, and
    over a paged pool several for a high-rank token, :func:`~loraplex.kernels.lora_delta.row_split`; with ``split``
    one program per token holding the whole row, up to ``SPLIT_FUSED_MAX`` columns without ``lora``, else the split
    by ``fp8_linear.split_activations`` after); ``gelu_tanh`` switches the gate to :func:`gelu_tanh_and_mul_ref`'s.
    ``lora_blocks``: (columns per program, num_warps) with ``lora`` (benchmarks)."""
    require_triton(_OP)
    _check_args(x)
    if lora is not None:
        _check_halves(lora, x)
    check_last_dim_contiguous(_OP, "x", x)
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    _check_out(x, out)
    check_last_dim_contiguous(_OP, "out", out)
    if split is not None:
        check_split(_OP, split, out)
    if num_tokens == 0 or inter_size == 0:
        return out
    if split is not None and (lora is not None or next_pow2(inter_size) > SPLIT_FUSED_MAX):
        _launch_silu_and_mul(x, out=out, lora=lora, gelu_tanh=gelu_tanh, lora_blocks=lora_blocks)
        split_activations(out, split)
        return out
    if lora is not None:
        gate, up = delta_args(lora, x, 0, inter_size), delta_args(lora, x, inter_size, inter_size)
        block, warps = lora_blocks or (max(16, tile_columns(_LORA_BLOCK, lora)), 4)
        split, split_rank = row_split(lora, _OP)
        split = min(split, block)
        _act_and_mul_lora_kernel[(num_tokens, cdiv(inter_size, block), split)](
            x, out, inter_size, x.stride(0), out.stride(0), *gate[:3], *gate[3:10], *up[3:10], gate[10],
            BLOCK=block, GELU_TANH=gelu_tanh, BLOCK_R=block_r(lora), SLOT_PAGES=slot_pages(lora),
            PAGES_AT_ONCE=CONSUMER_PAGES[_OP], SPLIT=split, SPLIT_RANK=split_rank, PAIR=paired(lora, _OP),
            num_warps=warps, **pdl_args(x.device, _OP),
        )
        return out
    block = next_pow2(inter_size) if split is not None else _BLOCK
    _silu_and_mul_kernel[(num_tokens, cdiv(inter_size, block))](
        x, out, split.q.view(torch.uint8) if split is not None else out, split.s if split is not None else out,
        inter_size, x.stride(0), out.stride(0), split.q.stride(0) if split is not None else 0, BLOCK=block,
        GELU_TANH=gelu_tanh, SPLIT=split is not None, num_warps=min(max(block // 1024, 4), 16),
        **pdl_args(x.device, _OP)
    )
    return out


def silu_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None, lora: LoRADelta | None = None,
                     split: ActivationSplit | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for a fused gate/up projection (plain torch: HF ``act_fn(gate) * up``).

    Args:
        x: ``[T, 2I]`` fp16/bf16/fp32 (last dim stride 1 for Triton).
        out: optional ``[T, I]`` output of x's dtype.
        lora: optional expand of the folded gate/up linear that made ``x``
            (:class:`~loraplex.kernels.lora_delta.LoRADelta`): ``x`` is first replaced by ``x + delta`` rounded to
            its dtype.
        split: optional :class:`~loraplex.kernels.fp8_linear.ActivationSplit` ``[T, 2, I]`` / ``[T]``, filled with
            the output's split (``fp8_linear.SPLIT_ACTIVATIONS``) for the FP8 linear that reads it.

    Returns:
        ``[T, I]`` in x.dtype (``out`` when given).

    Raises:
        KernelArgumentError: bad shape/dtype/layout or odd ``x.shape[1]``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    return _gated_ref(x, out, lora, split, torch.nn.functional.silu)


def _gated_ref(x: torch.Tensor, out: torch.Tensor | None, lora: LoRADelta | None, split: ActivationSplit | None,
               act) -> torch.Tensor:
    """``act(gate) * up`` of ``x + delta`` (the references' shared body), and its split into ``split``."""
    _check_args(x)
    if lora is not None:
        _check_halves(lora, x)
        x = lora_delta_ref(lora, x)
    gate, up = x.chunk(2, dim=-1)
    result = act(gate) * up
    if out is not None:
        _check_out(x, out)
        result = out.copy_(result)
    if split is not None:
        check_split(_OP, split, result)
        write_split_ref(result, split)
    return result


SILU_AND_MUL = Op(
    name=_OP,
    semantics="out[t, i] = silu(x'[t, i]) * x'[t, I + i], x' = x + delta (x without lora), x [T, 2I] -> out [T, I]; "
    "split <- SPLIT_ACTIVATIONS of out",
    reference=silu_and_mul_ref,
    triton=_launch_silu_and_mul,
)



def _launch_gelu_tanh_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, lora: LoRADelta | None = None,
                              split: ActivationSplit | None = None) -> torch.Tensor:
    """Triton launch of :func:`gelu_tanh_and_mul_ref` (the SwiGLU kernel with the GeGLU gate)."""
    return _launch_silu_and_mul(x, out=out, lora=lora, split=split, gelu_tanh=True)


def gelu_tanh_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None, lora: LoRADelta | None = None,
                          split: ActivationSplit | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU, Gemma) for a fused gate/up projection (plain torch: HF
    ``ACT2FN["gelu_pytorch_tanh"](gate) * up``).

    Args:
        x: ``[T, 2I]`` fp16/bf16/fp32 (last dim stride 1 for Triton).
        out: optional ``[T, I]`` output of x's dtype.
        lora: optional expand of the folded gate/up linear that made ``x``
            (:class:`~loraplex.kernels.lora_delta.LoRADelta`): ``x`` is first replaced by ``x + delta`` rounded to
            its dtype.
        split: optional :class:`~loraplex.kernels.fp8_linear.ActivationSplit` ``[T, 2, I]`` / ``[T]``, filled with
            the output's split (``fp8_linear.SPLIT_ACTIVATIONS``) for the FP8 linear that reads it.

    Returns:
        ``[T, I]`` in x.dtype (``out`` when given).

    Raises:
        KernelArgumentError: bad shape/dtype/layout or odd ``x.shape[1]``.
        TritonUnavailableError: Triton backend without triton installed.
    """
    return _gated_ref(x, out, lora, split, lambda gate: torch.nn.functional.gelu(gate, approximate="tanh"))


GELU_TANH_AND_MUL = Op(
    name="gelu_tanh_and_mul",
    semantics="out[t, i] = gelu_tanh(x'[t, i]) * x'[t, I + i], x' = x + delta (x without lora), x [T, 2I] -> "
    "out [T, I]; split <- SPLIT_ACTIVATIONS of out",
    reference=gelu_tanh_and_mul_ref,
    triton=_launch_gelu_tanh_and_mul,
)
