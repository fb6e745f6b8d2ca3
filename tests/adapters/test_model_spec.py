"""ModelSpec: every field of each supported transformers config class is read, checked or inert;
anything the engine does not implement is refused at load with the field named."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from loraplex.adapters.model_spec import FAMILIES, INERT_FIELDS, ModelSpec, UnsupportedModelError

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


def test_every_supported_family_has_its_config_class_audited():
    assert set(CONFIG_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_config_field_is_read_checked_or_inert(model_type):
    """A field that transformers adds to a config class fails here until it is classified."""
    fields = {f.name for f in dataclasses.fields(getattr(transformers, CONFIG_CLASSES[model_type]))}
    family = FAMILIES[model_type]
    assert fields - family.reads - INERT_FIELDS == set()
    assert family.reads - fields == set()  # no stale names


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_default_config_of_each_family_reads(model_type):
    overrides = dict(sliding_window=None) if model_type == "mistral" else {}  # MistralConfig defaults to 4096
    config = getattr(transformers, CONFIG_CLASSES[model_type])(**SMALL, **overrides)
    spec = ModelSpec.from_hf_config(config)
    assert (spec.model_type, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (model_type, 2, 4, 2)
    # Gemma 2 alternates sliding/global; Gemma 3 has every 6th layer global
    windows = {"gemma2": (4096, None), "gemma3_text": (4096, 4096)}.get(model_type, (None, None))
    assert spec.layer_windows == windows


REFUSED = [
    # (config class, overrides, message naming the field and value)
    ("LlamaConfig", dict(hidden_act="gelu"), r"config.hidden_act='gelu' \(LlamaConfig\): not implemented"),
    ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"config.rope_parameters\['partial_rotary_factor'\]=0.5: partial rotary"),
    ("Phi3Config", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                         "long_factor": [2.0] * 8}, original_max_position_embeddings=64),
     r"config.rope_parameters\['rope_type'\]='longrope': not implemented"),
    ("LlamaConfig", dict(attn_logit_softcapping=50.0),
     r"config.attn_logit_softcapping=50.0: not a field of LlamaConfig"),
    ("LlamaConfig", dict(final_logit_softcapping=30.0),
     r"config.final_logit_softcapping=30.0: not a field of LlamaConfig"),
    ("LlamaConfig", dict(quantization_config={"quant_method": "fp8"}),
     r"config.quantization_config\['quant_method'\]='fp8': this quantization method is not implemented; loraplex "
     r"serves fbgemm_fp8"),
    ("GPT2Config", {}, r"config.model_type='gpt2': unsupported"),
    ("Gemma3Config", {}, r"config.model_type='gemma3': unsupported"),  # the multimodal one
    ("Gemma3TextConfig", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                               "full_attention": {"rope_type": "longrope", "rope_theta": 1e6}}),
     r"config.rope_parameters\['full_attention'\]\['rope_type'\]='longrope': not implemented"),
    ("Gemma2Config", dict(hidden_activation="gelu"), r"config.hidden_activation='gelu' \(Gemma2Config\)"),
    ("Gemma2Config", dict(use_bidirectional_attention=True), r"config.use_bidirectional_attention=True"),
    ("Gemma2Config", dict(attn_logit_softcapping=-1.0), r"config.attn_logit_softcapping=-1.0: expected None"),
]


@pytest.mark.parametrize(("config_name", "overrides", "message"), REFUSED,
                         ids=[f"{c}-{next(iter(o), 'model_type')}" for c, o, _ in REFUSED])
def test_unimplemented_field_is_refused_naming_it(config_name, overrides, message):
    config_cls = getattr(transformers, config_name)
    config = config_cls(**overrides) if config_name in ("GPT2Config", "Gemma3Config") else config_cls(**SMALL, **overrides)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_hf_config(config)


def test_neutral_unknown_attribute_is_accepted():
    """A key HF keeps but that asks for nothing (None/False) is no request to refuse."""
    spec = ModelSpec.from_hf_config(transformers.LlamaConfig(**SMALL, sliding_window=None, use_mrope=False,
                                                             auto_map={"AutoModelForCausalLM": "modeling_x.X"},
                                                             cache_implementation="hybrid"))
    assert spec.layer_windows == (None, None)


def test_sliding_windows_per_layer():
    mistral = ModelSpec.from_hf_config(transformers.MistralConfig(**SMALL, sliding_window=16))
    assert mistral.layer_windows == (16, 16)
    qwen2 = ModelSpec.from_hf_config(transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                                              max_window_layers=1))
    assert qwen2.layer_windows == (None, 8)  # HF: layers >= max_window_layers slide
    off = ModelSpec.from_hf_config(transformers.Qwen3Config(**SMALL, use_sliding_window=False, sliding_window=8))
    assert off.layer_windows == (None, None)
    with pytest.raises(UnsupportedModelError, match=r"config.sliding_window=0: expected a positive number"):
        ModelSpec.from_hf_config(transformers.MistralConfig(**SMALL, sliding_window=0))


def test_gemma2_features_are_read():
    config = transformers.Gemma2Config(**SMALL, head_dim=16, query_pre_attn_scalar=24, hidden_act="gelu_pytorch_tanh")
    spec = ModelSpec.from_hf_config(config)  # Hub configs carry hidden_act too; HF reads hidden_activation
    assert (spec.activation, spec.attn_scale, spec.embed_scale) == ("gelu_pytorch_tanh", 24 ** -0.5, 64 ** 0.5)
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping, spec.gemma_norms) == (50.0, 30.0, True)
    assert spec.layer_windows == (4096, None)  # HF: even layers slide


def test_gemma3_reads_rope_per_layer_type_and_hub_leftovers():
    config = transformers.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window_pattern=2, sliding_window=8,
                                           cache_implementation="hybrid", hidden_act="gelu_pytorch_tanh")
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_rope == ("sliding_attention", "full_attention")
    assert spec.layer_windows == (8, None) and spec.qk_norm and spec.gemma_norms


def test_biases_and_head_dim_are_read():
    spec = ModelSpec.from_hf_config(transformers.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, head_dim=8))
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.head_dim) == (True, True, True, 8)
    assert spec.module_shapes["q_proj"] == (64, 32) and spec.module_shapes["o_proj"] == (32, 64)
    qwen2 = ModelSpec.from_hf_config(transformers.Qwen2Config(**SMALL))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias) == (True, False, False)
