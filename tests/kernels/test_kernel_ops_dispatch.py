"""The op registry: one signature per op, a backend bound once per Kernels, the Triton-free import."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.op import BACKENDS, Op
from loraplex.kernels.ops import OPS, Kernels, default_backend

REPO_ROOT = __file__.rsplit("/tests/", 1)[0]


def test_kernels_binds_every_registered_op_to_one_backend(kernel_device):
    assert [op.name for op in OPS] == [
        "reshape_and_cache", "paged_attention", "rms_norm", "rotary_embedding", "rotary_and_cache",
        "silu_and_mul", "gelu_tanh_and_mul", "lora_shrink", "lora_expand",
        "lora_expand_slot_rows", "add_lora", "fused_lora", "fp8_linear", "dense_linear",
    ]
    for backend in BACKENDS:
        kernels = Kernels(backend)
        bound = {name for name in vars(kernels) if name != "backend"}
        assert bound == {op.name for op in OPS}
        for op in OPS:
            assert getattr(kernels, op.name) is (op.triton if backend == "triton" else op.reference)


def test_unknown_backend_is_refused_and_device_picks_the_default():
    with pytest.raises(KernelArgumentError, match="backend='cuda'"):
        Kernels("cuda")  # type: ignore[arg-type]
    assert default_backend(torch.device("cpu")) == "reference"
    assert default_backend(torch.device("cuda", 0)) == "triton"


def test_every_op_documents_itself_once():
    for op in OPS:
        assert op.semantics and "=" in op.semantics, op.name
        doc = inspect.getdoc(op.reference) or ""
        assert "Args:" in doc and "Raises:" in doc, op.name
        assert "Semantics" not in doc, f"{op.name}: the semantics line lives in the Op only"


def test_op_refuses_a_launcher_whose_parameters_drift():
    def reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return x

    def same(x: torch.Tensor, eps: float = 1e-6, *, block: int = 16) -> torch.Tensor:
        return x

    def other_default(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
        return x

    def extra_positional(x: torch.Tensor, eps: float = 1e-6, block: int = 16) -> torch.Tensor:
        return x

    assert Op("toy", "out = x", reference=reference, triton=same).select("triton") is same
    for launcher in (other_default, extra_positional):
        with pytest.raises(TypeError, match="op toy"):
            Op("toy", "out = x", reference=reference, triton=launcher)


def test_reference_kernels_run_every_op_on_cpu_without_triton():
    """`import loraplex.kernels.ops` works with triton unimportable; Kernels("reference") runs every op."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from loraplex.kernels import AttentionMetadata, LoRAMapping, TritonUnavailableError
        from loraplex.kernels.ops import Kernels
        from loraplex.kernels.rms_norm import RMS_NORM
        from loraplex.kernels.rotary import compute_cos_sin_cache, rope_inv_freq
        ops = Kernels("reference")
        meta = AttentionMetadata.build([2, 1], [2, 3], [[0], [1]], 4, "cpu")
        kc = torch.zeros(2, 4, 1, 8); vc = torch.zeros(2, 4, 1, 8)
        ops.reshape_and_cache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), kc, vc, meta.slot_mapping)
        out = ops.paged_attention(torch.randn(3, 2, 8), kc, vc, meta, 8 ** -0.5)
        ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
        cache = compute_cos_sin_cache(rope_inv_freq(8, 10000.0), 16)
        ops.rotary_embedding(torch.arange(3), torch.randn(3, 16), torch.randn(3, 8), cache, 8)
        ops.rotary_and_cache(torch.arange(3), torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 8), kc, vc,
                             meta.slot_mapping, cache)
        ops.silu_and_mul(torch.randn(3, 8))
        m = LoRAMapping.from_token_slots(torch.tensor([0, -1, 1], dtype=torch.int32))
        v = ops.lora_shrink(torch.randn(3, 8), [torch.randn(2, 4, 8)], m)
        ops.lora_expand(v, [torch.randn(2, 6, 4)], [torch.ones(2)], torch.zeros(3, 6), m)
        for fn in (lambda: Kernels("triton"), lambda: RMS_NORM.triton(torch.randn(3, 8), torch.ones(8), 1e-6)):
            try:
                fn()
            except TritonUnavailableError:
                pass
            else:
                raise SystemExit("expected TritonUnavailableError")
        assert "triton" not in {k for k, v in sys.modules.items() if v is not None and k.startswith("triton")}
        print("ok", tuple(out.shape))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": REPO_ROOT, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok (3, 2, 8)"
