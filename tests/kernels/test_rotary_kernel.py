"""Rotary embedding: cos/sin cache and the in-place op against HF transformers' Llama RoPE."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import assert_within_ulps
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.rotary import compute_cos_sin_cache, rope_inv_freq, rotary_embedding_ref

HEAD_DIM, MAX_POS = 16, 96
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3, "yarn": YARN}


def _hf_rope(head_dim: int, base: float, scaling: dict | None) -> LlamaRotaryEmbedding:
    params = {"rope_type": "default", "rope_theta": base} if scaling is None else {**scaling, "rope_theta": base}
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POS,
        rope_parameters=params,
    )
    return LlamaRotaryEmbedding(config)


def hf_cache(head_dim: int, base: float, scaling: dict | None, device="cpu") -> torch.Tensor:
    """The table as the engine builds it: HF's inverse frequencies and attention scaling."""
    rope = _hf_rope(head_dim, base, scaling)
    return compute_cos_sin_cache(rope.inv_freq, MAX_POS, rope.attention_scaling, device=device)


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim", [16, 128])
def test_cos_sin_cache_is_hf_exactly(name, head_dim):
    base = 500000.0 if name == "llama3" else 10000.0
    cache = hf_cache(head_dim, base, SCALINGS[name])
    assert cache.shape == (MAX_POS, head_dim) and cache.dtype == torch.float32
    cos, sin = _hf_rope(head_dim, base, SCALINGS[name])(torch.zeros(1), torch.arange(MAX_POS)[None])
    half = head_dim // 2
    assert torch.equal(cache[:, :half], cos[0, :, :half])
    assert torch.equal(cache[:, half:], sin[0, :, :half])


def test_llama3_scaling_changes_only_low_frequencies():
    plain = compute_cos_sin_cache(rope_inv_freq(HEAD_DIM, 500000.0), MAX_POS)
    scaled = hf_cache(HEAD_DIM, 500000.0, LLAMA3)
    assert torch.equal(plain[:, 0], scaled[:, 0])  # highest frequency untouched
    assert not torch.equal(plain[:, HEAD_DIM // 2 - 1], scaled[:, HEAD_DIM // 2 - 1])


def _hf_apply(positions, query, key, cache_name: str, head_dim: int):
    base = 500000.0 if cache_name == "llama3" else 10000.0
    cos, sin = _hf_rope(head_dim, base, SCALINGS[cache_name])(query.cpu(), positions.cpu()[None])  # reference on CPU
    t = query.shape[0]
    q = query.cpu().view(1, t, -1, head_dim).transpose(1, 2)
    k = key.cpu().view(1, t, -1, head_dim).transpose(1, 2)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    return q_out.transpose(1, 2).reshape(t, -1), k_out.transpose(1, 2).reshape(t, -1)


def _inputs(num_q_heads: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device):
    t = 6
    positions = torch.tensor([0, 1, 2, 31, 33, MAX_POS - 1])[torch.randperm(t)].to(device)
    # query/key as strided views of a fused qkv output.
    qkv = (torch.randn(t, (num_q_heads + 2 * num_kv_heads) * HEAD_DIM) * 2).to(device=device, dtype=dtype)
    query = qkv[:, : num_q_heads * HEAD_DIM]
    key = qkv[:, num_q_heads * HEAD_DIM : (num_q_heads + num_kv_heads) * HEAD_DIM]
    return positions, qkv, query, key


# fp16 matches HF bit for bit (the kernel rounds like HF); fp32 within an ulp or two of
# the summands (fused multiply-add); bf16 loses up to an ulp per rounding step to the
# interpreter's truncating fp32 -> bf16 cast (on a GPU it is bit-exact, see the gpu tests).
ULPS = {torch.float32: 2, torch.float16: 0, torch.bfloat16: 3}


def _term_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Per output element, |x1| + |x2| of its head: a bound on the rotated summands."""
    heads = x.float().cpu().view(x.shape[0], -1, HEAD_DIM).abs()
    pair = heads[..., : HEAD_DIM // 2] + heads[..., HEAD_DIM // 2 :]
    return torch.cat((pair, pair), dim=-1).view(x.shape[0], -1)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", ["default", "llama3"])
def test_kernel_matches_hf(kernel_device, triton_kernels, scaling, dtype):
    base = 500000.0 if scaling == "llama3" else 10000.0
    cache = hf_cache(HEAD_DIM, base, SCALINGS[scaling], device=kernel_device)
    positions, qkv, query, key = _inputs(3, 1, dtype, kernel_device)
    expected_q, expected_k = _hf_apply(positions, query, key, scaling, HEAD_DIM)
    untouched = qkv[:, 4 * HEAD_DIM :].clone()
    q_mag, k_mag = _term_magnitude(query), _term_magnitude(key)
    triton_kernels.rotary_embedding(positions, query, key, cache, HEAD_DIM)
    interpreted = torch.device(kernel_device).type == "cpu"
    if dtype == torch.float16 and interpreted:
        assert torch.equal(query.cpu(), expected_q) and torch.equal(key.cpu(), expected_k)
    # On a GPU the compiler contracts x1 * cos - x2 * sin into an FMA: fp16 may differ by an ulp.
    ulps = ULPS[dtype] if interpreted else max(ULPS[dtype], 1)
    assert_within_ulps(query, expected_q, dtype, ulps, q_mag)
    assert_within_ulps(key, expected_k, dtype, ulps, k_mag)
    assert torch.equal(qkv[:, 4 * HEAD_DIM :], untouched)  # the value slice is not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_reference_is_hf_exactly(dtype):
    cache = hf_cache(HEAD_DIM, 500000.0, LLAMA3)
    positions, _, query, key = _inputs(4, 2, dtype, torch.device("cpu"))
    expected_q, expected_k = _hf_apply(positions, query, key, "llama3", HEAD_DIM)
    rotary_embedding_ref(positions, query, key, cache, HEAD_DIM)
    assert torch.equal(query, expected_q)
    assert torch.equal(key, expected_k)


def test_bad_arguments_raise_typed_errors():
    cache = compute_cos_sin_cache(rope_inv_freq(HEAD_DIM, 10000.0), MAX_POS)
    positions, _, query, key = _inputs(2, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(KernelArgumentError, match="positions.dtype"):
        rotary_embedding_ref(positions.int(), query, key, cache, HEAD_DIM)
    with pytest.raises(KernelArgumentError, match="head_dim=15"):
        rotary_embedding_ref(positions, query, key, cache, 15)
    with pytest.raises(KernelArgumentError, match="positions span"):
        rotary_embedding_ref(positions + MAX_POS, query, key, cache, HEAD_DIM)
    with pytest.raises(KernelArgumentError, match="head_dim=15"):
        rope_inv_freq(15, 10000.0)
    with pytest.raises(KernelArgumentError, match="inv_freq.dtype"):
        compute_cos_sin_cache(rope_inv_freq(HEAD_DIM, 10000.0).double(), MAX_POS)
