"""No module of the engine copies a host list to a device with ``torch.tensor(..., device=...)``.

Such a copy reads pageable memory and waits for the kernels queued on the stream, so one call in
a step's path makes the host wait for the previous step's GPU work (measured on the H200, session
9: decode steps of adapters with LoRA on ``lm_head`` and with an ``lm_head`` copy ran at 58-74% GPU
busy while every other row ran at 93-98%, because ``compute_logits`` built its row indices that
way). ``loraplex.engine.host_copy.host_to_device`` is the one path: pinned memory, non-blocking.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from loraplex.engine import host_copy
from loraplex.engine.host_copy import host_to_device

ENGINE = Path(host_copy.__file__).resolve().parent


def _device_tensor_calls(path: Path) -> list[str]:
    """``file:line`` of each ``torch.tensor(..., device=...)`` call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tensor"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and any(k.arg == "device" for k in node.keywords)):
            found.append(f"{path.relative_to(ENGINE.parent)}:{node.lineno}")
    return found


def test_no_engine_module_copies_host_lists_with_torch_tensor_device():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 20 and ENGINE / "models" / "llama.py" in files
    offenders = [site for path in files for site in _device_tensor_calls(path)]
    assert offenders == [], offenders


def test_the_scan_finds_the_pattern(tmp_path):
    # The compute_logits line this replaced, and the forms that must not count.
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\n"
                      "at = torch.tensor(rows, dtype=torch.int64, device=hidden.device)\n"
                      "ok = torch.tensor(rows, dtype=torch.int64)\n"
                      "also_ok = torch.zeros(3, device='cpu')\n")
    sites = []
    for node in ast.walk(ast.parse(sample.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "tensor"
                and any(k.arg == "device" for k in node.keywords)):
            sites.append(node.lineno)
    assert sites == [2]


def test_host_to_device_values_and_dtype():
    t = host_to_device([3, -1, 7], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [3, -1, 7]
    assert host_to_device([[0, 1], [2, 3]], torch.int64, torch.device("cpu")).tolist() == [[0, 1], [2, 3]]
