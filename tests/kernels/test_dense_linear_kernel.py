"""dense_linear: the Triton GEMMs (token-major, swapped operands, GEMV) and the reference against a float64 loop over
output channels; the measured-table lookup and its JSON form."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import _triton, dense_linear
from loraplex.kernels.dense_linear import (
    check_dense_config,
    configs_from_json,
    configs_to_json,
    dense_linear_config,
    dense_linear_ref,
    fused_configs_from_json,
    fused_configs_to_json,
    fusion_name,
    token_bucket,
)
from loraplex.kernels.errors import KernelArgumentError


def _loop(x, weight, bias):
    """out[t, n] = sum_k x[t, k] * weight[n, k] + bias[n], one output channel at a time, in float64."""
    xd, wd = x.double().cpu(), weight.double().cpu()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float64)
    for n in range(weight.shape[0]):
        out[:, n] = (xd * wd[n]).sum(1) + (float(bias[n]) if bias is not None else 0.0)
    return out


def _magnitude(x, weight, bias):
    """``sum_k |x[t, k] * weight[n, k]| + |bias[n]|``: what the rounding of a float32 sum is relative to."""
    mag = x.double().cpu().abs() @ weight.double().cpu().abs().T
    return mag + (bias.double().cpu().abs() if bias is not None else 0.0)


# bf16 / fp16 outputs are rounded once (2^-8 / 2^-11 of the value); the fp32 sum's own error is far below
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

# (config, T, K, N): every kind, token tiles with masked rows, K and N not multiples of BLOCK_K and BLOCK_N
CASES = [
    (("tm", 16, 16, 32, 4, 1), 3, 80, 40),
    (("tm", 32, 32, 64, 4, 2), 33, 128, 64),
    (("swap", 16, 64, 32, 4, 1), 5, 72, 96),
    (("swap", 32, 64, 64, 4, 1), 40, 64, 150),
    (("gemv", 1, 8, 32, 4, 1), 1, 72, 20),
    (("gemv", 1, 8, 32, 4, 1), 1, 64, 20),  # EVEN_K: the unmasked loads
]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}-T{c[1]}-K{c[2]}-N{c[3]}")
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_and_reference_match_the_loop(kernel_device, triton_kernels, poison_allocations, dtype, case, bias):
    config, t, k, n = case
    x = torch.randn(t, k).to(device=kernel_device, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(device=kernel_device, dtype=dtype)
    b = torch.randn(n).to(device=kernel_device, dtype=dtype) if bias else None
    expected = _loop(x, w, b)
    for out in (triton_kernels.dense_linear(x, w, b, config=config), dense_linear_ref(x, w, b)):
        assert out.dtype == dtype and out.shape == (t, n)
        err = (out.double().cpu() - expected).abs() / _magnitude(x, w, b).clamp_min(1.0)
        assert err.max().item() <= TOL[dtype], err.max().item()


# Split-K launches (a seventh config entry): splits of whole K tiles, the last split shorter or K masked, token tiles
SPLIT_CASES = [
    (("tm", 16, 16, 16, 4, 1, 4), 3, 80, 40),  # 5 K tiles in splits of 2: 3 splits
    (("swap", 16, 64, 16, 4, 1, 3), 5, 72, 96),  # K not a multiple of BLOCK_K
    (("tm", 32, 32, 64, 4, 2, 2), 33, 128, 64),  # two token tiles, each tile its own counter
    (("swap", 16, 16, 16, 4, 1, 16), 1, 64, 16),  # more splits asked for than K tiles: one per tile
]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"{c[0][0]}-S{c[0][6]}-T{c[1]}-K{c[2]}-N{c[3]}")
def test_split_k_matches_the_loop_and_leaves_its_counters_at_zero(kernel_device, triton_kernels, poison_allocations,
                                                                   dtype, case):
    config, t, k, n = case
    x = torch.randn(t, k).to(device=kernel_device, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(device=kernel_device, dtype=dtype)
    b = torch.randn(n).to(device=kernel_device, dtype=dtype)
    r = torch.randn(t, n).to(device=kernel_device, dtype=dtype)
    expected = _loop(x, w, b) + r.double().cpu()
    for _ in range(2):  # a second launch reuses the counters the first set back to zero
        out = triton_kernels.dense_linear(x, w, b, residual=r, config=config)
        err = (out.double().cpu() - expected).abs() / (_magnitude(x, w, b) + r.double().cpu().abs()).clamp_min(1.0)
        assert err.max().item() <= TOL[dtype], err.max().item()
        assert _triton._LAUNCH_COUNTERS[x.device].count_nonzero().item() == 0


@pytest.mark.interpreter
def test_split_k_configs_are_checked(kernel_device, triton_kernels):
    x, w = torch.randn(2, 32, device=kernel_device), torch.randn(16, 32, device=kernel_device)
    for config, match in ((("tm", 16, 16, 16, 4, 1, 0), "split_k=0"), (("tm", 16, 16, 16, 4, 1, 17), "split_k=17"),
                          (("tm", 16, 16, 16, 4, 1, 2, 1), "programs\\]"), (("gemv", 1, 8, 16, 4, 1, 2), "gemv")):
        with pytest.raises(KernelArgumentError, match=match):
            triton_kernels.dense_linear(x if config[0] != "gemv" else x[:1], w, config=config)
    with pytest.raises(KernelArgumentError, match="whole rows"):
        triton_kernels.dense_linear(x, w, norm_weight=torch.ones(32, device=kernel_device),
                                    config=("tm", 16, 16, 16, 4, 1, 2))
    table = {("NVIDIA H200", 32, 4096, 11008): ("swap", 32, 64, 256, 4, 4, 4),
             ("NVIDIA H200", 32, 4096, 4096): ("tm", 32, 32, 256, 4, 4)}
    assert configs_from_json(configs_to_json(table)) == table
    # a fused table row may split K only where the fusion is the residual add (an input transform needs whole rows)
    fused = {("NVIDIA H200", 32, 4096, 11008, "residual"): ("swap", 32, 64, 256, 4, 4, 4)}
    assert fused_configs_from_json(fused_configs_to_json(fused)) == fused
    for fusion in ("norm", "gated+residual"):
        with pytest.raises(ValueError, match="split-K"):
            fused_configs_from_json(fused_configs_to_json({("NVIDIA H200", 32, 4096, 11008, fusion):
                                                           ("swap", 32, 64, 256, 4, 4, 4)}))
    with pytest.raises(ValueError, match="split-K tiles"):  # more output tiles than the device's tile counters
        configs_from_json(configs_to_json({("NVIDIA H200", 128, 1 << 21, 4096): ("tm", 16, 16, 64, 4, 1, 2)}))
    assert dense_linear.split_k_of(table[("NVIDIA H200", 32, 4096, 11008)]) == 4
    assert dense_linear.split_k_of(table[("NVIDIA H200", 32, 4096, 4096)]) == 1


# Stream-K launches (kind, BLOCK_T, BLOCK_N, BLOCK_K, warps, stages, programs) and (T, K, N). At 3 x 80 x 40 with
# 16-wide tiles: 3 column tiles x 5 K tiles = 15 iterations; 4 programs take [0, 3), [3, 7), [7, 11), [11, 15), so
# program 1 ends tile 0 (its first segment) and begins tile 1 (its second), and each tile sums two partials
STREAMK_CASES = [
    ((16, 16, 16, 4, 1, 1), 3, 80, 40),  # one program: every tile whole, no partial
    ((16, 16, 16, 4, 1, 4), 3, 80, 40),
    ((16, 16, 16, 4, 1, 15), 3, 80, 40),  # one K tile per program: up to 5 partials per tile
    ((16, 16, 16, 4, 1, 64), 3, 80, 40),  # more programs than iterations: 15 launched
    ((16, 32, 32, 4, 2, 7), 40, 72, 150),  # three token tiles; K and N not multiples of their tiles
    ((32, 64, 16, 4, 2, 5), 33, 200, 96),  # 2 x 2 tiles of 13 K tiles: ranges of 10-11 across tile boundaries
    ((16, 256, 16, 4, 1, 1), 5, 80, 300),  # 256-column tiles, whole: the epilogue in two halves, the second masked
    ((16, 256, 16, 4, 1, 3), 5, 80, 300),  # ... and partial: the last program sums them in two halves
]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", dense_linear.STREAMK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", STREAMK_CASES, ids=lambda c: f"P{c[0][5]}-T{c[1]}-K{c[2]}-N{c[3]}")
def test_streamk_matches_the_loop_and_leaves_its_counters_at_zero(kernel_device, triton_kernels, poison_allocations,
                                                                  kind, dtype, case):
    tiles, t, k, n = case
    config = (kind, *tiles)
    x = torch.randn(t, k).to(device=kernel_device, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(device=kernel_device, dtype=dtype)
    b = torch.randn(n).to(device=kernel_device, dtype=dtype)
    r = torch.randn(t, n).to(device=kernel_device, dtype=dtype)
    expected = _loop(x, w, b) + r.double().cpu()
    mag = (_magnitude(x, w, b) + r.double().cpu().abs()).clamp_min(1.0)
    first = None
    for _ in range(2):  # a second launch reuses the counters the first set back to zero, and sums alike
        out = triton_kernels.dense_linear(x, w, b, residual=r, config=config)
        assert ((out.double().cpu() - expected).abs() / mag).max().item() <= TOL[dtype]
        assert _triton._LAUNCH_COUNTERS[x.device].count_nonzero().item() == 0
        assert first is None or torch.equal(out, first)
        first = out
    plain = triton_kernels.dense_linear(x, w, config=config)
    err = (plain.double().cpu() - _loop(x, w, None)).abs() / _magnitude(x, w, None).clamp_min(1.0)
    assert err.max().item() <= TOL[dtype]


@pytest.mark.interpreter
def test_streamk_configs_and_operands_are_checked(kernel_device, triton_kernels):
    """A stream-K config needs its grid size; a TMA one boxes of at most 256 and operands TMA can address; neither
    takes an input norm or activation; a table row takes it as a seventh entry, fused only with the residual."""
    x, w = torch.randn(2, 32, device=kernel_device), torch.randn(16, 32, device=kernel_device)
    for config, match in ((("streamk", 16, 16, 16, 4, 1), "programs=None"),
                          (("streamk", 16, 16, 16, 4, 1, 0), "programs=0"),
                          (("streamk_tma", 16, 16, 16, 4, 1, 5000), "programs=5000"),
                          (("streamk_tma", 16, 16, 512, 4, 1, 8), "TMA box")):
        with pytest.raises(KernelArgumentError, match=match):
            triton_kernels.dense_linear(x, w, config=config)
    with pytest.raises(KernelArgumentError, match="whole rows"):
        triton_kernels.dense_linear(x, w, norm_weight=torch.ones(32, device=kernel_device),
                                    config=("streamk", 16, 16, 16, 4, 1, 4))
    # a row stride of 30 fp32 (120 bytes) is no multiple of 16 bytes: the pointer kind reads it, TMA refuses it
    wide = torch.randn(2, 30, device=kernel_device)
    w30 = torch.randn(16, 30, device=kernel_device)
    with pytest.raises(KernelArgumentError, match="cannot be read by TMA"):
        triton_kernels.dense_linear(wide, w30, config=("streamk_tma", 16, 16, 16, 4, 1, 4))
    got = triton_kernels.dense_linear(wide, w30, config=("streamk", 16, 16, 16, 4, 1, 4))
    err = (got.double().cpu() - _loop(wide, w30, None)).abs() / _magnitude(wide, w30, None).clamp_min(1.0)
    assert err.max().item() <= TOL[torch.float32]
    assert dense_linear.programs_of(("streamk", 16, 16, 16, 4, 1, 4)) == 4
    assert dense_linear.split_k_of(("streamk", 16, 16, 16, 4, 1, 4)) == 1
    assert dense_linear.programs_of(("swap", 16, 64, 16, 4, 1, 4)) is None
    table = {("NVIDIA H200", 128, 4096, 11008): ("streamk_tma", 128, 128, 64, 8, 4, 264)}
    assert configs_from_json(configs_to_json(table)) == table
    fused = {("NVIDIA H200", 128, 4096, 11008, "residual"): ("streamk", 128, 64, 128, 4, 3, 132)}
    assert fused_configs_from_json(fused_configs_to_json(fused)) == fused
    with pytest.raises(ValueError, match="split-K"):
        fused_configs_from_json(fused_configs_to_json({("NVIDIA H200", 128, 4096, 4096, "norm"):
                                                       ("streamk", 128, 64, 128, 4, 3, 132)}))
    with pytest.raises(ValueError, match="split-K tiles"):  # a counter per output tile
        configs_from_json(configs_to_json({("NVIDIA H200", 128, 1 << 21, 4096): ("streamk", 16, 16, 64, 4, 1, 132)}))


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", dense_linear.STREAMK_KINDS)
def test_streamk_without_output_columns_or_k(kernel_device, triton_kernels, poison_allocations, kind):
    """No output column is an empty output (nothing launched: a TMA descriptor takes no empty dimension); no K column
    is refused (a grid of no iteration would leave the output unwritten), by the tiled kernels too."""
    config = (kind, 16, 16, 16, 4, 1, 4)
    x = torch.randn(3, 32, device=kernel_device)
    assert triton_kernels.dense_linear(x, torch.randn(0, 32, device=kernel_device), config=config).shape == (3, 0)
    for cfg in (config, ("swap", 16, 16, 16, 4, 1)):
        with pytest.raises(KernelArgumentError, match="in_features=0"):
            triton_kernels.dense_linear(torch.randn(3, 0, device=kernel_device),
                                        torch.randn(8, 0, device=kernel_device), torch.ones(8, device=kernel_device),
                                        config=cfg)


def _input_loop(x, norm_weight, eps, activation):
    """The GEMM's input u in float64: rms_norm(x) * norm_weight, act(gate) * up, or x."""
    xd = x.double().cpu()
    if activation is not None:
        gate, up = xd.chunk(2, dim=1)
        act = gate * torch.sigmoid(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
        return act * up
    if norm_weight is not None:
        return xd * torch.rsqrt(xd.pow(2).mean(1, keepdim=True) + eps) * norm_weight.double().cpu()
    return xd


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}-T{c[1]}-K{c[2]}-N{c[3]}")
@pytest.mark.parametrize("fusion", ["norm", "silu", "gelu_tanh", "residual", "norm+residual", "silu+residual"])
def test_fused_input_and_residual_match_the_loop(kernel_device, triton_kernels, poison_allocations, dtype, case,
                                                 fusion):
    """A decode layer's RMSNorm (the rows' rsqrt applied after the dot), gated activation and residual add inside
    the GEMM: the kernels and the reference against a float64 loop, for every kind, masked rows and ragged K."""
    config, t, k, n = case
    torch.manual_seed(len(fusion) + t)
    activation = next((a for a in ("silu", "gelu_tanh") if a in fusion), None)
    x = ((1 if activation else 3) * torch.randn(t, 2 * k if activation else k)).to(device=kernel_device, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(device=kernel_device, dtype=dtype)
    b = torch.randn(n).to(device=kernel_device, dtype=dtype)
    norm_weight = (1 + 0.5 * torch.randn(k)).to(device=kernel_device, dtype=dtype) if "norm" in fusion else None
    residual = (10 * torch.randn(t, n)).to(device=kernel_device, dtype=dtype) if "residual" in fusion else None
    kw = dict(norm_weight=norm_weight, norm_eps=1e-5, activation=activation, residual=residual)
    u = _input_loop(x, norm_weight, 1e-5, activation)
    expected = _loop(u, w, b) + (residual.double().cpu() if residual is not None else 0.0)
    mag = _magnitude(u, w, b) + (residual.double().cpu().abs() if residual is not None else 0.0)
    # bf16: u rounded once before the dot (2^-8 of its terms), the output once after
    tol = TOL[dtype] if dtype == torch.float32 else 2 * TOL[dtype]
    for out in (triton_kernels.dense_linear(x, w, b, config=config, **kw), dense_linear_ref(x, w, b, **kw)):
        assert out.dtype == dtype and out.shape == (t, n)
        err = (out.double().cpu() - expected).abs() / mag.clamp_min(1.0)
        assert err.max().item() <= tol, (fusion, err.max().item())


@pytest.mark.interpreter
def test_fused_arguments_are_checked(kernel_device, triton_kernels):
    x, w = torch.randn(2, 16, device=kernel_device), torch.randn(8, 16, device=kernel_device)
    config = ("tm", 16, 16, 16, 4, 1)
    for kw, match in ((dict(activation="relu"), "activation"), (dict(activation="silu"), "weight"),
                      (dict(norm_weight=torch.ones(8, device=kernel_device)), "norm_weight"),
                      (dict(norm_weight=torch.ones(16, device=kernel_device), norm_eps=0.0), "norm_eps"),
                      (dict(norm_weight=torch.ones(8, device=kernel_device), activation="silu"), "together"),
                      (dict(residual=torch.ones(2, 16, device=kernel_device)), "residual"),
                      (dict(residual=torch.ones(2, 8, device=kernel_device).half()), "residual")):
        for fn in (lambda: triton_kernels.dense_linear(x, w, config=config, **kw), lambda: dense_linear_ref(x, w, **kw)):
            with pytest.raises(KernelArgumentError, match=match):
                fn()
    with pytest.raises(KernelArgumentError, match="residual"):  # the kernels read the residual's rows at stride 1
        triton_kernels.dense_linear(x, w, residual=torch.ones(2, 16, device=kernel_device)[:, ::2], config=config)


def test_without_a_measured_config_a_fused_call_is_the_reference(triton_kernels):
    """Off the table (CPU tensors here) a call with an input transform or a residual is the reference's composition
    of separate ops, bit for bit."""
    x, w, b, r = torch.randn(3, 48), torch.randn(10, 24), torch.randn(10), torch.randn(3, 10)
    for kw in (dict(activation="silu", residual=r), dict(activation="gelu_tanh")):
        assert torch.equal(triton_kernels.dense_linear(x, w, b, **kw), dense_linear_ref(x, w, b, **kw))
    kw = dict(norm_weight=torch.randn(48), norm_eps=1e-6, residual=r)
    w48 = torch.randn(10, 48)
    assert torch.equal(triton_kernels.dense_linear(x, w48, b, **kw), dense_linear_ref(x, w48, b, **kw))


@pytest.mark.interpreter
def test_empty_batch_bad_configs_and_arguments(kernel_device, triton_kernels):
    w = torch.randn(32, 16, device=kernel_device)
    assert triton_kernels.dense_linear(torch.randn(0, 16, device=kernel_device), w,
                                       config=("tm", 16, 16, 16, 4, 1)).shape == (0, 32)
    x = torch.randn(2, 16, device=kernel_device)
    for config, match in ((("gemv", 1, 8, 16, 4, 1), "gemv with 2 tokens"), (("tm", 8, 16, 16, 4, 1), ">= 16"),
                          (("tm", 16, 24, 16, 4, 1), "powers of two"), (("ptm", 16, 16, 16, 4, 1), "kind"),
                          (("tm", 16, 16, 16, 3, 1), "num_warps")):
        with pytest.raises(KernelArgumentError, match=match):
            triton_kernels.dense_linear(x, w, config=config)
    with pytest.raises(KernelArgumentError, match="weight"):
        triton_kernels.dense_linear(x, w.half(), config=("tm", 16, 16, 16, 4, 1))
    with pytest.raises(KernelArgumentError, match="weight"):
        dense_linear_ref(x, torch.randn(32, 8, device=kernel_device))
    with pytest.raises(KernelArgumentError, match="bias"):  # the kernels read the bias at stride 1
        triton_kernels.dense_linear(x, w, torch.randn(64, device=kernel_device)[::2], config=("tm", 16, 16, 16, 4, 1))
    # an empty step under a one-token config (token bucket 1) is an empty output, not a config error
    assert triton_kernels.dense_linear(torch.randn(0, 16, device=kernel_device), w,
                                       config=("gemv", 1, 8, 16, 4, 1)).shape == (0, 32)


def test_measured_table_lookup(monkeypatch):
    """Token buckets round up to 1 / 16 / 32 / 64 / 128 and stop above 128; off CUDA, for other dtypes, devices and
    shapes (a folded LoRA linear's wider output too) the lookup is None (``F.linear``); the JSON form round-trips
    and refuses bad rows."""
    tokens = (1, 2, 16, 17, 32, 33, 64, 65, 128, 129)
    assert [token_bucket(t) for t in tokens] == [1, 16, 16, 32, 32, 64, 64, 128, 128, None]
    table = {("NVIDIA H200", 32, 12288, 4096): ("tm", 32, 32, 256, 4, 4),
             ("NVIDIA H200", 32, 11000, 4096): ("swap", 32, 64, 64, 4, 4),
             ("NVIDIA H200", 1, 4096, 11008): ("gemv", 1, 8, 512, 4, 1)}
    assert configs_from_json(configs_to_json(table)) == table
    with pytest.raises(ValueError, match="bad table row"):
        configs_from_json('[{"device": "d", "tokens": 3, "out_features": 8, "in_features": 8, '
                          '"config": ["tm", 16, 16, 16, 4, 1]}]')
    with pytest.raises(ValueError, match="kind"):
        configs_from_json('[{"device": "d", "tokens": 16, "out_features": 8, "in_features": 8, '
                          '"config": ["wide", 16, 16, 16, 4, 1]}]')
    previous = dense_linear.use_configs(dict(table))
    try:
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, torch.device("cpu")) is None
        assert dense_linear.device_name(torch.device("cpu")) == "cpu"
        monkeypatch.setattr(dense_linear, "device_name", lambda device: "NVIDIA H200")
        cuda = torch.device("cuda", 0)
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda) == ("tm", 32, 32, 256, 4, 4)
        assert dense_linear_config(17, 12288, 4096, torch.bfloat16, cuda) == ("tm", 32, 32, 256, 4, 4)
        assert dense_linear_config(16, 12288, 4096, torch.bfloat16, cuda) is None  # bucket 16 not measured
        assert dense_linear_config(1, 4096, 11008, torch.bfloat16, cuda) == ("gemv", 1, 8, 512, 4, 1)
        assert dense_linear_config(32, 12288, 4096, torch.float16, cuda) is None
        assert dense_linear_config(65, 12288, 4096, torch.bfloat16, cuda) is None  # bucket 128 not measured
        assert dense_linear_config(129, 12288, 4096, torch.bfloat16, cuda) is None
        assert dense_linear_config(32, 11000, 4096, torch.bfloat16, cuda) == ("swap", 32, 64, 64, 4, 4)
        assert dense_linear_config(32, 13824, 4096, torch.bfloat16, cuda) is None  # folded qkv: not measured
        assert dense_linear_config(32, 12288, 4096 * 2, torch.bfloat16, cuda) is None
        monkeypatch.setattr(dense_linear, "device_name", lambda device: "NVIDIA A100")
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda) is None
        dense_linear.use_configs({})
        monkeypatch.setattr(dense_linear, "device_name", lambda device: "NVIDIA H200")
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda) is None
    finally:
        dense_linear.use_configs(previous)


