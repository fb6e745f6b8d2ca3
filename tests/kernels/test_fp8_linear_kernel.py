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


def _magnitude(x, weight, scale, bias):
    """``scale[n] * sum_k |x[t, k] * weight[n, k]| + |bias[n]|``: what a rounding error of the sum is relative to
    (a float32 sum of K terms is off by up to about K * 6e-8 of it, however much the terms cancel)."""
    mag = (x.double().cpu().abs() @ weight.to(torch.float32).double().cpu().abs().T) * scale.double().cpu()
    return mag + (bias.double().cpu().abs() if bias is not None else 0.0)


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
        # relative to the terms' magnitude (CI, session 15: a fresh seed's cancelling sum was off by 1.1e-5 of
        # max(|sum|, 1), within float32's rounding of its terms)
        err = (out.double().cpu() - expected).abs() / _magnitude(x, weight, scale, b).clamp_min(1.0)
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


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_swapped_operand_kernel_with_split_k_matches_the_loop(kernel_device, poison_allocations, split, bias):
    """The swapped-operand kernel (weight tile as the dot's M side), its K chunks summed by a second kernel when
    SPLIT_K > 1; K = 72 is not a multiple of the 16-element K tile times the split (a partial last chunk)."""
    from loraplex.kernels.fp8_linear import _launch_fp8_linear

    x, weight, scale, b = _inputs(19, 72, 50, torch.float32, kernel_device, bias)
    out = _launch_fp8_linear(x, weight, scale, b, config=(16, 16, 16, 4, 3, split))
    err = (out.double().cpu() - _loop(x, weight, scale, b)).abs().max().item()
    assert err <= 1e-4, err


def test_cuda_launch_shapes_are_the_measured_ones():
    """RESULTS.md sessions 7 and 13: token-major tiles up to 64 tokens, the swapped-operand kernel from 65 to 128
    (split over K for down_proj's 11008), o_proj's narrow short reduction in 64-token tiles, prefill tiles after."""
    from loraplex.kernels.fp8_linear import _block_sizes

    cuda = torch.device("cuda")
    assert _block_sizes(1, 12288, 4096, cuda) == (16, 32, 256, 4, 4)
    assert _block_sizes(32, 4096, 11008, cuda) == (32, 32, 512, 4, 4)
    assert _block_sizes(33, 4096, 11008, cuda) == (64, 16, 256, 4, 4)
    assert _block_sizes(128, 12288, 4096, cuda) == (128, 64, 128, 4, 3, 1)
    assert _block_sizes(100, 4096, 11008, cuda) == (128, 64, 128, 4, 3, 4)
    assert _block_sizes(128, 4096, 4096, cuda) == (64, 16, 256, 4, 3)
    assert _block_sizes(129, 22016, 4096, cuda) == (128, 128, 64, 8, 3)


def test_default_shapes_fit_shared_memory_with_fp32_activations():
    """The swept shapes hold 16-bit x tiles; fp32 ones double them: (32, 32, 512) x 4 stages compiled to 256 KB of
    shared memory (320 KB by this model; the H200 refused to launch it, session 18). BLOCK_K halves until the tiles
    fit 7/8 of the device's shared memory (sm_90: 227 KB; sm_86/89: 99 KB)."""
    from loraplex.kernels._triton import SM90_SHARED_MEMORY_BYTES
    from loraplex.kernels.fp8_linear import _block_sizes, _fit_shared_memory, shared_memory_budget

    cuda = torch.device("cuda")
    h200 = shared_memory_budget(torch.device("cpu"))  # off CUDA: the sm_90 figure
    assert h200 == SM90_SHARED_MEMORY_BYTES * 7 // 8
    assert _fit_shared_memory(_block_sizes(32, 4096, 11008, cuda), 2, h200) == (32, 32, 512, 4, 4)
    assert _fit_shared_memory(_block_sizes(32, 4096, 11008, cuda), 4, h200) == (32, 32, 256, 4, 4)
    assert _fit_shared_memory(_block_sizes(64, 4096, 4096, cuda), 4, h200) == (64, 16, 128, 4, 4)
    assert _fit_shared_memory((128, 64, 128, 4, 3, 4), 2, h200) == (128, 64, 128, 4, 3, 4)
    assert _fit_shared_memory((128, 64, 128, 4, 3, 4), 4, h200) == (128, 64, 64, 4, 3, 4)
    assert _fit_shared_memory(_block_sizes(32, 4096, 11008, cuda), 2, 101376 * 7 // 8) == (32, 32, 128, 4, 4)
    for budget in (h200, 101376 * 7 // 8):
        for tokens in (1, 16, 32, 64, 100, 128, 129, 4096):
            for n, k in ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)):
                for x_bytes in (2, 4):
                    bt, bn, bk, _, stages = _fit_shared_memory(_block_sizes(tokens, n, k, cuda), x_bytes, budget)[:5]
                    assert (bt * x_bytes + bn) * bk * stages <= budget


