"""``RequestOutput.num_cached_tokens`` and the engine's prefix-cache stats count prompt tokens served from the
prefix cache at a request's admission: a recompute preemption's re-admission (which may hit the sequence's own
prompt and output blocks) changes neither, so the cached tokens never exceed the prompt."""

from __future__ import annotations

from loraplex import LLM, SamplingParams


def test_num_cached_tokens_not_inflated_by_a_recompute_preemption(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=48, block_size=4, num_kv_blocks=14,
              enable_prefix_caching=True)
    engine = llm.engine
    prompts = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [20, 21, 22, 23, 24, 25]}
    for rid, prompt in prompts.items():  # cold prompts: nothing cached at admission
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    # the two cold prompts' lookups only: no hit, their prompt tokens queried
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (sum(map(len, prompts.values())), 0)
    for rid, prompt in prompts.items():
        assert 0 <= final[rid].num_cached_tokens <= len(prompt)
        assert final[rid].num_cached_tokens == 0  # nothing was cached when each was admitted