def test_fused_table_lookup(monkeypatch):
    """A call's fusion name; fused launches come from their own table, keyed by the fusion too; JSON round trip."""
    g, r = torch.ones(4), torch.ones(2, 4)
    assert [fusion_name(*args) for args in ((None, None, None), (g, None, None), (None, None, r), (None, "silu", r),
                                             (None, "silu", None), (g, None, r))] == [
        None, "norm", "residual", "gated+residual", "gated", "norm+residual"]
    table = {("NVIDIA H200", 32, 12288, 4096, "norm"): ("tm", 32, 64, 128, 4, 3),
             ("NVIDIA H200", 1, 4096, 11008, "gated+residual"): ("gemv", 1, 8, 512, 4, 1)}
    assert fused_configs_from_json(fused_configs_to_json(table)) == table
    # rows that differ only in their fusion (o_proj's residual, down_proj's gated input of the same shape)
    same_shape = {("NVIDIA H200", 1, 4096, 4096, "residual"): ("gemv", 1, 4, 512, 4, 1),
                  ("NVIDIA H200", 1, 4096, 4096, "gated+residual"): ("gemv", 1, 8, 512, 4, 1)}
    assert fused_configs_from_json(fused_configs_to_json(same_shape)) == same_shape
    with pytest.raises(ValueError, match="fusion"):
        fused_configs_from_json('[{"device": "d", "tokens": 16, "out_features": 8, "in_features": 8, '
                                '"fusion": "norm+residual", "config": ["tm", 16, 16, 16, 4, 1]}]')
    previous = dense_linear.use_fused_configs(dict(table))
    try:
        monkeypatch.setattr(dense_linear, "device_name", lambda device: "NVIDIA H200")
        cuda = torch.device("cuda", 0)
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda, "norm") == ("tm", 32, 64, 128, 4, 3)
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda, "residual") is None
        assert dense_linear_config(1, 4096, 11008, torch.bfloat16, cuda, "gated+residual")[0] == "gemv"
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, torch.device("cpu"), "norm") is None
        dense_linear.use_fused_configs({})
        assert dense_linear_config(32, 12288, 4096, torch.bfloat16, cuda, "norm") is None
    finally:
        dense_linear.use_fused_configs(previous)


