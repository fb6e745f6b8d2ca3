"""The paged adapter weight pool (ranks without padding) on CPU with toy shapes: each adapter holds
``ceil(r / page_rows)`` pages, exact page contents against the PEFT factors, page reuse zeroes what a new
holder does not target, and admission waits for pages like it waits for slots."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters import BaseModelSpec, LoRASlotPool, NoFreeSlotError
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.device_weights import LoRADeviceWeights, page_runs
from loraplex.adapters.lora_request import LoRARequest

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 64
PAGE = 8
ALL = [(layer, m) for layer in range(2) for m in SPEC.module_shapes]
# name -> (rank, lora_alpha, targeted (layer, module) pairs)
ADAPTERS = {
    "r8": (8, 16.0, ALL),
    "r12": (12, 8.0, [(0, "q_proj"), (1, "down_proj")]),  # rank 12 -> 2 pages, rows 12..16 zero
    "r64": (64, 32.0, ALL),
    "r3": (3, 6.0, [(1, "v_proj")]),
}


@pytest.fixture
def adapters(tmp_path, write_adapter):
    made = {}
    for index, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        generator = torch.Generator().manual_seed(100 + index)
        reference = {}
        for layer, module in targets:
            in_features, out_features = SPEC.module_shapes[module]
            reference[(layer, module)] = (torch.randn(rank, in_features, generator=generator),
                                          torch.randn(out_features, rank, generator=generator), alpha / rank)
        write_adapter(tmp_path / name, {k: (a, b) for k, (a, b, _) in reference.items()}, r=rank, lora_alpha=alpha)
        made[name] = (LoRARequest(name, index, str(tmp_path / name)), reference)
    return made


def make_pool(adapters, *, num_pages=None, max_loras=4, declared=False):
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=8, background_loads=False,
                        page_rows=PAGE, num_pages=num_pages)
    pool = LoRASlotPool(SPEC, dtype=torch.float32, config=config)
    for name, (request, _) in adapters.items():
        if declared:  # registered from the header alone (version id given): pages planned from the layout
            from loraplex.adapters.peft_format import load_peft_adapter

            version = load_peft_adapter(request.lora_path, SPEC, MAX_RANK).version_id
            request = LoRARequest(request.lora_name, request.lora_int_id, request.lora_path, version_id=version)
        assert pool.add_lora(request)
    return pool


def assert_holds(pool, slot, reference, rank):
    """The slot's gathered factors are the PEFT ones, zero-padded to ``rank`` rows, zero where untargeted."""
    for layer in range(SPEC.num_layers):
        for column, (module, (in_features, out_features)) in enumerate(SPEC.module_shapes.items()):
            a, b = pool.weights.slot_factors(slot, layer, module)
            expected_a, expected_b, scaling = torch.zeros(rank, in_features), torch.zeros(out_features, rank), 0.0
            if (layer, module) in reference:
                ref_a, ref_b, scaling = reference[(layer, module)]
                expected_a[: ref_a.shape[0]], expected_b[:, : ref_b.shape[1]] = ref_a, ref_b
            assert torch.equal(a, expected_a) and torch.equal(b, expected_b), (slot, layer, module)
            assert pool.scaling[layer][module][slot].item() == pytest.approx(scaling, rel=1e-7)


def test_page_runs():
    assert page_runs((3, 4, 5, 9, 1, 2)) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert page_runs(()) == []


