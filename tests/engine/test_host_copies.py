"""No step-path code of the engine copies host data to a device in a blocking way.

A copy from pageable host memory (``torch.tensor(values, device=cuda)``, ``cpu_tensor.to(cuda)``,
``.cuda()``) waits for the kernels queued on the stream, so one such call in a step's path makes
the host wait for the previous step's GPU work (measured on the H200, session 9: decode steps of
adapters with LoRA on ``lm_head`` and with an ``lm_head`` copy ran at 58-74% GPU busy while every
other row ran at 93-98%, because ``compute_logits`` built its row indices that way). The step path
uses ``loraplex.engine.host_copy`` (pinned memory, non-blocking); the scan below allows the blocking
forms only at the load-time sites listed in ``LOAD_TIME``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from loraplex.engine import host_copy
from loraplex.engine.host_copy import host_to_device, tensor_to_device

ENGINE = Path(host_copy.__file__).resolve().parent
LOAD_TIME = {
    "host_copy.py:tensor_to_device",  # the non-CUDA branch of the helper itself
    "models/llama.py:__init__",  # RoPE caches, built once at load
}
"""``file:function`` sites allowed a blocking host-to-device form (they run once, not per step)."""


def _is_device_arg(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "device")
            or (isinstance(node, ast.Attribute) and node.attr == "device")
            or (isinstance(node, ast.Constant) and node.value in ("cuda", "cuda:0")))


def blocking_copies(source: str) -> list[tuple[int, str]]:
    """``(line, function)`` of each blocking host-to-device form in ``source``: ``torch.tensor`` /
    ``torch.as_tensor`` with ``device=``; ``x.cuda()``; ``x.to(device | x.device | "cuda", ...)``
    without ``non_blocking=``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                attr, keywords = child.func.attr, {k.arg for k in child.keywords}
                owner = child.func.value
                if (attr in ("tensor", "as_tensor") and isinstance(owner, ast.Name) and owner.id == "torch"
                        and "device" in keywords):
                    found.append((child.lineno, name))
                elif attr == "cuda" and not child.args:
                    found.append((child.lineno, name))
                elif (attr == "to" and "non_blocking" not in keywords
                      and (any(_is_device_arg(a) for a in child.args[:1])
                           or any(k.arg == "device" and _is_device_arg(k.value) for k in child.keywords))):
                    found.append((child.lineno, name))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_no_blocking_host_to_device_copy_in_the_engine():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 20 and ENGINE / "models" / "llama.py" in files
    sites = {f"{path.relative_to(ENGINE)}:{function}": line
             for path in files for line, function in blocking_copies(path.read_text())}
    assert set(sites) == LOAD_TIME, sites


@pytest.mark.parametrize("line, expected", [
    ("at = torch.tensor(rows, dtype=torch.int64, device=hidden.device)", True),  # compute_logits' old line
    ("ids = torch.as_tensor(ids, device=device)", True),
    ("x = padded.to(device)", True),  # _padded_ids' old line
    ("x = padded.to(logits.device)", True),
    ("x = padded.cuda()", True),
    ("x = host.pin_memory().to(device, non_blocking=True)", False),
    ("x = torch.tensor(rows, dtype=torch.int64)", False),
    ("x = torch.zeros(3, device=device)", False),  # allocates on the device, copies nothing
    ("x = logits.to(torch.float32)", False),
])
def test_the_scan_finds_the_blocking_forms(line, expected):
    assert blocking_copies(f"def step():\n    {line}\n") == ([(2, "step")] if expected else [])


def test_host_to_device_values_and_dtype():
    t = host_to_device([3, -1, 7], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [3, -1, 7]
    assert host_to_device([[0, 1], [2, 3]], torch.int64, torch.device("cpu")).tolist() == [[0, 1], [2, 3]]
    host = torch.arange(6).view(2, 3)
    assert torch.equal(tensor_to_device(host, "cpu"), host)
