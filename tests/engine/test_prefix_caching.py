"""Prefix caching in the engine: identical outputs with and without it, no
sharing across adapters or adapter versions, n > 1 copy-on-write without leaks."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from loraplex import LLM, LoRARequest, SamplingParams
from tiny_models import make_peft_adapter

SYSTEM = list(range(40, 80))  # 40 shared tokens = 10 blocks of 4


def make_llm(path, caching: bool, **kw) -> LLM:
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=256, enable_lora=True,
               max_lora_rank=8, max_loras=2, enable_prefix_caching=caching, **kw)


@pytest.fixture(scope="module")
def lora_a(tiny_llama_dir, tmp_path_factory) -> LoRARequest:
    path = make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("pa") / "a", r=8, seed=1)
    return LoRARequest("a", 1, str(path))


def workload(lora):
    prompts, params, loras = [], [], []
    for i in range(8):
        prompts.append({"prompt_token_ids": SYSTEM + [100 + i, 101 + i, 7]})
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10, ignore_eos=True))
        loras.append(lora if i % 3 == 0 else None)
    return prompts, params, loras


def test_outputs_identical_with_and_without_prefix_caching(tiny_llama_dir, lora_a):
    prompts, params, loras = workload(lora_a)
    cold = make_llm(tiny_llama_dir, caching=False)
    warm = make_llm(tiny_llama_dir, caching=True)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params, loras)]
    first = [o.outputs[0].token_ids for o in warm.generate(prompts, params, loras)]
    second_outs = warm.generate(prompts, params, loras)
    assert first == expected
    assert [o.outputs[0].token_ids for o in second_outs] == expected
    assert all(o.num_cached_tokens >= 40 for o in second_outs)
    stats = warm.engine.get_stats()
    assert stats.prefix_hits_tokens > 0 and 0 < stats.prefix_hit_rate < 1
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0


def test_same_prompt_other_adapter_shares_no_block(tiny_llama_dir, lora_a):
    llm = make_llm(tiny_llama_dir, caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": SYSTEM + [1]}, params)  # base model caches the prefix
    out = llm.generate({"prompt_token_ids": SYSTEM + [1]}, params, lora_request=lora_a)[0]
    assert out.num_cached_tokens == 0
    again = llm.generate({"prompt_token_ids": SYSTEM + [1]}, params, lora_request=lora_a)[0]
    assert again.num_cached_tokens == 40


def test_tenants_never_share_cached_blocks(tiny_llama_dir, lora_a):
    """The tenant salts the prefix cache (a timing side channel otherwise: a hit shows that another
    tenant sent the same prompt); one tenant's requests share, also with the same adapter."""
    from loraplex.engine.fairness import TenantShare

    llm = make_llm(tiny_llama_dir, caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = SYSTEM + [1]
    cached = {}
    for step, (tenant, lora) in enumerate([("acme", None), ("globex", None), ("acme", None), ("acme", lora_a),
                                           ("globex", lora_a), ("globex", lora_a)]):
        llm.engine.add_request(f"r{step}", prompt, params, lora_request=lora, tenant=TenantShare(tenant))
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    cached[step] = out.num_cached_tokens
    assert cached == {0: 0, 1: 0, 2: 40, 3: 0, 4: 0, 5: 40}


def test_new_adapter_version_shares_nothing_and_equals_cold_run(tiny_llama_dir, lora_a, tmp_path):
    v2_dir = tmp_path / "a-v2"
    shutil.copytree(lora_a.lora_path, v2_dir)
    weights = load_file(str(v2_dir / "adapter_model.safetensors"))
    weights = {k: (v * 1.5 if "lora_B" in k else v) for k, v in weights.items()}
    save_file(weights, str(v2_dir / "adapter_model.safetensors"))
    v2 = LoRARequest("a", 2, str(v2_dir))  # same name, new version = new int id
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": SYSTEM + [3, 4]}
    llm = make_llm(tiny_llama_dir, caching=True)
    llm.generate(prompt, params, lora_request=lora_a)
    out = llm.generate(prompt, params, lora_request=v2)[0]
    assert out.num_cached_tokens == 0
    cold = make_llm(tiny_llama_dir, caching=False).generate(prompt, params, lora_request=v2)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.engine.lora_pool.version_id(1) != llm.engine.lora_pool.version_id(2)


def test_n4_shares_prompt_blocks_copy_on_write_no_leak(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, caching=True)
    engine = llm.engine
    prompt = SYSTEM + [9, 9]  # 42 tokens: 10 full blocks + a partial block shared after the fork
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    engine.step()  # prefill + fork
    seqs = engine.groups["n4"].seqs
    table = engine.kv_manager.block_ids
    assert all(table(s)[:10] == table(seqs[0])[:10] for s in seqs)
    assert engine.kv_manager.pool.ref_cnt[table(seqs[0])[0]] == 4
    engine.step()  # each child writes into the shared partial block: copy-on-write
    last_blocks = {table(s)[10] for s in seqs}
    assert len(last_blocks) == 4
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    cold = make_llm(tiny_llama_dir, caching=False)
    ref = cold.generate({"prompt_token_ids": prompt},
                        SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))[0]
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in ref.outputs]
    assert engine.get_stats().kv_blocks_used == 0


def test_prefix_cache_counters_count_each_admission_once(tiny_llama_dir):
    """Issue 14 ("Also in this issue"): a request that waits for KV blocks is looked up every step
    but counted once. 16 blocks of 4 tokens; greedy prompts of 40 and 32 tokens, the second sharing
    the first's 28-token prefix (7 full blocks) and arriving when the first holds every block."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    prefix = list(range(200, 228))
    first_prompt, second_prompt = prefix + list(range(300, 312)), prefix + list(range(330, 334))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=16))
    engine.add_request("first", first_prompt, params)
    for _ in range(21):
        engine.step()
    engine.add_request("second", second_prompt, params)
    outputs, waited = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        waited += engine.get_stats().num_waiting
    assert waited == 3  # looked up on 4 steps, admitted on the 4th
    stats = engine.get_stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (72, 28)
    assert stats.prefix_hit_rate == pytest.approx(28 / 72)  # 38.9%, the most this prefix allows
    assert outputs["second"].num_cached_tokens == 28
    cold = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64,
               enable_prefix_caching=False)
    expected = cold.generate({"prompt_token_ids": second_prompt}, params)[0].outputs[0].token_ids
    assert outputs["second"].outputs[0].token_ids == expected
