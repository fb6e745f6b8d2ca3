"""Kernels for the engine: Triton ops, each with a plain-torch reference of the same semantics.

Call them through :mod:`loraplex.kernels.ops`, which dispatches to Triton for
CUDA tensors and to the references otherwise. Depends on torch and
(optionally) triton only; never imports the engine.

One op per file, each with a private ``@triton.jit`` kernel, a launcher that
checks its arguments and picks block sizes, a thin public function and the
``*_ref`` reference: ``reshape_and_cache``, ``attention`` (``attention_decode``,
``attention_prefill``), ``rms_norm``, ``rotary``, ``activation`` (silu_and_mul),
``lora_shrink`` / ``lora_expand`` (Punica SGMV) with ``lora_mapping``.
"""

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError, TritonUnavailableError
from loraplex.kernels.lora_mapping import LoRAMapping

__all__ = ["AttentionMetadata", "KernelArgumentError", "LoRAMapping", "TritonUnavailableError"]
