"""benchmarks/bench_kernels.py imports on CPU and its checks and table work at tiny shapes."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "bench_kernels.py")


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
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
