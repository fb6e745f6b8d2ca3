"""Argument checks shared by the kernel launchers and references.

Every failure raises :class:`KernelArgumentError` naming the op, the argument
and the offending value. The checks read only shapes, dtypes, strides and
devices (never tensor contents), so they cost no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.errors import KernelArgumentError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """``t.dtype`` must be one of ``allowed``."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelArgumentError(f"{op}: {name}.dtype={t.dtype}, expected one of ({names})")


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` must have the dtype of ``ref``."""
    if t.dtype != ref.dtype:
        raise KernelArgumentError(f"{op}: {name}.dtype={t.dtype} differs from {ref_name}.dtype={ref.dtype}")


def check_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """``t.shape`` must match ``expected``; ``None`` entries match any size."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        shown = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise KernelArgumentError(f"{op}: {name}.shape={tuple(t.shape)}, expected {shown}")


def check_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """``t`` must live on ``device``."""
    if t.device != device:
        raise KernelArgumentError(f"{op}: {name}.device={t.device}, expected {device}")


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """The last dimension of ``t`` must have stride 1 (other strides are free)."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelArgumentError(f"{op}: {name}.stride()={t.stride()}, the last dimension must have stride 1")


def check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    """``t`` must be contiguous."""
    if not t.is_contiguous():
        raise KernelArgumentError(f"{op}: {name} must be contiguous, got stride()={t.stride()}")


def check_positive(op: str, name: str, value: float) -> None:
    """``value`` must be > 0."""
    if not value > 0:
        raise KernelArgumentError(f"{op}: {name}={value!r}, expected > 0")
