"""Start-up self-check of the batched LoRA op on the serving device (``add_lora`` against its reference).

The Triton kernels are tested under the CPU interpreter in CI; compiled on a GPU they take other launch
shapes. Before an engine serves adapters on a GPU it runs the op once per layer shape, for one decode token,
a decode batch and a prompt chunk (each with its own launch shapes), against the float32 reference:
a mismatch raises :class:`LoRAKernelMismatch` and the engine refuses to start, rather than serve wrong
tokens. Semantics checked: :data:`~loraplex.kernels.lora_linear.ADD_LORA`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.lora_linear import ADD_LORA
from loraplex.kernels.lora_mapping import plan_segments

TOKEN_COUNTS = (1, 32, 300)  # one decode token, a decode batch, a prompt chunk (their own launch shapes)


class LoRAKernelMismatch(RuntimeError):
    """The LoRA op disagrees with its float32 reference on this device (the message says where)."""


def check_add_lora(shapes: Sequence[tuple[int, Sequence[int]]], num_slots: int, rank: int, dtype: torch.dtype,
                   device: torch.device, *, seed: int = 0) -> None:
    """Run ``ADD_LORA.triton`` for each ``(in_features, out_widths)`` in ``shapes`` at every count of
    :data:`TOKEN_COUNTS` (20% of the tokens without adapter, the rest over ``min(num_slots, 4)`` slots)
    and compare with ``ADD_LORA.reference`` in float32: ``max |ours - ref| <= 0.03 * max |delta| + 0.05``
    (bf16 rounding of the shrink result and of y). Raises :class:`LoRAKernelMismatch`."""
    gen = torch.Generator().manual_seed(seed)
    slots_used = max(1, min(num_slots, 4))
    for hidden, widths in shapes:
        for tokens in TOKEN_COUNTS:
            base = min(round(0.2 * tokens), tokens - 1)
            token_slots = torch.tensor([-1] * base + [i % slots_used for i in range(tokens - base)], dtype=torch.int32)
            token_slots = token_slots[torch.randperm(tokens, generator=gen)].to(device)
            mapping = plan_segments(token_slots, num_slots)
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            y = torch.randn(tokens, sum(widths), generator=gen).to(device, dtype)
            a = [(torch.randn(num_slots, rank, hidden, generator=gen) / hidden**0.5).to(device, dtype) for _ in widths]
            b = [(torch.randn(num_slots, w, rank, generator=gen) / rank**0.5).to(device, dtype) for w in widths]
            scaling = [torch.full((num_slots,), 2.0, device=device) for _ in widths]
            ours, ref = y.clone(), y.to(torch.float32, copy=True)
            ADD_LORA.triton(x, a, b, scaling, ours, mapping)
            ADD_LORA.reference(x.float(), [t.float() for t in a], [t.float() for t in b], scaling, ref, mapping)
            err = (ours.float() - ref).abs().max().item()
            delta = (ref - y.float()).abs().max().item()
            if not err <= 0.03 * delta + 0.05:
                raise LoRAKernelMismatch(
                    f"add_lora on {device} ({dtype}): max error {err:.4g} against the float32 reference "
                    f"(delta scale {delta:.4g}) for {tokens} tokens, in_features={hidden}, widths={list(widths)}, "
                    f"rank={rank}, slots={num_slots}; refusing to serve adapters with a wrong LoRA kernel "
                    "(enable_lora=False serves the base model)")
