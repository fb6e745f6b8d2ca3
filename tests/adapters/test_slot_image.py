"""SlotImage: an adapter read straight into its slot layout equals the loaded adapter, padded."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters import AdapterFormatError, BaseModelSpec, inspect_peft_adapter, load_peft_adapter
from loraplex.adapters.slot_image import read_slot_image, slot_image_from_adapter

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 8
TARGETS = [(0, "q_proj"), (0, "down_proj"), (1, "v_proj")]


@pytest.fixture
def adapter_dir(tmp_path, write_adapter):
    generator = torch.Generator().manual_seed(7)
    weights = {}
    for layer, module in TARGETS:
        in_features, out_features = SPEC.module_shapes[module]
        weights[(layer, module)] = (torch.randn(3, in_features, generator=generator),
                                    torch.randn(out_features, 3, generator=generator))
    write_adapter(tmp_path / "ad", weights, r=3, lora_alpha=6.0)
    return tmp_path / "ad", weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_image_equals_loaded_adapter_padded(adapter_dir, dtype):
    folder, weights = adapter_dir
    layout = inspect_peft_adapter(folder, SPEC, MAX_RANK)
    image = read_slot_image(layout, SPEC, MAX_RANK, dtype, version_id="v" * 64, pin_memory=False)
    loaded = slot_image_from_adapter(load_peft_adapter(folder, SPEC, MAX_RANK), SPEC, MAX_RANK, dtype,
                                     pin_memory=False)
    assert image.version_id == "v" * 64
    assert image.data.dtype == dtype and torch.equal(image.data, loaded.data)
    assert torch.equal(image.scaling, loaded.scaling)
    expected_numel = sum(MAX_RANK * sum(SPEC.module_shapes[module]) for _, module in TARGETS)
    assert image.nbytes == expected_numel * image.data.element_size()
    columns = list(SPEC.module_shapes)
    for layer in range(SPEC.num_layers):
        for module in SPEC.module_shapes:
            key = (layer, module)
            if key not in weights:
                assert key not in image.offsets and image.scaling[layer, columns.index(module)] == 0.0
                continue
            a, b = weights[key]
            assert torch.equal(image.a(key)[:3], a.to(dtype)) and not image.a(key)[3:].any()
            assert torch.equal(image.b(key)[:, :3], b.to(dtype)) and not image.b(key)[:, 3:].any()
            assert image.scaling[layer, columns.index(module)] == pytest.approx(6.0 / 3)


def test_overflow_in_slot_dtype_is_refused_naming_the_tensor(tmp_path, write_adapter):
    a = torch.full((2, 16), 0.5)
    b = torch.ones(16, 2)
    b[4, 1] = 70000.0  # finite in fp32, Inf in fp16
    write_adapter(tmp_path / "big", {(1, "q_proj"): (a, b)}, r=2, lora_alpha=2.0)
    layout = inspect_peft_adapter(tmp_path / "big", SPEC, MAX_RANK)
    read_slot_image(layout, SPEC, MAX_RANK, torch.bfloat16, version_id="x" * 64, pin_memory=False)  # fits bf16
    with pytest.raises(AdapterFormatError, match=r"layers\.1\.self_attn\.q_proj\.lora_B.*NaN or Inf.*float16"):
        read_slot_image(layout, SPEC, MAX_RANK, torch.float16, version_id="x" * 64, pin_memory=False)
