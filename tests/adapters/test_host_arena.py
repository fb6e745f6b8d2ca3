"""The host cache's arena (issue 17 goal 3: no allocation per adapter read): exact byte ranges,
reuse after an image dies, chunk allocations counted through the slot pool, image contents
intact under churn."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from loraplex.adapters import BaseModelSpec, LoRASlotPool, load_peft_adapter
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.host_arena import HostArena
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.slot_image import slot_image_from_adapter

SPEC = BaseModelSpec(num_layers=2, hidden_size=16, module_shapes={"q_proj": (16, 16), "v_proj": (16, 8)},
                     architecture="Toy")
MAX_RANK = 4
IMAGE_BYTES = 2 * MAX_RANK * ((16 + 16) + (16 + 8)) * 4  # both layers, q and v, fp32: 1792 bytes


def offset(arena: HostArena, tensor: torch.Tensor) -> tuple[int, int]:
    """(chunk index, byte offset in it) of ``tensor``."""
    for index, chunk in enumerate(arena._chunks):
        base = chunk.buffer.data_ptr()
        if base <= tensor.data_ptr() < base + chunk.buffer.numel():
            return index, tensor.data_ptr() - base
    raise AssertionError("not in the arena")


def test_ranges_are_aligned_first_fit_and_reused_after_the_tensor_dies():
    arena = HostArena(4096, pin_memory=False)
    a = arena.empty(100, torch.float32)  # 400 bytes -> one 512-byte range
    b = arena.empty(300, torch.bfloat16)  # 600 bytes -> 1024
    c = arena.empty(512, torch.float32)  # 2048 bytes
    assert [offset(arena, t) for t in (a, b, c)] == [(0, 0), (0, 512), (0, 1536)]
    assert a.shape == (100,) and b.dtype == torch.bfloat16 and arena.free_bytes() == 4096 - 3584
    del b
    gc.collect()
    assert arena.free_bytes() == 4096 - 2560
    d = arena.empty(128, torch.float32)  # 512 bytes: first fit is b's old range
    assert offset(arena, d) == (0, 512)
    e = arena.empty(1024, torch.uint8)  # no free range of 1024 left in chunk 0: a new chunk
    assert offset(arena, e) == (1, 0) and arena.chunk_allocations == 2
    del a, d
    gc.collect()
    assert arena._chunks[0].free == [(0, 1536), (3584, 4096)]  # neighbours coalesced
    f = arena.empty(3000, torch.uint8)  # 3072 bytes: fits behind e in chunk 1
    assert offset(arena, f) == (1, 1024)
    big = arena.empty(5000, torch.uint8)  # larger than a chunk: a chunk of its own size
    assert offset(arena, big) == (2, 0) and arena._chunks[2].buffer.numel() == 5120
    assert (arena.chunk_allocations, arena.images) == (3, 7)
    del c, e, f, big


def make_requests(tmp_path, write_adapter, count: int, *, mixed: bool) -> list[LoRARequest]:
    """``mixed``: ranks 1-4 and target sets vary (images of several sizes); else rank 4 on every
    module (images of IMAGE_BYTES)."""
    made = []
    for index in range(1, count + 1):
        generator = torch.Generator().manual_seed(index)
        rank = 1 + index % MAX_RANK if mixed else MAX_RANK
        weights = {(layer, module): (torch.randn(rank, SPEC.module_shapes[module][0], generator=generator),
                                     torch.randn(SPEC.module_shapes[module][1], rank, generator=generator))
                   for layer in range(2) for module in ("q_proj", "v_proj") if not mixed or (layer + index) % 3}
        write_adapter(tmp_path / f"ad{index}", weights, r=rank, lora_alpha=2.0 * rank)
        version = load_peft_adapter(tmp_path / f"ad{index}", SPEC, MAX_RANK).version_id
        made.append(LoRARequest(f"ad{index}", index, str(tmp_path / f"ad{index}"), version_id=version))
    return made


def churn(requests, chunk_bytes: int) -> tuple[LoRASlotPool, list[int]]:
    """160 reads of the 40 adapters in random order through a host cache of 4; returns the pool and
    the arena's chunk count after each read."""
    config = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, max_cpu_loras=4, background_loads=False,
                        host_arena_chunk_bytes=chunk_bytes)
    pool = LoRASlotPool(SPEC, dtype=torch.float32, device="cpu", config=config)
    for request in requests:
        pool.add_lora(request)
    rng = random.Random(0)
    chunks = []
    for _ in range(160):
        pool.ensure_ready(rng.randrange(1, len(requests) + 1))
        chunks.append(pool.loader.arenas[False].chunk_allocations)
    return pool, chunks


@pytest.mark.parametrize(("chunk_images", "chunks"), [(1, 5), (4, 2), (16, 1)])
def test_reads_take_no_allocation_once_the_chunks_exist(tmp_path, write_adapter, chunk_images, chunks):
    """Images of one size, a host cache of 4: at most 5 live at once (the cache and the image
    being read before the LRU one is evicted), so the arena allocates exactly ceil(5 / images
    per chunk) chunks while the cache first fills, then none in the remaining ~150 reads."""
    pool, counts = churn(make_requests(tmp_path, write_adapter, 40, mixed=False), chunk_images * IMAGE_BYTES)
    arena = pool.loader.arenas[False]
    assert pool.stats().disk_loads == arena.images > 100  # every read went into the arena
    assert counts[-1] == counts[10] == chunks


def test_mixed_sizes_reuse_ranges_and_images_stay_intact(tmp_path, write_adapter):
    """Ranks 1-4 and different target sets (several image sizes) in one-image chunks: the arena
    stops growing once the free ranges fit (first fit, coalesced), and every cached image still
    equals its adapter: no range was handed out again while its image lived."""
    requests = make_requests(tmp_path, write_adapter, 40, mixed=True)
    pool, counts = churn(requests, IMAGE_BYTES)
    assert counts[-1] == counts[80] <= 10
    for int_id in pool.loader.cache.lru_order():
        image = pool.loader.cached(int_id)
        expected = slot_image_from_adapter(load_peft_adapter(requests[int_id - 1].lora_path, SPEC, MAX_RANK),
                                           SPEC, MAX_RANK, torch.float32, pin_memory=False)
        assert torch.equal(image.data, expected.data) and torch.equal(image.scaling, expected.scaling)
