"""The paged adapter weight pool ("ranks without padding") under fuzzing and at the edges.

Pool level: a differential fuzz of LoRASlotPool (pin / unpin / remove / re-add / batched installs) with adapters
of random ranks, rank_pattern and target sets against their PEFT factors; LoRADeviceWeights.write_many against
one-by-one writes on scattered pages.

Engine level (the LLM API on the tiny Llama against HF + PEFT): DoRA and rank_pattern adapters of mixed ranks on
8-row pages, the min(lora_page_rows, max_lora_rank) rule, prefix caching across ranks, an adapter removed while
pinned whose pages are reused, emulated CUDA-graph steps, the Triton kernels (interpreter), vocabulary adapters,
tensor parallelism over pages, and admission liveness when pages (not slots) are short.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, SamplingParams
from loraplex.adapters import BaseModelSpec, LoRASlotPool, NoFreeSlotError
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import load_peft_adapter
from tiny_models import check_row, hf_greedy_ids, hf_last_logprobs, make_peft_adapter, reference_models

_ENGINE_TESTS = str(Path(__file__).resolve().parents[1] / "engine")
if _ENGINE_TESTS not in sys.path:
    sys.path.append(_ENGINE_TESTS)  # sched_sim, test_step_fastpaths

from test_paged_pool import MAX_RANK, SPEC  # noqa: E402 - the toy model and pool rank of the exact page tests

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
        self.removed_name: dict[int, str] = {}  # removed ids (still resident while pinned) -> adapter name
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
        self.removed_name[int_id] = self.registered.pop(int_id)
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
        # dirty every page first (as if written by an adapter on every module), so stale zeroing runs too
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


def test_pool_with_a_max_lora_rank_that_is_not_a_power_of_two(tmp_path, write_adapter):
    """LoRAConfig accepts any max_lora_rank >= 1 and the pool served max_lora_rank=12 before the change (one padded
    rectangle per slot). Without page_rows the pool's pages are max_lora_rank rows, and LoRADeviceWeights now
    refuses them as 'page_rows=12 must be a power of two', a setting the caller never gave."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(12, 16, generator=gen), torch.randn(16, 12, generator=gen)
    write_adapter(tmp_path / "r12", {(0, "q_proj"): (a, b)}, r=12, lora_alpha=12.0)
    pool = LoRASlotPool(SPEC, 2, 12, 2, torch.float32, "cpu")
    assert pool.add_lora(LoRARequest("r12", 1, str(tmp_path / "r12")))
    slot = pool.pin(1)
    got_a, got_b = pool.weights.slot_factors(slot, 0, "q_proj")
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


# ---------------------------------------------------------------------------------------------------- engine

ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NEW = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
TEXTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Colors: red, green"]


