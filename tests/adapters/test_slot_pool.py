"""LoRASlotPool on CPU with toy shapes: exact slot ids, LRU order, pins, and slot contents."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.adapters import (
    AdapterChangedError,
    AdapterConflictError,
    AdapterFormatError,
    AdapterIncompatibleError,
    BaseModelSpec,
    LoRASlotPool,
    NoFreeSlotError,
    SlotInfo,
    SlotPoolError,
    UnknownAdapterError,
)
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.slot_image import SlotImage, VocabImage

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 8

# name -> (rank, lora_alpha, targeted (layer, module) pairs)
ADAPTERS = {
    "a1": (2, 4.0, [(0, "q_proj"), (1, "q_proj"), (0, "v_proj")]),
    "a2": (8, 8.0, [(0, "q_proj"), (0, "v_proj"), (0, "down_proj"), (1, "q_proj"), (1, "v_proj"), (1, "down_proj")]),
    "a3": (4, 2.0, [(1, "down_proj")]),
    "a4": (1, 3.0, [(0, "down_proj"), (1, "v_proj")]),
    "a5": (6, 12.0, [(0, "v_proj"), (1, "q_proj")]),
}


@pytest.fixture
def adapters(tmp_path, write_adapter):
    """name -> (LoRARequest, reference {(layer, module): (A fp32, B fp32, scaling)}) for ADAPTERS."""
    made = {}
    for index, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        generator = torch.Generator().manual_seed(index)
        reference = {}
        for layer, module in targets:
            in_features, out_features = SPEC.module_shapes[module]
            a = torch.randn(rank, in_features, generator=generator)
            b = torch.randn(out_features, rank, generator=generator)
            reference[(layer, module)] = (a, b, alpha / rank)
        write_adapter(tmp_path / name, {k: (a, b) for k, (a, b, _) in reference.items()}, r=rank, lora_alpha=alpha)
        made[name] = (LoRARequest(name, index, str(tmp_path / name)), reference)
    return made


def make_pool(adapters, *, max_loras=3, max_cpu_loras=5, dtype=torch.float32, register=("a1", "a2", "a3", "a4", "a5"),
              device="cpu"):
    pool = LoRASlotPool(SPEC, max_loras, MAX_RANK, max_cpu_loras, dtype, device)
    for name in register:
        assert pool.add_lora(adapters[name][0]) is True
    return pool


def iid(adapters, name):
    return adapters[name][0].lora_int_id


def assert_slot_holds(pool, slot, reference):
    """Slot ``slot`` equals the adapter's weights zero-padded to max_lora_rank, and zero elsewhere."""
    for layer in range(SPEC.num_layers):
        for module, (in_features, out_features) in SPEC.module_shapes.items():
            expected_a = torch.zeros(MAX_RANK, in_features)
            expected_b = torch.zeros(out_features, MAX_RANK)
            expected_scaling = 0.0
            if (layer, module) in reference:
                a, b, expected_scaling = reference[(layer, module)]
                expected_a[: a.shape[0]] = a
                expected_b[:, : b.shape[1]] = b
            got_a, got_b = (t.cpu() for t in pool.weights.slot_factors(slot, layer, module))
            assert torch.equal(got_a, expected_a.to(pool.dtype)), (slot, layer, module)
            assert torch.equal(got_b, expected_b.to(pool.dtype)), (slot, layer, module)
            assert pool.scaling[layer][module][slot].item() == pytest.approx(expected_scaling, rel=1e-7)


