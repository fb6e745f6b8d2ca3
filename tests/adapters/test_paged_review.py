"""Review of the paged adapter weight pool: a differential fuzz of LoRASlotPool (pin / unpin / remove / re-add /
batched installs) with adapters of random ranks, rank_pattern and target sets against their PEFT factors, and
LoRADeviceWeights.write_many against one-by-one writes on scattered pages."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.adapters import BaseModelSpec, LoRASlotPool, NoFreeSlotError
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import load_peft_adapter

SPEC = BaseModelSpec(
    num_layers=2,
    hidden_size=16,
    module_shapes={"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (24, 16)},
    architecture="Toy",
)
MAX_RANK = 64
MODULES = list(SPEC.module_shapes)
ALL = [(layer, m) for layer in range(SPEC.num_layers) for m in MODULES]


def _make_adapters(root, write_adapter, count, seed):
    """name -> (folder, {(layer, module): (A, B, scaling)}); ranks 1..64, some with a rank_pattern, some with
    few modules."""
    rng = random.Random(seed)
    made = {}
    for k in range(count):
        r = rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 31, 32, 33, 48, 63, 64])
        alpha = float(rng.choice([1, 2, 8, 16, 32]))
        if rng.random() < 0.3:
            targets = ALL
        else:
            modules = rng.sample(MODULES, rng.randint(1, 3))
            targets = [(layer, m) for layer in range(SPEC.num_layers) for m in modules]
        pattern = {}
        if rng.random() < 0.35:  # one module gets another rank (above or below r)
            module = rng.choice(sorted({m for _, m in targets}))
            pattern[module] = rng.choice([1, 3, 8, 20, 40, 64])
        gen = torch.Generator().manual_seed(seed * 1000 + k)
        reference = {}
        for layer, module in targets:
            rank = pattern.get(module, r)
            in_f, out_f = SPEC.module_shapes[module]
            reference[(layer, module)] = (torch.randn(rank, in_f, generator=gen), torch.randn(out_f, rank, generator=gen),
                                          alpha / rank)
        folder = root / f"ad{k}"
        write_adapter(folder, {key: (a, b) for key, (a, b, _) in reference.items()}, r=r, lora_alpha=alpha,
                      rank_pattern=pattern)
        made[f"ad{k}"] = (folder, reference)
    return made


class Fuzz:
    def __init__(self, adapters, page_rows, num_pages, max_loras, rng):
        self.adapters = adapters
        self.page = page_rows
        self.rng = rng
        config = LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=3, background_loads=False,
                            page_rows=page_rows, num_pages=num_pages, install_staging_bytes=rng.choice([1, 1 << 20]))
        self.pool = LoRASlotPool(SPEC, dtype=torch.float32, config=config)
        self.num_pages = self.pool.weights.num_pages
        self.next_id = 1
        self.registered: dict[int, str] = {}  # int id -> adapter name (accepting pins)
        self.removing: set[int] = set()
        self.pins: dict[int, int] = {}
        self.held: dict[int, tuple[int, tuple[int, ...]]] = {}  # pinned id -> (slot, pages) at its first pin
        self.log: list[str] = []

    def add(self, name):
        folder, _ = self.adapters[name]
        int_id = self.next_id
        self.next_id += 1
        version = None
        if self.rng.random() < 0.5:  # header-only registration: pages planned from the layout
            version = load_peft_adapter(folder, SPEC, MAX_RANK).version_id
        assert self.pool.add_lora(LoRARequest(f"{name}-{int_id}", int_id, str(folder), version_id=version))
        self.registered[int_id] = name
        self.log.append(f"add {name} as {int_id} declared={version is not None}")

    def pages_for(self, int_id):
        ref = self.adapters[self.registered.get(int_id) or self.removed_name[int_id]][1]
        rank = max(a.shape[0] for a, _, _ in ref.values())
        return -(-rank // self.page)

    def pin(self, int_id):
        pool = self.pool
        could = pool.can_pin(int_id)
        self.log.append(f"pin {int_id} ({self.registered[int_id]}) can_pin={could}")
        try:
            slot = pool.pin(int_id)
        except NoFreeSlotError:
            assert not could, self.log[-30:]
            return
        assert could, self.log[-30:]
        self.pins[int_id] = self.pins.get(int_id, 0) + 1
        pages = pool.slots.pages_of(slot)
        if int_id in self.held:
            assert self.held[int_id] == (slot, pages), self.log[-30:]
        else:
            self.held[int_id] = (slot, pages)
        name = self.registered[int_id]
        rank = max(a.shape[0] for a, _, _ in self.adapters[name][1].values())
        assert len(pages) == -(-rank // self.page), (name, rank, pages)

    def unpin(self, int_id):
        self.log.append(f"unpin {int_id}")
        self.pool.unpin(int_id)
        self.pins[int_id] -= 1
        if self.pins[int_id] == 0:
            del self.pins[int_id]
            del self.held[int_id]
            if int_id in self.removing:
                self.removing.discard(int_id)

    def remove(self, int_id):
        self.log.append(f"remove {int_id}")
        assert self.pool.remove_lora(int_id)
        del self.registered[int_id]
        if int_id in self.pins:
            self.removing.add(int_id)

    def step(self):
        rng = self.rng
        op = rng.random()
        if op < 0.12 or not self.registered:
            self.add(rng.choice(sorted(self.adapters)))
        elif op < 0.5:
            self.pin(rng.choice(sorted(self.registered)))
        elif op < 0.8 and self.pins:
            self.unpin(rng.choice(sorted(self.pins)))
        elif op < 0.86:
            self.remove(rng.choice(sorted(self.registered)))
        else:
            self.log.append("batch {")
            with self.pool.batched_installs():
                for _ in range(rng.randint(1, 4)):
                    if self.registered and rng.random() < 0.6:
                        self.pin(rng.choice(sorted(self.registered)))
                    elif self.pins:
                        self.unpin(rng.choice(sorted(self.pins)))
            self.log.append("}")

    def check(self):
        pool, weights, P = self.pool, self.pool.weights, self.page
        seen: list[int] = []
        resident = 0
        for slot in range(pool.max_loras):
            occupant = pool.slots.occupant(slot)
            pages = pool.slots.pages_of(slot)
            rank = int(weights.ranks[slot])
            table = weights.page_table[slot].tolist()
            if occupant is None:
                assert pages == () and rank == 0, (slot, pages, rank, self.log[-30:])
                assert not weights._scaling_table[:, :, slot].any(), (slot, self.log[-30:])
                continue
            int_id, pin_count = occupant
            resident += 1
            assert pin_count == self.pins.get(int_id, 0), self.log[-30:]
            if int_id in self.held:
                assert self.held[int_id] == (slot, pages), ("pinned adapter moved", int_id, self.log[-30:])
            assert rank == len(pages) * P, (slot, rank, pages, self.log[-30:])
            assert table[: len(pages)] == list(pages) and all(p == -1 for p in table[len(pages):]), (table, pages)
            seen += pages
            name = self.registered.get(int_id) or self.removed_name.get(int_id)
            reference = self.adapters[name][1]
            for layer in range(SPEC.num_layers):
                for column, (module, (in_f, out_f)) in enumerate(SPEC.module_shapes.items()):
                    index = torch.tensor(table[: len(pages)], dtype=torch.long)
                    a = weights.a[layer][module].index_select(0, index).flatten(0, 1)
                    b = weights.b[layer][module].index_select(0, index).permute(1, 0, 2).flatten(1, 2)
                    expected_a, expected_b, scaling = torch.zeros(rank, in_f), torch.zeros(out_f, rank), 0.0
                    if (layer, module) in reference:
                        ref_a, ref_b, scaling = reference[(layer, module)]
                        expected_a[: ref_a.shape[0]] = ref_a
                        expected_b[:, : ref_b.shape[1]] = ref_b
                    assert torch.equal(a, expected_a) and torch.equal(b, expected_b), (
                        "slot contents", name, slot, layer, module, self.log[-30:])
                    got = float(weights.scaling[layer][module][slot])
                    assert got == pytest.approx(scaling, rel=1e-6), (name, layer, module, got, scaling)
                    fa, fb = weights.slot_factors(slot, layer, module)
                    assert torch.equal(fa, a) and torch.equal(fb, b)
        assert len(seen) == len(set(seen)), ("pages shared", seen, self.log[-30:])
        assert set(seen) | pool.slots._free_pages == set(range(self.num_pages))
        assert not set(seen) & pool.slots._free_pages
        assert len(self.pins) <= resident


@pytest.mark.parametrize("seed,page_rows,num_pages,max_loras", [
    (1, 8, 12, 4), (2, 4, 22, 4), (3, 8, 9, 3), (4, 4, 16, 5), (5, 8, None, 3), (6, 8, 8, 6),
])
def test_fuzz_pool_matches_peft(tmp_path, write_adapter, seed, page_rows, num_pages, max_loras):
    adapters = _make_adapters(tmp_path, write_adapter, 9, seed)
    rng = random.Random(seed)
    fuzz = Fuzz(adapters, page_rows, num_pages, max_loras, rng)
    fuzz.removed_name = {}
    original_remove = fuzz.remove

    def remove(int_id):
        fuzz.removed_name[int_id] = fuzz.registered[int_id]
        original_remove(int_id)

    fuzz.remove = remove
    for _ in range(250):
        fuzz.step()
        fuzz.check()
    assert fuzz.pool.stats().slot_evictions >= 5  # page / slot pressure was exercised


def test_write_many_equals_one_by_one_writes_on_scattered_pages(tmp_path, write_adapter):
    adapters = _make_adapters(tmp_path, write_adapter, 8, 11)
    config = LoRAConfig(max_loras=8, max_lora_rank=MAX_RANK, max_cpu_loras=8, background_loads=False, page_rows=4)
    pool = LoRASlotPool(SPEC, dtype=torch.float32, config=config)
    images = []
    for k, (name, (folder, _)) in enumerate(sorted(adapters.items())):
        pool.add_lora(LoRARequest(name, k + 1, str(folder)))
        images.append(pool.loader.host_copy(pool.registry.get(k + 1)))
    num_pages = sum(image.num_pages for image in images) + 5
    rng = random.Random(3)
    order = list(range(num_pages))
    rng.shuffle(order)
    writes, start = [], 0
    for slot, image in enumerate(images):
        writes.append((slot, image, tuple(order[start : start + image.num_pages])))
        start += image.num_pages

    def fresh():
        w = LoRADeviceWeights(SPEC, 8, MAX_RANK, torch.float32, "cpu", page_rows=4, num_pages=num_pages)
        # dirty every page first, so stale zeroing is exercised too
        full = LoRADeviceWeights(SPEC, 1, MAX_RANK, torch.float32, "cpu", page_rows=4, num_pages=num_pages)
        del full
        for layer in range(SPEC.num_layers):
            for m in MODULES:
                w.a[layer][m].fill_(7.0)
                w.b[layer][m].fill_(7.0)
        w._written = [frozenset(ALL)] * num_pages
        return w

    one, many, tiny = fresh(), fresh(), fresh()
    for write in writes:
        one.write(*write)
    many.write_many(writes, staging_bytes=1 << 20)
    tiny.write_many(writes, staging_bytes=1)  # one image per chunk
    for other in (many, tiny):
        assert torch.equal(one.page_table, other.page_table) and torch.equal(one.ranks, other.ranks)
        assert torch.equal(one._scaling_table, other._scaling_table)
        for slot, image, pages in writes:
            for layer in range(SPEC.num_layers):
                for m in MODULES:
                    for t in (0, 1):
                        assert torch.equal(one.slot_factors(slot, layer, m)[t], other.slot_factors(slot, layer, m)[t])
        used = sorted(p for _, _, pages in writes for p in pages)
        for layer in range(SPEC.num_layers):
            for m in MODULES:
                assert torch.equal(one.a[layer][m][used], other.a[layer][m][used])
                assert torch.equal(one.b[layer][m][used], other.b[layer][m][used])
