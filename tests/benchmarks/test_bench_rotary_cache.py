"""benchmarks/bench_rotary_cache.py on CPU: a tiny run under the Triton interpreter checks every variant against
the fused kernel and writes the report; a full run refuses without a GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_rotary_cache as brc  # noqa: E402


def test_full_run_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        brc.main([])


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton loads")
def test_smoke_run_checks_variants_and_writes_the_report(tmp_path):
    out = tmp_path / "rc.md"
    rows = brc.main(["--smoke", "--out", str(out)])
    assert [(r.model, r.tokens, r.variant) for r in rows[:3]] == [("tiny-MHA", 1, v) for v in brc.VARIANTS]
    assert len(rows) == len(brc.SMOKE_HEADS) * len(brc.SMOKE_TOKENS) * len(brc.VARIANTS)
    assert all(r.us_per_layer > 0 for r in rows)
    assert all(r.step_saving_us == 0 for r in rows if r.variant == "before")
    assert out.read_text().count("\n") == len(rows) + 2
    assert len(json.loads(out.with_suffix(".md.json").read_text())) == len(rows)


def test_check_refuses_a_variant_that_differs(monkeypatch):
    """The correctness check is not a no-op: a variant that skips the rotation is refused."""
    real = brc.variant_call

    def broken(variant, layer, positions, slots, cache, hq, hkv, d):
        if variant == "two launches":
            return lambda: layer.views(hq, hkv, d)[0]  # nothing rotated, nothing cached
        return real(variant, layer, positions, slots, cache, hq, hkv, d)

    monkeypatch.setattr(brc, "variant_call", broken)
    cache = brc.compute_cos_sin_cache(brc.rope_inv_freq(16, 10000.0), 256)
    with pytest.raises(SystemExit, match="two launches"):
        brc.check_variants(3, 2, 1, 16, 4, torch.float32, torch.device("cpu"), cache)


def test_check_refuses_positions_past_the_cos_sin_cache():
    """Positions start at 128: a 64-row cache would be read out of bounds (garbage, sometimes NaN)."""
    cache = brc.compute_cos_sin_cache(brc.rope_inv_freq(16, 10000.0), 64)
    with pytest.raises(ValueError, match="cos/sin cache has 64 positions"):
        brc.check_variants(3, 2, 1, 16, 4, torch.float32, torch.device("cpu"), cache)
