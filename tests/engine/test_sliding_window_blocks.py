"""Issue 19: a model whose every layer uses the same sliding window frees the KV blocks wholly outside the
window (NULL entries stay in the table); exact block ids and reference counts on toy managers, then a tiny
random Mistral (window 16, block size 4) against HF transformers with the blocks counted after every step."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex import LLM, SamplingParams
from loraplex.engine.kv_cache import KVCacheTooSmallError, size_kv_cache
from loraplex.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager, uniform_sliding_window
from loraplex.engine.models.loader import load_model_spec
from tiny_models import hf_greedy_ids
from test_block_pool import make_seq

N = NULL_BLOCK


def _advance(kv: KVCacheManager, seq, num_new_tokens: int) -> None:
    """As a scheduled step does: allocate, then count the tokens computed."""
    assert kv.try_allocate_slots(seq, num_new_tokens)
    seq.num_computed_tokens += num_new_tokens


def test_uniform_window_only_when_every_layer_has_the_same_one():
    assert uniform_sliding_window((16, 16, 16)) == 16
    assert uniform_sliding_window((8, None)) is None  # Gemma 2 style: a global layer keeps every block
    assert uniform_sliding_window((None, None)) is None
    assert uniform_sliding_window((8, 16)) is None


def test_blocks_wholly_before_the_window_are_freed_deepest_first():
    """Window 6, block size 4: once 13 tokens are computed, the next query (position 13) reads positions
    >= 8, so blocks 0 (0-3) and 1 (4-7) go back to the pool; NULL keeps the table's positions."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=6)
    seq = make_seq(list(range(20)))
    _advance(kv, seq, 8)  # prompt chunk: positions 0-7
    assert kv.block_ids(seq) == [0, 1]
    _advance(kv, seq, 4)  # reads from position 8 - 6 + 1 = 3: nothing wholly before it
    assert kv.block_ids(seq) == [0, 1, 2]
    _advance(kv, seq, 1)  # position 12 reads from 7: block 0 freed
    assert kv.block_ids(seq) == [N, 1, 2, 3]
    assert kv.pool.ref_cnt[:4] == [0, 1, 1, 1] and kv.pool.free_queue_order()[-1] == 0
    for _ in range(2):  # positions 13, 14 read from 8, 9: block 1 freed at the first
        _advance(kv, seq, 1)
    assert kv.block_ids(seq) == [N, N, 2, 3]
    assert kv.num_held_blocks(seq) == 2 and kv.pool.stats().used == 2
    assert kv.pool.free_queue_order()[-2:] == [0, 1]
    kv.free(seq)  # NULL entries are skipped: no double free
    assert kv.pool.stats().used == 0 and kv.num_tables() == 0


def test_no_window_frees_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(20)))
    for n in (8, 4, 1, 1, 1):
        _advance(kv, seq, n)
    assert kv.block_ids(seq) == [0, 1, 2, 3] and kv.free_blocks_outside_window(seq) == 0


def test_forked_sequences_free_shared_blocks_by_reference_count():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=6)
    parent = make_seq(list(range(13)), 1)
    _advance(kv, parent, 12)
    _advance(kv, parent, 1)
    assert kv.block_ids(parent) == [N, 1, 2, 3]
    child = make_seq(list(range(13)), 2)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)  # NULL stays NULL, the real blocks get a second reference
    assert kv.block_ids(child) == [N, 1, 2, 3] and kv.pool.ref_cnt[:4] == [0, 2, 2, 2]
    parent.token_ids.append(7)
    _advance(kv, parent, 1)  # position 13 reads from 8: parent drops its reference to block 1 ...
    assert kv.block_ids(parent) == [N, N, 2, 4] and kv.pool.ref_cnt[1] == 1  # ... (and copies shared block 3)
    assert kv.take_pending().copy == [(3, 4)]
    child.token_ids.append(9)
    _advance(kv, child, 1)  # ... and block 1 returns to the pool with the last one
    assert kv.block_ids(child) == [N, N, 2, 3] and kv.pool.ref_cnt[:5] == [0, 0, 2, 1, 1]
    for seq in (parent, child):
        kv.free(seq)
    assert kv.pool.stats().used == 0


