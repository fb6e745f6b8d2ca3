"""Kernel test setup: run the Triton kernels under the CPU interpreter when there is no GPU.

Triton reads ``TRITON_INTERPRET`` when *it* is imported (its own ``tl.sum``,
``tl.max``... are ``@jit`` functions) and when each kernel is decorated, so the
variable must be set before the first ``import triton`` in the process. This
file sets it if Triton is not imported yet. When the whole test suite runs in
one process, an earlier test directory may import the engine (and so Triton)
first; set the variable in ``tests/conftest.py`` for that case (re-importing
Triton in-process is impossible: its C extension refuses to load twice). If it
was missed, the interpreter tests are skipped with that reason, not failed.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # kernel_test_utils, whatever pytest's import mode


def _enable_interpreter() -> str | None:
    """Set TRITON_INTERPRET=1 if possible; return why interpreted kernels cannot run, or None."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if "triton" in sys.modules:
        return (
            "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module); "
            "set it in tests/conftest.py or run tests/kernels on its own"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return None


_NO_INTERPRETER_REASON = _enable_interpreter()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "interpreter: runs Triton kernels (under the CPU interpreter when there is no GPU; slow-ish)"
    )


@pytest.fixture
def kernel_device() -> torch.device:
    """Where Triton kernels run: the GPU if present, else CPU tensors under the interpreter."""
    from loraplex.kernels._triton import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if _NO_INTERPRETER_REASON:
        pytest.skip(_NO_INTERPRETER_REASON)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def triton_kernels(kernel_device: torch.device):
    """The Triton ops, for tensors on ``kernel_device`` (CPU tensors run under the interpreter)."""
    from loraplex.kernels.ops import Kernels

    return Kernels("triton")


@pytest.fixture(autouse=True)
def _fresh_seed() -> None:
    """Fresh random inputs every run; the seed is printed on failure, and ``LORAPLEX_TEST_SEED=<seed>``
    replays it."""
    seed = int(os.environ.get("LORAPLEX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


@pytest.fixture
def poison_allocations(monkeypatch):
    """``torch.empty`` / ``torch.empty_like`` return NaN-filled float tensors for the test.

    Outputs and scratch buffers that kernels allocate themselves are then
    poisoned too, so an element a kernel forgets to write shows up as NaN.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
