"""Tensor parallelism on CPU: TP=2 (this process as the driver + one spawned worker, gloo) against
TP=1, token for token in float32 with mixed adapters; the sharding rules against the whole
tensors; refusals of what cannot be split."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.model_spec import ModelSpec
from loraplex.adapters.slot_image import slot_image_from_adapter
from loraplex.adapters.peft_format import load_peft_adapter
from loraplex.engine.models.loader import load_model_spec
from loraplex.engine.tensor_parallel import TensorShard, UnsupportedParallelismError, shard_spec
from tiny_models import make_peft_adapter

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("tp-adapters")
    specs = [(8, ALL_MODULES), (4, ("q_proj", "v_proj", "down_proj")), (8, ("o_proj", "gate_proj", "up_proj"))]
    return [LoRARequest(f"tp{i}", i + 1, str(make_peft_adapter(tiny_llama_dir, root / f"a{i}", r=r, targets=t,
                                                                  seed=10 + i)))
            for i, (r, t) in enumerate(specs)]


def _generate(path, adapters, tensor_parallel_size: int):
    # 3 adapters over 2 slots (slots are rewritten mid-run, on every rank), base rows mixed in,
    # prompts chunked over several steps (32-token budget), then decode.
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 300 + 5 for j in range(9 + 5 * i)]} for i in range(8)]
    loras = [None if i % 4 == 3 else adapters[i % 3] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, tensor_parallel_size=tensor_parallel_size)
    try:
        outs = llm.generate(prompts, params, loras)
        stats = llm.engine.lora_pool.stats()
    finally:
        llm.engine.close()
    return outs, stats


def test_tp2_equals_tp1_token_for_token_with_mixed_adapters(tiny_llama_dir, adapters):
    ref, ref_stats = _generate(tiny_llama_dir, adapters, 1)
    tp, tp_stats = _generate(tiny_llama_dir, adapters, 2)
    assert not multiprocessing.active_children()  # the worker has left
    assert tp_stats.slot_evictions == ref_stats.slot_evictions > 0  # slots were rewritten during the run
    for r, t in zip(ref, tp):
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        ids = r.outputs[0].token_ids
        ref_lp = [step[token] for step, token in zip(r.outputs[0].logprobs, ids)]
        tp_lp = [step[token] for step, token in zip(t.outputs[0].logprobs, ids)]
        assert torch.allclose(torch.tensor(tp_lp), torch.tensor(ref_lp), atol=1e-4)
    # the adapters matter: the same prompt differs under each adapter (so a rank ignoring LoRA would show)
    assert len({tuple(o.outputs[0].token_ids) for o in ref[:3]}) == 3


def test_size_not_dividing_kv_heads_is_refused_before_any_process_starts(tiny_llama_dir):
    with pytest.raises(UnsupportedParallelismError,
                       match="tensor_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4, num_kv_blocks=16)
    assert not multiprocessing.active_children()


def test_cuda_all_reduce_on_cpu_is_refused(tiny_llama_dir):
    with pytest.raises(UnsupportedParallelismError, match="tensor_parallel_all_reduce='nccl' needs CUDA devices"):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, tensor_parallel_all_reduce="nccl",
            num_kv_blocks=16)
    assert not multiprocessing.active_children()


def _spec(path) -> ModelSpec:
    return load_model_spec(path)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused-phi3"])
def test_weight_shards_put_together_give_the_whole_layer(tiny_llama_dir, tiny_phi3_dir, fused):
    spec = _spec(tiny_phi3_dir if fused else tiny_llama_dir)
    shards = [TensorShard(r, 2, spec) for r in range(2)]
    q, kv, i = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    qkv = torch.randn(q + 2 * kv, spec.hidden_size)
    parts = [s.shard_tensor("layers.0.self_attn.qkv_proj.weight", qkv, whole=True) for s in shards]
    # rank r: heads r*Hq/2.. of q, KV heads r*Hkv/2.. of k and v
    for r, part in enumerate(parts):
        q_r, k_r, v_r = part.split([q // 2, kv // 2, kv // 2])
        assert torch.equal(q_r, qkv[r * q // 2:(r + 1) * q // 2])
        assert torch.equal(k_r, qkv[q + r * kv // 2:q + (r + 1) * kv // 2])
        assert torch.equal(v_r, qkv[q + kv + r * kv // 2:q + kv + (r + 1) * kv // 2])
    down = torch.randn(spec.hidden_size, i)
    x = torch.randn(3, i)
    partial = [x.chunk(2, dim=1)[r] @ s.shard_tensor("layers.1.mlp.down_proj.weight", down, whole=True).T
               for r, s in enumerate(shards)]
    assert torch.allclose(partial[0] + partial[1], x @ down.T, atol=1e-5)
    assert shards[1].full_shape("layers.1.mlp.down_proj.weight", torch.Size([spec.hidden_size, i // 2])) == \
        (spec.hidden_size, i)
    norm = torch.randn(spec.hidden_size)
    assert shards[1].shard_tensor("layers.0.input_layernorm.weight", norm, whole=True) is norm


def test_lora_shards_give_the_whole_delta(tiny_llama_dir, adapters):
    """Column-parallel: each rank's delta rows (full A, B rows) are the whole delta's rows; row-parallel:
    the ranks' partial deltas (A columns, full B) add up to the whole delta."""
    spec = _spec(tiny_llama_dir)
    adapter = load_peft_adapter(adapters[0].lora_path, spec.adapter_spec, 8)
    image = slot_image_from_adapter(adapter, spec.adapter_spec, 8, torch.float32, pin_memory=False)
    local = shard_spec(spec, 2).adapter_spec.module_shapes
    images = [TensorShard(r, 2, spec).shard_slot_image(image, local) for r in range(2)]
    x_h = torch.randn(5, spec.hidden_size)
    key = (1, "k_proj")
    whole = (x_h @ image.a(key).T) @ image.b(key).T
    assert torch.allclose(torch.cat([(x_h @ im.a(key).T) @ im.b(key).T for im in images], dim=1), whole, atol=1e-5)
    key = (0, "o_proj")
    x_o = torch.randn(5, spec.num_heads * spec.head_dim)
    whole = (x_o @ image.a(key).T) @ image.b(key).T
    partial = [(x_o.chunk(2, dim=1)[r] @ im.a(key).T) @ im.b(key).T for r, im in enumerate(images)]
    assert torch.allclose(partial[0] + partial[1], whole, atol=1e-5)
    assert images[0].module_shapes["o_proj"] == (spec.num_heads * spec.head_dim // 2, spec.hidden_size)
