"""benchmarks/diag_fp8_split_act.py on the CPU: its launch-shape grid and its split + GEMM pair (the interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import diag_fp8_split_act as diag  # noqa: E402

from loraplex.kernels.fp8_linear import FP8_DTYPE, _split_block_sizes, fp8_linear_split_ref  # noqa: E402


def test_the_grid_holds_row_tiles_for_the_2t_rows_and_fits_shared_memory():
    for tokens, rows in ((1, {16}), (32, {64}), (128, {128, 256})):
        grid = list(diag.configs(tokens))
        assert grid and {c[0] for c in grid} == rows
        assert {c[5] for c in grid} == {1, 2, 4}
        assert all((c[1] + c[0]) * c[2] * c[4] <= 200 * 1024 for c in grid)  # e4m3 weight + q tiles per stage
        # the launcher's defaults for the Llama-2-7B linears use the same row tiles
        assert {_split_block_sizes(tokens, n, k)[0] for _, k, n in diag.LINEARS} <= rows


@pytest.mark.interpreter
def test_split_act_pair_equals_the_reference():
    """The diag's quantize() then gemm() (the library's split_activations and split_gemm on fixed buffers) against
    fp8_linear_split_ref."""
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = (torch.randn(24, 64) * 40).to(FP8_DTYPE)
    scale = torch.rand(24) * 1e-3 + 5e-4
    op = diag.SplitAct(x, 24, (16, 16, 32, 4, 2, 1))
    got = op(w, scale).float()
    expected = fp8_linear_split_ref(x, w, scale).float()
    assert (got - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
