"""The op registry and :class:`Kernels`, the ops of one backend, bound once.

Every op is an :class:`~loraplex.kernels.op.Op` defined at the end of its
file, with its semantics line; the reference function there documents its
arguments. The engine builds one ``Kernels`` per model from its device
(:func:`default_backend`); tests pick the backend explicitly. There is no
process-wide backend switch.

- ``"triton"``: the Triton kernels (on CUDA tensors, or on CPU tensors under
  the Triton CPU interpreter, ``TRITON_INTERPRET=1`` set before Triton is
  imported: this is how the CPU tests run the kernels).
- ``"reference"``: the plain-torch references.

This module imports without Triton installed; ``Kernels("triton")`` then raises
:class:`~loraplex.kernels.errors.TritonUnavailableError`.
"""

from __future__ import annotations

import torch

from loraplex.kernels._triton import require_triton
from loraplex.kernels.activation import GELU_TANH_AND_MUL, SILU_AND_MUL
from loraplex.kernels.attention import PAGED_ATTENTION
from loraplex.kernels.dense_linear import DENSE_LINEAR
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.fp8_linear import FP8_LINEAR
from loraplex.kernels.lora_expand import LORA_EXPAND, LORA_EXPAND_SLOT_ROWS
from loraplex.kernels.lora_fused import FUSED_LORA
from loraplex.kernels.lora_linear import ADD_LORA
from loraplex.kernels.lora_shrink import LORA_SHRINK
from loraplex.kernels.op import BACKENDS, Backend, Op
from loraplex.kernels.reshape_and_cache import RESHAPE_AND_CACHE
from loraplex.kernels.rms_norm import RMS_NORM
from loraplex.kernels.rotary import ROTARY_EMBEDDING
from loraplex.kernels.rotary_and_cache import ROTARY_AND_CACHE

__all__ = ["BACKENDS", "OPS", "Backend", "Kernels", "default_backend"]

OPS: tuple[Op, ...] = (
    RESHAPE_AND_CACHE,
    PAGED_ATTENTION,
    RMS_NORM,
    ROTARY_EMBEDDING,
    ROTARY_AND_CACHE,
    SILU_AND_MUL,
    GELU_TANH_AND_MUL,
    LORA_SHRINK,
    LORA_EXPAND,
    LORA_EXPAND_SLOT_ROWS,
    ADD_LORA,
    FUSED_LORA,
    FP8_LINEAR,
    DENSE_LINEAR,
)


def default_backend(device: torch.device) -> Backend:
    """"triton" for a CUDA device, "reference" otherwise."""
    return "triton" if device.type == "cuda" else "reference"


class Kernels:
    """Every op of :data:`OPS` bound to one backend; attributes are named after the ops.

    Raises:
        KernelArgumentError: unknown backend.
        TritonUnavailableError: "triton" requested but triton is not installed.
    """

    def __init__(self, backend: Backend) -> None:
        if backend not in BACKENDS:
            raise KernelArgumentError(f"Kernels: backend={backend!r}, expected one of {BACKENDS}")
        if backend == "triton":
            require_triton("Kernels")
        self.backend = backend
        self.reshape_and_cache = RESHAPE_AND_CACHE.select(backend)
        self.paged_attention = PAGED_ATTENTION.select(backend)
        self.rms_norm = RMS_NORM.select(backend)
        self.rotary_embedding = ROTARY_EMBEDDING.select(backend)
        self.rotary_and_cache = ROTARY_AND_CACHE.select(backend)
        self.silu_and_mul = SILU_AND_MUL.select(backend)
        self.gelu_tanh_and_mul = GELU_TANH_AND_MUL.select(backend)
        self.lora_shrink = LORA_SHRINK.select(backend)
        self.lora_expand = LORA_EXPAND.select(backend)
        self.lora_expand_slot_rows = LORA_EXPAND_SLOT_ROWS.select(backend)
        self.add_lora = ADD_LORA.select(backend)
        self.fused_lora = FUSED_LORA.select(backend)
        self.fp8_linear = FP8_LINEAR.select(backend)
        self.dense_linear = DENSE_LINEAR.select(backend)

    def __repr__(self) -> str:
        return f"Kernels({self.backend!r})"
