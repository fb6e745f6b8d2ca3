"""Typed errors raised by the kernels package."""

from __future__ import annotations


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong shape, dtype, device, layout or value.

    The message always names the argument and the offending value, e.g.
    ``paged_attention: query.dtype=torch.int8, expected one of (float16, bfloat16, float32)``.
    """


class TritonUnavailableError(RuntimeError):
    """The Triton backend was requested but ``triton`` cannot be imported."""
