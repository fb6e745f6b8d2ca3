"""Continuous batching: chunked prefill, batch invariance, preemption (recompute
and swap), n > 1 forks, bad requests that leave the engine serving."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.engine.llm_engine import InvalidRequestError, PromptTooLongError
from loraplex.engine.kv_cache import KVCacheTooSmallError


def random_prompts(tokenizer_dir, count: int, seed: int = 0, max_len: int = 60) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    return [[rng.choice(vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_batch_invariance_with_chunked_prefill(tiny_llama_dir):
    prompts = random_prompts(tiny_llama_dir, 24)
    solo_llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=512)
    solo = [run(solo_llm, [p], GREEDY)[0] for p in prompts]
    # 16-token budget: prompts up to 60 tokens are split into chunks while others decode.
    batched_llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=512,
                      max_num_batched_tokens=16, max_num_seqs=8)
    assert run(batched_llm, prompts, GREEDY) == solo


@pytest.mark.parametrize("swap_space", [0.0, 0.01])
def test_preemption_gives_identical_outputs(tiny_llama_dir, swap_space):
    prompts = random_prompts(tiny_llama_dir, 12, seed=1, max_len=40)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)] + \
             [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 6
    big = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=400)
    expected = run(big, prompts, params)
    # 16 blocks x 4 tokens: one 60-token sequence fits, twelve do not.
    small = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=16,
                swap_space=swap_space, enable_prefix_caching=False)
    assert run(small, prompts, params) == expected
    assert small.engine.get_stats().num_preemptions > 0
    assert small.engine.get_stats().kv_blocks_used == 0


def test_n_greater_than_one_shares_prompt_blocks(tiny_llama_dir):
    prompt = random_prompts(tiny_llama_dir, 1, seed=3, max_len=30)[0]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Completion i equals a solo request with seed 7 + i.
    for c in out.outputs:
        solo = llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=1.0, seed=7 + c.index, max_tokens=8, ignore_eos=True))[0]
        assert solo.outputs[0].token_ids == c.token_ids
    assert llm.engine.get_stats().kv_blocks_used == 0


def test_too_long_prompt_rejected_engine_keeps_serving(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=32, block_size=4, num_kv_blocks=64)
    good = random_prompts(tiny_llama_dir, 2, seed=4, max_len=10)
    llm.engine.add_request("ok-1", good[0], GREEDY)
    with pytest.raises(PromptTooLongError, match="maximum context length is 32 tokens"):
        llm.engine.add_request("too-long", list(range(5, 45)), GREEDY)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.add_request("bad-token", [10**7], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.engine.add_request("empty", [], GREEDY)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"ok-1"}
    assert len(done["ok-1"].outputs[0].token_ids) == 12
    assert llm.generate({"prompt_token_ids": good[1]}, GREEDY)[0].outputs[0].finish_reason == "length"


def test_kv_cache_too_small_names_numbers(tiny_llama_dir):
    with pytest.raises(KVCacheTooSmallError, match=r"max_model_len=256 needs 64 blocks"):
        LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=10)


def test_abort_frees_blocks(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64)
    llm.engine.add_request("a", list(range(5, 25)), GREEDY)
    llm.engine.step()
    assert llm.engine.get_stats().kv_blocks_used > 0
    llm.engine.abort_request("a")
    assert llm.engine.get_stats().kv_blocks_used == 0
    assert not llm.engine.has_unfinished_requests()


def test_throughput_gauge_drops_to_zero_when_idle(monkeypatch):
    from loraplex.engine import llm_engine

    clock = [100.0]
    monkeypatch.setattr(llm_engine.time, "monotonic", lambda: clock[0])
    gauge = llm_engine._Throughput(window_s=10.0)
    for _ in range(3):
        gauge.add(50)
        clock[0] += 1.0
    assert gauge.rate() == pytest.approx(100 / 2.0)  # 2 steps of 50 tokens after the first, over 2 s
    clock[0] += 11.0
    assert gauge.rate() == 0.0