def make_pattern_adapter(base_dir: Path, out_dir: Path, *, r: int, rank_pattern: dict[str, int], targets,
                         seed: int) -> Path:
    """A PEFT adapter whose modules have different ranks (``rank_pattern``), random non-zero B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), rank_pattern=rank_pattern,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
            elif "lora_A" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("paged-review")
    paths = {
        "dora4": make_peft_adapter(tiny_llama_dir, root / "dora4", r=4, alpha=8, targets=ALL_PROJ, seed=71, use_dora=True),
        "dora12": make_peft_adapter(tiny_llama_dir, root / "dora12", r=12, alpha=12,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=72, use_dora=True),
        "lora8": make_peft_adapter(tiny_llama_dir, root / "lora8", r=8, alpha=16, targets=("q_proj", "v_proj"),
                                   seed=73),
        "pattern": make_pattern_adapter(tiny_llama_dir, root / "pattern", r=6, rank_pattern={"down_proj": 24},
                                        targets=("q_proj", "v_proj", "down_proj"), seed=74),
        "lora32": make_peft_adapter(tiny_llama_dir, root / "lora32", r=32, alpha=32, targets=ALL_PROJ, seed=75,
                                    b_std=0.05),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def models(tiny_llama_dir, adapters):
    return reference_models(tiny_llama_dir, adapters)


_REFS: dict = {}


def reference(models, prompts, name, i, max_new=MAX_NEW):
    key = (name, i, max_new)
    if key not in _REFS:
        model = models[name]
        _REFS[key] = (hf_greedy_ids(model, prompts[i], max_new), hf_last_logprobs(model, prompts[i]))
    return _REFS[key]



def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    kw.setdefault("max_lora_rank", 32)
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=256, enable_lora=True, **kw)


def pages_of(llm, request):
    pool = llm.engine.lora_pool
    return pool.slots.pages_of(pool.slot_of(request.lora_int_id))


def test_dora_and_rank_pattern_of_mixed_ranks_on_8_row_pages_equal_peft(tiny_llama_dir, adapters, prompts, models):
    """DoRA r=4 (all modules) and r=12 (attention), LoRA r=8, rank_pattern r=6 / down_proj 24, base: one batch."""
    llm = make_llm(tiny_llama_dir, lora_page_rows=8)
    order = ["dora4", "dora12", None, "pattern", "lora8"]
    rows = [(name, i % len(prompts)) for i, name in enumerate(order)]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in rows], PARAMS,
                        lora_request=[adapters[n] if n else None for n, _ in rows])
    for (name, i), out in zip(rows, outs):
        check_row(out, *reference(models, prompts, name or "base", i))
    assert {n: len(pages_of(llm, adapters[n])) for n in ("dora4", "dora12", "pattern", "lora8")} == \
        {"dora4": 1, "dora12": 2, "pattern": 3, "lora8": 1}
    assert llm.engine.lora_pool.weights.dora_slots  # the DoRA gains were computed from paged factors


def test_page_rows_above_max_lora_rank_take_the_min(tiny_llama_dir, adapters, prompts, models):
    """max_lora_rank=8, lora_page_rows=16: pages of 8 rows, one per adapter (the rectangle path through the
    table); a rank-4 and a rank-8 adapter with base rows."""
    llm = make_llm(tiny_llama_dir, max_lora_rank=8, lora_page_rows=16, max_loras=2)
    weights = llm.engine.lora_pool.weights
    assert weights.page_rows == 8 and weights.page_table.shape == (2, 1) and weights.num_pages == 2
    order = ["dora4", "lora8", None]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in range(3)], PARAMS,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *reference(models, prompts, name or "base", i))


def test_prefix_cache_is_not_shared_across_adapters_of_different_ranks(tiny_llama_dir, adapters, prompts, models):
    llm = make_llm(tiny_llama_dir, lora_page_rows=8, enable_prefix_caching=True, max_loras=2)
    long_prompt = prompts[0] + prompts[1] + prompts[2]
    names = ["lora8", "pattern", None, "lora8", "pattern", None]
    outs = []
    for name in names:  # one at a time: each later one may find the earlier ones' blocks
        outs += llm.generate({"prompt_token_ids": long_prompt}, PARAMS,
                             lora_request=adapters[name] if name else None)
    for name, out in zip(names, outs):
        model = models[name or "base"]
        check_row(out, hf_greedy_ids(model, long_prompt, MAX_NEW), hf_last_logprobs(model, long_prompt))
    assert [o.num_cached_tokens > 0 for o in outs] == [False, False, False, True, True, True]


def test_adapter_removed_while_pinned_gives_its_pages_to_a_waiting_one(tiny_llama_dir, adapters, prompts, models):
    """max_lora_pages=4 (8-row pages): lora32 (4 pages, all modules) runs; it is removed while running; a request
    on `pattern` (3 pages, fewer modules) waits for those pages and then reuses them: both rows equal PEFT."""
    llm = make_llm(tiny_llama_dir, lora_page_rows=8, max_lora_pages=4, max_loras=2)
    engine = llm.engine
    long_params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=5)
    engine.add_request("long", prompts[0], long_params, adapters["lora32"])
    engine.step()
    old_pages = pages_of(llm, adapters["lora32"])
    assert old_pages == (0, 1, 2, 3)
    assert engine.remove_lora(adapters["lora32"].lora_int_id)
    with pytest.raises(AdapterError):
        engine.add_request("again", prompts[1], PARAMS, adapters["lora32"])
    engine.add_request("short", prompts[2], PARAMS, adapters["pattern"])
    finals, reused = {}, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        pool = engine.lora_pool
        if reused is None and pool.slots.slot_of(adapters["pattern"].lora_int_id) is not None:
            reused = pages_of(llm, adapters["pattern"])
            assert "long" in finals  # it waited for the removed adapter's pages
    assert set(reused) <= set(old_pages)
    check_row(finals["long"], *reference(models, prompts, "lora32", 0, 12))
    check_row(finals["short"], *reference(models, prompts, "pattern", 2))
    assert engine.lora_pool.slots.slot_of(adapters["lora32"].lora_int_id) is None


def test_emulated_graph_steps_with_pages_and_churn_equal_peft(tiny_llama_dir, adapters, prompts, models):
    """Decode steps through the (emulated) CUDA-graph runner while 4 adapters of ranks 4..32 (DoRA among them)
    churn through 2 slots and 5 pages: page table and ranks are read in place by the captured steps."""
    from test_step_fastpaths import _emulate_graphs

    llm = make_llm(tiny_llama_dir, lora_page_rows=8, max_loras=2, max_lora_pages=5, max_num_seqs=4)
    replays = _emulate_graphs(llm)
    order = ["dora12", "lora32", None, "dora4", "pattern", "lora8"]
    rows = [(name, i % len(prompts)) for i, name in enumerate(order)]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in rows], PARAMS,
                        lora_request=[adapters[n] if n else None for n, _ in rows])
    for (name, i), out in zip(rows, outs):
        check_row(out, *reference(models, prompts, name or "base", i))
    assert sum(r.replays for r in replays if r.with_lora) > 0
    assert llm.engine.lora_pool.stats().slot_evictions > 0


@pytest.mark.interpreter
def test_triton_kernels_on_pages_equal_peft(tiny_llama_dir, adapters, prompts, models, monkeypatch):
    """The engine through the Triton kernels (CPU interpreter): paged shrink/expand, DoRA, rank_pattern."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    from loraplex.engine import llm_engine

    monkeypatch.setattr(llm_engine, "default_backend", lambda device: "triton")
    llm = make_llm(tiny_llama_dir, lora_page_rows=8)
    assert llm.engine.model.norm.kernels.backend == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2, logprobs=5)
    order = ["pattern", "dora12", None]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in range(3)], params,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        tokens, lp = reference(models, prompts, name or "base", i)
        check_row(out, tokens[:2], lp)


