"""rms_norm: Triton kernel and reference against HF ``LlamaRMSNorm``."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import assert_within_ulps
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.rms_norm import rms_norm_ref

EPS = 1e-5


def _hf(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[1], eps=EPS).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight.cpu())
        return norm(x.cpu())


def _inputs(num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device):
    x = (torch.randn(num_tokens, hidden) * 3).to(device=device, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(hidden)).to(device=device, dtype=dtype)
    residual = torch.randn(num_tokens, hidden).to(device=device, dtype=dtype)
    return x, weight, residual


# fp32/fp16 conversions are exact in the interpreter, so only rsqrt/summation
# order differ from HF (<= 2 ulp); bf16 may lose one more ulp to the
# interpreter's truncating fp32 -> bf16 cast.
ULPS = {torch.float32: 64, torch.float16: 2, torch.bfloat16: 3}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [16, 100])
def test_kernel_matches_hf(kernel_device, triton_kernels, poison_allocations, hidden, dtype):
    x, weight, residual = _inputs(5, hidden, dtype, kernel_device)
    out = triton_kernels.rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert_within_ulps(out, _hf(x, weight), dtype, ULPS[dtype])
    out, summed = triton_kernels.rms_norm(x, weight, EPS, residual)
    expected_sum = x.cpu() + residual.cpu()  # HF: residual add in the activation dtype
    assert_within_ulps(summed, expected_sum, dtype, ULPS[dtype] - 1)
    assert_within_ulps(out, _hf(expected_sum, weight), dtype, ULPS[dtype])


@pytest.mark.interpreter
def test_kernel_strided_rows(kernel_device, triton_kernels):
    base, weight, _ = _inputs(4, 64, torch.float32, kernel_device)
    x = base[:, :32]  # row stride 64, hidden 32
    out = triton_kernels.rms_norm(x, weight[:32].contiguous(), EPS)
    assert_within_ulps(out, _hf(x.contiguous(), weight[:32]), torch.float32, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_is_hf_exactly(dtype):
    x, weight, residual = _inputs(7, 48, dtype, torch.device("cpu"))
    assert torch.equal(rms_norm_ref(x, weight, EPS), _hf(x, weight))
    out, summed = rms_norm_ref(x, weight, EPS, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, _hf(x + residual, weight))


def test_bad_arguments_raise_typed_errors():
    x, weight, residual = _inputs(3, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(KernelArgumentError, match=r"weight.shape=\(8,\)"):
        rms_norm_ref(x, weight[:8], EPS)
    with pytest.raises(KernelArgumentError, match="eps=0"):
        rms_norm_ref(x, weight, 0)
    with pytest.raises(KernelArgumentError, match="residual.dtype"):
        rms_norm_ref(x, weight, EPS, residual.half())
