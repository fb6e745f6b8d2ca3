"""The start-up self-check of add_lora: passes for the real kernel, refuses a wrong one with the shape."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import lora_linear, self_check
from loraplex.kernels.op import Op


@pytest.mark.interpreter
def test_the_kernel_passes_and_a_wrong_kernel_is_refused(kernel_device, monkeypatch):
    self_check.check_add_lora([(32, (16, 8))], num_slots=3, rank=4, dtype=torch.float32, device=kernel_device)

    def off_by_a_tenth(x, lora_a, lora_b, scaling, y, mapping, **kw):
        lora_linear.ADD_LORA.triton(x, lora_a, lora_b, [s * 1.1 for s in scaling], y, mapping, **kw)

    wrong = Op(name="add_lora", semantics="", reference=lora_linear.add_lora_ref, triton=lora_linear._launch_add_lora)
    monkeypatch.setattr(self_check, "ADD_LORA", wrong)
    object.__setattr__(wrong, "triton", off_by_a_tenth)
    with pytest.raises(self_check.LoRAKernelMismatch, match=r"for 1 tokens, in_features=32, widths=\[16, 8\]"):
        self_check.check_add_lora([(32, (16, 8))], num_slots=3, rank=4, dtype=torch.float32, device=kernel_device)
