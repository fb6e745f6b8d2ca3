"""The Triton kernels at real model shapes on a CUDA GPU (skipped without one).

Llama-2-7B attention: 32 query heads / 32 KV heads / head_dim 128; Llama-3-8B:
32 / 8 / 128; contexts up to 32k; hidden 4096, intermediate 11008 (Llama-2-7B).
On a GPU fp32 -> bf16 casts round to nearest even, so ops that reproduce HF's
roundings are compared bit for bit (rotary, the residual add) or to two ulps
where HF and Triton use different approximate rsqrt/exp instructions.
"""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import assert_close, assert_within_ulps, make_paged_batch, nan_like
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from loraplex.kernels.attention import paged_attention_ref
from loraplex.kernels.attention_decode import paged_decode_attention
from loraplex.kernels.lora_expand import lora_expand_ref
from loraplex.kernels.lora_fused import fused_lora_ref
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import lora_shrink_ref
from loraplex.kernels.ops import Kernels, default_backend
from loraplex.kernels.reshape_and_cache import reshape_and_cache_ref
from loraplex.kernels.rotary import compute_cos_sin_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
MODELS = {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}
HEAD_DIM, BLOCK_SIZE = 128, 16
BF16 = torch.bfloat16


ops = Kernels(default_backend(CUDA))  # the engine's choice for a CUDA device: Triton


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=str)
def test_decode_long_contexts(model, dtype):
    hq, hkv = MODELS[model]
    seq_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 1000, 4096, 8192, 32768]
    batch = make_paged_batch([1] * len(seq_lens), seq_lens, hkv, hq // hkv, HEAD_DIM, BLOCK_SIZE, dtype, CUDA)
    scale = HEAD_DIM**-0.5
    expected = paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    out = ops.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, scale, out=nan_like(batch.query)
    )
    assert_close(out, expected, dtype)
    for splits in (1, 7):
        forced = paged_decode_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.meta,
            scale,
            out=nan_like(batch.query),
            num_splits=splits,
        )
        assert_close(forced, expected, dtype)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=str)
def test_prefill_extend_and_mixed_batch(model, dtype):
    hq, hkv = MODELS[model]
    # Full prefill, chunk after a 3000-token cached prefix, decode rows, lengths around the block size.
    query_lens = [2048, 512, 1, 1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 300]
    seq_lens = [2048, 3512, 32768, 17, BLOCK_SIZE - 1, 2 * BLOCK_SIZE + 1, 300]
    batch = make_paged_batch(
        query_lens, seq_lens, hkv, hq // hkv, HEAD_DIM, BLOCK_SIZE, dtype, CUDA, num_padded_tokens=sum(query_lens) + 5
    )
    scale = HEAD_DIM**-0.5
    expected = paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    out = ops.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, scale, out=nan_like(batch.query)
    )
    assert_close(out, expected, dtype)


def test_reshape_and_cache_real_shape():
    num_tokens, hkv = 4096, 8
    shape = (2048, BLOCK_SIZE, hkv, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, device=CUDA).to(BF16), torch.randn(shape, device=CUDA).to(BF16)
    slots = torch.randperm(2048 * BLOCK_SIZE, device=CUDA)[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, hkv, HEAD_DIM, device=CUDA).to(BF16)
    value = torch.randn_like(key)
    kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, kc_ref, vc_ref, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, kc_ref) and torch.equal(value_cache, vc_ref)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=str)
