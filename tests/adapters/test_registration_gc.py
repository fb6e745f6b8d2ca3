"""A registration keeps its layout and header packed in tuples of atoms (peft_format.pack_layout /
pack_stored), which the garbage collector stops walking: registered adapters add a few tracked objects
each, not one per module and tensor (session 15: ~270 per q/v adapter over 32 layers, 290 ms full
collections with 2,000 registered)."""

from __future__ import annotations

import gc

import torch

from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import (
    inspect_peft_adapter,
    load_peft_adapter,
    pack_layout,
    pack_stored,
    unpack_layout,
    unpack_stored,
)
from loraplex.adapters.tensor_file import stored_tensors
from loraplex.adapters.slot_pool import LoRASlotPool

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_packed_layouts_and_headers_unpack_equal_and_untracked(peft_adapter, spec):
    for kwargs in (dict(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"v_proj": 2}),
                   dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True),
                   dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens", "lm_head"])):
        folder, _ = peft_adapter(**kwargs)
        layout = inspect_peft_adapter(folder, spec, 8)
        packed = pack_layout(layout)
        assert unpack_layout(packed) == layout
        stored = stored_tensors(folder / "adapter_model.safetensors")
        packed_stored = pack_stored(stored)
        assert unpack_stored(packed_stored) == stored and list(unpack_stored(packed_stored)) == list(stored)
        gc.collect()
        gc.collect()  # a tuple is untracked once its items are: a nested one may take a second pass
        tracked = [t for t in (*packed[6], *packed[7], *packed_stored) if gc.is_tracked(t)]
        assert not tracked, tracked


def test_registered_and_host_cached_adapters_add_few_tracked_objects(base_adapter_dir, spec):
    pool = LoRASlotPool(spec, 2, 8, 64, torch.float32, "cpu")
    version = load_peft_adapter(base_adapter_dir, spec, 8).version_id
    gc.collect()
    before = len(gc.get_objects())
    count = 40
    for i in range(1, count + 1):
        assert pool.add_lora(LoRARequest(f"a{i}", i, str(base_adapter_dir), version_id=version))
        pool.preload(i)  # its header parsed and kept, its image in the host cache
    assert pool.registry.get(count).stored is not None and pool.registry.get(count).layout is not None
    gc.collect()
    per_adapter = (len(gc.get_objects()) - before) / count
    # 2 layers x 7 modules: unpacked, a _ModulePlan and a ModuleHyperparams per module and a StoredTensor per
    # tensor were 56 of ~70
    assert per_adapter < 20, per_adapter
    pool.close()
