"""benchmarks/bench_kernels.py and bench_lora_kernels.py --mixed-ranks import on CPU, and their checks and tables work
at tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
BENCH = os.path.join(BENCHMARKS, "bench_kernels.py")


def _load_bench(name: str = "bench_kernels"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_imports_on_cpu_and_refuses_full_run_without_gpu():
    bench = _load_bench()
    assert bench.FULL.decode_contexts == (4096, 32768) and bench.FULL.num_kv_heads == 8
    if not bench.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main([])


@pytest.mark.interpreter
def test_smoke_run_checks_correctness_and_prints_table(kernel_device, capsys):
    bench = _load_bench()
    results = bench.run(bench.SMOKE, kernel_device, lambda fn: bench.wall_clock_median(fn, repeats=1))
    kernels = [r.kernel for r in results]
    assert kernels.count("decode attention") == 2 and kernels.count("lora_expand") == 2
    assert all(r.achieved > 0 for r in results)
    table = bench.format_table(results)
    assert table.count("\n") == len(results) + 1


def test_mixed_ranks_have_the_all_16_batch_s_rank_rows():
    bench = _load_bench("bench_lora_kernels")
    ranks = bench.mixed_ranks(32, 16)
    assert sorted(ranks) == [8] * 24 + [16] * 4 + [64] * 4 and sum(ranks) == 32 * 16
    assert ranks != sorted(ranks), "ranks are spread over the slots"
    names = [v.name for v in bench.mixed_variants(32, 16)]
    assert "(c) pages mixed, PAGE 8" in names and "(e) pages mixed, PAGE 16, pool R=256" in names


@pytest.mark.interpreter
def test_lora_mixed_ranks_smoke_checks_every_layout_and_writes_the_rows(kernel_device, tmp_path, capsys):
    if kernel_device.type == "cuda":
        pytest.skip("CPU interpreter run")
    bench = _load_bench("bench_lora_kernels")
    out = tmp_path / "mixed.json"
    result = bench.main(["--mixed-ranks", "--smoke", "--out", str(out)])  # each variant checked first
    rows = result["rows"]
    assert [r["variant"][:3] for r in rows] == ["(a)", "(b)", "(c)", "(c)", "(d)", "(d)", "(e)", "(e)"]
    assert {r["rank_rows"] for r in rows} == {8 * 4} and all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert [r["page"] for r in rows] == [None, 4, 2, 4, None, None, 4, None]
    assert set(result["speed_c_vs_b"]) == {rows[2]["variant"], rows[3]["variant"]}
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "time(b) / time(c) (goal >= 0.9)" in capsys.readouterr().out
