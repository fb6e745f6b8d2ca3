"""BaseModelSpec.from_hf_config against the Linear layers of real (tiny, random) HF models."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters import BaseModelSpec
from loraplex.adapters.spec import MODULE_PARENT

SMALL = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, vocab_size=64)


def hf_module_shapes(model) -> dict[str, tuple[int, int]]:
    """Every LoRA-able nn.Linear of HF's first decoder layer (q_proj.. or Phi-3's fused qkv_proj..)."""
    layer = model.model.layers[0]
    shapes = {}
    for name, parent in MODULE_PARENT.items():
        linear = getattr(getattr(layer, parent), name, None)
        if linear is not None:
            shapes[name] = (linear.in_features, linear.out_features)
    return shapes


@pytest.mark.parametrize(
    ("config_name", "model_name", "extra"),
    [
        ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
        ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=None)),  # MHA: Hkv defaults to Hq
        # head_dim != hidden/Hq
        ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, head_dim=20, sliding_window=None)),
        ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
        ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
        ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
        ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
        ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0, eos_token_id=1)),  # fused
    ],
)
def test_shapes_match_hf_model(config_name, model_name, extra):
    import transformers

    config = getattr(transformers, config_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    spec = BaseModelSpec.from_hf_config(config)
    assert spec.module_shapes == hf_module_shapes(model)
    assert spec.num_layers == len(model.model.layers) == 3
    assert spec.hidden_size == 48
    assert spec.architecture == model_name


def test_head_dim_is_used_when_present():
    from transformers import MistralConfig

    spec = BaseModelSpec.from_hf_config(MistralConfig(**SMALL, num_key_value_heads=2, head_dim=20,
                                                      sliding_window=None))
    assert spec.module_shapes["q_proj"] == (48, 80)
    assert spec.module_shapes["k_proj"] == (48, 40)
    assert spec.module_shapes["o_proj"] == (80, 48)


def test_unsupported_architecture_refused():
    from transformers import GPT2Config

    message = r"config.model_type='gpt2': unsupported; supported are gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"
    with pytest.raises(ValueError, match=message):
        BaseModelSpec.from_hf_config(GPT2Config())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_layers=0), "BaseModelSpec.num_layers=0: must be >= 1"),
        (dict(module_shapes={"fc1": (4, 4)}), "BaseModelSpec.module_shapes: unknown module 'fc1'"),
        (dict(module_shapes={"q_proj": (4, 0)}), r"BaseModelSpec.module_shapes\['q_proj'\]=\(4, 0\)"),
        (dict(module_shapes={}), "BaseModelSpec.module_shapes: must name at least one module"),
    ],
)
def test_bad_spec_refused(kwargs, message):
    args = dict(num_layers=1, hidden_size=4, module_shapes={"q_proj": (4, 4)}, architecture="Toy") | kwargs
    with pytest.raises(ValueError, match=message):
        BaseModelSpec(**args)
