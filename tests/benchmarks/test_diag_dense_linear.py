"""benchmarks/diag_dense_linear.py on the CPU: its stream-K launch shapes, and one of them run at a small shape under
the interpreter against a float64 product."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import diag_dense_linear as diag  # noqa: E402

from loraplex.kernels._triton import SM90_SHARED_MEMORY_BYTES  # noqa: E402
from loraplex.kernels.dense_linear import STREAMK_KINDS, check_dense_config  # noqa: E402


def test_streamk_shapes_per_grid_size_and_one_program_per_tile():
    """Without ``--streamk`` no stream-K shape; with grids 132 and "tiles" (0) both kinds at one token tile, the
    "tiles" grid being the shape's output tile count (Llama-2-7B's o_proj at 128 tokens: 4096 / BLOCK_N)."""
    assert not [kind for kind, _ in diag.launch_shapes(128, 4096, 4096, (1,)) if kind in STREAMK_KINDS]
    shapes = [(kind, cfg) for kind, cfg in diag.launch_shapes(128, 4096, 4096, (1,), (132, 0))
              if kind in STREAMK_KINDS]
    assert {kind for kind, _ in shapes} == set(STREAMK_KINDS)
    assert {cfg[0] for _, cfg in shapes} == {128}
    assert {cfg[1] for _, cfg in shapes} == {64, 128, 256}
    assert {(cfg[1], cfg[5]) for _, cfg in shapes} == {(64, 132), (128, 132), (256, 132), (64, 64), (128, 32),
                                                       (256, 16)}
    for kind, cfg in shapes:
        check_dense_config((kind, *cfg), 128)
        bt, bn, bk, warps, stages, _programs = cfg
        assert (bt + bn) * bk * 2 * stages <= SM90_SHARED_MEMORY_BYTES
        assert bn * bt <= 128 * 32 * warps  # at most 128 fp32 accumulators a thread
    # 20 tokens take a 32-token tile; one token takes none (GEMV)
    assert {cfg[0] for kind, cfg in diag.launch_shapes(20, 4096, 4096, (1,), (132,)) if kind in STREAMK_KINDS} == {32}
    assert not [kind for kind, _ in diag.launch_shapes(1, 4096, 4096, (1,), (132,)) if kind in STREAMK_KINDS]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", STREAMK_KINDS)
def test_a_streamk_launch_of_the_diag_equals_the_product(kind):
    """The diag's ``launch`` with a stream-K shape (tiles shrunk to 16 so the interpreter runs it quickly, three
    programs over 2 x 4 iterations) against float64."""
    x, w = torch.randn(5, 64), torch.randn(32, 64)
    got = diag.launch(kind, (16, 16, 16, 4, 2, 3), x, w, None)
    want = x.double() @ w.double().T
    assert ((got.double() - want).abs() / (x.double().abs() @ w.double().abs().T)).max().item() <= 1e-5


_BROKEN = []  # set in a worker process once it ran the faulting launch: its CUDA context is gone


def _worker_with_a_fault(task: tuple) -> str | None:
    """Stands in for ``diag._compile_one``: the launch named "fault" ends its process's context, so every launch
    that process runs after it fails too."""
    if task[0] == "fault":
        _BROKEN.append(True)
        return "AcceleratorError: an illegal memory access was encountered"
    return "AcceleratorError: (the context is gone)" if _BROKEN else None


def test_precompile_retries_failures_alone_and_returns_only_the_launch_that_faults():
    tasks = [("tm", (i,), 32, 64, 64) for i in range(3)] + [("fault", (0,), 32, 64, 64)]
    tasks += [("tm", (i,), 32, 64, 64) for i in range(3, 8)]
    failed = diag.precompile(tasks, jobs=1, worker=_worker_with_a_fault)  # one process: all after the fault fail
    assert failed == {("fault", (0,), 32, 64, 64): "AcceleratorError: an illegal memory access was encountered"}
