"""Adapter slots on CPU for adapters on embed_tokens / lm_head: the vocab-sized slot tensors, and the bounded
full-module slots of modules_to_save copies (exact slot ids, evictions, refusals naming the setting)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.adapters import LoRASlotPool, NoFreeSlotError
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.errors import AdapterUnsupportedError
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import load_peft_adapter


def make_pool(spec, max_full_module_slots, weights=None):
    config = LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=4, background_loads=False,
                        max_full_module_slots=max_full_module_slots)
    return LoRASlotPool(spec, config=config, weights=weights)


@pytest.fixture
def folders(peft_adapter):
    return {
        "head": peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], seed=1)[0],
        "embed": peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["embed_tokens"],
                              seed=2)[0],
        "plain": peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"], seed=3)[0],
        "vocab_lora": peft_adapter(r=4, lora_alpha=8, target_modules=["lm_head", "embed_tokens"], seed=4)[0],
    }


def request(folders, name, int_id):
    return LoRARequest(name, int_id, str(folders[name]))


def test_full_module_slots_are_given_taken_and_freed(spec, folders):
    pool = make_pool(spec, max_full_module_slots=1)
    head, embed, plain = (request(folders, n, i) for i, n in enumerate(("head", "embed", "plain"), start=1))
    for r in (head, embed, plain):
        pool.add_lora(r)
    weights = pool.weights
    assert pool.pin(1) == 0
    assert weights.full_index_host == [[-1, -1, -1], [0, -1, -1]]
    copy = load_peft_adapter(folders["head"], spec, 8).vocab.full["lm_head"]
    assert torch.equal(weights.full[0], copy) and weights.full_index[1].tolist() == [0, -1, -1]
    # The one full-module slot is pinned: the embed copy waits; a plain adapter does not.
    assert not pool.full_modules_fit(2) and not pool.can_pin(2) and pool.can_pin(3)
    with pytest.raises(NoFreeSlotError, match=r"needs 1 of the max_full_module_slots=1 full-module slots"):
        pool.pin(2)
    assert pool.pin(3) == 1
    pool.unpin(1)
    assert pool.full_modules_fit(2) and pool.can_pin(2)
    assert pool.pin(2) == 2  # the lowest free adapter slot; the head copy's adapter is evicted for its full slot
    stats = pool.stats()
    assert [s.lora_name for s in stats.slots] == [None, "plain", "embed"] and stats.slot_evictions == 1
    assert weights.full_index_host == [[-1, -1, 0], [-1, -1, -1]]
    assert weights.full_index.tolist() == [[-1, -1, 0], [-1, -1, -1]]
    # Removing a pinned adapter frees its full slot at its last unpin.
    assert pool.remove_lora(2) and weights.full_index_host[0][2] == 0
    pool.unpin(2)
    assert weights.full_index_host == [[-1, -1, -1], [-1, -1, -1]] and pool.full_modules_fit(1)
    assert pool.pin(1) == 0 and weights.full_index_host[1] == [0, -1, -1]


def test_vocab_slot_tensors_and_their_memory(spec, folders):
    pool = make_pool(spec, max_full_module_slots=2)
    pool.add_lora(request(folders, "vocab_lora", 1))
    slot = pool.pin(1)
    adapter = load_peft_adapter(folders["vocab_lora"], spec, 8)
    weights, (V, H, S, R) = pool.weights, (spec.vocab_size, spec.hidden_size, 3, 8)
    assert torch.equal(weights.embed_a_t[slot, :, :4], adapter.vocab.embed.a.T)
    assert torch.equal(weights.head_b[slot, :, :4], adapter.vocab.head.b) and not weights.head_b[slot, :, 4:].any()
    assert weights.vocab_scaling[:, slot].tolist() == [2.0, 2.0]
    assert weights.vocab_lora_host == [[True, False, False], [True, False, False]] and slot == 0
    base = LoRADeviceWeights(dataclasses.replace(spec, vocab_size=None), S, R, torch.float32, "cpu").memory_bytes()
    vocab = 4 * (S * V * R + S * H * R + S * R * H + S * V * R + 2 * S + 2 * V * H) + 8 * 2 * S
    assert pool.stats().slot_memory_bytes == base + vocab
    pool.unpin(1)
    pool.remove_lora(1)
    assert weights.vocab_scaling[:, slot].tolist() == [0.0, 0.0]
    assert weights.vocab_lora_host == [[False] * 3, [False] * 3]


@pytest.mark.parametrize("declared", [False, True], ids=["hashed", "declared-version-id"])
def test_refusals_name_the_setting(spec, folders, declared):
    version = {"version_id": "0" * 64} if declared else {}
    pool = make_pool(spec, max_full_module_slots=0)
    with pytest.raises(AdapterUnsupportedError, match=r"modules_to_save=\['lm_head'\] needs 1 full-module slot\(s\) "
                                                      r"but max_full_module_slots=0.*raise --max-full-module-slots"):
        pool.add_lora(LoRARequest("head", 1, str(folders["head"]), **version))
    # Slots without vocab tensors (tensor parallelism's) refuse LoRA on embed_tokens / lm_head.
    no_vocab = LoRADeviceWeights(dataclasses.replace(spec, vocab_size=None), 3, 8, torch.float32, "cpu")
    pool = make_pool(spec, max_full_module_slots=0, weights=no_vocab)
    with pytest.raises(AdapterUnsupportedError, match="not implemented with tensor_parallel_size > 1"):
        pool.add_lora(LoRARequest("v", 2, str(folders["vocab_lora"]), **version))
    assert pool.add_lora(LoRARequest("plain", 3, str(folders["plain"]), **version))