def dispatch_counter():
    """A ``TorchDispatchMode`` counting ATen calls by name in ``.calls`` while it is entered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


def slot_names(pool):
    return [(s.lora_name, s.pin_count) for s in pool.stats().slots]


def test_slot_tensor_shapes_and_dtypes(adapters):
    pool = make_pool(adapters, max_loras=3, dtype=torch.bfloat16, register=())
    for layer in range(2):
        assert pool.a[layer]["v_proj"].shape == (3, MAX_RANK, 16) and pool.a[layer]["v_proj"].dtype == torch.bfloat16
        assert pool.b[layer]["v_proj"].shape == (3, 8, MAX_RANK) and pool.b[layer]["down_proj"].shape == (3, 16, 8)
        assert pool.a[layer]["down_proj"].shape == (3, MAX_RANK, 24)
        assert pool.scaling[layer]["q_proj"].shape == (3,) and pool.scaling[layer]["q_proj"].dtype == torch.float32
        assert pool.weights.gain[layer]["v_proj"].shape == (3 + 1, 8)  # DoRA gains: a row per slot, then ones
    per_slot = 2 * (MAX_RANK * (16 + 16) + MAX_RANK * (16 + 8) + MAX_RANK * (24 + 16))
    gains = 2 * (3 + 1) * (16 + 8 + 16) * 4  # [L, S + 1, sum(out)] float32
    assert pool.stats().slot_memory_bytes == 3 * (per_slot * 2 + 2 * 3 * 4) + gains + 3 * 4 * 2  # + page table, ranks


def test_pin_takes_lowest_free_slot_and_reuses_resident(adapters):
    pool = make_pool(adapters)
    assert pool.pin(iid(adapters, "a2")) == 0
    assert pool.pin(iid(adapters, "a1")) == 1
    assert pool.pin(iid(adapters, "a2")) == 0
    assert pool.pin(iid(adapters, "a3")) == 2
    stats = pool.stats()
    assert stats.slots == [
        SlotInfo(0, "a2", 2, pool.version_id(2), 2),
        SlotInfo(1, "a1", 1, pool.version_id(1), 1),
        SlotInfo(2, "a3", 3, pool.version_id(3), 1),
    ]
    assert (stats.slot_loads, stats.slot_evictions, stats.disk_loads) == (3, 0, 5)
    for name, slot in (("a2", 0), ("a1", 1), ("a3", 2)):
        assert_slot_holds(pool, slot, adapters[name][1])


def test_lru_eviction_picks_least_recently_used_unpinned_slot(adapters):
    pool = make_pool(adapters)
    for name in ("a1", "a2", "a3"):
        pool.pin(iid(adapters, name))
    pool.unpin(iid(adapters, "a2"))  # a2 released first ...
    pool.unpin(iid(adapters, "a1"))  # ... then a1; a3 stays pinned
    assert pool.pin(iid(adapters, "a4")) == 1  # evicts a2 (least recently used unpinned)
    assert pool.pin(iid(adapters, "a5")) == 0  # evicts a1
    assert slot_names(pool) == [("a5", 1), ("a4", 1), ("a3", 1)]
    assert pool.stats().slot_evictions == 2
    pool.unpin(iid(adapters, "a5"))
    pool.unpin(iid(adapters, "a3"))
    pool.pin(iid(adapters, "a5"))  # touching a resident slot makes it most recent again
    pool.unpin(iid(adapters, "a5"))
    assert pool.pin(iid(adapters, "a1")) == 2  # a3 (slot 2) is now the oldest unpinned
    assert_slot_holds(pool, 2, adapters["a1"][1])


def test_no_free_slot_when_all_pinned(adapters):
    pool = make_pool(adapters, max_loras=2)
    pool.pin(iid(adapters, "a1"))
    pool.pin(iid(adapters, "a2"))
    before = pool.stats()
    assert pool.can_pin(iid(adapters, "a3")) is False
    assert pool.can_pin(iid(adapters, "a1")) is True
    with pytest.raises(
        NoFreeSlotError,
        match=r"all max_loras=2 adapter slots are pinned \(lora_int_ids \[1, 2\]\); "
        r"adapter 'a3' \(lora_int_id=3\) must wait",
    ):
        pool.pin(iid(adapters, "a3"))
    assert pool.stats() == before
    assert pool.pin(iid(adapters, "a1")) == 0  # already resident: still fine
    pool.unpin(iid(adapters, "a2"))
    assert pool.can_pin(iid(adapters, "a3")) is True
    assert pool.pin(iid(adapters, "a3")) == 1
    assert_slot_holds(pool, 1, adapters["a3"][1])


def test_remove_while_pinned_is_deferred_until_last_unpin(adapters):
    pool = make_pool(adapters)
    a1 = iid(adapters, "a1")
    assert pool.pin(a1) == 0 and pool.pin(a1) == 0
    version = pool.version_id(a1)
    assert pool.remove_lora(a1) is True
    assert pool.remove_lora(a1) is False  # already being removed
    assert [r.lora_name for r in pool.list_loras()] == ["a2", "a3", "a4", "a5"]
    assert pool.stats().pending_removal == ["a1"]
    with pytest.raises(UnknownAdapterError, match="lora_int_id=1 is being removed"):
        pool.pin(a1)
    with pytest.raises(AdapterConflictError, match="lora_int_id=1 is being removed"):
        pool.add_lora(adapters["a1"][0])
    assert pool.version_id(a1) == version  # running requests keep their prefix-cache key
    assert_slot_holds(pool, 0, adapters["a1"][1])  # running requests still see their weights
    pool.unpin(a1)
    assert_slot_holds(pool, 0, adapters["a1"][1])
    pool.unpin(a1)  # last pin: removal completes
    stats = pool.stats()
    assert stats.slots[0] == SlotInfo(0, None, None, None, 0)
    assert stats.pending_removal == [] and "a1" not in stats.cpu_cache_lru
    assert all(pool.scaling[layer][module][0].item() == 0.0 for layer in range(2) for module in SPEC.module_shapes)
    with pytest.raises(UnknownAdapterError, match="lora_int_id=1 is not registered"):
        pool.version_id(a1)
    assert pool.add_lora(adapters["a1"][0]) is True  # the id can be registered again


def test_remove_unpinned_is_immediate(adapters):
    pool = make_pool(adapters)
    a2 = iid(adapters, "a2")
    assert pool.pin(a2) == 0
    pool.unpin(a2)
    assert pool.remove_lora(a2) is True
    assert pool.stats().slots[0].lora_name is None
    assert pool.remove_lora(a2) is False
    assert pool.remove_lora(99) is False
    assert pool.pin(iid(adapters, "a3")) == 0


def test_cpu_cache_lru_order_and_reload_from_disk(adapters):
    pool = make_pool(adapters, max_cpu_loras=2, register=("a1", "a2", "a3"))
    stats = pool.stats()
    assert stats.cpu_cache_lru == ["a1", "a2"]  # registering a3 found no room and evicted nothing
    assert (stats.disk_loads, stats.cpu_evictions) == (3, 0)
    assert pool.pin(iid(adapters, "a2")) == 0  # from the cache: no disk read, a2 becomes most recent
    assert pool.stats().cpu_cache_lru == ["a1", "a2"]
    assert pool.stats().disk_loads == 3
    assert pool.pin(iid(adapters, "a3")) == 1  # not cached: read from disk, cached, evicting a1 (LRU)
    stats = pool.stats()
    assert stats.cpu_cache_lru == ["a2", "a3"]
    assert (stats.disk_loads, stats.cpu_evictions) == (4, 1)
    assert_slot_holds(pool, 1, adapters["a3"][1])
    assert pool.pin(iid(adapters, "a1")) == 2  # evicted from the cache: re-read from disk
    stats = pool.stats()
    assert stats.cpu_cache_lru == ["a3", "a1"]
    assert (stats.disk_loads, stats.cpu_evictions) == (5, 2)
    assert_slot_holds(pool, 2, adapters["a1"][1])


def test_reload_refuses_changed_or_vanished_files(adapters, write_adapter):
    pool = make_pool(adapters, max_cpu_loras=1, register=("a2", "a1"))  # a1 is not cached
    request = adapters["a1"][0]
    rank, alpha, _ = ADAPTERS["a1"]
    changed = {k: (a, b * 2) for k, (a, b, _) in adapters["a1"][1].items()}
    write_adapter(Path(request.lora_path), changed, r=rank, lora_alpha=alpha)
    before = pool.stats()
    with pytest.raises(AdapterChangedError, match="adapter 'a1' at lora_path=.* changed on disk: version_id"):
        pool.pin(request.lora_int_id)
    shutil.rmtree(request.lora_path)
    with pytest.raises(AdapterFormatError, match="does not exist"):
        pool.pin(request.lora_int_id)
    after = pool.stats()
    assert after.slots == before.slots and after.slot_loads == before.slot_loads == 0


def test_slot_contents_after_churn(adapters):
    """Random pins / unpins / removals on 3 slots; every resident slot always holds exactly its adapter."""
    pool = make_pool(adapters, max_loras=3, max_cpu_loras=2, dtype=torch.bfloat16)
    rng = random.Random(0)
    pins = {iid(adapters, name): 0 for name in ADAPTERS}
    by_id = {req.lora_int_id: (name, ref) for name, (req, ref) in adapters.items()}
    for _ in range(60):
        int_id = rng.choice(list(pins))
        action = rng.random()
        if action < 0.55:
            try:
                pool.pin(int_id)
                pins[int_id] += 1
            except NoFreeSlotError:
                assert sum(1 for count in pins.values() if count > 0) == 3 and pins[int_id] == 0
        elif pins[int_id] > 0:
            pool.unpin(int_id)
            pins[int_id] -= 1
        elif action > 0.95:
            pool.remove_lora(int_id)
            pool.add_lora(adapters[by_id[int_id][0]][0])
        for info in pool.stats().slots:
            if info.lora_int_id is not None:
                assert info.pin_count == pins[info.lora_int_id]
                assert_slot_holds(pool, info.slot, by_id[info.lora_int_id][1])
    stats = pool.stats()
    assert stats.slot_evictions > 3 and stats.disk_loads > 5  # the churn really evicted and reloaded


def test_add_lora_idempotent_and_conflicts(adapters, tmp_path):
    pool = make_pool(adapters, register=("a1",))
    request = adapters["a1"][0]
    assert pool.add_lora(request) is False
    with pytest.raises(
        AdapterConflictError,
        match=r"LoRARequest.lora_path='/elsewhere': lora_int_id=1 is already "
        r"registered with lora_path=",
    ):
        pool.add_lora(LoRARequest("a1", 1, "/elsewhere"))
    with pytest.raises(AdapterConflictError, match="LoRARequest.lora_name='renamed': lora_int_id=1 is already"):
        pool.add_lora(LoRARequest("renamed", 1, request.lora_path))
    # The same name under a new id is a new version of that adapter: both stay registered.
    assert pool.add_lora(LoRARequest("a1", 7, adapters["a2"][0].lora_path)) is True
    assert [r.lora_int_id for r in pool.list_loras()] == [1, 7]
    assert pool.version_id(1) != pool.version_id(7)


def test_refused_adapter_leaves_pool_unchanged(adapters, tmp_path, write_adapter):
    pool = make_pool(adapters, register=("a1", "a2"))
    big = {(0, "q_proj"): (torch.randn(16, 16), torch.randn(16, 16))}
    write_adapter(tmp_path / "big", big, r=16, lora_alpha=16)
    before = pool.stats()
    with pytest.raises(AdapterIncompatibleError, match="adapter_config.json: r=16 exceeds max_lora_rank=8"):
        pool.add_lora(LoRARequest("big", 9, str(tmp_path / "big")))
    assert pool.stats() == before
    with pytest.raises(UnknownAdapterError):
        pool.pin(9)


def test_protocol_errors(adapters):
    pool = make_pool(adapters, register=("a1",))
    with pytest.raises(SlotPoolError, match=r"unpin\(lora_int_id=1\): the adapter is not pinned"):
        pool.unpin(1)
    with pytest.raises(UnknownAdapterError, match="lora_int_id=42 is not registered"):
        pool.pin(42)
    for kwargs, message in (
        (dict(max_loras=0), "LoRAConfig.max_loras=0: must be an integer >= 1"),
        (dict(max_lora_rank=0), "LoRAConfig.max_lora_rank=0: must be an integer >= 1"),
        (dict(max_cpu_loras=0), "LoRAConfig.max_cpu_loras=0: must be an integer >= 1"),
        (dict(dtype=torch.int8), "LoRASlotPool.dtype=torch.int8: must be one of"),
    ):
        args = dict(max_loras=2, max_lora_rank=4, max_cpu_loras=2, dtype=torch.float16, device="cpu") | kwargs
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            LoRASlotPool(SPEC, **args)


def test_batched_installs_hold_exactly_their_adapters_after_churn(adapters):
    """The churn above, four operations per ``batched_installs`` (a scheduler step): slots are
    assigned at once and written together at exit (``write_many``), never one by one, and every
    resident slot then holds exactly its adapter, modules of an earlier occupant zeroed included
    (adapters of different ranks and target sets share the 3 slots, so a batch has several layouts)."""
    pool = make_pool(adapters, max_loras=3, max_cpu_loras=2, dtype=torch.bfloat16)
    single_writes = []
    pool.weights.write = lambda slot, image: single_writes.append(slot)
    rng = random.Random(1)
    pins = {iid(adapters, name): 0 for name in ADAPTERS}
    by_id = {req.lora_int_id: (name, ref) for name, (req, ref) in adapters.items()}
    batches_with_installs = most_in_one_batch = 0
    for _ in range(60):
        loads_before = pool.stats().slot_loads
        with pool.batched_installs():
            for _ in range(4):
                int_id = rng.choice(list(pins))
                if rng.random() < 0.45:
                    try:
                        pool.pin(int_id)
                        pins[int_id] += 1
                    except NoFreeSlotError:
                        assert sum(1 for count in pins.values() if count > 0) == 3
                elif pins[int_id] > 0:
                    pool.unpin(int_id)
                    pins[int_id] -= 1
        batches_with_installs += pool.stats().slot_loads > loads_before
        most_in_one_batch = max(most_in_one_batch, pool.stats().slot_loads - loads_before)
        for info in pool.stats().slots:
            if info.lora_int_id is not None:
                assert info.pin_count == pins[info.lora_int_id]
                assert_slot_holds(pool, info.slot, by_id[info.lora_int_id][1])
    assert single_writes == []
    assert pool.install_batches == batches_with_installs == 10  # one device write batch each
    assert most_in_one_batch == 2  # two adapters (two layouts) written in one batch
    assert pool.stats().slot_evictions > 5


def test_batched_installs_refuse_nesting(adapters):
    pool = make_pool(adapters)
    with pool.batched_installs():
        with pytest.raises(SlotPoolError, match="already open"):
            with pool.batched_installs():
                pass


def test_one_batch_of_installs_is_one_copy_per_adapter_and_one_scatter_per_layout(adapters):
    """The device work of three installs in one batch, counted at the ATen level: each image is
    copied whole once (3 copies), then one ``_foreach_copy_`` per group of adapters sharing a layout
    writes every targeted (layer, module) factor of the group (it was two ``index_copy_`` per
    factor: ~900 launches per install at Llama-2-7B shapes), plus one scatter of the scalings per
    layout; one-by-one installs took two copies per targeted module and adapter."""
    pool = make_pool(adapters, max_loras=3)
    for name in ("a1", "a2", "a5"):
        pool.preload(iid(adapters, name))
    images = [pool.loader.cached(iid(adapters, name)) for name in ("a1", "a2", "a5")]
    count = dispatch_counter()
    with count:
        with pool.batched_installs():
            for name in ("a1", "a2", "a5"):
                pool.pin(iid(adapters, name))
            assert count.calls == {}  # pins only assign slots: nothing is written before the batch ends
    keys = sum(len(image.offsets) for image in images)  # 3 + 6 + 2 targeted modules, one layout each
    assert keys == 11
    assert count.calls.get("copy_") == 3
    assert count.calls.get("_foreach_copy_") == 3  # three layouts here
    assert count.calls.get("index_copy_") == 3 + 2  # the scalings (per layout), page-table rows and ranks (once)
    for slot, name in enumerate(("a1", "a2", "a5")):
        assert_slot_holds(pool, slot, adapters[name][1])


def test_write_many_reuses_and_grows_its_staging_buffer(adapters):
    """write_many keeps its device staging buffer between calls: two rows of one layout (the same image),
    then a larger
    image (the buffer grows and its cached views are dropped), then two other layouts over slots that
    held another adapter; every slot holds exactly its adapter (zeros elsewhere) after each call."""
    pool = make_pool(adapters, max_loras=3)
    for name in ("a1", "a2", "a3", "a5"):
        pool.preload(iid(adapters, name))
    image = {name: pool.loader.cached(iid(adapters, name)) for name in ("a1", "a2", "a3", "a5")}
    weights = pool.weights
    weights.write_many([(0, image["a3"], (0,)), (1, image["a3"], (1,))], staging_bytes=1 << 30)
    first_buffer = weights._staging
    assert first_buffer.numel() == 2 * image["a3"].data.numel()
    assert_slot_holds(pool, 0, adapters["a3"][1])
    assert_slot_holds(pool, 1, adapters["a3"][1])
    weights.write_many([(2, image["a2"], (2,))], staging_bytes=1 << 30)
    assert image["a2"].data.numel() > 2 * image["a3"].data.numel()
    assert weights._staging is not first_buffer  # grown
    first_buffer.fill_(7.0)  # a view left on the old buffer would now copy 7s
    assert_slot_holds(pool, 2, adapters["a2"][1])
    weights.write_many([(0, image["a1"], (0,)), (1, image["a5"], (1,))], staging_bytes=1 << 30)
    assert_slot_holds(pool, 0, adapters["a1"][1])
    assert_slot_holds(pool, 1, adapters["a5"][1])
    assert_slot_holds(pool, 2, adapters["a2"][1])
    grown = weights._staging
    weights.write_many([(2, image["a3"], (2,)), (0, image["a3"], (0,))], staging_bytes=1 << 30)  # fits: kept
    assert weights._staging is grown
    assert_slot_holds(pool, 2, adapters["a3"][1])
    assert_slot_holds(pool, 0, adapters["a3"][1])
    assert_slot_holds(pool, 1, adapters["a5"][1])


@dataclasses.dataclass
class _Holder:
    """What assert_slot_holds reads of a pool, for weights outside one."""

    weights: LoRADeviceWeights
    dtype: torch.dtype

    @property
    def scaling(self):
        return self.weights.scaling


def test_reserved_staging_holds_every_install_batch(adapters):
    """reserve_staging allocates what write_many can need (largest image: every module of every layer at
    max_lora_rank; one group at most staging_bytes of images, one per slot), so no later install allocates:
    the buffer object stays the same through batches of small and full-rank images."""
    weights = LoRADeviceWeights(SPEC, 3, MAX_RANK, torch.float32, "cpu")
    largest = SPEC.num_layers * (MAX_RANK * (16 + 16 + 16 + 8 + 24 + 16) + (16 + 8 + 16))  # A, B, DoRA magnitudes
    assert weights.staging_bound(1 << 30) == 3 * largest  # one image per slot
    assert weights.staging_bound(4 * (2 * largest + 5)) == 2 * largest + 5  # capped by the bytes
    assert weights.staging_bound(8) == largest  # one image even when larger than the staging bytes
    staging_bytes = 4 * (2 * largest + 5)
    assert weights.reserve_staging(staging_bytes) == 4 * (2 * largest + 5)
    reserved = weights._staging
    pool = make_pool(adapters, max_loras=3)
    for name in ("a1", "a2", "a3", "a5"):
        pool.preload(iid(adapters, name))
    image = {name: pool.loader.cached(iid(adapters, name)) for name in ("a1", "a2", "a3", "a5")}
    assert image["a2"].data.numel() == largest - SPEC.num_layers * 40  # rank 8 = MAX_RANK on every module, no DoRA
    weights.write_many([(0, image["a2"], (0,)), (1, image["a2"], (1,)), (2, image["a3"], (2,))],
                       staging_bytes=staging_bytes)
    weights.write_many([(0, image["a1"], (0,)), (1, image["a5"], (1,)), (2, image["a2"], (2,))],
                       staging_bytes=staging_bytes)
    assert weights._staging is reserved
    # more staging bytes than reserved: the groups are cut to what the buffer holds, it does not grow
    weights.write_many([(0, image["a2"], (0,)), (1, image["a2"], (1,)), (2, image["a2"], (2,))],
                       staging_bytes=1 << 30)
    assert weights._staging is reserved
    for slot in range(3):
        assert_slot_holds(_Holder(weights, pool.dtype), slot, adapters["a2"][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the pool reserves its staging there)")
def test_pool_on_cuda_reserves_its_staging_before_any_install(adapters):
    pool = LoRASlotPool(SPEC, 3, MAX_RANK, 5, torch.bfloat16, "cuda")
    assert pool.weights._staging is not None
    assert pool.weights._staging.numel() == pool.weights.staging_bound(pool.config.install_staging_bytes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the foreach multi-tensor path)")
def test_write_many_on_cuda_matches_the_adapters(adapters):
    """On CUDA the staging copies are asynchronous and ``_foreach_copy_`` takes its multi-tensor kernel
    path; the slots must still hold exactly each adapter, through two batches reusing the buffer."""
    pool = LoRASlotPool(SPEC, 3, MAX_RANK, 5, torch.bfloat16, "cuda")
    for name in ("a1", "a2", "a3", "a5"):
        assert pool.add_lora(adapters[name][0]) is True
        pool.preload(iid(adapters, name))
    for names in (("a1", "a2", "a5"), ("a3", "a1")):
        with pool.batched_installs():
            for name in names:
                pool.pin(iid(adapters, name))
        torch.cuda.synchronize()
        for name in names:
            slot = pool.slot_of(iid(adapters, name))
            for (layer, module), (a, b, scaling) in adapters[name][1].items():
                rank = a.shape[0]
                assert torch.equal(pool.weights.slot_factors(slot, layer, module)[0][:rank].cpu(), a.to(torch.bfloat16))
                assert torch.equal(pool.weights.slot_factors(slot, layer, module)[1][:, :rank].cpu(), b.to(torch.bfloat16))
                assert pool.scaling[layer][module][slot].item() == pytest.approx(scaling, rel=1e-7)
        for name in names:
            pool.unpin(iid(adapters, name))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the copy stream)")
def test_an_install_overlaps_queued_kernels_but_not_their_reads_of_the_slot(adapters):
    """The host-to-device copies of an install run on the copy stream while the compute stream is still
    busy (``torch.cuda._sleep`` stands in for a running step), but the write into the slot stays behind
    what was queued before it: a read of the slot queued before the install sees the old adapter, one
    queued after sees the new one."""
    pool = LoRASlotPool(SPEC, 1, MAX_RANK, 5, torch.bfloat16, "cuda")
    for name in ("a2", "a1"):  # a2's image is the larger: the staging buffer it grows takes a1's too
        assert pool.add_lora(adapters[name][0]) is True
        pool.preload(iid(adapters, name))
    layer, module = 0, "q_proj"  # targeted by both
    a_old, a_new = adapters["a2"][1][(layer, module)][0], adapters["a1"][1][(layer, module)][0]
    with pool.batched_installs():
        pool.pin(iid(adapters, "a2"))
    torch.cuda.synchronize()
    slot = pool.slot_of(iid(adapters, "a2"))
    pool.unpin(iid(adapters, "a2"))
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of a busy compute stream
    before = pool.weights.slot_factors(slot, layer, module)[0].clone()  # queued before the install
    with pool.batched_installs():
        pool.pin(iid(adapters, "a1"))  # evicts a2 from the only slot
    assert pool.slot_of(iid(adapters, "a1")) == slot
    after = pool.weights.slot_factors(slot, layer, module)[0].clone()
    while not pool.weights._copy_stream.query():  # the copies finish while the compute stream still sleeps
        assert not compute.query(), "the install's copies waited for the queued kernels"
    torch.cuda.synchronize()
    assert torch.equal(before[: a_old.shape[0]].cpu(), a_old.to(torch.bfloat16))
    assert torch.equal(after[: a_new.shape[0]].cpu(), a_new.to(torch.bfloat16))
    pool.unpin(iid(adapters, "a1"))


# -- write_many's grouping and staging rows (mutants found by review: every row read from row 0, images
# grouped by size alone, a vocabulary-only image, a failure part-way) --------------------------------
def _negated(image, reference):
    img = dataclasses.replace(image, data=(-image.data).clone(), version_id=image.version_id + "-neg")
    return img, {k: (-a, -b, s) for k, (a, b, s) in reference.items()}


@pytest.mark.parametrize("staging_bytes", [1 << 30, 1])
def test_distinct_images_of_one_layout_land_in_their_own_rows(adapters, staging_bytes):
    pool = make_pool(adapters, max_loras=3)
    pool.preload(iid(adapters, "a1"))
    a1 = pool.loader.cached(iid(adapters, "a1"))
    neg, neg_ref = _negated(a1, adapters["a1"][1])
    pool.weights.write_many([(0, a1, (0,)), (1, neg, (1,)), (2, a1, (2,))], staging_bytes=staging_bytes)
    assert_slot_holds(pool, 0, adapters["a1"][1])
    assert_slot_holds(pool, 1, neg_ref)
    assert_slot_holds(pool, 2, adapters["a1"][1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (asynchronous staging copies, CUDA index_copy_)"))])
@pytest.mark.parametrize("count", [7, 8, 10])
def test_many_one_page_images_of_one_layout_are_scattered_per_module(adapters, count, device):
    """From INDEX_COPY_MIN_IMAGES (8) one-page images of one layout on, the group is scattered with two
    ``index_copy_`` per targeted (layer, module) instead of one ``_foreach_copy_`` over views of every image;
    each slot holds exactly its image either way."""
    from loraplex.adapters.device_weights import INDEX_COPY_MIN_IMAGES

    assert INDEX_COPY_MIN_IMAGES == 8
    pool = make_pool(adapters, max_loras=count, device=device)
    pool.preload(iid(adapters, "a2"))
    a2 = pool.loader.cached(iid(adapters, "a2"))
    neg, neg_ref = _negated(a2, adapters["a2"][1])
    writes = [(slot, neg if slot % 2 else a2, (count - 1 - slot,)) for slot in range(count)]  # pages reversed
    counter = dispatch_counter()
    with counter:
        pool.weights.write_many(writes, staging_bytes=1 << 30)
    factors = 2 * len(a2.offsets)  # 6 targeted modules, A and B
    if count >= INDEX_COPY_MIN_IMAGES:
        assert "_foreach_copy_" not in counter.calls
        assert counter.calls["index_copy_"] == factors + 3  # + the scalings, page-table rows and ranks
    else:
        assert counter.calls["_foreach_copy_"] == 1
    for slot in range(count):
        assert_slot_holds(pool, slot, neg_ref if slot % 2 else adapters["a2"][1])


def test_same_numel_different_modules_are_not_one_layout(adapters):
    """(0, q_proj) only vs (1, q_proj) only: same numel, same offset values, different modules."""
    pool = make_pool(adapters, max_loras=3)
    pool.preload(iid(adapters, "a1"))
    a1 = pool.loader.cached(iid(adapters, "a1"))
    ref = adapters["a1"][1]
    only0 = dataclasses.replace(a1, offsets={(0, "q_proj"): a1.offsets[(0, "q_proj")]},
                                scaling=a1.scaling * torch.tensor([[1.0, 0, 0], [0, 0, 0]]))
    off = a1.offsets[(1, "q_proj")]
    data1 = a1.data.clone()
    n = off[1] - off[0]
    data1[a1.offsets[(0, "q_proj")][0]: a1.offsets[(0, "q_proj")][0] + 2 * n] = a1.data[off[0]: off[0] + 2 * n]
    only1 = dataclasses.replace(a1, data=data1, offsets={(1, "q_proj"): a1.offsets[(0, "q_proj")]},
                                scaling=a1.scaling * torch.tensor([[0.0, 0, 0], [1, 0, 0]]))
    pool.weights.write_many([(0, only0, (0,)), (1, only1, (1,))], staging_bytes=1 << 30)
    assert_slot_holds(pool, 0, {(0, "q_proj"): ref[(0, "q_proj")]})
    assert_slot_holds(pool, 1, {(1, "q_proj"): ref[(1, "q_proj")]})


def test_write_many_with_an_adapter_only_on_the_vocabulary():
    spec = BaseModelSpec(num_layers=1, hidden_size=8, module_shapes={"q_proj": (8, 8)}, architecture="Toy", vocab_size=16)
    w = LoRADeviceWeights(spec, 2, 2, torch.float32, "cpu")
    vocab = VocabImage(embed_a_t=torch.ones(16, 2), embed_b=torch.ones(8, 2), head_a=None, head_b=None,
                       scaling=torch.tensor([2.0, 0.0]))
    image = SlotImage("v", 2, torch.empty(0), {}, torch.zeros(1, 1), spec.module_shapes, vocab=vocab)
    w.write_many([(0, image, (0,)), (1, image, (1,))], staging_bytes=1 << 30)
    assert torch.equal(w.embed_a_t[1], torch.ones(16, 2)) and w.vocab_scaling[0, 1].item() == 2.0


def test_write_many_failure_invalidates_every_slot(adapters, monkeypatch):
    pool = make_pool(adapters, max_loras=3)
    for name in ("a1", "a2"):
        pool.preload(iid(adapters, name))
    images = [pool.loader.cached(iid(adapters, n)) for n in ("a1", "a2")]
    w = pool.weights
    w.write_many([(0, images[1], (0,)), (1, images[1], (1,))], staging_bytes=1 << 30)
    real, calls = torch._foreach_copy_, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        w.write_many([(0, images[0], (0,)), (1, images[1], (1,))], staging_bytes=1 << 30)
    monkeypatch.setattr(torch, "_foreach_copy_", real)
    assert bool((w._scaling_table[:, :, :2] == 0).all())
    w.write_many([(0, images[0], (0,)), (1, images[0], (1,))], staging_bytes=1 << 30)
    assert_slot_holds(pool, 0, adapters["a1"][1])
    assert_slot_holds(pool, 1, adapters["a1"][1])