def test_every_measured_config_is_valid():
    for (_device, tokens, _out_features, _in_features), config in dense_linear.MEASURED_CONFIGS.items():
        assert tokens in dense_linear.TOKEN_BUCKETS
        check_dense_config(config, tokens)
    for (_device, tokens, _out_features, _in_features, fusion), config in dense_linear.MEASURED_FUSED_CONFIGS.items():
        assert tokens in dense_linear.TOKEN_BUCKETS and fusion in dense_linear.FUSIONS
        check_dense_config(config, tokens)


def test_without_a_measured_config_the_launcher_is_f_linear(triton_kernels):
    """On CPU tensors (``dense_linear_config`` is None off CUDA: test_measured_table_lookup) the launcher is
    ``F.linear`` itself, bit for bit."""
    x, w, b = torch.randn(3, 24), torch.randn(10, 24), torch.randn(10)
    assert torch.equal(triton_kernels.dense_linear(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measured_configs_at_their_shapes_on_this_gpu():
    """Each launch of the table measured on this device, at its own shape, against a float32 product (bf16 output
    rounding: 2^-8 of the terms' magnitude)."""
    from loraplex.kernels._triton import device_name
    from loraplex.kernels.dense_linear import _launch_dense_linear

    name = device_name(torch.device("cuda"))
    rows = [(key, config) for key, config in dense_linear.MEASURED_CONFIGS.items() if key[0] == name]
    if not rows:
        pytest.skip(f"no measured configs for {name}")
    for (_dev, tokens, n, k), config in rows:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        assert dense_linear_config(tokens, n, k, torch.bfloat16, x.device) == config
        got = _launch_dense_linear(x, w)
        mag = x.float().abs() @ w.float().abs().T
        err = ((got.float() - x.float() @ w.float().T).abs() / mag.clamp_min(1.0)).max().item()
        assert err <= 8e-3, (config, err)
        # the decode layer's fusions at the same launch (the gated input takes fewer stages where it needs them; a
        # split launch takes the residual only: an input norm or activation needs whole rows)
        g = (1 + 0.5 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        r = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        xx = torch.randn(tokens, 2 * k, device="cuda", dtype=torch.bfloat16)
        fusions = [(dict(norm_weight=g, norm_eps=1e-5), _input_loop(x, g, 1e-5, None)),
                   (dict(activation="silu", residual=r), _input_loop(xx, None, 0.0, "silu"))]
        if dense_linear.splits_k(config):
            fusions = [(dict(residual=r), _input_loop(x, None, 0.0, None))]
        for kw, u in fusions:
            got = _launch_dense_linear(xx if "activation" in kw else x, w, config=config, **kw).double().cpu()
            want = u @ w.double().cpu().T + (r.double().cpu() if "residual" in kw else 0.0)
            mag = u.abs() @ w.double().cpu().abs().T + (r.double().cpu().abs() if "residual" in kw else 0.0)
            err = ((got - want).abs() / mag.clamp_min(1.0)).max().item()
            assert err <= 1.6e-2, (config, sorted(kw), err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("config,t,n,k", [(("tm", 32, 32, 256, 4, 4, 2), 32, 4096, 4096),
                                          (("swap", 32, 64, 256, 4, 4, 4), 32, 4096, 11008),
                                          (("swap", 16, 64, 128, 4, 4, 4), 1, 4096, 11008),
                                          (("streamk", 128, 64, 128, 4, 3, 132), 128, 4096, 4096),
                                          (("streamk_tma", 128, 128, 64, 8, 4, 264), 128, 4096, 11008),
                                          (("streamk_tma", 32, 64, 256, 4, 4, 132), 20, 12288, 4096)])
def test_split_k_in_a_graph_replayed_with_new_inputs(config, t, n, k):
    """Serial split-K and stream-K at Llama-2-7B's o/down/qkv shapes, captured in a CUDA graph (with programmatic
    dependent launches) and replayed with new inputs: each replay equals the eager launch bitwise (the partials are
    summed in split / program order), which is within bf16 rounding of a float32 product; the tile counters are
    zero after every replay."""
    from loraplex.kernels._triton import pdl_launches
    from loraplex.kernels.dense_linear import _launch_dense_linear

    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    with pdl_launches():
        _launch_dense_linear(x, w, residual=r, config=config)  # compiles, allocates the counters
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _launch_dense_linear(x, w, residual=r, config=config)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = _launch_dense_linear(x, w, residual=r, config=config)
        assert torch.equal(out, eager)
        want = x.float() @ w.float().T + r.float()
        mag = x.float().abs() @ w.float().abs().T + r.float().abs()
        assert ((out.float() - want).abs() / mag.clamp_min(1.0)).max().item() <= 8e-3
        assert _triton._LAUNCH_COUNTERS[x.device].count_nonzero().item() == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
def test_dependent_split_k_launches_under_pdl_in_a_graph():
    """Twelve dependent split-K and stream-K launches (each one's output the next one's input and residual; different
    grids and split counts) captured with programmatic dependent launches at the default "late" trigger: a launch may
    start while the one before finishes its reduction, and reuses the tile counters. Replays equal the same chain
    launched eagerly without PDL, bitwise; the counters are zero after each."""
    from loraplex.kernels._triton import pdl_launches
    from loraplex.kernels.dense_linear import _launch_dense_linear

    torch.manual_seed(0)
    d = 1024
    configs = [("tm", 32, 32, 256, 4, 4, 2), ("swap", 32, 64, 128, 4, 3, 4), ("tm", 32, 64, 128, 4, 3, 3),
               ("swap", 32, 64, 256, 4, 4, 2), ("streamk", 32, 64, 128, 4, 3, 132),
               ("streamk_tma", 32, 64, 256, 4, 3, 40)] * 2
    weights = [(torch.randn(d, d, device="cuda") / d**0.5).to(torch.bfloat16) for _ in configs]

    def chain(h):
        for w, config in zip(weights, configs):
            h = _launch_dense_linear(h, w, residual=h, config=config)
        return h

    x = torch.randn(32, d, device="cuda", dtype=torch.bfloat16)
    with pdl_launches():
        chain(x)  # compiles, allocates the counters
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(x))
        assert _triton._LAUNCH_COUNTERS[x.device].count_nonzero().item() == 0
