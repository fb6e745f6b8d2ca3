"""silu_and_mul: Triton kernel and reference against HF's ``act_fn(gate) * up``."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import assert_within_ulps, nan_like
from transformers.activations import ACT2FN

from loraplex.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from loraplex.kernels.errors import KernelArgumentError


def _hf(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.cpu().chunk(2, dim=-1)
    return ACT2FN["silu"](gate) * up


# silu in fp32 may differ from torch's by an ulp of fp32 before rounding; bf16 may lose
# one more ulp to the interpreter's truncating fp32 -> bf16 cast.
ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 3}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("inter", [16, 1100])  # one partial tile / two tiles of 1024
def test_kernel_matches_hf(kernel_device, triton_kernels, poison_allocations, inter, dtype):
    x = (torch.randn(3, 2 * inter) * 4).to(device=kernel_device, dtype=dtype)
    out = nan_like(torch.empty(3, inter, dtype=dtype, device=kernel_device))
    result = triton_kernels.silu_and_mul(x, out=out)
    assert result is out
    assert_within_ulps(out, _hf(x), dtype, ULPS[dtype])
    assert_within_ulps(triton_kernels.silu_and_mul(x), _hf(x), dtype, ULPS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_is_hf_exactly(dtype):
    x = (torch.randn(5, 2 * 40) * 4).to(dtype)
    assert torch.equal(silu_and_mul_ref(x), _hf(x))


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(KernelArgumentError, match="must be even"):
        silu_and_mul_ref(torch.randn(2, 7))
    with pytest.raises(KernelArgumentError, match="x.dtype"):
        silu_and_mul_ref(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(KernelArgumentError, match="out.dtype"):
        silu_and_mul_ref(torch.randn(2, 8), out=torch.empty(2, 4, dtype=torch.float16))


def _hf_gelu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.cpu().chunk(2, dim=-1)
    return ACT2FN["gelu_pytorch_tanh"](gate) * up


# tanh through exp in fp32 differs from torch's by a few fp32 ulps of the gate's magnitude.
GELU_ULPS = {torch.float32: 64, torch.float16: 2, torch.bfloat16: 3}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("inter", [16, 1100])
def test_gelu_tanh_kernel_matches_hf(kernel_device, triton_kernels, poison_allocations, inter, dtype):
    x = (torch.randn(3, 2 * inter) * 4).to(device=kernel_device, dtype=dtype)
    out = nan_like(torch.empty(3, inter, dtype=dtype, device=kernel_device))
    assert triton_kernels.gelu_tanh_and_mul(x, out=out) is out
    gate, up = x.float().cpu().chunk(2, dim=-1)
    assert_within_ulps(out, _hf_gelu(x), dtype, GELU_ULPS[dtype], magnitude=(gate * up).abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gelu_tanh_reference_is_hf_exactly(dtype):
    x = (torch.randn(5, 2 * 40) * 4).to(dtype)
    assert torch.equal(gelu_tanh_and_mul_ref(x), _hf_gelu(x))
