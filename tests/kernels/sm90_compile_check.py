"""Compile every Triton kernel for sm_90 (H100/H200) on a machine without a GPU.

The CPU interpreter accepts programs the GPU compiler rejects (dot shapes,
dtype mixes, pointer casts) and ignores shared-memory limits, so this script
drives each launcher with CPU tensors at real model shapes, with the launch
decisions it would make on a 132-SM CUDA device, records the launches instead
of running them, and compiles each recorded specialisation down to a cubin
with Triton's bundled ptxas. Exit status 1 on any failure.

Run without ``TRITON_INTERPRET`` (the kernels must be ``JITFunction``s):
``python tests/kernels/sm90_compile_check.py``.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from loraplex.kernels import (  # noqa: E402
    activation,
    attention,
    attention_decode,
    attention_prefill,
    dense_linear,
    fp8_linear,
    lora_expand,
    lora_fused,
    lora_shrink,
    reshape_and_cache,
    rms_norm,
    rotary,
    rotary_and_cache,
)
from loraplex.kernels import _triton, lora_delta  # noqa: E402
from loraplex.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from loraplex.kernels.lora_mapping import LoRAMapping  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 232448  # sm_90 opt-in dynamic shared memory per block
CUDA = torch.device("cuda")
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
_PTR_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.uint8: "*u8",
}
_KERNELS = {
    reshape_and_cache: ["_reshape_and_cache_kernel"],
    attention_decode: ["_paged_decode_kernel", "_paged_decode_reduce_kernel"],
    attention_prefill: ["_paged_prefill_kernel"],
    rms_norm: ["_rms_norm_kernel", "_rms_norm_lora_kernel"],
    rotary: ["_rotary_kernel"],
    rotary_and_cache: ["_rotary_and_cache_kernel", "_rotary_and_cache_lora_kernel"],
    activation: ["_silu_and_mul_kernel", "_act_and_mul_lora_kernel"],
    fp8_linear: ["_fp8_linear_kernel", "_fp8_linear_swap_kernel", "_fp8_split_sum_kernel", "_split_activations_kernel",
                 "_fp8_linear_split_kernel"],
    dense_linear: ["_dense_linear_kernel", "_dense_gemv_kernel", "_dense_streamk_kernel"],
    lora_shrink: ["_lora_shrink_kernel"],
    lora_expand: ["_lora_expand_kernel"],
    lora_fused: ["_fused_lora_kernel"],
}


class TensorArg:
    """What compiling needs of a tensor argument (its dtype and 16-byte alignment), kept instead of the tensor: the
    launchers run at real model shapes (an LM head of 128256 x 4096), and holding every recorded tensor took ~12 GB."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype = tensor.dtype
        self.aligned_16 = tensor.data_ptr() % 16 == 0


class DescriptorArg:
    """What compiling needs of a host TMA descriptor argument: its dtype and block shape."""

    def __init__(self, descriptor: TensorDescriptor) -> None:
        self.dtype = descriptor.base.dtype
        self.block_shape = list(descriptor.block_shape)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call (tensors as
    :class:`TensorArg`)."""

    def __init__(self, kernel: Any) -> None:
        self.fn = kernel.fn
        self.launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            args = tuple(TensorArg(a) if isinstance(a, torch.Tensor) else DescriptorArg(a)
                         if isinstance(a, TensorDescriptor) else a for a in args)
            self.launches.append((grid, args, kwargs))

        return launch


def _as_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a launch-config helper ``f(..., device)`` so it decides as on a CUDA device."""

    def wrapper(*args: Any) -> Any:
        return fn(*args[:-1], CUDA)

    return wrapper


def _hopper_pdl_args(device: Any, op: str) -> dict[str, Any]:
    """``_triton.pdl_args`` inside ``pdl_launches()`` on a Hopper device: the op's trigger mode."""
    return {"USE_PDL": _triton.pdl_trigger_mode(op), "launch_pdl": True}


