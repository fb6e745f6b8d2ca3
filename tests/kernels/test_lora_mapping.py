"""LoRAMapping: segment grouping of tokens by adapter slot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping


def test_documented_example():
    m = LoRAMapping.from_token_slots(torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32))
    assert m.sorted_token_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert m.segment_starts.tolist() == [2, 4] == m.segment_starts_host
    assert m.segment_lens.tolist() == [2, 3] == m.segment_lens_host
    assert m.segment_slots.tolist() == [0, 2] == m.segment_slots_host
    assert (m.num_tokens, m.num_segments, m.max_segment_len, m.has_lora) == (7, 2, 3, True)
    for t in (m.sorted_token_ids, m.segment_starts, m.segment_lens, m.segment_slots):
        assert t.dtype == torch.int32


@pytest.mark.parametrize("slots", [[], [-1, -1, -1]])
def test_no_lora_tokens(slots):
    m = LoRAMapping.from_token_slots(torch.tensor(slots, dtype=torch.int32))
    assert (m.num_tokens, m.num_segments, m.max_segment_len, m.has_lora) == (len(slots), 0, 0, False)
    assert m.segment_slots.numel() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=6), max_size=50))
def test_segments_partition_the_lora_tokens(slots):
    m = LoRAMapping.from_token_slots(torch.tensor(slots, dtype=torch.int32))
    order = m.sorted_token_ids.tolist()
    assert sorted(order) == list(range(len(slots)))
    covered = []
    for start, length, slot in zip(m.segment_starts_host, m.segment_lens_host, m.segment_slots_host, strict=True):
        tokens = order[start : start + length]
        assert tokens == sorted(tokens), "stable: original order kept inside a segment"
        assert all(slots[t] == slot for t in tokens)
        covered += tokens
    assert sorted(covered) == [t for t, s in enumerate(slots) if s >= 0]
    assert m.segment_slots_host == sorted(set(s for s in slots if s >= 0))
    assert m.max_segment_len == max(m.segment_lens_host, default=0)
    assert m.has_lora == any(s >= 0 for s in slots)


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(KernelArgumentError, match="int32"):
        LoRAMapping.from_token_slots(torch.tensor([0, 1], dtype=torch.int64))
    with pytest.raises(KernelArgumentError, match="contains -2"):
        LoRAMapping.from_token_slots(torch.tensor([0, -2], dtype=torch.int32))