@pytest.mark.parametrize("declared", [False, True])
def test_each_adapter_holds_pages_for_its_own_rank(adapters, declared):
    pool = make_pool(adapters, declared=declared)
    assert pool.a[0]["q_proj"].shape == (4 * MAX_RANK // PAGE, PAGE, 16)  # default: room for 4 rank-64 adapters
    assert pool.b[1]["v_proj"].shape == (32, 8, PAGE)
    for name in ("r8", "r12", "r64", "r3"):
        pool.pin(adapters[name][0].lora_int_id)
    pages = {name: pool.slots.pages_of(pool.slot_of(adapters[name][0].lora_int_id)) for name in adapters}
    assert pages == {"r8": (0,), "r12": (1, 2), "r64": tuple(range(3, 11)), "r3": (11,)}
    assert pool.weights.ranks.tolist() == [8, 16, 64, 8]
    assert pool.weights.page_table[1].tolist() == [1, 2] + [-1] * 6
    for name, rank in (("r8", 8), ("r12", 16), ("r64", 64), ("r3", 8)):
        assert_holds(pool, pool.slot_of(adapters[name][0].lora_int_id), adapters[name][1], rank)
    image = pool.loader.cached(adapters["r64"][0].lora_int_id)
    assert image.max_rank == 64 and image.num_pages == 8
    assert pool.loader.cached(adapters["r8"][0].lora_int_id).nbytes * 8 == image.nbytes  # host bytes by rank too


def test_pages_wait_for_unpins_and_reused_pages_are_clean(adapters):
    """num_pages=9: the rank-64 adapter (8 pages) fits beside one 1-page adapter only; while pinned
    adapters hold pages it is refused like an adapter without a slot, and once unpinned it evicts the
    least recently used adapters; a page reused by an adapter targeting fewer modules holds zeros there."""
    pool = make_pool(adapters, num_pages=9)
    ids = {name: request.lora_int_id for name, (request, _) in adapters.items()}
    pool.pin(ids["r8"])
    pool.pin(ids["r12"])
    assert pool.slots.free_pages == 6
    assert not pool.can_pin(ids["r64"])
    with pytest.raises(NoFreeSlotError, match=r"needs 8 weight pages of 8 rank rows; 6 of num_pages=9 are free"):
        pool.pin(ids["r64"])
    pool.unpin(ids["r12"])
    assert pool.can_pin(ids["r64"])
    pool.pin(ids["r64"])  # evicts r12 (unpinned, 2 pages) -> 8 free
    assert pool.slots.slot_of(ids["r12"]) is None and pool.stats().slot_evictions == 1
    assert_holds(pool, pool.slot_of(ids["r64"]), adapters["r64"][1], 64)
    pool.unpin(ids["r64"])
    pool.unpin(ids["r8"])
    assert [pool.slots.pages_of(pool.slot_of(ids[n])) for n in ("r8", "r64")] == [(0,), tuple(range(1, 9))]
    pool.pin(ids["r3"])  # no free page: evicts r64, the least recently used
    assert pool.slots.slot_of(ids["r64"]) is None and pool.slots.pages_of(pool.slot_of(ids["r3"])) == (1,)
    pool.pin(ids["r12"])  # two of r64's old pages, free now
    slot = pool.slot_of(ids["r12"])
    assert pool.slots.pages_of(slot) == (2, 3)
    assert_holds(pool, slot, adapters["r12"][1], 16)  # those pages held every module of r64: zeroed where untargeted
    held = [p for s in range(4) for p in pool.slots.pages_of(s)]
    assert len(held) == len(set(held)) and len(held) + pool.slots.free_pages == 9


def test_one_batch_of_installs_writes_pages(adapters):
    pool = make_pool(adapters)
    with pool.batched_installs():
        for name in ("r64", "r12", "r8"):
            pool.pin(adapters[name][0].lora_int_id)
    for name, rank in (("r64", 64), ("r12", 16), ("r8", 8)):
        assert_holds(pool, pool.slot_of(adapters[name][0].lora_int_id), adapters[name][1], rank)


def test_non_contiguous_pages_and_wrong_page_counts(adapters):
    pool = make_pool(adapters)
    image = pool.loader.host_copy(pool.registry.get(adapters["r12"][0].lora_int_id))
    weights = LoRADeviceWeights(SPEC, 2, 16, torch.float32, "cpu", page_rows=PAGE, num_pages=6)
    weights.write_many([(1, image, (5, 2))], staging_bytes=1 << 20)  # out of order, not adjacent
    a, b = weights.slot_factors(1, 0, "q_proj")
    ref_a, ref_b, _ = adapters["r12"][1][(0, "q_proj")]
    assert torch.equal(a[:12], ref_a) and torch.equal(b[:, :12], ref_b) and not a[12:].any()
    second_b_page = torch.zeros(16, 8)  # rank 12 in 8-row pages: columns 8..11, then 4 zero columns
    second_b_page[:, :4] = ref_b[:, 8:12]
    assert torch.equal(weights.a[0]["q_proj"][5], ref_a[:8]) and torch.equal(weights.b[0]["q_proj"][2], second_b_page)
    with pytest.raises(ValueError, match=r"needs 2 pages of 0..5, given \[1\]"):
        weights.write(0, image, (1,))
    with pytest.raises(ValueError, match="page_rows=3 must be a power of two"):
        LoRADeviceWeights(SPEC, 2, MAX_RANK, torch.float32, "cpu", page_rows=3)
    with pytest.raises(ValueError, match="LoRAConfig.page_rows=128: must be a power of two <= max_lora_rank=64"):
        LoRAConfig(max_lora_rank=64, page_rows=128)


def test_engine_refuses_a_pool_smaller_than_one_max_rank_adapter():
    from loraplex.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=r"max_lora_pages=3: must be >= 4, the pages of one max_lora_rank=32"):
        EngineConfig(model="x", enable_lora=True, max_lora_rank=32, lora_page_rows=8, max_lora_pages=3)
    assert EngineConfig(model="x", enable_lora=True, max_lora_rank=32, lora_page_rows=8, max_lora_pages=4)
    with pytest.raises(ValueError, match=r"LoRAConfig.num_pages=1: an adapter of max_lora_rank=64 takes 8 pages"):
        LoRAConfig(max_lora_rank=64, page_rows=8, num_pages=1)