def test_tp2_with_pages_equals_tp1(tiny_llama_dir, adapters, prompts):
    """Ranks 8 and 32 (and rank_pattern 6/24) on 8-row pages, 2 slots, TP=2 over gloo against TP=1."""
    loras = [adapters["lora8"], adapters["lora32"], None, adapters["pattern"], adapters["lora32"]]
    batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(loras))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    results = []
    for tp in (1, 2):
        llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=32, lora_page_rows=8,
                  max_lora_pages=6, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=32,
                  tensor_parallel_size=tp)
        try:
            weights = llm.engine.lora_pool.weights
            assert weights.page_rows == 8 and weights.page_table.shape == (2, 4) and weights.num_pages == 6
            results.append((llm.generate(batch, params, loras), llm.engine.lora_pool.stats()))
        finally:
            llm.engine.close()
    assert not multiprocessing.active_children()
    (ref, ref_stats), (got, got_stats) = results
    assert got_stats.slot_evictions == ref_stats.slot_evictions > 0
    for r, t in zip(ref, got):
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        ids = r.outputs[0].token_ids
        ref_lp = torch.tensor([step[tok] for step, tok in zip(r.outputs[0].logprobs, ids)])
        tp_lp = torch.tensor([step[tok] for step, tok in zip(t.outputs[0].logprobs, ids)])
        assert torch.allclose(tp_lp, ref_lp, atol=1e-4)


# ---------------------------------------------------------------------------------------------- liveness


def test_adapter_needing_more_pages_than_the_pool_holds_does_not_wait_forever(tiny_llama_dir, adapters, prompts):
    """max_lora_pages=2 with 8-row pages and max_lora_rank=32: a rank-32 adapter needs 4 pages, more than the
    whole pool. The engine must refuse it (at add_lora / add_request) or fail its request; it must not keep the
    request waiting for pages that can never be free (LLM.generate would never return)."""
    try:
        llm = make_llm(tiny_llama_dir, lora_page_rows=8, max_lora_pages=2, max_loras=2)
    except ValueError:
        return  # the configuration refused: max_lora_pages below one max_lora_rank adapter's pages
    engine = llm.engine
    try:
        engine.add_request("big", prompts[0], PARAMS, adapters["lora32"])
    except AdapterError:
        return  # refused up front: fine
    finished = False
    for _ in range(30):
        if any(out.finished for out in engine.step()):
            finished = True
            break
    assert finished, ("a request on a rank-32 adapter (4 pages) with max_lora_pages=2 is still waiting after 30 "
                      "steps: it can never be admitted")


def test_high_rank_adapter_blocked_on_pages_is_not_starved(tmp_path):
    """Aging for pages: max_loras=4, num_pages=9 (8-row pages); two rank-8 adapters with closed-loop clients keep
    2 of the 4 slots and 2 pages busy at all times; a rank-64 request (8 pages) must still run within about
    max_adapter_wait_steps plus a few request durations (the scheduler docstring's guarantee for a request
    blocked on a slot; the config says a page-blocked adapter 'waits like one without a free slot')."""
    from sched_sim import Sim, closed_loop, make_scheduler

    from loraplex.adapters import BaseModelSpec, LoRASlotPool
    from loraplex.adapters.config import LoRAConfig

    spec = BaseModelSpec(num_layers=1, hidden_size=16, module_shapes={"q_proj": (16, 16)}, architecture="Toy")
    pool = LoRASlotPool(spec, dtype=torch.float32, config=LoRAConfig(
        max_loras=4, max_lora_rank=64, max_cpu_loras=4, background_loads=False, page_rows=8, num_pages=9))
    for int_id, rank in ((1, 8), (2, 8), (3, 64)):
        _write_toy_adapter(tmp_path / f"a{int_id}", rank)
        pool.add_lora(LoRARequest(f"a{int_id}", int_id, str(tmp_path / f"a{int_id}")))
    sim = Sim(make_scheduler(pool, max_loras=4, max_adapter_wait_steps=32))
    for lora in (1, 2):
        for client in range(6):
            closed_loop(sim, f"a{lora}c{client}", start=client * 5 + lora, lora=lora)
    big = sim.submit("big", at=40, lora=3)
    sim.run(400)
    assert big.first_token_step is not None, (
        f"the rank-64 request waited {sim.now - 40} steps for 8 free pages (only "
        f"{len(sim.scheduler.running_adapters())} of 4 slots in use, so the slot aging never drains one)")
    assert big.ttft_steps <= 32 + 3 * 32


