"""Throughput of the fair scheduling policy against FCFS (issue 21's goal: fair >= 0.97 x FCFS)
on the chatbot scenario (128 prompt / 64 output tokens) with 4 tenants.

Offline ``LLMEngine``, Llama-2-7B shapes with random bf16 weights, 100 r=16 adapters on all
7 projections (25 per tenant, Zipf popularity within a tenant) plus 20% base-model requests.
The tenants send 40/30/20/10% of the requests, all queued at once (every tenant backlogged),
in a random interleaving; each policy runs on its own fresh engine, alternating
``fcfs, fair, fcfs, fair, ...`` (``--repeats`` each), and the median output tokens/s is
compared. Also reported per policy and tenant: output tokens served while all four tenants
were still backlogged (the fair policy splits them about evenly, FCFS by arrival share) and
the p50/p99 queueing delay (``RequestOutput.queued_s``).

Usage (GPU): ``python benchmarks/bench_fairness.py --out fairness.json``
CPU logic check: ``python benchmarks/bench_fairness.py --tiny --out /tmp/fairness.json``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA2_7B, adapter_version_id, git_commit, make_model_dir, print_table  # noqa: E402

from loraplex import LLM, LoRARequest, SamplingParams  # noqa: E402
from loraplex.engine.fairness import TenantShare  # noqa: E402

TENANTS = (("t1", 0.4), ("t2", 0.3), ("t3", 0.2), ("t4", 0.1))
TINY = dict(LLAMA2_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, torch_dtype="float32")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def workload(rng: random.Random, count: int, in_len: int, vocab: int, adapters_per_tenant: int):
    """(tenant, prompt, adapter index within the tenant or None) per request, interleaved at random."""
    names = [t for t, _ in TENANTS]
    shares = [s for _, s in TENANTS]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(adapters_per_tenant)]
    out = []
    for _ in range(count):
        tenant = rng.choices(names, weights=shares)[0]
        adapter = None if rng.random() < 0.2 else rng.choices(range(adapters_per_tenant), weights=weights)[0]
        out.append((tenant, [rng.randrange(10, vocab - 1) for _ in range(in_len)], adapter))
    return out


def make_adapters(root: Path, config: dict, rank: int, per_tenant: int, distinct: int) -> dict[str, list]:
    """``per_tenant`` adapters for each tenant (own ids and version ids; ``distinct`` weight files)."""
    from common import make_random_adapter

    dtype = torch.float32 if config["torch_dtype"] == "float32" else torch.bfloat16
    files = []
    for i in range(distinct):
        files.append(make_random_adapter(root / f"w{i}", config, rank, seed=i, dtype=dtype))
    adapters: dict[str, list] = {}
    next_id = 1
    for tenant, _ in TENANTS:
        adapters[tenant] = []
        for k in range(per_tenant):
            path = root / tenant / f"a{k}"
            path.mkdir(parents=True, exist_ok=True)
            src = files[(next_id - 1) % distinct]
            (path / "adapter_model.safetensors").symlink_to(src / "adapter_model.safetensors")
            cfg = json.loads((src / "adapter_config.json").read_text())
            cfg["base_model_name_or_path"] = f"{tenant}-{k}"
            (path / "adapter_config.json").write_text(json.dumps(cfg))
            # a declared version id (as the platform declares its registry's content hash):
            # registration reads only the config and the safetensors header
            version_id = adapter_version_id(path)
            adapters[tenant].append(LoRARequest(f"{tenant}-a{k}", next_id, str(path), version_id=version_id))
            next_id += 1
    return adapters


def build_engine(model_dir: Path, policy: str, tiny: bool, max_cpu_loras: int) -> LLM:
    common = dict(model=str(model_dir), dummy_weights=True, enable_lora=True, max_cpu_loras=max_cpu_loras,
                  scheduling_policy=policy)
    if tiny:
        return LLM(**common, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16,
                   max_num_seqs=8, max_num_batched_tokens=256, max_loras=2, max_lora_rank=8)
    return LLM(**common, dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.85, max_num_seqs=256,
               max_num_batched_tokens=8192, max_loras=64, max_lora_rank=16)


def run_policy(llm: LLM, requests, adapters: dict[str, list], out_len: int) -> dict:
    """All requests queued at once; drive the engine to the end. Returns throughput and per-tenant service."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="final_only")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    tenant_of: dict[str, str] = {}
    before = {s.tenant_id: s.output_tokens_served for s in engine.scheduler.tenant_stats()}  # earlier runs
    sync()
    t0 = time.perf_counter()
    for i, (tenant, prompt, adapter) in enumerate(requests):
        request_id = f"{tenant}-{i}-{time.monotonic_ns()}"
        tenant_of[request_id] = tenant
        lora = adapters[tenant][adapter] if adapter is not None else None
        engine.add_request(request_id, prompt, params, lora, tenant=TenantShare(tenant))
    queued: dict[str, list[float]] = {t: [] for t, _ in TENANTS}
    backlogged_tokens: dict[str, int] | None = None
    steps = errors = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                errors += out.error is not None
                queued[tenant_of[out.request_id]].append(out.queued_s or 0.0)
        steps += 1
        if backlogged_tokens is None:  # until the first tenant's queue empties
            stats = {s.tenant_id: s for s in engine.scheduler.tenant_stats()}
            if any(stats[t].num_waiting == 0 for t, _ in TENANTS if t in stats):
                backlogged_tokens = {t: stats[t].output_tokens_served - before.get(t, 0) if t in stats else 0
                                     for t, _ in TENANTS}
    sync()
    dt = time.perf_counter() - t0
    served = {s.tenant_id: s.output_tokens_served - before.get(s.tenant_id, 0) for s in engine.scheduler.tenant_stats()}
    return {"requests": len(requests), "total_s": dt, "output_tokens_per_s": len(requests) * out_len / dt,
            "steps": steps, "errors": errors, "output_tokens_served": served,
            "output_tokens_while_all_backlogged": backlogged_tokens,
            "queued_s_p50": {t: percentile(v, 50) for t, v in queued.items()},
            "queued_s_p99": {t: percentile(v, 99) for t, v in queued.items()}}