def test_rms_norm_llama_hidden(dtype):
    x = torch.randn(257, 4096, device=CUDA).to(dtype)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(4096, device=CUDA)).to(dtype)
    hf = LlamaRMSNorm(4096, eps=1e-5).to(device=CUDA, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        out, summed = ops.rms_norm(x, weight, 1e-5, residual)
        assert torch.equal(summed, x + residual)
        # rsqrt is approximate on both sides (<= 2 fp32 ulp): one 16-bit rounding may flip, then the weight product.
        assert_within_ulps(out, hf(x + residual), dtype, 2 if dtype != torch.float32 else 16)


@pytest.mark.parametrize("model", list(MODELS))
def test_rotary_bf16_matches_hf(model):
    hq, hkv = MODELS[model]
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=hq * HEAD_DIM,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=HEAD_DIM,
        max_position_embeddings=32768,
        rope_parameters={**scaling, "rope_theta": 500000.0},
    )
    rope = LlamaRotaryEmbedding(config)
    cache = compute_cos_sin_cache(rope.inv_freq, 32768, rope.attention_scaling, device=CUDA)
    positions = torch.randint(0, 32768, (300,), device=CUDA)
    qkv = torch.randn(300, (hq + 2 * hkv) * HEAD_DIM, device=CUDA).to(BF16)
    query, key = qkv[:, : hq * HEAD_DIM], qkv[:, hq * HEAD_DIM : (hq + hkv) * HEAD_DIM]
    cos, sin = rope.to(CUDA)(query, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(
        query.view(1, 300, hq, HEAD_DIM).transpose(1, 2), key.view(1, 300, hkv, HEAD_DIM).transpose(1, 2), cos, sin
    )
    q_in, k_in = query.float().clone(), key.float().clone()
    ops.rotary_embedding(positions, query, key, cache, HEAD_DIM)
    # The kernel rotates in fp32 and rounds once; HF rounds cos/sin and each product to bf16
    # (seen on an H200: not bit-equal; 1.02 ulp worst vs fp32, from the cos/sin tables at large positions).
    cos32, sin32 = LlamaRotaryEmbedding(config).to(CUDA)(q_in, positions[None])
    q32, k32 = apply_rotary_pos_emb(q_in.view(1, 300, hq, HEAD_DIM).transpose(1, 2),
                                    k_in.view(1, 300, hkv, HEAD_DIM).transpose(1, 2), cos32, sin32)
    for ours, ref32, ref_hf, x in ((query, q32, q_hf, q_in), (key, k32, k_hf, k_in)):
        mag = x.abs().view(300, -1, HEAD_DIM).amax(-1, keepdim=True).expand(-1, -1, HEAD_DIM).reshape(300, -1)
        assert_within_ulps(ours, ref32.transpose(1, 2).reshape(300, -1), BF16, 2, magnitude=mag)
        assert_within_ulps(ours, ref_hf.transpose(1, 2).reshape(300, -1), BF16, 4, magnitude=mag)


def test_silu_and_mul_llama2_intermediate():
    x = (torch.randn(129, 2 * 11008, device=CUDA) * 4).to(BF16)
    gate, up = x.chunk(2, dim=-1)
    # exp differs by <= 2 fp32 ulp between torch and Triton: at most one bf16 rounding of silu flips.
    assert_within_ulps(ops.silu_and_mul(x), ACT2FN["silu"](gate) * up, BF16, 2)


@pytest.mark.parametrize("num_tokens", [32, 4096])
@pytest.mark.parametrize("slices", [[4096, 4096, 4096], [4096, 1024, 1024], [11008, 11008]], ids=str)
def test_lora_sgmv_llama_shapes(num_tokens, slices):
    hidden, rank, slots = 4096, 16, 32
    lora_a = [(torch.randn(slots, rank, hidden, device=CUDA) / hidden**0.5).to(BF16) for _ in slices]
    lora_b = [(torch.randn(slots, w, rank, device=CUDA) / rank**0.5).to(BF16) for w in slices]
    scaling = [torch.rand(slots, device=CUDA) + 0.5 for _ in slices]
    ranks = torch.tensor([rank >> (s % 2) for s in range(slots)], dtype=torch.int32, device=CUDA)
    for s in range(slots):  # mixed ranks: odd slots rank 8, zero-padded
        for a, b in zip(lora_a, lora_b):
            a[s, int(ranks[s]) :] = 0
            b[s, :, int(ranks[s]) :] = 0
    token_slots = torch.randint(0, slots, (num_tokens,), device=CUDA, dtype=torch.int32)
    token_slots[::5] = -1
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(num_tokens, hidden, device=CUDA).to(BF16)
    v = ops.lora_shrink(x, lora_a, mapping, ranks=ranks)
    assert_close(v, lora_shrink_ref(x, lora_a, mapping), BF16)
    y = torch.randn(num_tokens, sum(slices), device=CUDA).to(BF16)
    y_ref = y.clone()
    ops.lora_expand(v, lora_b, scaling, y, mapping, ranks=ranks)
    lora_expand_ref(v, lora_b, scaling, y_ref, mapping)
    assert_close(y, y_ref, BF16, scale=2.0)


@pytest.mark.parametrize("num_tokens", [1, 32, 256])
@pytest.mark.parametrize("slices", [[4096, 4096, 4096], [4096, 1024, 1024], [11008, 11008]], ids=str)
def test_fused_lora_llama_shapes(num_tokens, slices):
    """The one-launch shrink+expand at decode sizes against the float32 reference (v rounded to bf16, as PEFT)."""
    hidden, rank, slots = 4096, 16, 32
    lora_a = [(torch.randn(slots, rank, hidden, device=CUDA) / hidden**0.5).to(BF16) for _ in slices]
    lora_b = [(torch.randn(slots, w, rank, device=CUDA) / rank**0.5).to(BF16) for w in slices]
    scaling = [torch.rand(slots, device=CUDA) + 0.5 for _ in slices]
    token_slots = torch.randint(0, slots, (num_tokens,), device=CUDA, dtype=torch.int32)
    token_slots[1::5] = -1
    mapping = LoRAMapping.from_token_slots(token_slots, slots)
    x = torch.randn(num_tokens, hidden, device=CUDA).to(BF16)
    y = torch.randn(num_tokens, sum(slices), device=CUDA).to(BF16)
    y_ref = y.float()
    ops.fused_lora(x, lora_a, lora_b, scaling, y, mapping)
    fused_lora_ref(x.float(), [a.float() for a in lora_a], [b.float() for b in lora_b], scaling, y_ref, mapping)
    assert_close(y, y_ref, BF16, scale=2.0)