def test_swap_out_and_in_keep_the_null_entries():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, num_swap_blocks=4,
                        sliding_window=6)
    seq = make_seq(list(range(14)))
    _advance(kv, seq, 12)
    _advance(kv, seq, 1)
    assert kv.block_ids(seq) == [N, 1, 2, 3]
    assert kv.can_swap_out(seq)
    kv.swap_out(seq)
    assert kv.take_pending().swap_out == [(1, 0), (2, 1), (3, 2)] and kv.pool.stats().used == 0
    assert kv.swap_pool.stats().used == 3
    assert kv.can_swap_in(seq, 1)
    kv.swap_in(seq)
    assert kv.block_ids(seq)[0] == N and kv.num_held_blocks(seq) == 3
    assert kv.take_pending().swap_in == list(zip([0, 1, 2], kv.block_ids(seq)[1:]))
    kv.release(seq)
    assert kv.pool.stats().used == 0 and kv.swap_pool.stats().used == 0


def test_freed_blocks_stay_cached_and_a_later_prefix_hit_revives_them():
    """Prefix caching stays on: a block freed outside the window keeps its hash in the free queue, and a new
    request with the same prompt hits the chain from block 0 (its content is its tokens' KV whatever the
    window), then frees what is outside its own window."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, sliding_window=6)
    first = make_seq(list(range(13)), 1)
    _advance(kv, first, 12)
    kv.cache_full_blocks(first)
    _advance(kv, first, 1)
    assert kv.block_ids(first) == [N, 1, 2, 3] and kv.pool.stats().cached == 1  # block 0, hash kept
    second = make_seq(list(range(13)), 2)
    computed = kv.get_computed_blocks(second)
    assert computed.block_ids == (0, 1, 2) and computed.num_tokens == 12
    assert kv.allocate_new_computed(second, computed, 1)
    assert kv.block_ids(second) == [N, 1, 2, 4]  # block 0 revived, then freed again: outside the window
    assert kv.pool.ref_cnt[:5] == [0, 2, 2, 1, 1]  # blocks 1, 2 shared with the first


def test_cache_sizing_asks_for_the_window_not_max_model_len(tiny_mistral_window_dir):
    spec = load_model_spec(str(tiny_mistral_window_dir))
    assert uniform_sliding_window(spec.layer_windows) == 16
    common = dict(block_size=4, max_model_len=128, max_num_seqs=1, kv_cache_memory_bytes=None,
                  gpu_memory_utilization=0.9)
    sizing = size_kv_cache(spec, torch.float32, torch.device("cpu"), num_kv_blocks=9, sliding_window=16,
                           max_num_batched_tokens=16, **common)  # ceil((15 + 16) / 4) + 1 = 9
    assert sizing.num_blocks == 9
    with pytest.raises(KVCacheTooSmallError, match="sliding_window=16 and max_num_batched_tokens=16 needs 9"):
        size_kv_cache(spec, torch.float32, torch.device("cpu"), num_kv_blocks=8, sliding_window=16,
                      max_num_batched_tokens=16, **common)
    with pytest.raises(KVCacheTooSmallError, match="max_model_len=128 needs 32"):
        size_kv_cache(spec, torch.float32, torch.device("cpu"), num_kv_blocks=9, **common)


PROMPT_LEN, MAX_NEW, WINDOW, BLOCK = 50, 40, 16, 4


@pytest.fixture(scope="module")
def mistral_case(tiny_mistral_window_dir):
    """(model dir, a 50-token prompt, HF's 40 greedy tokens in fp32)."""
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_mistral_window_dir), torch_dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    rng = random.Random(19)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(PROMPT_LEN)]
    return tiny_mistral_window_dir, prompt, hf_greedy_ids(hf, prompt, MAX_NEW)


