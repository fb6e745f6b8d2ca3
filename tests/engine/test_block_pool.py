"""Block pool and KV cache manager: exact block ids, reference counts,
eviction order, and random operation sequences that never leak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.block_pool import BlockPool, NoFreeBlocksError
from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import RequestGroup, Sequence


def make_seq(tokens: list[int], seq_id: int = 1, lora_version: str | None = None) -> Sequence:
    lora = LoRARequest("a", 1, "/x") if lora_version else None
    group = RequestGroup(f"r{seq_id}", None, list(tokens), SamplingParams(), lora, lora_version)
    seq = Sequence(seq_id, group, 0, list(tokens), len(tokens), None, None)
    group.seqs.append(seq)
    return seq


def take_prefix(kv: KVCacheManager, seq: Sequence) -> int:
    """Admit ``seq`` with its cached prefix and nothing more (as the scheduler's commit); the hit tokens."""
    computed = kv.get_computed_blocks(seq)
    assert kv.allocate_new_computed(seq, computed, 0)
    return computed.num_tokens


def test_allocate_takes_lowest_then_lru_order():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    pool.free(2)
    pool.free(0)
    assert pool.free_queue_order() == [2, 0]
    assert pool.allocate() == 2


def test_double_free_raises():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)


def test_prefix_sharing_exact_blocks_and_eviction_order():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_seq(prefix + [1, 2], seq_id=1)
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    assert kv.block_ids(a) == [0, 1, 2, 3]
    b = make_seq(prefix + [7, 8, 9], seq_id=2)
    assert take_prefix(kv, b) == 12
    assert kv.block_ids(b) == [0, 1, 2]
    assert [kv.pool.ref_cnt[i] for i in range(4)] == [2, 2, 2, 1]
    kv.allocate_slots(b, b.num_tokens - b.num_computed_tokens)
    assert kv.block_ids(b) == [0, 1, 2, 4]
    kv.free(a)
    kv.free(b)
    # a frees only its private block 3 (0-2 are still held by b); b frees deepest first.
    assert kv.pool.free_queue_order()[-5:] == [3, 4, 2, 1, 0]
    assert kv.pool.stats().cached == 3
    # New work takes never-used blocks first, then evicts oldest-freed, deepest first.
    c = make_seq(list(range(500, 524)), seq_id=3)
    kv.allocate_slots(c, c.num_tokens)
    assert kv.block_ids(c) == [5, 6, 7, 8, 9, 3]
    assert kv.pool.lookup(kv.pool.block_hash(2)) == 2


def test_same_tokens_other_adapter_share_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(9))
    a = make_seq(tokens, 1, lora_version="v1")
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    assert take_prefix(kv, make_seq(tokens, 2, lora_version="v2")) == 0
    assert take_prefix(kv, make_seq(tokens, 3, lora_version=None)) == 0
    assert take_prefix(kv, make_seq(tokens, 4, lora_version="v1")) == 8


def test_fork_then_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(6)), 1)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_seq(list(range(6)), 2)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent) == [0, 1]
    assert kv.pool.ref_cnt[:2] == [2, 2]
    parent.token_ids.append(50)
    assert kv.num_blocks_needed(parent, 1) == 1  # the copy of shared block 1
    kv.allocate_slots(parent, 1)
    assert kv.block_ids(parent) == [0, 2]
    assert kv.take_pending().copy == [(1, 2)]
    child.token_ids.append(60)
    kv.allocate_slots(child, 1)  # now sole owner of block 1: writes in place
    assert kv.block_ids(child) == [0, 1]
    assert not kv.take_pending()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 7),
                          st.integers(1, 9)), max_size=60))
def test_random_operations_never_leak(ops):
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    live: list[Sequence] = []
    next_id = 0
    for op, pick, n in ops:
        if op == "new" or not live:
            next_id += 1
            seq = make_seq([pick % 3] * n, next_id)
            computed = kv.get_computed_blocks(seq)
            before = (list(kv.pool.ref_cnt), kv.pool.free_queue_order(), kv.prefix_stats.queries_tokens)
            if kv.allocate_new_computed(seq, computed, seq.num_tokens - computed.num_tokens):
                seq.num_computed_tokens = seq.num_tokens
                kv.cache_full_blocks(seq)
                live.append(seq)
            else:  # a failed admission changes nothing (it is retried next step)
                assert (list(kv.pool.ref_cnt), kv.pool.free_queue_order(), kv.prefix_stats.queries_tokens) == before
                assert kv.block_ids(seq) == [] and seq.num_computed_tokens == 0
        elif op == "append":
            seq = live[pick % len(live)]
            seq.token_ids.extend([pick] * n)
            if kv.can_allocate(seq, n):
                kv.allocate_slots(seq, n)
                seq.num_computed_tokens += n
                kv.cache_full_blocks(seq)
            else:
                del seq.token_ids[-n:]
        elif op == "fork":
            parent = live[pick % len(live)]
            next_id += 1
            child = make_seq(list(parent.token_ids), next_id)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent, child)
            live.append(child)
        else:
            kv.free(live.pop(pick % len(live)))
        kv.take_pending()
        _check_invariants(kv, live)
    for seq in live:
        kv.free(seq)
    assert kv.pool.num_free_blocks == 24
    assert all(r == 0 for r in kv.pool.ref_cnt)


def _check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    counts = [0] * kv.pool.num_blocks
    for seq in live:
        assert len(kv.block_ids(seq)) == kv.blocks_for(seq.num_computed_tokens)
        for b in kv.block_ids(seq):
            counts[b] += 1
    assert counts == kv.pool.ref_cnt
    free = set(kv.pool.free_queue_order())
    assert all((counts[b] == 0) == (b in free) for b in range(kv.pool.num_blocks))