def _e4m3_codes(normal_only: bool = False) -> list[int]:
    """Every finite e4m3 byte (both signs, zeros, subnormals, 448), or the normal values and zeros only."""
    return [b for b in range(256) if b not in (0x7F, 0xFF) and not (normal_only and (b & 0x78) == 0 and b & 7)]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("widen", [0, 1, 2])
def test_every_widening_is_exact_on_every_e4m3_byte(kernel_device, dtype, widen):
    """_widen_e4m3: Triton's conversion (0), bit moves scaled by 2^-E (1), the same in inline PTX (2, bf16 on CUDA
    only). One-hot activations and power-of-two scales make ``out[t, n] = float(weight[n, t]) * scale[n]``
    exactly in every dtype (each e4m3 value is exact in fp16/bf16/fp32), so each byte's widening is checked alone
    and exactly, in both kernels. The CPU interpreter turns bf16 subnormals into other values (its own bf16
    emulation), so there the bf16 bit moves see normal values and zeros."""
    from loraplex.kernels.fp8_linear import _launch_fp8_linear

    if widen == 2 and (kernel_device.type != "cuda" or dtype != torch.bfloat16):
        pytest.skip("inline PTX: bf16 on CUDA")
    codes = torch.tensor(_e4m3_codes(widen == 1 and dtype == torch.bfloat16 and kernel_device.type != "cuda"),
                         dtype=torch.uint8)
    k = len(codes)
    weight = torch.stack([codes.roll(3 * n) for n in range(8)]).view(FP8_DTYPE).to(kernel_device)  # [8, K]
    scale = (2.0 ** -torch.arange(8, dtype=torch.float32)).to(kernel_device)
    x = torch.eye(k).to(device=kernel_device, dtype=dtype)
    expected = (weight.to(torch.float32) * scale[:, None]).T.cpu()
    for config in ((16, 16, 64, 4, 2), (16, 16, 64, 4, 2, 3)):
        out = _launch_fp8_linear(x, weight, scale, config=config, widen=widen)
        assert torch.equal(out.float().cpu(), expected), (config, (out.float().cpu() - expected).abs().max().item())


def test_default_widening_and_bad_widen():
    from loraplex.kernels.fp8_linear import _launch_fp8_linear, default_widen

    assert default_widen(torch.bfloat16, torch.device("cuda")) == 2
    assert default_widen(torch.float16, torch.device("cuda")) == 0
    assert default_widen(torch.bfloat16, torch.device("cpu")) == 0
    x, weight, scale, _ = _inputs(2, 16, 8, torch.float16, torch.device("cpu"), False)
    with pytest.raises(KernelArgumentError, match="widen=2 with torch.float16"):
        _launch_fp8_linear(x, weight, scale, widen=2)


# --- split activations (SPLIT_ACTIVATIONS: e4m3 x e4m3 tensor cores, x as s * (h + l / 16)) ---