def _run_counting_blocks(llm: LLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """Greedy generation step by step; the blocks the sequence holds after each step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    engine.add_request("r", prompt, params)
    held, tokens = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for seq in engine.scheduler.running:
            held.append(engine.kv_manager.num_held_blocks(seq))
            assert engine.kv_manager.pool.stats().used == held[-1]  # the only sequence: every used block is its
        for out in outputs:
            if out.finished:
                tokens = out.outputs[0].token_ids
    assert engine.kv_manager.pool.stats().used == 0
    return tokens, held


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mistral_window_holds_only_the_window_and_equals_hf(mistral_case, async_scheduling):
    """Async scheduling: step N + 1 is scheduled (its blocks freed) before step N's output is applied."""
    path, prompt, expected = mistral_case
    llm = LLM(model=str(path), max_model_len=128, block_size=BLOCK, num_kv_blocks=64, device="cpu",
              async_scheduling=async_scheduling)
    assert llm.engine.kv_manager.sliding_window == WINDOW
    tokens, held = _run_counting_blocks(llm, prompt)
    assert tokens == expected
    assert len(held) >= MAX_NEW - 1  # counted while running: every step but the one that finishes it
    if async_scheduling:  # the first count is taken with the 50-token prefill still in flight (13 blocks)
        assert held[0] == -(-PROMPT_LEN // BLOCK)
        held = held[1:]
    assert max(held) <= -(-WINDOW // BLOCK) + 2
    assert max(held) == -(-(WINDOW - 1) // BLOCK) + 1  # after a step: positions c - W + 1 .. c - 1, 5 blocks
    assert -(-(PROMPT_LEN + MAX_NEW) // BLOCK) == 23  # what the sequence would hold without freeing


def test_pool_too_small_for_the_sequence_completes_without_preemption(mistral_case):
    """10 blocks (40 tokens) for a 90-token sequence: chunks of 16 tokens and the window fit, no preemption."""
    path, prompt, expected = mistral_case
    llm = LLM(model=str(path), max_model_len=128, block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=16,
              device="cpu", enable_prefix_caching=True)
    tokens, held = _run_counting_blocks(llm, prompt)
    assert tokens == expected
    assert llm.engine.get_stats().num_preemptions == 0
    assert max(held) <= -(-WINDOW // BLOCK) + 2


def test_mixed_windows_free_nothing(tiny_gemma2_dir):
    """Gemma 2 (an 8-token sliding layer, then a global one): every block is kept."""
    llm = LLM(model=str(tiny_gemma2_dir), max_model_len=128, block_size=BLOCK, num_kv_blocks=64, device="cpu")
    assert llm.engine.kv_manager.sliding_window is None
    engine = llm.engine
    engine.add_request("r", list(range(3, 3 + 30)), SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            table = engine.kv_manager.block_ids(seq)
            assert NULL_BLOCK not in table and len(table) == -(-seq.num_computed_tokens // BLOCK)


def test_forks_and_swap_preemption_with_freed_blocks(mistral_case):
    """n = 2 (the fork shares a table with NULL entries) and a second request in a pool too small for both,
    with host swap space: preempted by swapping (NULL entries stay NULL across it), every row still HF's."""
    path, prompt, expected = mistral_case
    other = [t + 1 for t in prompt[::-1]]
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    expected_other = hf_greedy_ids(hf, other, MAX_NEW)
    llm = LLM(model=str(path), max_model_len=128, block_size=BLOCK, num_kv_blocks=12, max_num_batched_tokens=16,
              swap_space=0.01, device="cpu", enable_prefix_caching=False)
    kv = llm.engine.kv_manager
    swapped_tables = []
    real_swap_out = kv.swap_out

    def swap_out(seq):
        swapped_tables.append(list(kv.block_ids(seq)))
        real_swap_out(seq)

    kv.swap_out = swap_out
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    forked = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, n=2)
    outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": other}], [forked, greedy])
    assert [c.token_ids for c in outs[0].outputs] == [expected, expected]
    assert outs[1].outputs[0].token_ids == expected_other
    assert llm.engine.get_stats().num_preemptions > 0
    assert any(NULL_BLOCK in table for table in swapped_tables)  # swapped with freed entries in its table
    assert llm.engine.kv_manager.pool.stats().used == 0 and llm.engine.kv_manager.swap_pool.stats().used == 0
