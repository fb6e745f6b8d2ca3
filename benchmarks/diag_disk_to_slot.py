"""Where the disk -> slot time of one adapter goes (issue 17 goal 3: <= 5 ms for a 16.8 MB q/v adapter).

Llama-2-7B shapes, q/v r=16, bf16, a pool serving q_proj,v_proj (16 slots), files in the page cache, the adapter
evicted from the host cache and its slot before each run (the re-read path of ``bench_serving.disk_to_slot``).
Medians over 16 adapters, ms:

- ``total``: ``ensure_ready`` until True, then a pin in one install batch, device synchronized;
- ``read``: the loader's verified re-read alone on this thread (header, ``pread`` into the host arena);
- ``header``: ``stored_tensors`` (the safetensors header parsed) alone; ``pread``: the data section read alone;
- ``install``: the pin of an image already in the host cache (copy to the device staging, scatter into pages),
  device synchronized.

Usage: ``python benchmarks/diag_disk_to_slot.py [--count N] [--read-parts 2,4,8]`` (CUDA; on CPU the install is a
host copy). ``--read-parts``: the same medians once per value of ``tensor_file.PARALLEL_READ_PARTS`` (the parts a
data section's ``pread`` is split into; default: the library's value only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving as bs  # noqa: E402
from common import make_model_dir, out_dir  # noqa: E402

from loraplex.adapters import LoRASlotPool, tensor_file  # noqa: E402
from loraplex.adapters.config import LoRAConfig  # noqa: E402
from loraplex.adapters.model_spec import ModelSpec  # noqa: E402
from loraplex.adapters.tensor_file import stored_tensors  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--read-parts", default=None, help="comma-separated PARALLEL_READ_PARTS values to time in turn")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler tables (CPU and device time by op) of 4 installs and 4 re-reads")
    args = ap.parse_args()
    from transformers import AutoConfig

    root = Path(tempfile.mkdtemp())
    config = dict(bs.LLAMA2_7B)
    model_dir = make_model_dir(root / "model", config)
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    adapters = bs.make_adapters(root / "adapters", config, args.count, args.count, targets=("q_proj", "v_proj"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = LoRASlotPool(spec.served_adapter_spec(("q_proj", "v_proj")), dtype=torch.bfloat16, device=device,
                        config=LoRAConfig(max_loras=16, max_lora_rank=16, max_cpu_loras=args.count,
                                          background_loads=device == "cuda", page_rows=16))
    for a in adapters:
        pool.add_lora(a)
    ids = [a.lora_int_id for a in adapters]
    for i in ids:  # first reads (hashed), then out of the host cache and the slots
        while not pool.ensure_ready(i):
            pool.wait_for_loads(timeout_s=0.0002)
        with pool.batched_installs():
            pool.pin(i)
        sync()
        pool.unpin(i)

    def evict(i: int) -> None:
        pool.loader.cache.pop(i)
        slot = pool.slots.slot_of(i)
        if slot is not None and slot >= 0:
            pool.slots.clear(slot)

    parts_values = [int(p) for p in args.read_parts.split(",")] if args.read_parts else [tensor_file.PARALLEL_READ_PARTS]
    results = {}
    for parts in parts_values:
        tensor_file.PARALLEL_READ_PARTS = parts
        tensor_file._forget_read_pool_in_child()  # a pool of PARALLEL_READ_PARTS - 1 threads is made at the next read
        results[parts] = measure(pool, ids, evict)
        print(f"PARALLEL_READ_PARTS={parts}:", json.dumps({k: v for k, v in results[parts].items() if k != "all"}),
              flush=True)
    result = results[parts_values[-1]] if len(parts_values) == 1 else {"by_read_parts": results}
    if args.profile:
        profile(pool, ids[:4], evict)
    (out_dir() / "disk-to-slot.json").write_text(json.dumps(result, indent=1))


def measure(pool: LoRASlotPool, ids: list[int], evict) -> dict:
    """The medians (ms) described in the module docstring, over ``ids``."""
    times: dict[str, list[float]] = {k: [] for k in ("total", "read", "header", "pread", "install")}
    buf = None
    for i in ids:
        evict(i)
        times["total"].append(bs.time_to_slot(pool, i))
        evict(i)
        registration = pool.registry.get(i)
        t0 = time.perf_counter()
        pool.loader.read_now(registration)
        times["read"].append(1e3 * (time.perf_counter() - t0))
        path = Path(registration.request.lora_path) / "adapter_model.safetensors"
        t0 = time.perf_counter()
        stored = stored_tensors(path)
        times["header"].append(1e3 * (time.perf_counter() - t0))
        start = min(t.offset_bytes for t in stored.values())
        if buf is None:  # one buffer, touched once (as the host arena's reused chunks are)
            buf = torch.ones(os.path.getsize(path) - start, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], start + done)
        times["pread"].append(1e3 * (time.perf_counter() - t0))
        os.close(fd)
        # the image is in the host cache again (read_now): time the install alone
        while not pool.ensure_ready(i):
            pool.wait_for_loads(timeout_s=0.0002)
        sync()
        t0 = time.perf_counter()
        with pool.batched_installs():
            pool.pin(i)
        sync()
        times["install"].append(1e3 * (time.perf_counter() - t0))
        pool.unpin(i)
    cached = pool.loader.cached(ids[0])
    return {k: statistics.median(v) for k, v in times.items()} | {
        "all": times, "device": str(pool.weights.device), "adapter_MB": cached.nbytes / 1e6 if cached else None}


def profile(pool: LoRASlotPool, ids: list[int], evict) -> None:
    """torch.profiler tables of ``ids``' installs (images in the host cache) and of their loader re-reads."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for label, evict_host in (("install (image in the host cache)", False), ("re-read (evicted from the host cache)",
                                                                             True)):
        for i in ids:  # images in the host cache, out of their slots
            evict(i) if evict_host else evict_slot(pool, i)
            while not pool.ensure_ready(i):
                pool.wait_for_loads(timeout_s=0.0002)
            evict(i) if evict_host else evict_slot(pool, i)
        sync()
        with torch_profile(activities=activities) as prof:
            for i in ids:
                if evict_host:
                    pool.loader.read_now(pool.registry.get(i))
                else:
                    with pool.batched_installs():
                        pool.pin(i)
                    sync()
                    pool.unpin(i)
        sort = "self_cuda_time_total" if torch.cuda.is_available() and not evict_host else "self_cpu_time_total"
        print(f"--- {label}, {len(ids)} adapters", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)


def evict_slot(pool: LoRASlotPool, i: int) -> None:
    slot = pool.slots.slot_of(i)
    if slot is not None and slot >= 0:
        pool.slots.clear(slot)


if __name__ == "__main__":
    main()
