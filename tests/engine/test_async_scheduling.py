"""Async scheduling (``EngineConfig.async_scheduling``): step N+1 is scheduled and launched
before step N's samples are applied; the tokens equal the sync engine's exactly: greedy and
seeded sampling, rows on two adapters and the base model in one batch, recompute
preemption (a KV cache too small for all), ``n = 2`` forks, EOS and stop strings that end
a sequence one step before the host sees it, and requests that fall back to sync steps
(logprobs, penalties)."""

from __future__ import annotations

import pytest
from tiny_models import make_peft_adapter

from loraplex import LLM, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("async-adapters")
    a = make_peft_adapter(tiny_llama_dir, root / "a", r=4, alpha=8, targets=("q_proj", "v_proj"), seed=3)
    b = make_peft_adapter(tiny_llama_dir, root / "b", r=8, alpha=16, targets=("o_proj", "down_proj"), seed=4)
    return [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))]


def _workload(adapters):
    prompts = [[(7 * i + 3 * k) % 200 + 3 for k in range(5 + 3 * i)] for i in range(10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=12, max_tokens=20, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=13, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25),  # may stop at EOS
        SamplingParams(temperature=0.8, seed=14, max_tokens=5, ignore_eos=True, logprobs=1),  # sync steps
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),  # sync steps
        SamplingParams(temperature=0.7, seed=15, max_tokens=22, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=16, max_tokens=19),
    ]
    loras = [None, adapters[0], adapters[1], adapters[0], None, adapters[1], None, adapters[0], adapters[1], None]
    return prompts, params, loras


def _run(tiny_llama_dir, adapters, *, async_scheduling: bool, num_kv_blocks: int, stop_text: str | None = None):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=96, block_size=4, num_kv_blocks=num_kv_blocks,
              enable_lora=True, max_loras=2, max_lora_rank=8, max_num_batched_tokens=32,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    prompts, params, loras = _workload(adapters)
    if stop_text is not None:
        params[4] = SamplingParams(temperature=0.0, max_tokens=25, stop=[stop_text])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras)
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_used == 0 and not llm.engine.scheduler.num_unfinished
    result = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs]
    return result, stats.num_preemptions, llm.engine.num_overlapped_steps


@pytest.mark.parametrize("num_kv_blocks", [400, 40])
def test_async_tokens_equal_sync(tiny_llama_dir, adapters, num_kv_blocks):
    sync, sync_preempted, sync_overlapped = _run(tiny_llama_dir, adapters, async_scheduling=False,
                                                 num_kv_blocks=num_kv_blocks)
    # a stop string from the middle of the greedy request's text: it stops one step before the host sees it
    text = sync[4][0][1]
    assert len(text) >= 8
    stop = text[6:8]
    sync, _, _ = _run(tiny_llama_dir, adapters, async_scheduling=False, num_kv_blocks=num_kv_blocks, stop_text=stop)
    asyn, async_preempted, overlapped = _run(tiny_llama_dir, adapters, async_scheduling=True,
                                             num_kv_blocks=num_kv_blocks, stop_text=stop)
    assert asyn == sync
    assert sync_overlapped == 0 and overlapped > 10
    assert [len(c[0]) for c in sync[3]] == [12, 12] and len(sync[0][0][0]) == 18
    assert sync[4][0][2:4] == ("stop", stop) and sync[4][0][1] == text[:text.index(stop)]
    if num_kv_blocks == 40:  # 40 blocks x 4 tokens: ten sequences of up to 58 tokens do not fit
        assert sync_preempted > 0 and async_preempted > 0