def _e4m3_grid() -> torch.Tensor:
    """Every non-negative finite e4m3 value, ascending (0, the 7 subnormals, ..., 448)."""
    codes = torch.tensor([b for b in range(0x7F)], dtype=torch.uint8)
    return codes.view(FP8_DTYPE).to(torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_split_rounds_every_value_and_tie_as_torch(kernel_device, dtype):
    """``_split_activations_kernel``'s own e4m3 rounding (integer and fp32 operations) against torch's nearest-even
    cast: every e4m3 value, every midpoint between neighbours (ties to even), points just off the midpoints, the
    subnormal/normal boundary, both signs. Row amax 448 * 2^-3 makes x / s exact, so h and l are checked bit for bit
    (the engine's x is bf16; fp32 x here holds the off-midpoint points exactly)."""
    from loraplex.kernels.fp8_linear import ActivationSplit, split_activations

    grid = _e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), torch.tensor([0.0155, 0.0157, 447.9])])
    if dtype == torch.bfloat16:  # only the values bf16 holds exactly
        values = values[values.to(torch.bfloat16).to(torch.float32) == values]
    v = torch.cat([values, -values, torch.tensor([448.0])])
    x = (v * 2.0**-3).to(dtype)
    x = torch.stack([x, x.flip(0)]).to(kernel_device)
    split = ActivationSplit.empty(2, x.shape[1], kernel_device)
    split_activations(x, split)
    q, s = split.q, split.s
    assert s.tolist() == [2.0**-3, 2.0**-3]
    vx = x.to(torch.float32).cpu() / 2.0**-3
    h = vx.to(FP8_DTYPE)
    lo = ((vx - h.to(torch.float32)) * 16).to(FP8_DTYPE)
    # zeros compared as zeros: on the H200 the compiled v - h of v = h = -0.0 gives -0.0 (IEEE: +0.0), so l's byte
    # for that zero is 0x80 there; every other byte is the cast's
    def as_bytes(t):
        b = t.contiguous().view(torch.uint8)
        return torch.where(b == 0x80, torch.zeros_like(b), b)

    assert torch.equal(as_bytes(q[:, 0].cpu()), as_bytes(h))
    assert torch.equal(as_bytes(q[:, 1].cpu()), as_bytes(lo))
    assert torch.equal(q[:, 0].cpu().view(torch.uint8) >> 7, h.view(torch.uint8) >> 7)  # h keeps every sign


@pytest.mark.interpreter
def test_activation_split_scale_is_the_power_of_two_at_or_above_amax_over_448(kernel_device):
    """s[t] = 2^ceil(log2(amax / 448)) (so that x / s is exact): at the powers' boundaries (amax 448 * 2^k, and one
    bf16 step either side), zero rows (amax clamped to 1e-30), a tiny and a huge amax; the kernel's s equals
    :func:`split_scale`'s, and its h / l stay the reference's."""
    from loraplex.kernels.fp8_linear import ActivationSplit, split_activations, split_activations_ref, split_scale

    amaxes = torch.tensor([56.0, 56.25, 55.75, 448.0, 100.0, 0.0, 3e-20, 3e30, 1.0])
    x = torch.randn(len(amaxes), 64).clamp(-1, 1) * amaxes[:, None] * 0.5
    x[:, 5] = amaxes
    x = x.to(torch.bfloat16)
    split = ActivationSplit.empty(len(amaxes), 64, kernel_device)
    split_activations(x.to(kernel_device), split)
    q, s = split.q, split.s
    expected = split_scale(x.float().abs().amax(dim=1))
    assert expected[:4].tolist() == [0.125, 0.25, 0.125, 1.0]
    assert torch.equal(s.cpu(), expected)
    got = (q[:, 0].float().cpu() + q[:, 1].float().cpu() / 16) * s.cpu()[:, None]
    assert torch.equal(got, split_activations_ref(x))


