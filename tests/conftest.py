"""Shared fixtures: tiny random models (HF reference), and the SmolLM2 demo model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads this when first imported (some engine test imports it): kernel
    # tests then run in the CPU interpreter whatever the collection order.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random Llama with GQA (4 query / 2 KV heads), float32, byte-level BPE tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2-style model (q/k/v bias, tied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A random Qwen3 (per-head q/k RMSNorm) with head_dim 32 != hidden / heads."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", head_dim=32)


@pytest.fixture(scope="session")
def tiny_qwen3_window_dir(tmp_path_factory) -> Path:
    """A random Qwen3 whose layer 1 (>= max_window_layers) uses an 8-token sliding window, layer 0 full attention."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-window"), "qwen3", head_dim=32, use_sliding_window=True,
                           sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """A random Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "phi3")


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory) -> Path:
    """A random Gemma 2: layer 0 an 8-token sliding window, layer 1 global; soft-caps small enough to matter;
    query_pre_attn_scalar != head_dim; tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2", head_dim=16, query_pre_attn_scalar=24,
                           sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                           tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """A random Gemma 3 text model: 3 layers, every 3rd global (sliding_window_pattern=3, window 8), per-head q/k
    norms, local/global RoPE (the global one with linear scaling), a final soft-cap."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", num_hidden_layers=3, head_dim=16,
                           query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=3, rope_parameters=rope,
                           final_logit_softcapping=5.0, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory) -> Path:
    """A random Llama with ``attention_bias`` (q/k/v/o biases) and ``mlp_bias``."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-bias"), "llama", attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="session")
def tiny_mistral_window_dir(tmp_path_factory) -> Path:
    """A random Mistral with ``sliding_window=16`` (issue 19's silent fault)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral-window"), "mistral", sliding_window=16)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct folder; CI prepares it, elsewhere the test is skipped if absent."""
    from loraplex.engine.demo_models import default_cache_dir, resolve_model

    cache = os.environ.get("LORAPLEX_CACHE_DIR")
    try:
        return resolve_model("smollm2-135m-instruct", Path(cache) if cache else default_cache_dir())
    except FileNotFoundError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("SmolLM2 demo model not prepared (run `loraplex models prepare smollm2`)")
