"""Loaded A/B/scaling must equal PEFT's own LoRA modules for the same saved adapter."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import pytest
import torch

from loraplex.adapters import AdapterInfo, load_peft_adapter, validate_adapter_dir
from loraplex.adapters.spec import SPLIT_MODULE_NAMES

ALL_PROJ = list(SPLIT_MODULE_NAMES)  # every LoRA-able module of a Llama
MAX_RANK = 16
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")


def peft_lora_modules(peft_model: Any) -> dict[tuple[int, str], Any]:
    """(layer, module) -> PEFT LoraLayer, for every module PEFT put LoRA on."""
    found = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            match = _KEY.fullmatch(name)
            assert match is not None, name
            found[(int(match[1]), match[2])] = module
    return found


def assert_matches_peft(adapter: Any, peft_model: Any) -> None:
    modules = peft_lora_modules(peft_model)
    assert set(adapter.weights) == set(modules)
    for key, module in modules.items():
        weight = adapter.weights[key]
        assert weight.a.dtype == torch.float32 and weight.b.dtype == torch.float32
        torch.testing.assert_close(weight.a, module.lora_A["default"].weight.float(), rtol=0, atol=0)
        torch.testing.assert_close(weight.b, module.lora_B["default"].weight.float(), rtol=0, atol=0)
        assert weight.scaling == pytest.approx(module.scaling["default"], rel=1e-12)


@pytest.mark.parametrize("r", [4, 8, 16])
def test_ranks_match_peft(peft_adapter, spec, r):
    folder, peft_model = peft_adapter(r=r, lora_alpha=2 * r + 3, target_modules=ALL_PROJ)
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    assert adapter.rank == r
    assert adapter.alpha == 2 * r + 3
    assert adapter.target_modules == tuple(ALL_PROJ)
    assert all(w.scaling == pytest.approx((2 * r + 3) / r) for w in adapter.weights.values())
    assert adapter.warnings == ()


def test_rslora_scaling_matches_peft(peft_adapter, spec):
    folder, peft_model = peft_adapter(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"])
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    assert adapter.use_rslora
    assert all(w.scaling == pytest.approx(16 / math.sqrt(8)) for w in adapter.weights.values())


def test_rank_and_alpha_patterns_match_peft(peft_adapter, spec):
    rank_pattern = {"v_proj": 2, r"model\.layers\.1\.self_attn\.q_proj": 8}
    alpha_pattern = {"down_proj": 3, "layers.0.mlp.up_proj": 5}
    folder, peft_model = peft_adapter(
        r=4, lora_alpha=8, target_modules=ALL_PROJ, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern
    )
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    # the patterns really took effect (guards against PEFT silently ignoring them)
    assert adapter.weights[(0, "v_proj")].rank == 2
    assert adapter.weights[(1, "q_proj")].rank == 8 and adapter.weights[(0, "q_proj")].rank == 4
    assert adapter.weights[(1, "down_proj")].scaling == pytest.approx(3 / 4)
    assert adapter.weights[(0, "up_proj")].scaling == pytest.approx(5 / 4)
    assert adapter.weights[(1, "up_proj")].scaling == pytest.approx(8 / 4)
    assert adapter.rank == 8


def test_target_modules_regex_matches_peft(peft_adapter, spec):
    folder, peft_model = peft_adapter(r=4, lora_alpha=4, target_modules=r".*\.layers\.1\.self_attn\.(q|v)_proj")
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    assert set(adapter.weights) == {(1, "q_proj"), (1, "v_proj")}
    assert adapter.info().num_layers_targeted == 1


@pytest.mark.parametrize("modules", [["q_proj"], ["k_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]])
def test_module_subsets_match_peft(peft_adapter, spec, modules):
    folder, peft_model = peft_adapter(r=4, lora_alpha=8, target_modules=modules)
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    assert adapter.target_modules == tuple(m for m in ALL_PROJ if m in modules)


def test_layers_to_transform_matches_peft(peft_adapter, spec):
    folder, peft_model = peft_adapter(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], layers_to_transform=[1]
    )
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert_matches_peft(adapter, peft_model)
    assert adapter.layers == (1,)


def test_lora_delta_equals_peft_module_output(peft_adapter, spec):
    folder, peft_model = peft_adapter(r=8, lora_alpha=16, target_modules=ALL_PROJ, rank_pattern={"o_proj": 4})
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    modules = peft_lora_modules(peft_model)
    torch.manual_seed(1)
    for key in [(0, "q_proj"), (1, "o_proj"), (1, "down_proj")]:
        module, weight = modules[key], adapter.weights[key]
        x = torch.randn(5, module.in_features)
        with torch.no_grad():
            expected = module(x) - module.base_layer(x)  # PEFT's LoRA contribution
        got = (x @ weight.a.T @ weight.b.T) * weight.scaling
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weight.delta(x), expected, rtol=1e-5, atol=1e-5)
        assert expected.abs().max() > 1e-3  # the adapter is not a no-op


def test_bf16_tensors_load_as_fp32(peft_adapter, spec, tmp_path):
    _, peft_model = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], seed=3)
    peft_model.to(torch.bfloat16).save_pretrained(str(tmp_path))
    peft_model.to(torch.float32)
    adapter = load_peft_adapter(tmp_path, spec, MAX_RANK)
    for key, module in peft_lora_modules(peft_model).items():
        expected_a = module.lora_A["default"].weight.to(torch.bfloat16).float()
        torch.testing.assert_close(adapter.weights[key].a, expected_a, rtol=0, atol=0)
    assert adapter.size_bytes == sum(2 * (w.a.numel() + w.b.numel()) for w in adapter.weights.values())


def test_tensor_names_with_adapter_name_are_accepted(adapter_copy, base_adapter_dir, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    renamed = load_peft_adapter(adapter_copy, spec, MAX_RANK)
    plain = load_peft_adapter(base_adapter_dir, spec, MAX_RANK)
    assert set(renamed.weights) == set(plain.weights) and len(plain.weights) == 14
    for key, weight in plain.weights.items():
        assert torch.equal(renamed.weights[key].a, weight.a) and torch.equal(renamed.weights[key].b, weight.b)


def test_validate_adapter_dir_summary(base_adapter_dir, spec):
    info = validate_adapter_dir(base_adapter_dir, spec, MAX_RANK)
    adapter = load_peft_adapter(base_adapter_dir, spec, MAX_RANK)
    # 2 layers x (q 64->64, k 64->32, v 64->32, o 64->64, gate 64->128, up 64->128, down 128->64), r=4, fp32
    per_layer = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64))
    assert info == AdapterInfo(
        version_id=adapter.version_id,
        rank=4,
        alpha=8.0,
        use_rslora=False,
        target_modules=tuple(ALL_PROJ),
        num_layers_targeted=2,
        size_bytes=2 * per_layer * 4,
        warnings=(),
    )
    assert len(info.version_id) == 64


def test_all_zero_b_loads_with_warning(peft_adapter, spec, caplog):
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], randomize_b=False)
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters.peft_format"):
        adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert adapter.warnings == ("all 4 lora_B matrices are zero: the adapter does not change the model (untrained?)",)
    assert any("all 4 lora_B matrices are zero" in record.getMessage() for record in caplog.records)
    assert all(not w.b.any() for w in adapter.weights.values())


def test_some_zero_b_warns_with_first_module(adapter_copy, spec, edit_tensors):
    edit_tensors(
        adapter_copy,
        lambda t: {k: (torch.zeros_like(v) if "layers.1.mlp.up_proj.lora_B" in k else v) for k, v in t.items()},
    )
    adapter = load_peft_adapter(adapter_copy, spec, MAX_RANK)
    assert adapter.warnings == (
        "1 of 14 lora_B matrices are zero (first: layer 1 up_proj): those modules do not change the model",
    )