def test_split_activations_hold_x_to_two_to_the_minus_8():
    """h + l / 16 carries two 3-bit mantissas: |split(x) - x| <= 2^-8 |x| + 2^-14 s per element (s <= 2 amax / 448;
    the second term is l's subnormal spacing), finer than bf16's own rounding (2^-9 |x|) on average. Rows with an
    outlier channel 1,000x the rest, as LLM activations have."""
    from loraplex.kernels.fp8_linear import split_activations_ref, split_scale

    torch.manual_seed(3)
    x = torch.randn(64, 4096) * torch.rand(64, 1) * 10
    x[:, 17] *= 1000
    got = split_activations_ref(x)
    s = split_scale(x.abs().amax(dim=1, keepdim=True))
    assert (s <= 2 * x.abs().amax(dim=1, keepdim=True) / 448).all()
    err = (got - x).abs()
    assert (err <= 2.0**-8 * x.abs() + 2.0**-14 * s).all()
    bf16_err = (x.to(torch.bfloat16).to(torch.float32) - x).abs()
    assert err.mean() < bf16_err.mean()


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 40, 24), (19, 72, 50)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_split_activation_kernel_matches_its_reference(kernel_device, poison_allocations, dtype, shape, split, bias):
    """The split path (activation split, e4m3 GEMM over the 2T rows of h and l, K split in ``split`` chunks summed
    in order) against a float64 loop over the split's values (and :func:`fp8_linear_split_ref` against it),
    relative to the terms' magnitude; K = 72 leaves a partial last K tile (and split 3 an 8-column third chunk);
    19 tokens leave a partial row tile."""
    from loraplex.kernels.fp8_linear import _launch_fp8_linear, fp8_linear_split_ref, split_activations_ref

    x, weight, scale, b = _inputs(*shape, dtype, kernel_device, bias)
    # K tiles of 32: e4m3 tensor-core instructions reduce 32 at a time (16 gave wrong sums on the H200)
    out = _launch_fp8_linear(x, weight, scale, b, config=(16, 16, 32, 4, 2, split), activations="split")
    # the float64 loop over the split's values (torch's e4m3 casts), and the torch reference against the same loop
    expected = _loop(split_activations_ref(x.cpu()), weight, scale, b)
    reference = fp8_linear_split_ref(x.cpu(), weight.cpu(), scale.cpu(), None if b is None else b.cpu())
    assert out.dtype == dtype and out.shape == (shape[0], shape[2])
    for got in (out, reference):
        err = (got.double().cpu() - expected).abs() / _magnitude(x, weight, scale, b).clamp_min(1.0)
        assert err.max().item() <= TOL[dtype], err.max().item()
    # and the split is not the exact product: the reference differs from the W8A16 loop somewhere
    assert not torch.equal(fp8_linear_ref(x.cpu().float(), weight.cpu(), scale.cpu()),
                           fp8_linear_split_ref(x.cpu().float().to(dtype), weight.cpu(), scale.cpu()).float())


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(1, 40, 24), (19, 72, 50)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("a_rows", [16, 37])
def test_split_gemm_with_a_folded_lora_shrink(kernel_device, poison_allocations, shape, split, a_rows):
    """``lora_a`` (a folded LoRA shrink: every slot's bf16 A rows): the launch's column tiles after the weight's
    give ``out[:, N:] = x @ lora_a.T`` (x itself, not its split; bf16 x bf16, no scale or bias), against a float64
    loop, with the K reduction split too; the weight's columns are those of the launch without it, bit for bit; 37
    rows leave a partial A tile, 19 tokens a partial token tile. The reference takes ``lora_a`` the same way."""
    from loraplex.kernels.fp8_linear import ActivationSplit, _launch_fp8_linear, split_activations

    x, weight, scale, b = _inputs(*shape, torch.bfloat16, kernel_device, True)
    lora_a = (torch.randn(a_rows, shape[1]) * 0.2).to(device=kernel_device, dtype=torch.bfloat16)
    config = (16, 16, 32, 4, 2, split)
    out = _launch_fp8_linear(x, weight, scale, b, lora_a=lora_a, config=config, activations="split")
    assert out.shape == (shape[0], shape[2] + a_rows) and out.dtype == torch.bfloat16
    assert torch.equal(out[:, :shape[2]], _launch_fp8_linear(x, weight, scale, b, config=config, activations="split"))
    xd = x.cpu().double()
    expected = xd @ lora_a.cpu().double().T
    magnitude = (xd.abs() @ lora_a.cpu().double().abs().T).clamp_min(1.0)
    given = ActivationSplit.empty(shape[0], shape[1], kernel_device)
    split_activations(x, given)
    reference = fp8_linear_ref(x, weight, scale, b, split=given, lora_a=lora_a)
    for got in (out[:, shape[2]:], reference[:, shape[2]:]):
        err = (got.double().cpu() - expected).abs() / magnitude
        assert err.max().item() <= TOL[torch.bfloat16], err.max().item()
    assert torch.equal(reference[:, :shape[2]], fp8_linear_ref(x, weight, scale, b, split=given))


@pytest.mark.interpreter
def test_a_folded_shrink_takes_split_activations_and_x_dtype(kernel_device):
    """``lora_a`` of another dtype, width or layout, or with the weights widened (``activations="exact"``):
    KernelArgumentError naming it."""
    from loraplex.kernels.fp8_linear import _launch_fp8_linear

    x, weight, scale, _ = _inputs(3, 64, 8, torch.bfloat16, kernel_device, False)
    good = torch.zeros(16, 64, dtype=torch.bfloat16, device=kernel_device)
    for bad in (good.float(), good[:, :32], torch.zeros(64, 16, dtype=torch.bfloat16, device=kernel_device).T):
        with pytest.raises(KernelArgumentError, match="lora_a"):
            _launch_fp8_linear(x, weight, scale, lora_a=bad, activations="split")
        with pytest.raises(KernelArgumentError, match="lora_a"):
            fp8_linear_ref(x, weight, scale, lora_a=bad)
    with pytest.raises(KernelArgumentError, match="lora_a.*split activations"):
        _launch_fp8_linear(x, weight, scale, lora_a=good, activations="exact")


