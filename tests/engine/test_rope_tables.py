"""The engine's RoPE table equals HF's rotary embedding for every supported rope type and family."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from loraplex.adapters.model_spec import ROPE_TYPES, ModelSpec
from loraplex.engine.models.llama import rope_cos_sin_cache

MAX_POS = 64
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


def hf_cos_sin(config, family: str, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rope = getattr(module, f"{prefix}RotaryEmbedding")(config)
    cos, sin = rope(torch.zeros(1), torch.arange(MAX_POS)[None])
    return cos[0], sin[0]


def test_every_supported_rope_type_is_tested():
    assert set(ROPES) == set(ROPE_TYPES)


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_llama_rope_table_is_hf_exactly(rope_type):
    config = transformers.LlamaConfig(**SMALL, rope_parameters=dict(ROPES[rope_type]))
    cache = rope_cos_sin_cache(ModelSpec.from_hf_config(config))
    cos, sin = hf_cos_sin(config, "llama", "Llama")
    half = cache.shape[1] // 2
    assert torch.equal(cache[:, :half], cos[:, :half]) and torch.equal(cache[:, half:], sin[:, :half])


@pytest.mark.parametrize("global_rope", ["default", "linear", "yarn"])
def test_gemma3_rope_tables_per_layer_type_are_hf_exactly(global_rope):
    params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": dict(ROPES[global_rope], rope_theta=1000000.0)}
    config = transformers.Gemma3TextConfig(**(SMALL | {"num_hidden_layers": 2}), head_dim=16, rope_parameters=params,
                                           sliding_window_pattern=2)  # layer 0 sliding, layer 1 full
    spec = ModelSpec.from_hf_config(config)
    module = importlib.import_module("transformers.models.gemma3.modeling_gemma3")
    rope = module.Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        cache = rope_cos_sin_cache(spec, layer_type)
        cos, sin = rope(torch.zeros(1), torch.arange(MAX_POS)[None], layer_type)
        assert torch.equal(cache[:, :8], cos[0, :, :8]) and torch.equal(cache[:, 8:], sin[0, :, :8])


@pytest.mark.parametrize(("family", "config_name", "prefix"), [
    ("mistral", "MistralConfig", "Mistral"), ("qwen2", "Qwen2Config", "Qwen2"), ("qwen3", "Qwen3Config", "Qwen3"),
    ("phi3", "Phi3Config", "Phi3"), ("gemma2", "Gemma2Config", "Gemma2")])
def test_family_rope_table_is_hf_exactly(family, config_name, prefix):
    extra = {"sliding_window": None} if family == "mistral" else {"head_dim": 16} if family == "gemma2" else {}
    config = getattr(transformers, config_name)(**SMALL, **extra, rope_parameters=dict(ROPES["yarn"]) | (
        {"rope_type": "default"} if family == "phi3" else {}))
    cache = rope_cos_sin_cache(ModelSpec.from_hf_config(config))
    cos, sin = hf_cos_sin(config, family, prefix)
    half = cache.shape[1] // 2
    assert torch.equal(cache[:, :half], cos[:, :half]) and torch.equal(cache[:, half:], sin[:, :half])