def _write_toy_adapter(folder: Path, rank: int) -> None:
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"], "bias": "none"}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.randn(rank, 16), f"{prefix}.lora_B.weight": torch.randn(16, rank)},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def test_vocab_adapters_with_zero_or_few_pages_equal_peft(tiny_llama_dir, tmp_path_factory, prompts):
    """LoRA on embed_tokens only (no projection: 0 pages), on lm_head + v_proj (r=8: 2 pages of 4), a
    modules_to_save head copy with q_proj r=4 (1 page), with 4-row pages, 2 slots and 3 pages: churn."""
    import warnings

    from tiny_models import make_vocab_adapter

    root = tmp_path_factory.mktemp("vocab-paged")
    cases = {"embed": dict(target_modules=["embed_tokens"], r=4, lora_alpha=8),
             "head": dict(target_modules=["lm_head", "v_proj"], r=8, lora_alpha=8),
             "save_head": dict(target_modules=["q_proj"], modules_to_save=["lm_head"], r=4, lora_alpha=8)}
    reqs = {name: LoRARequest(name, 20 + i, str(make_vocab_adapter(tiny_llama_dir, root / name, 50 + i, **kw)))
            for i, (name, kw) in enumerate(cases.items())}
    llm = make_llm(tiny_llama_dir, max_lora_rank=8, lora_page_rows=4, max_loras=2, max_lora_pages=3,
                   max_full_module_slots=1, max_num_seqs=2)
    order = ["embed", "head", "save_head", "embed", None, "head"]
    rows = [(name, i % len(prompts)) for i, name in enumerate(order)]
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for _, i in rows], PARAMS,
                        lora_request=[reqs[n] if n else None for n, _ in rows])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = reference_models(tiny_llama_dir, reqs)
    for (name, i), out in zip(rows, outs):
        model = models[name or "base"]
        check_row(out, hf_greedy_ids(model, prompts[i], MAX_NEW), hf_last_logprobs(model, prompts[i]))
    assert llm.engine.lora_pool.stats().slot_evictions > 0


def test_slot_aging_drain_for_a_page_blocked_adapter_does_not_starve_the_drained_one(tmp_path):
    """max_loras=3, num_pages=9 (8-row pages): rank-8 adapters 1, 2, 3 with closed-loop clients fill the 3 slots
    (3 pages); a rank-64 request (8 pages) arrives. After max_adapter_wait_steps the slot aging drains one rank-8
    adapter for it; but the drained slot frees 1 page (7 free < 8), so the rank-64 adapter still cannot be placed
    and the drain never ends: the drained rank-8 adapter admits nothing, forever, while its clients wait."""
    from sched_sim import Sim, closed_loop, make_scheduler

    spec = BaseModelSpec(num_layers=1, hidden_size=16, module_shapes={"q_proj": (16, 16)}, architecture="Toy")
    pool = LoRASlotPool(spec, dtype=torch.float32, config=LoRAConfig(
        max_loras=3, max_lora_rank=64, max_cpu_loras=4, background_loads=False, page_rows=8, num_pages=9))
    for int_id, rank in ((1, 8), (2, 8), (3, 8), (4, 64)):
        _write_toy_adapter(tmp_path / f"a{int_id}", rank)
        pool.add_lora(LoRARequest(f"a{int_id}", int_id, str(tmp_path / f"a{int_id}")))
    sim = Sim(make_scheduler(pool, max_loras=3, max_adapter_wait_steps=32))
    for lora in (1, 2, 3):
        for client in range(6):
            closed_loop(sim, f"a{lora}c{client}", start=client * 5 + lora, lora=lora)
    sim.submit("big", at=40, lora=4)
    sim.run(500)
    last_served = {lora: max((step for step, out in enumerate(sim.lora_outputs) if out.get(lora)), default=None)
                   for lora in (1, 2, 3)}
    assert all(step is not None and step >= 400 for step in last_served.values()), (
        f"last step each rank-8 adapter produced a token (of 500): {last_served}; drain={sim.scheduler._drain}")