def release(llm: LLM) -> None:
    import gc

    llm.engine.close()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (checks the logic only)")
    ap.add_argument("--requests", type=int, default=None, help="default 1024 (GPU), 24 (--tiny)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per policy; default 3 (GPU), 1 (--tiny)")
    ap.add_argument("--child", choices=("fcfs", "fair"), help=argparse.SUPPRESS)  # one run, in this process
    args = ap.parse_args(argv)
    config = TINY if args.tiny else dict(LLAMA2_7B)
    count = args.requests or (24 if args.tiny else 1024)
    repeats = args.repeats or (1 if args.tiny else 3)
    in_len, out_len = (16, 8) if args.tiny else (128, 64)
    per_tenant = 2 if args.tiny else 25
    root = Path(tempfile.mkdtemp())
    model_dir = make_model_dir(root / "model", config)
    adapters = make_adapters(root / "adapters", config, 8 if args.tiny else 16, per_tenant,
                             distinct=2 if args.tiny else 16)
    requests = workload(random.Random(0), count, in_len, config["vocab_size"], per_tenant)
    if args.child:  # one engine per process: an engine does not give its device memory back in-process
        llm = build_engine(model_dir, args.child, args.tiny, max_cpu_loras=4 * per_tenant)
        for tenant_adapters in adapters.values():  # a serving engine's steady state: adapters in host memory
            for adapter in tenant_adapters:
                llm.engine.preload_lora(adapter)
        run_policy(llm, requests[: max(4, count // 16)], adapters, out_len)  # warm-up, not measured
        args.out.write_text(json.dumps(run_policy(llm, requests, adapters, out_len)))
        release(llm)
        return {}
    runs: dict[str, list[dict]] = {"fcfs": [], "fair": []}
    for i in range(repeats):
        for policy in ("fcfs", "fair"):
            part = root / f"run-{i}-{policy}.json"
            cmd = [sys.executable, __file__, "--out", str(part), "--child", policy, "--requests", str(count)]
            subprocess.run(cmd + (["--tiny"] if args.tiny else []), check=True)
            runs[policy].append(json.loads(part.read_text()))
    median = {p: statistics.median(r["output_tokens_per_s"] for r in rs) for p, rs in runs.items()}
    results = {"commit": git_commit(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "scenario": {"prompt_tokens": in_len, "output_tokens": out_len, "requests": count,
                            "tenant_shares": dict(TENANTS), "adapters_per_tenant": per_tenant, "base_share": 0.2},
               "runs": runs, "median_output_tokens_per_s": median,
               "fair_over_fcfs": median["fair"] / median["fcfs"]}
    results["goal_met"] = results["fair_over_fcfs"] >= 0.97
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    rows = [[p, f"{median[p]:.0f}", *(str(runs[p][-1]["output_tokens_while_all_backlogged"][t]) for t, _ in TENANTS)]
            for p in ("fcfs", "fair")]
    print_table("fair vs FCFS, chatbot, 4 tenants", ["policy", "out tok/s", *(f"{t} tokens (backlogged)"
                                                                              for t, _ in TENANTS)], rows)
    print(f"fair / FCFS throughput = {results['fair_over_fcfs']:.3f} (goal >= 0.97: "
          f"{'met' if results['goal_met'] else 'NOT met'})")
    return results


if __name__ == "__main__":
    main()
