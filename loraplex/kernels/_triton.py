"""Optional Triton import and launch helpers shared by the kernel files.

``import loraplex.kernels.ops`` must work without Triton (reference path only).
When Triton is missing, ``triton.jit`` is replaced by a decorator that returns
a placeholder, and ``tl.constexpr`` (the only ``tl`` name evaluated when a
kernel is *defined*, in its annotations) by ``object``; every launcher calls
:func:`require_triton` first, so a placeholder is never launched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from loraplex.kernels.errors import KernelArgumentError, TritonUnavailableError

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised in a subprocess test
    HAS_TRITON = False

    class _UnavailableKernel:
        """Stands in for a ``@triton.jit`` kernel when Triton is not installed."""

        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            raise TritonUnavailableError(f"{self.fn.__name__}: triton is not installed")

    class _NoTriton:
        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_options: Any) -> Any:
            if fn is None:
                return _UnavailableKernel
            return _UnavailableKernel(fn)

    class _NoTritonLanguage:
        constexpr = object

    triton = _NoTriton()  # type: ignore[assignment]
    tl = _NoTritonLanguage()  # type: ignore[assignment]

# SM count assumed off CUDA (the CPU interpreter has no SMs) when sizing
# split-K grids: small, so that CPU tests exercise the split decisions.
_INTERPRETER_NUM_SMS = 4


# Launch counters per device: int32 zeros, each set back to 0 by the program that finishes its group (the last of a
# split-K tile's programs, of an rms_norm row's), so launches (and CUDA graph replays) on one stream share them
# (under PDL too: a kernel touches them only after its wait for the previous grid); launches on two streams of one
# device at once would race on them. Allocated at the first launch that needs them, which must not be inside a graph
# capture (the engine warms every graph's launches eagerly first).
_LAUNCH_COUNTERS: dict[torch.device, torch.Tensor] = {}
LAUNCH_COUNTERS = 1 << 16


def launch_counters(op: str, device: torch.device, count: int) -> torch.Tensor:
    """The device's launch counters (``[LAUNCH_COUNTERS]`` int32 zeros), of which op ``op``'s launch uses the first
    ``count``. Raises :class:`KernelArgumentError` for more than :data:`LAUNCH_COUNTERS`, or for a first use inside
    a CUDA graph capture."""
    if count > LAUNCH_COUNTERS:
        raise KernelArgumentError(f"{op}: {count} launch counters needed (at most {LAUNCH_COUNTERS})")
    counters = _LAUNCH_COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise KernelArgumentError(f"{op}: the first launch on {device} that needs launch counters is inside a "
                                      "CUDA graph capture; launch it once eagerly first (the counters must outlive "
                                      "the graph)")
        counters = _LAUNCH_COUNTERS[device] = torch.zeros(LAUNCH_COUNTERS, dtype=torch.int32, device=device)
    return counters


def require_triton(op_name: str) -> None:
    """Raise :class:`TritonUnavailableError` naming ``op_name`` if Triton is missing."""
    if not HAS_TRITON:
        raise TritonUnavailableError(
            f"{op_name}: the triton backend needs the `triton` package; install it or use Kernels('reference')"
        )


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


SM90_SHARED_MEMORY_BYTES = 232448  # H100/H200: opt-in shared memory per block


@functools.lru_cache(maxsize=16)
def _cuda_max_shared_memory(index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may take on ``device`` (the driver's opt-in limit; off CUDA the sm_90
    figure, so launch decisions made for the interpreter or a compile check match an H100/H200)."""
    if device.type == "cuda":
        return _cuda_max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())
    return SM90_SHARED_MEMORY_BYTES


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed small number off CUDA)."""
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_NUM_SMS


@functools.lru_cache(maxsize=16)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The CUDA device's name (``torch.cuda.get_device_name``, cached per index), e.g. "NVIDIA H200"; "cpu" off
    CUDA."""
    if device.type == "cuda":
        return _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())
    return "cpu"


