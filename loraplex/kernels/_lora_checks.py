"""Argument checks shared by the LoRA shrink/expand launchers and references."""

from __future__ import annotations

import torch

from loraplex.kernels._checks import check_contiguous, check_device, check_dtype, check_same_dtype, check_shape
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping


def check_mapping(op: str, mapping: LoRAMapping, num_tokens: int, num_slots: int, device: torch.device) -> None:
    """``mapping`` covers ``num_tokens`` tokens on ``device`` and has at most ``num_slots`` slots."""
    if not isinstance(mapping, LoRAMapping):
        raise KernelArgumentError(f"{op}: mapping has type {type(mapping).__name__}, expected LoRAMapping")
    if mapping.num_tokens != num_tokens:
        raise KernelArgumentError(f"{op}: mapping.num_tokens={mapping.num_tokens}, expected {num_tokens}")
    if mapping.num_slots > num_slots:
        raise KernelArgumentError(
            f"{op}: mapping has {mapping.num_slots} slots, but the weights have {num_slots} slots"
        )
    check_device(op, "mapping.sorted_token_ids", mapping.sorted_token_ids, device)


def check_weight_list(
    op: str, name: str, weights: list[torch.Tensor], like: torch.Tensor, last_dim: int | None
) -> None:
    """Each ``weights[i]`` is a contiguous ``[S, *, last_dim]`` tensor (same S) with ``like``'s dtype and device."""
    if not isinstance(weights, (list, tuple)) or not weights:
        raise KernelArgumentError(f"{op}: {name} must be a non-empty list of tensors, got {type(weights).__name__}")
    num_slots = weights[0].shape[0] if weights[0].dim() == 3 else None
    for i, w in enumerate(weights):
        check_shape(op, f"{name}[{i}]", w, (num_slots, None, last_dim))
        check_same_dtype(op, f"{name}[{i}]", w, "the activations", like)
        check_device(op, f"{name}[{i}]", w, like.device)
        check_contiguous(op, f"{name}[{i}]", w)


def check_ranks(op: str, ranks: torch.Tensor | None, num_slots: int, device: torch.device) -> None:
    """Optional ``ranks`` is ``[S] int32`` on ``device``."""
    if ranks is None:
        return
    check_dtype(op, "ranks", ranks, (torch.int32,))
    check_shape(op, "ranks", ranks, (num_slots,))
    check_device(op, "ranks", ranks, device)
    check_contiguous(op, "ranks", ranks)
