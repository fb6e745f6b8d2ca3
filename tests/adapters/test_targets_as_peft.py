"""Which modules an adapter config targets, as PEFT decides it (``check_target_module_exists``, ``LoraConfig``):
a module named whole in ``target_modules`` skips ``layers_to_transform``; ``"ALL-LINEAR"`` is ``"all-linear"``;
``layers_pattern`` must name the model's layer list (else PEFT adapts nothing) and needs ``layers_to_transform``."""

from __future__ import annotations

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.peft_config import PeftLoraConfig

KEYS = [(f"model.layers.{layer}.self_attn.{m}", layer) for layer in (1, 5) for m in ("q_proj", "v_proj")]


@pytest.mark.parametrize("fields", [
    {"target_modules": ["model.layers.1.self_attn.q_proj", "v_proj"], "layers_to_transform": [5]},
    {"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
    {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": 5, "layers_pattern": ["layers"]},
])
def test_targets_equal_peft(fields):
    ours = PeftLoraConfig.from_dict({"r": 4, "lora_alpha": 8, **fields})
    peft = LoraConfig(r=4, lora_alpha=8, **fields)
    for key, layer in KEYS:
        assert ours.targets(key, layer) == bool(check_target_module_exists(peft, key)), key


def test_lm_head_named_whole_is_targeted_whatever_the_layers():
    fields = {"target_modules": ["lm_head", "q_proj"], "layers_to_transform": [1]}
    assert bool(check_target_module_exists(LoraConfig(r=4, **fields), "lm_head"))
    assert PeftLoraConfig.from_dict({"r": 4, "lora_alpha": 8, **fields}).targets_vocab("lm_head")


def test_all_linear_in_any_case():
    assert PeftLoraConfig.from_dict({"r": 4, "lora_alpha": 8, "target_modules": "ALL-Linear"}).target_modules == \
        "all-linear"


@pytest.mark.parametrize("fields", [
    {"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "h"},  # PEFT: no module found
    {"target_modules": ["q_proj"], "layers_pattern": "layers"},  # PEFT's LoraConfig refuses it
])
def test_a_layers_pattern_peft_cannot_use_is_refused(fields):
    with pytest.raises(AdapterError, match="layers_pattern"):
        PeftLoraConfig.from_dict({"r": 4, "lora_alpha": 8, **fields})
