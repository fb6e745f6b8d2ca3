"""Adapter load path on the GPU machine: where the time of a cold adapter read goes.

Measures, for Llama-2-7B-shaped r=16 adapters (q/v: 16.8 MB; all 7 projections: 80 MB, bf16):
- one read at a time: header checks (``inspect_peft_adapter``), the read into a pinned
  image with a new pinned allocation and with a recycled one, and into pageable memory;
- the pool's background readers (``ensure_ready`` as the scheduler drives it) with 1/4/8
  threads, first with cold pinned memory, then recycled;
- installing an adapter into a GPU slot.

Run: ``python benchmarks/bench_adapter_loads.py`` (writes adapter-loads.json to $OUT).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA2_7B, adapter_version_id, git_commit, make_random_adapter, out_dir, print_table  # noqa: E402

from loraplex.adapters import BaseModelSpec, LoRASlotPool, inspect_peft_adapter  # noqa: E402
from loraplex.adapters.slot_image import read_slot_image  # noqa: E402
from loraplex.adapters.lora_request import LoRARequest  # noqa: E402


def spec_7b() -> BaseModelSpec:
    from transformers import LlamaConfig

    cfg = {k: v for k, v in LLAMA2_7B.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return BaseModelSpec.from_hf_config(LlamaConfig(**cfg))


def one_at_a_time(spec: BaseModelSpec, folders: list[Path]) -> dict:
    rows = {"inspect_ms": [], "pinned_new_ms": [], "pinned_recycled_ms": [], "pageable_ms": []}
    for folder in folders:
        t0 = time.perf_counter()
        layout = inspect_peft_adapter(folder, spec, 16)
        rows["inspect_ms"].append(1e3 * (time.perf_counter() - t0))
        for kind, pin in (("pinned_new_ms", True), ("pinned_recycled_ms", True), ("pageable_ms", False)):
            t0 = time.perf_counter()
            image = read_slot_image(layout, spec, 16, torch.bfloat16, version_id="x" * 64, pin_memory=pin)
            rows[kind].append(1e3 * (time.perf_counter() - t0))
            del image  # a pinned block goes back to torch's caching host allocator
    return {k: statistics.median(v) for k, v in rows.items()}


def read_and_install(pool: LoRASlotPool, int_ids: list[int]) -> dict:
    """Cold reads of registered ``int_ids`` through the pool's background readers, driven as the
    scheduler drives them (``ensure_ready`` each round), then one slot install each; ms per adapter."""
    pending = set(int_ids)
    t0 = time.perf_counter()
    while pending:
        pending = {i for i in pending if not pool.ensure_ready(i)}
        pool.wait_for_loads(timeout_s=0.005)
    read_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for int_id in int_ids:
        pool.pin(int_id)
        pool.unpin(int_id)
    torch.cuda.synchronize()
    install_s = time.perf_counter() - t0
    return {"threads": pool.config.num_loader_threads, "adapters": len(int_ids),
            "read_ms_per_adapter": 1e3 * read_s / len(int_ids), "install_ms_per_adapter": 1e3 * install_s / len(int_ids)}


def pool_throughput(spec: BaseModelSpec, folders: list[Path], threads: int, first_id: int, pinned: bool = True) -> dict:
    pool = LoRASlotPool(spec, 8, 16, len(folders), torch.bfloat16, "cuda", num_loader_threads=threads,
                        pin_host_cache=pinned)
    requests = [LoRARequest(f"l{first_id + i}", first_id + i, str(f), version_id=adapter_version_id(f))
                for i, f in enumerate(folders)]
    for r in requests:
        pool.add_lora(r)
    result = read_and_install(pool, [r.lora_int_id for r in requests])
    pool.close()
    return {**result, "pinned": pinned}


def main() -> None:
    root = Path(tempfile.mkdtemp())
    spec = spec_7b()
    qv = [make_random_adapter(root / f"qv{i}", LLAMA2_7B, 16, seed=i, targets=["q_proj", "v_proj"]) for i in range(32)]
    all7 = [make_random_adapter(root / f"all{i}", LLAMA2_7B, 16, seed=100 + i) for i in range(8)]
    results = {"commit": git_commit(), "device": torch.cuda.get_device_name()}
    # Pageable first (nothing to recycle), then pinned: cold (new page-locked memory), then recycled.
    results["pool"] = [pool_throughput(spec, qv, 4, 500, pinned=False), pool_throughput(spec, qv, 1, 600, pinned=False)]
    results["pool"] += [pool_throughput(spec, qv, threads, 1000 * k) for k, threads in enumerate((4, 4, 1, 8), start=1)]
    results["pool_all7"] = [pool_throughput(spec, all7, 4, 8900, pinned=False),
                            pool_throughput(spec, all7, 4, 9000), pool_throughput(spec, all7, 4, 9100)]
    results["single_qv"] = one_at_a_time(spec, qv[:8])
    results["single_all7"] = one_at_a_time(spec, all7[:4])
    (out_dir() / "adapter-loads.json").write_text(json.dumps(results, indent=2))
    print_table(f"One read at a time, ms (commit {results['commit']})", ["adapter"] + list(results["single_qv"]),
                [[name] + [f"{v:.1f}" for v in results[key].values()]
                 for name, key in (("q/v 16.8 MB", "single_qv"), ("all 7, 80 MB", "single_all7"))])
    rows = results["pool"] + results["pool_all7"]
    print_table("Pool background reads (pageable; pinned: first run cold, then recycled)",
                ["adapters", "threads", "host memory", "read ms/adapter", "install ms/adapter"],
                [[("q/v x" if i < len(results["pool"]) else "all7 x") + str(r["adapters"]), r["threads"],
                  "pinned" if r["pinned"] else "pageable", f"{r['read_ms_per_adapter']:.1f}",
                  f"{r['install_ms_per_adapter']:.2f}"] for i, r in enumerate(rows)])


if __name__ == "__main__":
    main()
