"""LoRAMapping: segment grouping of tokens by adapter slot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping, plan_segments


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


def test_fixed_slot_plan_of_the_documented_example():
    """The CUDA-graph form: one segment per slot 0..3, empty ones included, same token order."""
    plan = plan_segments(torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32), num_slots=4)
    assert plan.sorted_token_ids.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert (plan.segment_starts, plan.segment_lens, plan.segment_slots) == ([2, 4, 4, 7], [2, 0, 3, 0], [0, 1, 2, 3])
    with pytest.raises(KernelArgumentError, match="contains 4, expected -1 <= slot < num_slots=4"):
        plan_segments(torch.tensor([4], dtype=torch.int32), num_slots=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-1, max_value=5), max_size=40))
def test_fixed_slot_plan_agrees_with_the_eager_mapping(slots):
    token_slots = torch.tensor(slots, dtype=torch.int32)
    eager = LoRAMapping.from_token_slots(token_slots)
    plan = plan_segments(token_slots, num_slots=6)
    assert plan.sorted_token_ids.tolist() == eager.sorted_token_ids.tolist()
    used = [(s, st, n) for s, st, n in zip(plan.segment_slots, plan.segment_starts, plan.segment_lens) if n]
    assert used == list(zip(eager.segment_slots_host, eager.segment_starts_host, eager.segment_lens_host))
