"""FP8 (e4m3) weight-only quantization of the base model's linear layers (``quantization="fp8"``).

Per-output-channel symmetric scales, the format of vLLM's dynamic FP8 and of
compressed-tensors' ``float-quantized`` per-channel weights::

    scale[n] = max_k |W[n, k]| / 448        (448: the largest finite float8_e4m3fn)
    Wq[n, k] = round_to_e4m3(W[n, k] / scale[n])

LoRA stays in the model dtype; the products run in
:data:`loraplex.kernels.fp8_linear.FP8_LINEAR`: on Hopper GPUs, at steps of up to 128 tokens, on e4m3
tensor cores with each token's bf16 activations split into two e4m3 terms (``SPLIT_ACTIVATIONS``,
~2^-8 of each element), otherwise with the weights widened to the activations' dtype (W8A16). The
embeddings, the LM head and the norms stay unquantized (as in vLLM). A weight's relative error per
element is at most 2^-4 (3 mantissa bits) for normal values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.fp8_linear import FP8_DTYPE

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
QUANTIZATION_METHODS = ("fp8",)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` (any float dtype) -> ``(Wq [N, K] float8_e4m3fn, scale [N] float32)``
    with ``Wq * scale[:, None] ≈ weight``; an all-zero row gets scale 1 (and zeros)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Wq * scale[:, None]`` in ``dtype`` (the weight the FP8 model computes with)."""
    return (qweight.to(torch.float32) * scale[:, None]).to(dtype)


@dataclass(frozen=True)
class QuantizationReport:
    """What :func:`quantize_linears_fp8` did: layers quantized and weight bytes before/after."""

    num_linears: int
    weight_bytes_before: int
    weight_bytes_after: int


def quantize_linears_fp8(model: torch.nn.Module) -> QuantizationReport:
    """Quantize every base linear (q/k/v, o, gate/up, down) of ``model`` in place (the
    modules' ``quantize_fp8``); the embeddings and the LM head are left as they are."""
    before = after = count = 0
    for module in model.modules():
        quantize = getattr(module, "quantize_fp8", None)
        if quantize is None:
            continue
        before += module.weight.numel() * module.weight.element_size()
        quantize()
        after += module.qweight.numel() * module.qweight.element_size() + module.weight_scale.numel() * 4
        count += 1
    return QuantizationReport(num_linears=count, weight_bytes_before=before, weight_bytes_after=after)
