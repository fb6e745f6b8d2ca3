"""ops: backend selection, the Triton-free import, and the reference path of every op."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from loraplex.kernels import activation, ops
from loraplex.kernels import rms_norm as rms_norm_module
from loraplex.kernels.errors import KernelArgumentError

REPO_ROOT = __file__.rsplit("/tests/", 1)[0]


def test_set_backend_validates_and_use_backend_restores():
    assert ops.get_backend() == "auto"
    with pytest.raises(KernelArgumentError, match="name='cuda'"):
        ops.set_backend("cuda")  # type: ignore[arg-type]
    with ops.use_backend("reference"):
        assert ops.get_backend() == "reference"
    assert ops.get_backend() == "auto"


def test_auto_picks_reference_for_cpu_tensors_and_triton_when_forced(monkeypatch, kernel_device):
    calls = []
    monkeypatch.setattr(activation, "silu_and_mul_ref", lambda x, out=None: calls.append("ref") or x)
    monkeypatch.setattr(activation, "silu_and_mul", lambda x, out=None: calls.append("triton") or x)
    x = torch.randn(2, 8)
    ops.silu_and_mul(x)
    with ops.use_backend("triton"):
        ops.silu_and_mul(x)
    with ops.use_backend("reference"):
        ops.silu_and_mul(x)
    assert calls == ["ref", "triton", "ref"]


def test_reference_ops_run_on_cpu_by_default(monkeypatch):
    spy = []
    real = rms_norm_module.rms_norm_ref
    monkeypatch.setattr(rms_norm_module, "rms_norm_ref", lambda *a: spy.append(1) or real(*a))
    out = ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert spy == [1] and out.shape == (3, 8)


def test_ops_import_and_run_without_triton():
    """`import loraplex.kernels.ops` works with triton unimportable; every op runs on the reference path."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        from loraplex.kernels import ops, AttentionMetadata, LoRAMapping, TritonUnavailableError
        from loraplex.kernels.rms_norm import rms_norm
        from loraplex.kernels.rotary import rope_inv_freq
        meta = AttentionMetadata.build([2, 1], [2, 3], [[0], [1]], 4, "cpu")
        kc = torch.zeros(2, 4, 1, 8); vc = torch.zeros(2, 4, 1, 8)
        ops.reshape_and_cache(torch.randn(3, 1, 8), torch.randn(3, 1, 8), kc, vc, meta.slot_mapping)
        out = ops.paged_attention(torch.randn(3, 2, 8), kc, vc, meta, 8 ** -0.5)
        ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
        cache = ops.compute_cos_sin_cache(rope_inv_freq(8, 10000.0), 16)
        ops.rotary_embedding(torch.arange(3), torch.randn(3, 16), torch.randn(3, 8), cache, 8)
        ops.silu_and_mul(torch.randn(3, 8))
        m = LoRAMapping.from_token_slots(torch.tensor([0, -1, 1], dtype=torch.int32))
        v = ops.lora_shrink(torch.randn(3, 8), [torch.randn(2, 4, 8)], m)
        ops.lora_expand(v, [torch.randn(2, 6, 4)], [torch.ones(2)], torch.zeros(3, 6), m)
        for fn in (lambda: ops.set_backend("triton"), lambda: rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)):
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
