"""Kernels for the engine: Triton ops, each with a plain-torch reference of the same semantics.

Call them through :class:`loraplex.kernels.ops.Kernels`, every op bound to one
backend ("triton" or "reference"), chosen once by the caller. Depends on torch
and (optionally) triton only; never imports the engine.

One op per file, each with a private ``@triton.jit`` kernel, a launcher that
checks its arguments and picks block sizes, the documented ``*_ref`` plain-torch
reference and the :class:`~loraplex.kernels.op.Op` naming both with the op's
semantics line: ``reshape_and_cache``, ``attention`` (``attention_decode``,
``attention_prefill``), ``rms_norm``, ``rotary``, ``rotary_and_cache`` (RoPE + cache write in one launch),
``activation`` (silu_and_mul),
``lora_shrink`` / ``lora_expand`` (Punica SGMV) and ``fused_lora`` (both in one launch) with ``lora_mapping``.
"""

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError, TritonUnavailableError
from loraplex.kernels.lora_mapping import LoRAMapping

__all__ = ["AttentionMetadata", "KernelArgumentError", "LoRAMapping", "TritonUnavailableError"]
