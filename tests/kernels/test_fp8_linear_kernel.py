"""fp8_linear (W8A16): Triton kernel and reference against a float64 loop over output channels."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.fp8_linear import FP8_DTYPE, fp8_linear_ref


def _inputs(num_tokens, in_features, out_features, dtype, device, bias):
    x = torch.randn(num_tokens, in_features).to(device=device, dtype=dtype)
    weight = (torch.randn(out_features, in_features) * 100).clamp(-448, 448).to(FP8_DTYPE).to(device)
    scale = (torch.rand(out_features) * 0.02 + 1e-3).to(device)
    b = torch.randn(out_features).to(device=device, dtype=dtype) if bias else None
    return x, weight, scale, b


def _loop(x, weight, scale, bias):
    """out[t, n] = scale[n] * sum_k x[t, k] * float(weight[n, k]) + bias[n], one output channel at a time."""
    xd, wd = x.double().cpu(), weight.to(torch.float32).double().cpu()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float64)
    for n in range(weight.shape[0]):
        out[:, n] = (xd * wd[n]).sum(1) * float(scale[n]) + (float(bias[n]) if bias is not None else 0.0)
    return out


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 40, 24), (19, 72, 50)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_and_reference_match_the_loop(kernel_device, triton_kernels, poison_allocations, dtype, shape, bias):
    x, weight, scale, b = _inputs(*shape, dtype, kernel_device, bias)
    expected = _loop(x, weight, scale, b)
    for out in (triton_kernels.fp8_linear(x, weight, scale, b), fp8_linear_ref(x, weight, scale, b)):
        assert out.dtype == dtype and out.shape == (shape[0], shape[2])
        err = (out.double().cpu() - expected).abs() / expected.abs().clamp_min(1.0)
        assert err.max().item() <= TOL[dtype], err.max().item()


@pytest.mark.interpreter
def test_empty_batch_and_bad_arguments(kernel_device, triton_kernels):
    x, weight, scale, _ = _inputs(0, 16, 8, torch.float32, kernel_device, False)
    assert triton_kernels.fp8_linear(x, weight, scale).shape == (0, 8)
    x = torch.randn(2, 16, device=kernel_device)
    with pytest.raises(KernelArgumentError, match="weight"):
        fp8_linear_ref(x, weight.to(torch.float32), scale)
    with pytest.raises(KernelArgumentError, match="scale"):
        fp8_linear_ref(x, weight, scale[:4])
    with pytest.raises(KernelArgumentError, match="weight"):
        fp8_linear_ref(torch.randn(2, 12, device=kernel_device), weight, scale)
