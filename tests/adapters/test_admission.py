"""Adapter admission through the real slot pool and scheduler, on CPU with toy adapters.

Reads go through an executor that answers at submission (a disk with no latency), so what
is measured is the admission logic in counted scheduler steps, never wall time: a finished
read frees its place in the read queue at once (the completion queue), so a burst of new
adapters is admitted as soon as the slots allow instead of ``max_loads_in_flight`` per step;
the adapters of queued requests the scan did not reach are prefetched, at most the host
cache size of them.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from loraplex.adapters import BaseModelSpec, LoRASlotPool, load_peft_adapter
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import RequestGroup, Sequence

SPEC = BaseModelSpec(num_layers=1, hidden_size=8, module_shapes={"q_proj": (8, 8)}, architecture="Toy")
MAX_RANK = 4
PROMPT_TOKENS = 4


class InstantExecutor(concurrent.futures.Executor):
    """Runs each read at submission; counts the submissions."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the claimer like a real read
            future.set_exception(exc)
        return future


@pytest.fixture
def requests_for(tmp_path, write_adapter):
    def make(count: int) -> list[LoRARequest]:
        made = []
        for index in range(1, count + 1):
            generator = torch.Generator().manual_seed(index)
            folder = tmp_path / f"ad{index}"
            a, b = torch.randn(2, 8, generator=generator), torch.randn(8, 2, generator=generator)
            write_adapter(folder, {(0, "q_proj"): (a, b)}, r=2, lora_alpha=2.0)
            version = load_peft_adapter(folder, SPEC, MAX_RANK).version_id
            made.append(LoRARequest(f"ad{index}", index, str(folder), version_id=version))
        return made

    return make


def setup(requests, *, max_loras, max_cpu_loras, budget, max_loads_in_flight=None):
    executor = InstantExecutor()
    pool = LoRASlotPool(SPEC, max_loras, MAX_RANK, max_cpu_loras, torch.float32, "cpu",
                        max_loads_in_flight=max_loads_in_flight, read_executor=executor)
    for request in requests:
        pool.add_lora(request)
    kv = KVCacheManager(1024, block_size=4, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget, max_loras=max_loras,
                             max_model_len=128, max_lookahead_loras=max_cpu_loras)
    scheduler = Scheduler(config, kv, pool)
    for request in requests:
        group = RequestGroup(f"r{request.lora_int_id}", None, list(range(PROMPT_TOKENS)), SamplingParams(), request,
                             request.version_id)
        seq = Sequence(request.lora_int_id, group, 0, list(range(PROMPT_TOKENS)), PROMPT_TOKENS, None, None)
        group.seqs.append(seq)
        scheduler.add(seq)
    return pool, scheduler, executor


def admitted_per_step(scheduler, steps: int) -> list[int]:
    counts = []
    for _ in range(steps):
        batch = scheduler.schedule()
        assert not batch.failures
        counts.append(len(batch.seqs))
        for item in batch.seqs:  # the prompt is computed: the sequence decodes from now on
            item.seq.num_computed_tokens += item.num_new_tokens
    return counts


@pytest.mark.parametrize("max_loads_in_flight", [4, 64])
def test_64_new_adapters_fill_every_free_slot_in_one_step(requests_for, max_loads_in_flight):
    """64 queued requests on 64 adapters, 16 slots: step 1 queues all 64 reads (they finish at
    once and each frees its place in the read queue, so a queue of 4 does not cap them), step 2
    admits 16, one per slot; before, reads were claimed only when their own adapter was asked
    again and at most 4 were unclaimed, so about 4 adapters were admitted per step."""
    pool, scheduler, executor = setup(requests_for(64), max_loras=16, max_cpu_loras=64, budget=1024,
                                      max_loads_in_flight=max_loads_in_flight)
    assert admitted_per_step(scheduler, 1) == [0]
    assert executor.submitted == 64
    assert admitted_per_step(scheduler, 1) == [16]  # 16 prefills; the running 16 decode after that
    stats = pool.stats()
    assert sorted(s.lora_int_id for s in stats.slots) == list(range(1, 17))
    assert all(s.pin_count == 1 for s in stats.slots)
    assert (stats.disk_loads, stats.slot_loads, stats.cpu_evictions, stats.loads_in_flight) == (64, 16, 0, 0)
    assert executor.submitted == 64  # every adapter read once


@pytest.mark.parametrize(("max_cpu_loras", "reads_started"), [(16, 14), (8, 6)])
def test_adapters_behind_the_budget_are_prefetched_up_to_the_host_cache(requests_for, max_cpu_loras,
                                                                        reads_started):
    """16 queued adapters, the first two ready; the token budget admits only those two, yet the
    reads of the others start in the same step: all 14 with a 16-entry host cache, 6 with an
    8-entry one (2 ready + 6 = 8), so that no prefetch evicts another before it is pinned."""
    pool, scheduler, executor = setup(requests_for(16), max_loras=16, max_cpu_loras=max_cpu_loras,
                                      budget=2 * PROMPT_TOKENS)
    pool.preload(1)
    pool.preload(2)
    assert admitted_per_step(scheduler, 1) == [2]
    assert executor.submitted == reads_started
    assert pool.stats().cpu_evictions == 0
    assert sorted(pool.stats().cpu_cache_lru) == sorted(f"ad{i}" for i in range(1, 3 + reads_started))
