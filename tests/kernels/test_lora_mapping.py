"""LoRAMapping: segment grouping of tokens by adapter slot, built by torch ops on the tokens' device."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping, max_tiles, plan_segments


def test_documented_example():
    m = plan_segments(torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32), num_slots=4)
    assert m.sorted_token_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert m.segment_starts.tolist() == [2, 4, 4, 7]
    assert m.segment_lens.tolist() == [2, 0, 3, 0]
    assert m.segment_slots.tolist() == [0, 1, 2, 3]
    assert m.segments_host() == [(0, 2, 2), (2, 4, 3)]
    assert (m.num_tokens, m.num_slots, m.num_segments, m.has_lora) == (7, 4, 4, True)
    for t in (m.sorted_token_ids, m.segment_starts, m.segment_lens, m.segment_slots):
        assert t.dtype == torch.int32
    # work items of 2-token tiles: slot 0 one tile, slot 2 two; W = ceil(7/2) + min(7, 4) = 8
    assert m.tiles(2).tolist() == [[0, 2, 2, 3, 3, 3, 3, 3], [0, 0, 1, 0, 1, 2, 3, 4]]


@pytest.mark.parametrize("slots", [[], [-1, -1, -1]])
def test_no_lora_tokens(slots):
    m = plan_segments(torch.tensor(slots, dtype=torch.int32), num_slots=3)
    assert (m.num_tokens, m.num_segments, m.has_lora) == (len(slots), 3, False)
    assert m.segment_lens.tolist() == [0, 0, 0] and m.segments_host() == []


def test_has_lora_from_the_caller_needs_no_device_read():
    m = plan_segments(torch.tensor([-1, -1], dtype=torch.int32), num_slots=2, has_lora=True)
    assert m.has_lora  # the caller's word (the CUDA-graph runner captures the LoRA variant this way)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=6), max_size=50), st.sampled_from([1, 2, 16]))
def test_segments_partition_the_lora_tokens_and_tiles_cover_them(slots, block_m):
    m = plan_segments(torch.tensor(slots, dtype=torch.int32), num_slots=7)
    order = m.sorted_token_ids.tolist()
    assert sorted(order) == list(range(len(slots)))
    covered = []
    for slot, start, length in m.segments_host():
        tokens = order[start : start + length]
        assert tokens == sorted(tokens), "stable: original order kept inside a segment"
        assert all(slots[t] == slot for t in tokens)
        covered += tokens
    assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0]
    assert [s for s, _, _ in m.segments_host()] == sorted(set(s for s in slots if s >= 0))
    assert m.has_lora == any(s >= 0 for s in slots)
    # work items: exactly one per (segment, block_m-token tile), in order, then idle ones
    tiles = m.tiles(block_m)
    assert tiles.shape == (2, max_tiles(len(slots), 7, block_m))
    lens = m.segment_lens.tolist()
    want = [(g, i) for g, n in enumerate(lens) for i in range(-(-n // block_m))]
    items = list(zip(*tiles.tolist()))
    assert items[: len(want)] == want
    assert all(i * block_m >= lens[g] for g, i in items[len(want):]), "padding items are idle"


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(KernelArgumentError, match="int32"):
        plan_segments(torch.tensor([0, 1], dtype=torch.int64), num_slots=2)
    with pytest.raises(KernelArgumentError, match="contains -2"):
        plan_segments(torch.tensor([0, -2], dtype=torch.int32), num_slots=2)
    with pytest.raises(KernelArgumentError, match="contains 4, expected -1 <= slot < num_slots=4"):
        plan_segments(torch.tensor([4], dtype=torch.int32), num_slots=4)


def test_from_token_slots_defaults_to_the_largest_slot():
    m = LoRAMapping.from_token_slots(torch.tensor([3, -1], dtype=torch.int32))
    assert m.num_slots == 4 and m.segments_host() == [(3, 1, 1)]  # slot -1 sorts first