def test_split_activations_are_the_hopper_default_for_bf16_decode_batches(monkeypatch):
    """On CUDA devices of compute capability 9 (where it was measured), bf16 activations of 1-128 tokens take the
    split path; fp16 (whose own rounding is finer than the split's), fp32, longer batches, other devices (compute
    capability 12's 99 KB of shared memory does not hold the launch shapes) and the CPU widen the weights."""
    from loraplex.kernels import fp8_linear

    cuda = torch.device("cuda")
    monkeypatch.setattr(fp8_linear, "_cuda_capability", lambda device: (9, 0))
    assert [fp8_linear.default_activations(torch.bfloat16, cuda, t) for t in (1, 32, 128, 129)] == \
        ["split", "split", "split", "exact"]
    assert fp8_linear.default_activations(torch.float16, cuda, 32) == "exact"
    assert fp8_linear.default_activations(torch.float32, cuda, 32) == "exact"
    assert fp8_linear.default_activations(torch.bfloat16, torch.device("cpu"), 32) == "exact"
    for capability in ((8, 9), (10, 0), (12, 0)):
        monkeypatch.setattr(fp8_linear, "_cuda_capability", lambda device, c=capability: c)
        assert fp8_linear.default_activations(torch.bfloat16, cuda, 32) == "exact", capability


@pytest.mark.interpreter
def test_bad_split_arguments_are_refused(kernel_device):
    """A split that is not an ActivationSplit, of the wrong shape, dtype or layout, and a config of the other path's
    length: KernelArgumentError naming the argument; an unknown ``activations`` too."""
    from loraplex.kernels import fp8_linear
    from loraplex.kernels.fp8_linear import ActivationSplit, split_activations

    x, weight, scale, _ = _inputs(3, 64, 8, torch.bfloat16, kernel_device, False)
    good = ActivationSplit.empty(3, 64, kernel_device)
    strided_s = torch.empty(6, device=kernel_device)[::2]
    for bad, match in (((good.q, good.s), "must be an ActivationSplit"),
                       (ActivationSplit.empty(3, 32, kernel_device), "split.q"),
                       (ActivationSplit(good.q.view(torch.uint8), good.s), "split.q"),
                       (ActivationSplit(good.q, good.s.double()), "split.s"),
                       (ActivationSplit(good.q, strided_s), "contiguous")):
        with pytest.raises(KernelArgumentError, match=match):
            split_activations(x, bad)
        with pytest.raises(KernelArgumentError, match=match):
            fp8_linear._launch_fp8_linear(x, weight, scale, split=bad)
    with pytest.raises(KernelArgumentError, match="config"):
        fp8_linear._launch_fp8_linear(x, weight, scale, split=good, config=(16, 16, 32, 4, 2))
    with pytest.raises(KernelArgumentError, match="config"):
        fp8_linear._launch_fp8_linear(x, weight, scale, activations="split", config=(16, 16, 32, 4, 2))
    with pytest.raises(KernelArgumentError, match="activations='w8a8'"):
        fp8_linear._launch_fp8_linear(x, weight, scale, activations="w8a8")


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_holding_nan_or_inf_gives_a_nan_row(kernel_device, bad):
    """SPLIT_ACTIVATIONS: a row holding NaN or inf gets s = NaN and h = l = 0 (kernel and reference alike), so every
    output of that row is NaN and the other rows are untouched (the max and the clamps would otherwise skip a NaN
    and make it -448 s, and an inf would wrap 1/s)."""
    from loraplex.kernels.fp8_linear import (ActivationSplit, _launch_fp8_linear, fp8_linear_split_ref,
                                             split_activations, split_activations_ref)

    x, weight, scale, _ = _inputs(3, 72, 24, torch.bfloat16, kernel_device, False)
    x[1, 5] = bad
    split = ActivationSplit.empty(3, 72, kernel_device)
    split_activations(x, split)
    assert torch.isnan(split.s[1]).item() and torch.isfinite(split.s[[0, 2]]).all().item()
    assert not split.q[1].cpu().view(torch.uint8).any()
    assert torch.equal(split.values().cpu().isnan(), split_activations_ref(x.cpu()).isnan())
    out = _launch_fp8_linear(x, weight, scale, config=(16, 16, 32, 4, 2, 1), activations="split").cpu()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    assert torch.equal(out.isnan(), fp8_linear_split_ref(x.cpu(), weight.cpu(), scale.cpu()).isnan())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the measured launch shapes run on Hopper")