def pretend_cuda() -> dict[str, Recorder]:
    """Patch launch decisions to a 132-SM GPU and replace every kernel by a Recorder."""
    for module in (attention_decode, attention_prefill, lora_shrink, lora_expand, lora_fused, fp8_linear, dense_linear):
        for name in ("dot_dtype", "dot_precision", "_block_sizes", "_block_n", "partial_split_k", "decode_config",
                     "prefill_tiles", "default_widen", "_split_activations_launch"):
            if hasattr(module, name):
                setattr(module, name, _as_cuda(getattr(module, name)))
    for module in (rms_norm, rotary_and_cache, activation, attention_decode, attention_prefill, dense_linear, lora_shrink,
                   lora_expand, lora_fused, fp8_linear, reshape_and_cache, rotary):
        module.pdl_args = _hopper_pdl_args  # a Hopper launch's choice
    fp8_linear._cuda_capability = lambda device: (9, 0)
    default_activations = fp8_linear.default_activations
    fp8_linear.default_activations = lambda dtype, device, num_tokens: default_activations(dtype, CUDA, num_tokens)
    attention_decode.num_sms = lambda device: 132
    lora_shrink.num_sms = lambda device: 132
    lora_fused.num_sms = lambda device: 132
    recorders = {}
    for module, names in _KERNELS.items():
        for name in names:
            recorders[name] = Recorder(getattr(module, name))
            setattr(module, name, recorders[name])
    return recorders


def _signature_type(value: Any) -> str:
    if isinstance(value, (torch.Tensor, TensorArg)):
        return _PTR_TYPES[value.dtype]
    if isinstance(value, DescriptorArg):
        return f"tensordesc<{_PTR_TYPES[value.dtype][1:]}{value.block_shape}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unsupported kernel argument {value!r}")