_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dot_dtype(dtype: torch.dtype, device: torch.device) -> Any:
    """Operand dtype for ``tl.dot`` (a ``tl.constexpr``): ``dtype`` itself, or fp32 for bf16 off CUDA.

    The Triton CPU interpreter (3.x) runs ``tl.dot`` on bf16 *bit patterns*
    (stored as uint16) and returns garbage. bf16 x bf16 products are exact in
    fp32, so upcasting gives the tensor-core result up to accumulation order.
    Kernels write ``tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)``;
    the casts vanish when ``DOT_DTYPE`` is already the operand dtype.
    """
    if dtype == torch.bfloat16 and device.type != "cuda":
        return tl.float32
    return getattr(tl, _TL_DTYPES[dtype])


def tl_dtype(dtype: torch.dtype) -> Any:
    """The ``tl`` dtype of a float torch dtype (a ``tl.constexpr``)."""
    return getattr(tl, _TL_DTYPES[dtype])


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """``tl.dot`` input precision: exact ("ieee") when the operands are fp32, else "tf32" (ignored for 16-bit)."""
    return "ieee" if dot_dtype(dtype, device) == tl.float32 else "tf32"


@functools.lru_cache(maxsize=4096)
def _pointer_table(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def pointer_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)] int64`` device tensor of ``data_ptr()`` values, cached by value.

    Lets one launch read several weight tensors of different shapes (LoRA
    slices); the cache avoids a host-to-device copy per layer and step. The
    content is a pure function of the key, so a reused address is harmless.
    """
    return _pointer_table(tensors[0].device, tuple(t.data_ptr() for t in tensors))


@functools.lru_cache(maxsize=16384)
def _int32_table(device: torch.device, values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def int32_table(values: list[int], device: torch.device) -> torch.Tensor:
    """``[len(values)] int32`` device tensor holding ``values``, cached by value."""
    return _int32_table(device, tuple(values))


def launch_options(op: str, extra: tuple[int, ...]) -> dict[str, int]:
    """Triton launch options from a block override's tail ``(num_warps[, num_stages])``: 4 warps and Triton's
    default stages when absent. Raises ``KernelArgumentError`` for more than two values or a warp count that is
    not a power of two in 1..16."""
    if len(extra) > 2:
        raise KernelArgumentError(f"{op}: launch override {extra}: at most (num_warps, num_stages)")
    options = {"num_warps": extra[0] if extra else 4}
    if options["num_warps"] not in (1, 2, 4, 8, 16):
        raise KernelArgumentError(f"{op}: num_warps={options['num_warps']}: must be 1, 2, 4, 8 or 16")
    if len(extra) == 2:
        options["num_stages"] = extra[1]
    return options


# Programmatic dependent launch (Hopper and later; CUDA programming guide, "Programmatic Dependent Launch and
# Synchronization"): a kernel launched with it may start while the kernel before it in the stream still runs; its
# programs wait (``griddepcontrol.wait``) for that kernel's completion and memory before touching memory the earlier
# kernels write, and let the next kernel launch (``griddepcontrol.launch_dependents``) at the point its trigger mode
# names. CUDA graphs keep these edges, so a decode step's kernels start without the launch gap between them.
# Launches use it only inside :func:`pdl_launches` (the engine decides where it was measured to pay) and where
# :func:`use_pdl` allows.
_PDL: bool | frozenset[str] = True
_PDL_SCOPE = False
# When a kernel lets the next one launch (``USE_PDL`` values): "start" right after its wait, "late" where the kernel
# marks the end of its main loop (:func:`pdl_trigger`; kernels without such a mark: at exit), "exit" when each
# program ends (no explicit trigger).
PDL_TRIGGERS = {"start": 1, "exit": 2, "late": 3}
# The default: the GEMMs and decode attention (main loops over K or the context, several programs per SM, often more
# than one wave) let go late, every other kernel at its start. The split-K reductions launched under those ops' names
# (decode attention's, the FP8 split sum) have no trigger point and let go at exit (as measured). Measured on an H200
# (benchmarks/RESULTS.md, session 21, benchmarks/diag_pdl.py): with every kernel at "start" a Llama-2-7B decode graph
# of batch 32 took 5.19 ms against 4.82 without PDL, and 4.73 with this default (the dependents of a GEMM, taking SM
# slots while its programs still stream weights, were the loss); batch 1: 3.87 without PDL, 3.67 at "start", 3.69
# with this default.
DEFAULT_PDL_TRIGGERS = {"dense_linear": "late", "fp8_linear": "late", "paged_decode_attention": "late"}
_PDL_TRIGGER: str | dict[str, str] = DEFAULT_PDL_TRIGGERS
# Weight columns a GEMM prefetches into L2 before its wait (``pdl_prefetch``), per weight row of its tile; 0: none.
_PDL_PREFETCH_K = 0
# Context positions a decode attention program prefetches (K and V lines) into L2 before its wait; 0: none (the
# default). Measured on an H200 (benchmarks/RESULTS.md, session 22): in the decode graph alone (benchmarks/diag_pdl.py,
# Llama-2-7B, context 160) 64 positions took batch 1 / 32 / 128 from 3.756 / 4.861 / 7.456 ms to 3.714 / 4.837 /
# 7.444 (128 positions: slower at 32 and 128); in the engine's decode steps (bench_decode.py, runs interleaved) the
# base step at batch 128 was ~0.1 ms slower with 64 (8.06 / 8.17 against 7.97 / 8.03 ms) and batch 1 / 32 within
# 0.04 ms, so it stays off.
_PDL_KV_PREFETCH = 0


@functools.lru_cache(maxsize=16)
def _cuda_capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def use_pdl(enabled: bool | frozenset[str]) -> bool | frozenset[str]:
    """Turn programmatic dependent launches on or off, or on for the named ops only (benchmarks' A/B; on by
    default); returns the previous setting. CUDA graphs keep the launches they were captured with."""
    global _PDL
    previous, _PDL = _PDL, enabled
    return previous


def use_pdl_trigger(trigger: str | dict[str, str]) -> str | dict[str, str]:
    """Set when PDL kernels let the next kernel launch: one of :data:`PDL_TRIGGERS` for every op, or ``{op: trigger}``
    (ops not named: ``"start"``); returns the previous setting. Raises ``ValueError`` for an unknown trigger."""
    global _PDL_TRIGGER
    for name in (trigger.values() if isinstance(trigger, dict) else (trigger,)):
        if name not in PDL_TRIGGERS:
            raise ValueError(f"PDL trigger {name!r}: expected one of {sorted(PDL_TRIGGERS)}")
    previous, _PDL_TRIGGER = _PDL_TRIGGER, trigger
    return previous


def _check_prefetch_size(size: int, least: int, unit: str) -> None:
    """Raise ``ValueError`` unless ``size`` is 0 or a power of two >= ``least``."""
    if size and (size < least or size & (size - 1)):
        raise ValueError(f"PDL prefetch of {size} {unit}: a power of two >= {least}, or 0")


def use_pdl_prefetch(columns: int) -> int:
    """Weight columns (a power of two >= 64, or 0: none) each PDL-launched ``dense_linear`` program prefetches into L2
    per weight row of its tile (from the first column of its K split) before its wait (the weights do not depend on
    the kernel before it); returns the previous value. Raises ``ValueError`` for another value."""
    global _PDL_PREFETCH_K
    _check_prefetch_size(columns, 64, "columns")
    previous, _PDL_PREFETCH_K = _PDL_PREFETCH_K, columns
    return previous


def use_pdl_kv_prefetch(positions: int) -> int:
    """Context positions (a power of two >= 16, or 0: none) each PDL-launched decode attention program prefetches
    into L2 before its wait: the K and V lines of the first ``positions`` positions of its chunk (the kernel before it
    writes at most one of them, the step's new token, into L2, which is coherent); returns the previous value.
    Raises ``ValueError`` for another value."""
    global _PDL_KV_PREFETCH
    _check_prefetch_size(positions, 16, "positions")
    previous, _PDL_KV_PREFETCH = _PDL_KV_PREFETCH, positions
    return previous


def pdl_kv_prefetch_positions(use_pdl: int) -> int:
    """The ``PREFETCH_N`` constexpr of a decode attention launch: :func:`use_pdl_kv_prefetch`'s positions where the
    launch uses PDL (``use_pdl`` from :func:`pdl_args`); else 0."""
    return _PDL_KV_PREFETCH if use_pdl else 0


def pdl_prefetch_columns(use_pdl: int, in_features: int) -> int:
    """The ``PREFETCH_K`` constexpr of a GEMM launch: :func:`use_pdl_prefetch`'s columns, capped at the power of two
    at or below ``in_features``, where the launch uses PDL (``use_pdl`` from :func:`pdl_args`); else 0."""
    if not use_pdl or not _PDL_PREFETCH_K or in_features < 64:
        return 0
    return min(_PDL_PREFETCH_K, 1 << (in_features.bit_length() - 1))


@contextlib.contextmanager
def pdl_launches(enabled: bool = True) -> Iterator[None]:
    """Kernels launched inside (and ``enabled``) use programmatic dependent launches, where :func:`pdl_args`
    allows them."""
    global _PDL_SCOPE
    previous, _PDL_SCOPE = _PDL_SCOPE, enabled
    try:
        yield
    finally:
        _PDL_SCOPE = previous


def pdl_args(device: torch.device, op: str) -> dict[str, Any]:
    """Launch keywords of op ``op``'s kernel, which calls :func:`pdl_wait`: ``{"USE_PDL": mode, "launch_pdl":
    True}`` inside :func:`pdl_launches` on a CUDA device of compute capability >= 9 (with :func:`use_pdl` on for
    ``op``; ``mode`` the :data:`PDL_TRIGGERS` value of its trigger, :data:`DEFAULT_PDL_TRIGGERS`' by default: 3 for
    the ops named there, 1 for the others), else ``{"USE_PDL": False}`` (the interpreter and older GPUs: the wait
    compiles away)."""
    on = _PDL_SCOPE and (_PDL if isinstance(_PDL, bool) else op in _PDL)
    if on and device.type == "cuda" and _cuda_capability_major(
            device.index if device.index is not None else torch.cuda.current_device()) >= 9:
        return {"USE_PDL": pdl_trigger_mode(op), "launch_pdl": True}
    return {"USE_PDL": False}


def pdl_trigger_mode(op: str) -> int:
    """The :data:`PDL_TRIGGERS` value (``USE_PDL``) of op ``op``'s PDL launches under :func:`use_pdl_trigger`'s
    setting (ops a dict does not name: "start")."""
    return PDL_TRIGGERS[_PDL_TRIGGER if isinstance(_PDL_TRIGGER, str) else _PDL_TRIGGER.get(op, "start")]


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with :func:`pdl_args` (after :func:`pdl_prefetch`, and in decode attention
    the step's metadata loads, at most): wait for the previous kernel in the stream (its writes visible, its reads of
    what this kernel overwrites done); with the "start" trigger (``USE_PDL == 1``), then allow the next kernel to
    launch. Every program runs it before any store and before any load of memory a kernel of the step writes, and
    before it ends."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if USE_PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """The end of a kernel's main loop: with the "late" trigger (``USE_PDL == 3``), allow the next kernel to launch
    here (its programs then take SM slots only while this kernel's last programs finish their epilogues)."""
    if USE_PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prefetch(ptrs, mask, fallback, PREFETCH: tl.constexpr):
    """Before :func:`pdl_wait`: ask L2 for the 128-byte lines at ``ptrs`` (one pointer per line; masked-off ones ask for
    ``fallback``'s line) while the previous kernel still runs. L2 is the device's point of coherence and the prefetch
    fills no L1, so it never makes a later load stale, also of a line the previous kernel writes (decode attention's
    K/V: the step's new token) or has written. ``PREFETCH`` False: nothing."""
    if PREFETCH:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [tl.where(mask, ptrs, fallback)], dtype=tl.int32, is_pure=False, pack=1)
