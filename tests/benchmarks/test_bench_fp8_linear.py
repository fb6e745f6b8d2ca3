"""benchmarks/bench_fp8_linear.py on the CPU: the launch-shape grid and the weight copies it rotates."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_fp8_linear as bf  # noqa: E402

from loraplex.kernels._triton import SM90_SHARED_MEMORY_BYTES  # noqa: E402


def test_rotated_copies_span_twice_the_l2():
    assert [bf.copies_for(n * k) for _, k, n in bf.LINEARS] == [4, 8, 4, 4]  # o_proj: 16 MB -> 8 copies
    assert all(bf.copies_for(n * k) * n * k >= 2 * bf.L2_BYTES for _, k, n in bf.LINEARS)


def test_the_grid_has_both_kernels_and_token_tiles_that_fit_the_count():
    for tokens in (1, 32, 128):
        grid = list(bf.configs(tokens))
        token_major = [c for c in grid if len(c) == 5]
        swapped = [c for c in grid if len(c) == 6]
        assert token_major and swapped
        assert {c[5] for c in swapped} == {1, 2, 4, 8}  # split-K
        assert all(c[1] in (64, 128) for c in swapped)  # the weight tile is the dot's 64/128-row side
        assert all(c[0] >= min(tokens, 16) for c in grid)
        # token-major shapes whose bf16 x and fp8 weight tiles would not fit the shared memory are left out
        assert all((c[0] * 2 + c[1]) * c[2] * c[4] <= SM90_SHARED_MEMORY_BYTES * 7 // 8 for c in token_major)