@pytest.mark.parametrize("tokens", [1, 32, 40, 64, 96, 128])
@pytest.mark.parametrize("linear", [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_split_launch_shapes_at_llama_shapes(tokens, linear):
    """The default launch shape of every measured row (Llama-2-7B's linears, 1-128 tokens, split-K included), with
    a folded LoRA shrink (32 slots of r=16) where the engine folds (up to FP8_FOLD_MAX_TOKENS): the base columns
    against the split reference within bf16's tolerance of the product's magnitude, the A columns against x @ A.T."""
    from loraplex.engine.models.llama import FP8_FOLD_MAX_TOKENS
    from loraplex.kernels.fp8_linear import ActivationSplit, _launch_fp8_linear, split_activations

    in_features, out_features = linear
    x, weight, scale, _ = _inputs(tokens, in_features, out_features, torch.bfloat16, torch.device("cuda"), False)
    lora_a = (torch.randn(512, in_features, device="cuda") * 0.05).to(torch.bfloat16)
    folds = tokens <= FP8_FOLD_MAX_TOKENS
    out = _launch_fp8_linear(x, weight, scale, lora_a=lora_a if folds else None, activations="split")
    given = ActivationSplit.empty(tokens, in_features, x.device)
    split_activations(x, given)
    expected = fp8_linear_ref(x.float(), weight, scale, split=given).double()
    magnitude = (x.float().abs() @ weight.float().abs().T * scale).double().clamp_min(1e-3)
    err = (out[:, :out_features].double() - expected).abs() / magnitude
    assert err.max().item() <= TOL[torch.bfloat16], err.max().item()
    if folds:
        shrink = x.double() @ lora_a.double().T
        err = (out[:, out_features:].double() - shrink).abs() / (x.double().abs() @ lora_a.double().abs().T)
        assert err.max().item() <= TOL[torch.bfloat16], err.max().item()


def test_split_launch_shapes_are_the_measured_ones():
    """RESULTS.md sessions 27 and 29 (H200, Llama-2-7B's linears): (BLOCK_R over the 2T rows, BLOCK_N, BLOCK_K,
    warps, stages, SPLIT_K)."""
    from loraplex.kernels.fp8_linear import _split_block_sizes

    assert _split_block_sizes(1, 12288, 4096) == (16, 128, 256, 4, 4, 1)
    assert _split_block_sizes(1, 4096, 4096) == (16, 64, 256, 4, 4, 1)
    assert _split_block_sizes(1, 22016, 4096) == (16, 64, 128, 4, 4, 1)
    assert _split_block_sizes(1, 4096, 11008) == (16, 64, 256, 4, 3, 4)
    assert _split_block_sizes(32, 12288, 4096) == (64, 128, 256, 4, 4, 1)
    assert _split_block_sizes(32, 4096, 4096) == (64, 64, 256, 4, 5, 1)
    assert _split_block_sizes(32, 22016, 4096) == (64, 64, 128, 4, 4, 1)
    assert _split_block_sizes(32, 4096, 11008) == (64, 64, 256, 4, 5, 2)
    for tokens in (33, 48, 64):  # session 29
        assert _split_block_sizes(tokens, 12288, 4096) == (128, 128, 128, 4, 5, 1)
        assert _split_block_sizes(tokens, 4096, 4096) == (128, 64, 256, 4, 4, 2)
        assert _split_block_sizes(tokens, 22016, 4096) == (128, 64, 128, 4, 3, 1)
        assert _split_block_sizes(tokens, 4096, 11008) == (128, 64, 256, 4, 4, 2)
    for tokens in (65, 96, 128):
        assert _split_block_sizes(tokens, 12288, 4096) == (128, 64, 128, 4, 3, 1)
        assert _split_block_sizes(tokens, 4096, 4096) == (128, 64, 256, 4, 4, 1)
        assert _split_block_sizes(tokens, 22016, 4096) == (256, 64, 128, 4, 4, 1)
        assert _split_block_sizes(tokens, 4096, 11008) == (128, 64, 256, 4, 4, 1)