def compile_launch(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Compile one recorded launch for sm_90; returns the CompiledKernel."""
    names = list(inspect.signature(fn).parameters)
    # As a real launch specialises: an int argument equal to 1 is a constexpr.
    ones = {name: 1 for name, value in zip(names, args) if type(value) is int and value == 1}
    signature = {name: "constexpr" if name in ones else _signature_type(value) for name, value in zip(names, args)}
    constexprs = {**ones, **{k: v for k, v in kwargs.items() if k not in _OPTIONS}}
    signature.update({k: "constexpr" for k in constexprs})
    missing = [n for n in names if n not in signature]
    if missing:
        raise TypeError(f"{fn.__name__}: arguments not passed: {missing}")
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    jit_fn = triton.JITFunction(fn)
    # As a real launch specialises: 16-byte aligned pointers and ints divisible by 16 get tt.divisibility
    # (without it the compiler cannot prove alignment and emits scalar loads, unlike on the GPU).
    attrs = {(i,): [["tt.divisibility", 16]] for i, value in enumerate(args) if _divisible_by_16(value)}
    return triton.compile(
        ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET, options=options
    )


def _divisible_by_16(value: Any) -> bool:
    if isinstance(value, TensorArg):
        return value.aligned_16
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def drive_launchers() -> None:
    """Call every launcher at real model shapes (Llama-2-7B / Llama-3-8B), fp32 and bf16."""
    bf16 = torch.bfloat16
    for dtype, (hq, hkv) in ((bf16, (32, 8)), (bf16, (32, 32)), (torch.float32, (32, 8))):
        _attention(dtype, hq, hkv)
    _elementwise(bf16)
    _lora(bf16)
    _lora(torch.float32)
    _paged_lora(bf16)
    _paged_lora(torch.float32)
    for dtype in (bf16, torch.float32):
        _lora_consumers(dtype)
        _fp8(dtype)
    _dense(torch.bfloat16)


def _attention(dtype: torch.dtype, hq: int, hkv: int, d: int = 128, bs: int = 16) -> None:
    caches = [torch.zeros(4, bs, hkv, d, dtype=dtype) for _ in range(2)]
    for batch, ctx in ((2, 4096), (64, 256)):  # split-K decode, plain decode
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, [[0] * (ctx // bs)] * batch, bs, "cpu")
        attention_decode.paged_decode_attention(torch.zeros(batch, hq, d, dtype=dtype), *caches, meta, d**-0.5)
        # The tiles benchmarks/bench_attention.py sweeps, FMA and tl.dot tiles for MHA.
        for block_n, warps, stages in ((16, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2)):
            for use_dot in {True, hq != hkv}:
                config = attention_decode.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                                       num_splits=8, min_chunk=4 * block_n, use_dot=use_dot)
                attention_decode.paged_decode_attention(torch.zeros(batch, hq, d, dtype=dtype), *caches, meta,
                                                        d**-0.5, config=config)
        # several KV heads a program (one pipelined loop over their tiles), plain and split-K; the head-major grid
        for heads, head_major in ((2, False), (4, False), (1, True), (2, True)):
            for splits in (1, 8):
                config = attention_decode.DecodeConfig(block_n=64, num_warps=4, num_stages=2, num_splits=splits,
                                                       min_chunk=256, heads_per_program=heads, head_major=head_major)
                attention_decode.paged_decode_attention(torch.zeros(batch, hq, d, dtype=dtype), *caches, meta,
                                                        d**-0.5, config=config)
        # the K/V lines of a chunk's first positions prefetched into L2 before the PDL wait (off by default)
        previous = _triton.use_pdl_kv_prefetch(64)
        try:
            attention_decode.paged_decode_attention(torch.zeros(batch, hq, d, dtype=dtype), *caches, meta, d**-0.5)
        finally:
            _triton.use_pdl_kv_prefetch(previous)
    meta = AttentionMetadata.build([512, 1], [3000, 17], [[0] * 188, [0, 0]], bs, "cpu")
    attention_prefill.paged_prefill_attention(torch.zeros(513, hq, d, dtype=dtype), *caches, meta, d**-0.5)
    attention.PAGED_ATTENTION.triton(torch.zeros(513, hq, d, dtype=dtype), *caches, meta, d**-0.5)  # mixed
    kv = torch.zeros(513, hkv, d, dtype=dtype)
    reshape_and_cache.RESHAPE_AND_CACHE.triton(kv, kv, *caches, meta.slot_mapping)
    # The model's call: q/k/v as row-strided views of the fused qkv output, q rotated in place.
    q, k, v = torch.zeros(513, (hq + 2 * hkv) * d, dtype=dtype).split([hq * d, hkv * d, hkv * d], dim=-1)
    rope = rotary.compute_cos_sin_cache(rotary.rope_inv_freq(d, 500000.0), 64)
    rotary_and_cache.ROTARY_AND_CACHE.triton(torch.zeros(513, dtype=torch.int64), q, k, v, *caches,
                                             meta.slot_mapping, rope)


def _elementwise(dtype: torch.dtype) -> None:
    x = torch.zeros(8, 4096, dtype=dtype)
    rms_norm.RMS_NORM.triton(x, torch.ones(4096, dtype=dtype), 1e-5)
    rms_norm.RMS_NORM.triton(x, torch.ones(4096, dtype=dtype), 1e-5, x)
    cache = rotary.compute_cos_sin_cache(rotary.rope_inv_freq(128, 500000.0), 64)
    qkv = torch.zeros(8, 48 * 128, dtype=dtype)
    rotary.ROTARY_EMBEDDING.triton(
        torch.zeros(8, dtype=torch.int64), qkv[:, : 32 * 128], qkv[:, 32 * 128 : 40 * 128], cache, 128
    )
    activation.SILU_AND_MUL.triton(torch.zeros(8, 2 * 11008, dtype=dtype))
    # FP8 models' producers writing the activation split (Llama-2-7B / Llama-3-8B widths; 28672 past SPLIT_FUSED_MAX)
    split = fp8_linear.ActivationSplit.empty(8, 4096, torch.device("cpu"))
    rms_norm.RMS_NORM.triton(x, torch.ones(4096, dtype=dtype), 1e-5, x, split=split)
    for inter in (11008, 14336, 28672):
        activation.SILU_AND_MUL.triton(torch.zeros(8, 2 * inter, dtype=dtype),
                                       split=fp8_linear.ActivationSplit.empty(8, inter, torch.device("cpu")))
    # and with a folded linear's LoRA delta (an FP8 model's folded shrink), with and without the residual
    for page in (None, 8):
        delta = _folded_delta(dtype, [4096], 8, page=page)
        rms_norm.RMS_NORM.triton(x, torch.ones(4096, dtype=dtype), 1e-5, x, lora=delta, split=split)
        rms_norm.RMS_NORM.triton(x, torch.ones(4096, dtype=dtype), 1e-5, lora=delta, split=split)


def _lora(dtype: torch.dtype, hidden: int = 4096, rank: int = 16, slots: int = 32) -> None:
    lora_a = [torch.zeros(slots, rank, hidden, dtype=dtype) for _ in range(3)]
    lora_b = [torch.zeros(slots, w, rank, dtype=dtype) for w in (4096, 1024, 1024)]
    scaling = [torch.ones(slots) for _ in range(3)]
    ranks = torch.full((slots,), rank, dtype=torch.int32)
    for num_tokens in (32, 4096):  # decode (shrink BLOCK_M 16), prefill (shrink BLOCK_M 64); expand BLOCK_M 16
        mapping = LoRAMapping.from_token_slots((torch.arange(num_tokens) % slots).to(torch.int32))
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        v = lora_shrink.LORA_SHRINK.triton(x, lora_a, mapping, ranks=ranks)
        lora_expand.LORA_EXPAND.triton(v, lora_b, scaling, torch.zeros(num_tokens, 6144, dtype=dtype), mapping)
        # The model path: split-K partials summed inside the expand (SPLIT_K > 1; 256-column expand tiles).
        partials = lora_shrink.shrink_partials(x, lora_a, mapping)
        lora_expand.LORA_EXPAND.triton(partials, lora_b, scaling, torch.zeros(num_tokens, 6144, dtype=dtype), mapping)
    for num_tokens in (1, 32, 256):  # the fused shrink+expand (decode sizes), default shapes and mixed ranks
        mapping = LoRAMapping.from_token_slots((torch.arange(num_tokens) % slots).to(torch.int32), slots)
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        y = torch.zeros(num_tokens, 6144, dtype=dtype)
        lora_fused.FUSED_LORA.triton(x, lora_a, lora_b, scaling, y, mapping)
        lora_fused.FUSED_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
    for high_rank in (64, 128, 256):  # max_lora_rank up to 256: shorter K tiles, same kernel
        mapping = LoRAMapping.from_token_slots((torch.arange(8) % 4).to(torch.int32), 4)
        a_high = [torch.zeros(4, high_rank, hidden, dtype=dtype)]
        b_high = [torch.zeros(4, 4096, high_rank, dtype=dtype)]
        lora_fused.FUSED_LORA.triton(torch.zeros(8, hidden, dtype=dtype), a_high, b_high, [torch.ones(4)],
                                     torch.zeros(8, 4096, dtype=dtype), mapping,
                                     ranks=torch.full((4,), high_rank, dtype=torch.int32))
        big = LoRAMapping.from_token_slots((torch.arange(300) % 4).to(torch.int32), 4)  # the two-kernel path
        partials = lora_shrink.shrink_partials(torch.zeros(300, hidden, dtype=dtype), a_high, big)
        lora_expand.LORA_EXPAND.triton(partials, b_high, [torch.ones(4)], torch.zeros(300, 4096, dtype=dtype), big)
    down_a = [torch.zeros(slots, rank, 11008, dtype=dtype)]  # a long reduction: BLOCK_K 512
    mapping = LoRAMapping.from_token_slots((torch.arange(32) % slots).to(torch.int32), slots)
    lora_fused.FUSED_LORA.triton(torch.zeros(32, 11008, dtype=dtype), down_a, lora_b[:1], scaling[:1],
                                 torch.zeros(32, 4096, dtype=dtype), mapping)


def _paged_lora(dtype: torch.dtype, hidden: int = 4096, slots: int = 32, pages: int = 64) -> None:
    """The engine's model path (``add_lora``: split-K partials, untargeted slices skipped by scaling) over paged
    pools: several pages per slot (PAGE 8 / 16 / 32, rank tiles gathered from the table) and one page per slot
    (the rectangle kernel through the table), plus the paged shrink launcher."""
    from loraplex.kernels.lora_linear import ADD_LORA

    for page, max_pages in ((8, 8), (16, 4), (32, 8), (16, 1), (64, 1)):
        a = [torch.zeros(pages, page, hidden, dtype=dtype) for _ in range(3)]
        b = [torch.zeros(pages, w, page, dtype=dtype) for w in (4096, 1024, 1024)]
        scaling = [torch.ones(slots) for _ in range(3)]
        ranks = torch.full((slots,), 16, dtype=torch.int32)
        table = torch.zeros(slots, max_pages, dtype=torch.int32)
        for num_tokens in (32, 4096):
            mapping = LoRAMapping.from_token_slots((torch.arange(num_tokens) % slots).to(torch.int32), slots)
            x = torch.zeros(num_tokens, hidden, dtype=dtype)
            ADD_LORA.triton(x, a, b, scaling, torch.zeros(num_tokens, 6144, dtype=dtype), mapping, ranks=ranks,
                            page_table=table)
            lora_shrink.LORA_SHRINK.triton(x, a, mapping, ranks=ranks, page_table=table)


def _folded_delta(dtype: torch.dtype, widths: list[int], num_tokens: int, rank: int = 16,
                  slots: int = 32, page: int | None = None) -> lora_delta.LoRADelta:
    """A folded linear's LoRA delta at real shapes: ``v`` as the folded GEMM's slot-rows view; with ``page``, a
    paged pool of ``rank // page`` pages of ``page`` rows per slot."""
    rows = page or rank
    pages = slots * rank // rows
    out = torch.zeros(num_tokens, sum(widths) + len(widths) * pages * rows, dtype=dtype)
    v = lora_expand.slot_rows_view(out, sum(widths), len(widths), pages, rows)
    mapping = LoRAMapping.from_token_slots((torch.arange(num_tokens) % slots).to(torch.int32), slots)
    paging = {} if page is None else {"page_table": torch.zeros(slots, rank // page, dtype=torch.int32),
                                      "ranks": torch.full((slots,), rank, dtype=torch.int32)}
    return lora_delta.LoRADelta(v, [torch.zeros(pages, w, rows, dtype=dtype) for w in widths],
                                [torch.ones(slots) for _ in widths], mapping, **paging)


# Consumer launch settings (lora_delta.use_consumer_launch) compiled beside the engine's, over a paged pool in bf16:
# the others benchmarks/diag_lora_consumers.py measures.
CONSUMER_LAUNCHES = (
    {"rms_norm": {"row_split": 1}, "silu_and_mul": {"row_split": 4, "paired": False},
     "rotary_and_cache": {"paired": False, "pages_at_once": 4}},
    {"rms_norm": {"row_split": 2, "pages_at_once": 2}, "silu_and_mul": {"row_split": 1, "paired": True},
     "rotary_and_cache": {"paired": True, "pages_at_once": 2}},
    {"silu_and_mul": {"row_split": 1, "paired": True, "pages_at_once": 2},
     "rotary_and_cache": {"paired": True, "pages_at_once": 1}},
)


def _lora_consumers(dtype: torch.dtype) -> None:
    """:func:`_lora_consumers_once` under the engine's consumer launch settings, then (bf16) over a paged pool under
    each of :data:`CONSUMER_LAUNCHES`."""
    _lora_consumers_once(dtype)
    if dtype != torch.bfloat16:
        return
    for launch in CONSUMER_LAUNCHES:
        previous = {op: lora_delta.use_consumer_launch(op, **keywords) for op, keywords in launch.items()}
        try:
            _lora_consumers_once(dtype, cases=((32, 64, 8),))
        finally:
            for op, keywords in previous.items():
                lora_delta.use_consumer_launch(op, **{k: v for k, v in keywords.items() if v is not None})


def _lora_consumers_once(dtype: torch.dtype, hidden: int = 4096, inter: int = 11008,
                         cases=((32, 16, None), (512, 16, None), (32, 64, None), (32, 64, 8))) -> None:
    """The kernels that add a folded linear's delta (decode and prompt sizes; ranks 16 and 64; rank 64 in 8-row
    pages), and the expand that reads v per slot or page (DoRA steps, q/k-norm models)."""
    for num_tokens, rank, page in cases:
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        delta = _folded_delta(dtype, [hidden], num_tokens, rank, page=page)
        rms_norm.RMS_NORM.triton(x, torch.ones(hidden, dtype=dtype), 1e-5, x.clone(), lora=delta)
        wide = torch.zeros(num_tokens, 8192, dtype=dtype)  # two passes above 4096 columns
        rms_norm.RMS_NORM.triton(wide, torch.ones(8192, dtype=dtype), 1e-5, wide.clone(),
                                 lora=_folded_delta(dtype, [8192], num_tokens, rank, page=page))
        gate_up = torch.zeros(num_tokens, 2 * inter, dtype=dtype)
        for op in (activation.SILU_AND_MUL, activation.GELU_TANH_AND_MUL):
            op.triton(gate_up, lora=_folded_delta(dtype, [inter, inter], num_tokens, rank, page=page))
        for hq, hkv in ((32, 8), (32, 32)):
            d, bs = 128, 16
            caches = [torch.zeros(64, bs, hkv, d, dtype=dtype) for _ in range(2)]
            q, k, v = torch.zeros(num_tokens, (hq + 2 * hkv) * d, dtype=dtype).split([hq * d, hkv * d, hkv * d], -1)
            rope = rotary.compute_cos_sin_cache(rotary.rope_inv_freq(d, 500000.0), 64)
            rotary_and_cache.ROTARY_AND_CACHE.triton(
                torch.zeros(num_tokens, dtype=torch.int64), q, k, v, *caches,
                torch.arange(num_tokens, dtype=torch.int64), rope,
                lora=_folded_delta(dtype, [hq * d, hkv * d, hkv * d], num_tokens, rank, page=page))
        delta = _folded_delta(dtype, [hidden, 1024, 1024], num_tokens, rank, page=page)
        lora_expand.LORA_EXPAND_SLOT_ROWS.triton(delta.v, delta.lora_b, delta.scaling,
                                                 torch.zeros(num_tokens, hidden + 2048, dtype=dtype), delta.mapping,
                                                 ranks=delta.ranks, page_table=delta.page_table)


def _fp8(dtype: torch.dtype) -> None:
    """FP8 linears at Llama-2-7B shapes: decode, 33-128 tokens and prefill. bf16: split activations up to 128 tokens
    (split-K for the narrow outputs), W8A16 after; fp32: W8A16 (token-major, swapped operands with split-K)."""
    for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):
        weight = torch.zeros(n, k, dtype=fp8_linear.FP8_DTYPE)
        for num_tokens in (1, 16, 17, 32, 40, 64, 80, 100, 128, 512):
            bias = torch.zeros(n, dtype=dtype) if num_tokens == 17 else None
            fp8_linear.FP8_LINEAR.triton(torch.zeros(num_tokens, k, dtype=dtype), weight, torch.ones(n), bias)
            if dtype == torch.bfloat16 and num_tokens <= fp8_linear.SPLIT_MAX_TOKENS:
                # a folded LoRA shrink: 32 slots x r16 bf16 A rows per slice after the weight's tiles
                fp8_linear.FP8_LINEAR.triton(torch.zeros(num_tokens, k, dtype=dtype), weight, torch.ones(n), bias,
                                             lora_a=torch.zeros(512 * (3 if n == 12288 else 1), k, dtype=dtype))


def _dense(dtype: torch.dtype) -> None:
    """Dense linears: every launch of the measured table (``dense_linear.MEASURED_CONFIGS``) at its shape, plain and
    with a bias, one of each kernel kind at Llama-2-7B's shapes (uneven K included), split-K and prefetching launches;
    the decode layer's fusions (norm in, gated activation in, residual out) at every measured fused launch and once
    per kernel kind."""
    launches = [((t, n, k), c) for (_dev, t, n, k), c in dense_linear.MEASURED_CONFIGS.items()]
    launches += [((32, 12288, 4096), ("tm", 32, 32, 256, 4, 4)), ((1, 4096, 11008), ("swap", 16, 64, 128, 4, 3)),
                 ((1, 22016, 4096), ("gemv", 1, 8, 512, 4, 1))]
    # serial split-K (partials through a workspace, a counter per tile), plain and with the residual add, one token
    # too (an int of 1 is a constexpr); and the L2 weight prefetch before the PDL wait, split and GEMV
    for (t, n, k), config in (((32, 4096, 4096), ("tm", 32, 32, 256, 4, 4, 2)),
                              ((32, 4096, 11008), ("swap", 32, 64, 256, 4, 4, 4)),
                              ((1, 4096, 11008), ("swap", 16, 64, 128, 4, 4, 4))):
        dense_linear.DENSE_LINEAR.triton(torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype),
                                         residual=torch.zeros(t, n, dtype=dtype), config=config)
    # stream-K, pointer and TMA loads, at Llama-2-7B's o/down/qkv shapes, plain and with a bias and the residual add
    for kind in dense_linear.STREAMK_KINDS:
        for (t, n, k), tiles in (((128, 4096, 4096), (128, 64, 128, 4, 3, 132)),
                                 ((128, 4096, 11008), (128, 128, 64, 8, 4, 264)),
                                 ((128, 12288, 4096), (128, 128, 128, 8, 3, 132)),
                                 ((32, 4096, 4096), (32, 64, 256, 4, 4, 132)),
                                 ((64, 22016, 4096), (64, 128, 128, 4, 4, 264)),
                                 ((128, 22016, 4096), (128, 256, 64, 8, 3, 132))):
            x, w = torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
            dense_linear.DENSE_LINEAR.triton(x, w, config=(kind, *tiles))
            dense_linear.DENSE_LINEAR.triton(x, w, torch.zeros(n, dtype=dtype), residual=torch.zeros(t, n, dtype=dtype),
                                             config=(kind, *tiles))
    previous = _triton.use_pdl_prefetch(512)
    try:
        for (t, n, k), config in (((32, 4096, 11008), ("swap", 32, 64, 256, 4, 4, 4)),
                                  ((1, 4096, 11008), ("gemv", 1, 4, 512, 4, 3))):
            dense_linear.DENSE_LINEAR.triton(torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype),
                                             config=config)
    finally:
        _triton.use_pdl_prefetch(previous)
    for (t, n, k), config in launches:
        x, w = torch.zeros(t, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
        dense_linear.DENSE_LINEAR.triton(x, w, config=config)
        dense_linear.DENSE_LINEAR.triton(x, w, torch.zeros(n, dtype=dtype), config=config)
    # the fused variants: every measured fused launch, and each fusion once per kernel kind at a Llama-2-7B shape
    fused = [((t, n, k, f), c) for (_dev, t, n, k, f), c in dense_linear.MEASURED_FUSED_CONFIGS.items()]
    fused += [((t, n, k, f), c) for (t, n, k), c in launches[-3:] for f in dense_linear.FUSIONS]
    for (t, n, k, fusion), config in fused:
        w, residual = torch.zeros(n, k, dtype=dtype), torch.zeros(t, n, dtype=dtype)
        if fusion == "norm":
            dense_linear.DENSE_LINEAR.triton(torch.zeros(t, k, dtype=dtype), w, norm_weight=torch.ones(k, dtype=dtype),
                                             config=config)
        elif fusion == "residual":
            dense_linear.DENSE_LINEAR.triton(torch.zeros(t, k, dtype=dtype), w, residual=residual, config=config)
        else:
            dense_linear.DENSE_LINEAR.triton(torch.zeros(t, 2 * k, dtype=dtype), w, activation="silu",
                                             residual=residual, config=config)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
        return 2
    recorders = pretend_cuda()
    drive_launchers()
    failures, seen = 0, set()
    for name, rec in recorders.items():
        if not rec.launches:
            print(f"FAIL {name}: never launched")
            failures += 1
        for _grid, args, kwargs in rec.launches:
            key = (name, tuple(_signature_type(a) for a in args), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
            if key in seen:
                continue
            seen.add(key)
            consts = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            try:
                compiled = compile_launch(rec.fn, args, kwargs)
            except Exception as err:  # report every failure, not only the first
                print(f"FAIL {name}[{consts}]: {type(err).__name__}: {err}")
                failures += 1
                continue
            shared = compiled.metadata.shared
            status = "ok  " if shared <= MAX_SHARED_BYTES else "FAIL"
            failures += shared > MAX_SHARED_BYTES
            print(f"{status} {name}[{consts}] shared={shared} B")
    print(f"{len(seen)} specialisations, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
