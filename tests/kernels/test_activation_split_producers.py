"""The kernels that make an FP8 linear's input write its activation split too (fp8_linear.SPLIT_ACTIVATIONS):
``rms_norm(..., split=)``, ``silu_and_mul(..., split=)``, ``gelu_tanh_and_mul(..., split=)``. Each against the same
op without a split (the output unchanged, bit for bit) and against ``split_activations`` of that output (the split
bit for bit), on both backends; rows longer than ``SPLIT_FUSED_MAX`` (and LoRA deltas) take the split kernel after the
op; ``fp8_linear(..., split=)`` reads a given split as the split path would have made it."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import activation, rms_norm
from loraplex.kernels.fp8_linear import FP8_DTYPE, ActivationSplit, split_activations
from loraplex.kernels.ops import Kernels


def _expected_split(y: torch.Tensor) -> ActivationSplit:
    split = ActivationSplit.empty(*y.shape, y.device)
    split_activations(y, split)
    return split


def _assert_same_split(got: ActivationSplit, expected: ActivationSplit) -> None:
    """Equal scales, and equal bytes with zeros compared as zeros: for an output of -0.0 (a gated activation's
    underflow) the compiled kernel writes l = -0.0 on the H200 where torch's IEEE v - h gives +0.0."""
    def as_bytes(q):
        b = q.cpu().view(torch.uint8)
        return torch.where(b == 0x80, torch.zeros_like(b), b)

    assert torch.equal(got.s.cpu(), expected.s.cpu())
    assert torch.equal(as_bytes(got.q), as_bytes(expected.q))


@pytest.fixture(params=["triton", "reference"])
def kernels(request, kernel_device):
    return Kernels(request.param)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [40, 72])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("fused_max", [16384, 32])
def test_rms_norm_writes_its_outputs_split(kernels, kernel_device, poison_allocations, monkeypatch, dtype, hidden,
                                            with_residual, fused_max):
    monkeypatch.setattr(rms_norm, "SPLIT_FUSED_MAX", fused_max)  # 32: the split kernel after the norm
    torch.manual_seed(1)
    x = torch.randn(5, hidden).to(kernel_device, dtype)
    x[2, 3] = 300.0  # an outlier in one row
    weight = (torch.rand(hidden) + 0.5).to(kernel_device, dtype)
    residual = torch.randn(5, hidden).to(kernel_device, dtype) if with_residual else None
    split = ActivationSplit.empty(5, hidden, kernel_device)
    got = kernels.rms_norm(x, weight, 1e-6, residual, split=split)
    plain = kernels.rms_norm(x, weight, 1e-6, residual)
    out = got[0] if with_residual else got
    for a, b in zip(got if with_residual else [got], plain if with_residual else [plain]):
        assert torch.equal(a, b)
    _assert_same_split(split, _expected_split(out))


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("inter", [40, 72])
@pytest.mark.parametrize("fused_max", [16384, 32])
def test_gated_activations_write_their_outputs_split(kernels, kernel_device, poison_allocations, monkeypatch, op,
                                                     inter, fused_max):
    monkeypatch.setattr(activation, "SPLIT_FUSED_MAX", fused_max)
    torch.manual_seed(2)
    x = (torch.randn(5, 2 * inter) * 3).to(kernel_device, torch.bfloat16)
    split = ActivationSplit.empty(5, inter, kernel_device)
    got = getattr(kernels, op)(x, split=split)
    assert torch.equal(got, getattr(kernels, op)(x))
    _assert_same_split(split, _expected_split(got))


@pytest.mark.interpreter
def test_a_split_of_the_wrong_shape_is_refused(kernel_device):
    from loraplex.kernels.errors import KernelArgumentError

    kernels = Kernels("triton")
    x = torch.randn(3, 40).to(kernel_device, torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="split.q"):
        kernels.rms_norm(x, torch.ones(40).to(kernel_device, torch.bfloat16), 1e-6,
                         split=ActivationSplit.empty(3, 20, kernel_device))
    with pytest.raises(KernelArgumentError, match="split.q"):
        kernels.silu_and_mul(x, split=ActivationSplit.empty(3, 40, kernel_device))


@pytest.mark.interpreter
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_reads_a_given_split_as_its_own(kernel_device, poison_allocations, bias):
    """``fp8_linear(x, ..., split=S)`` with S the split of x equals the split path splitting x itself, bit for bit,
    on the Triton backend; the reference backend computes from S's values (``ActivationSplit.values``)."""
    from loraplex.kernels.fp8_linear import _launch_fp8_linear, fp8_linear_ref

    torch.manual_seed(4)
    x = torch.randn(7, 72).to(kernel_device, torch.bfloat16)
    weight = (torch.randn(24, 72) * 100).clamp(-448, 448).to(FP8_DTYPE).to(kernel_device)
    scale = (torch.rand(24) * 0.02 + 1e-3).to(kernel_device)
    b = torch.randn(24).to(kernel_device, torch.bfloat16) if bias else None
    config = (16, 16, 32, 4, 2, 1)
    split = _expected_split(x)
    given = _launch_fp8_linear(x, weight, scale, b, split=split, config=config)
    own = _launch_fp8_linear(x, weight, scale, b, config=config, activations="split")
    assert torch.equal(given, own)
    ref = fp8_linear_ref(x.cpu(), weight.cpu(), scale.cpu(), None if b is None else b.cpu(),
                         split=ActivationSplit(split.q.cpu(), split.s.cpu()))
    expected = (split.values().cpu() @ weight.cpu().float().T) * scale.cpu()
    if b is not None:
        expected = expected + b.cpu().float()
    assert torch.equal(ref, expected.to(torch.bfloat16))
