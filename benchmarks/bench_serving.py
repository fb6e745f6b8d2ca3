"""Serving-scale GPU benchmarks (issue 9), offline engine, Llama-2-7B shapes,
random bf16 weights, r=16 adapters on all 7 projections.

1. ``scenarios``: chatbot / long-document summary / code generation / RAG /
   shared system prompt, 100 adapters with Zipf popularity plus 20% base
   requests; loraplex on all requests, HF transformers + PEFT (``generate``
   with ``adapter_names``, padded batch) on a fixed subset, both as output
   tokens/s on the same GPU in the same run.
2. ``scaling`` (issue 17 goal 3): 512 requests (2000 for 2000 adapters), prompt 128 /
   output 32, r=16 on q/v (16.8 MB per adapter), 256 slots: output tokens/s with 1, 8,
   64, 512 and 2000 distinct adapters (uniform) and 512 requests Zipf over 2000, every
   adapter already in the host cache (files in the page cache), each against the base
   model on the same requests (its step count is the batch math's minimum); a cold-start
   row (512 adapters read for the first time inside the run) with its measured cause;
   disk -> slot ms of a 16.8 MB adapter. Adapters beyond the 64 distinct weight files
   link to one of them but have their own config (own version id), so each is a
   separate read. ``--parts scaling --cpu-check`` runs its logic on CPU.
3. ``decode``: decode step time at batch 1, 32 and 128, base and mixed
   adapters, against the weight-bandwidth floor.

Usage: ``python benchmarks/bench_serving.py [--parts scenarios,scaling,decode] [--quick]``.
Writes ``$OUT/serving.json``; prints markdown tables last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (ALL_TARGETS, LLAMA2_7B, git_commit, make_model_dir,  # noqa: E402
                    make_random_adapter, measure_copy_bandwidth, out_dir, print_table, triton_variants)

from loraplex import LLM, LoRARequest, SamplingParams  # noqa: E402
from loraplex.engine.gc_heap import freeze_gc_heap, unfreeze_gc_heap  # noqa: E402

SCENARIOS = [("chatbot", 128, 64), ("long-document summary", 2048, 256), ("code generation", 512, 512),
             ("RAG", 1024, 128), ("shared system prompt (500 + 50)", 550, 200)]
RESULTS: dict = {"commit": os.environ.get("LORAPLEX_COMMIT") or git_commit()}


def zipf_choices(rng: random.Random, n_items: int, count: int, s: float = 1.1) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(n_items)]
    return rng.choices(range(n_items), weights=weights, k=count)


def make_adapters(root: Path, config: dict, count: int, distinct_files: int,
                  targets=ALL_TARGETS, first_id: int = 1, rank: int = 16, **adapter_kw) -> list[LoRARequest]:
    """``count`` adapters; the first ``distinct_files`` have their own weights, the rest
    link to one of them but have their own config (so their own version id), declared as the
    platform declares its registry's content hash (registration reads only the config and the
    header; the engine checks the id at the first read). Ids are hashed on 16 threads."""
    from safetensors.torch import load_file

    from loraplex.adapters.identity import compute_version_id

    paths = []
    for i in range(count):
        path = root / f"a{i}"
        if i < distinct_files:
            make_random_adapter(path, config, rank, seed=first_id + i, targets=targets, **adapter_kw)
        else:
            path.mkdir(parents=True, exist_ok=True)
            src = root / f"a{i % distinct_files}"
            os.symlink(src / "adapter_model.safetensors", path / "adapter_model.safetensors")
            cfg = json.loads((src / "adapter_config.json").read_text())
            cfg["base_model_name_or_path"] = f"dummy-{i}"
            (path / "adapter_config.json").write_text(json.dumps(cfg))
        paths.append(path)
    tensors = [load_file(str(root / f"a{i}" / "adapter_model.safetensors")) for i in range(min(count, distinct_files))]

    def version_id(i: int) -> str:  # common.adapter_version_id, the weight file loaded once
        cfg = json.loads((paths[i] / "adapter_config.json").read_text())
        return compute_version_id(cfg, tensors[i % distinct_files])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(version_id, range(count)))
    return [LoRARequest(f"a{first_id + i}", first_id + i, str(path), version_id=ids[i])
            for i, path in enumerate(paths)]


class GCPauses:
    """Pauses of Python's cyclic garbage collector while entered (``gc.callbacks``): per generation the
    collections, their summed and their longest ms. The engine's host time includes them."""

    def __init__(self) -> None:
        self.by_generation: dict[int, list[float]] = {}
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.by_generation.setdefault(info["generation"], []).append(1e3 * (time.perf_counter() - self._start))

    def __enter__(self) -> "GCPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """``{"total_ms", "gen<g>": [collections, total ms, max ms]}``."""
        out: dict = {"total_ms": sum(sum(v) for v in self.by_generation.values())}
        for gen, pauses in sorted(self.by_generation.items()):
            out[f"gen{gen}"] = [len(pauses), sum(pauses), max(pauses)]
        return out


def _gc_cell(row: dict, base: dict) -> str:
    """``"<ms>, <gen-2 collections> (<base ms>, <base gen-2 collections>)"``."""
    return (f"{row['total_ms']:.0f}, {row.get('gen2', [0])[0]} "
            f"({base['total_ms']:.0f}, {base.get('gen2', [0])[0]})")


def run_requests(llm: LLM, prompts: list[list[int]], out_len: int, loras: list, trace_loads: bool = False,
                 trace_steps: bool = False) -> dict:
    """Submit all, step until done. ``trace_loads``: also ``load_trace`` = per step (seconds since
    the start, disk loads so far in this run). ``trace_steps``: also ``step_trace`` = per step
    (ms from the previous step's return, prompt tokens, decode tokens, distinct adapters among
    its rows, slot installs so far in this run)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="final_only")
    pool = engine.lora_pool
    loads0 = pool.loader.disk_loads if pool is not None else 0
    installs0 = pool.slot_loads if pool is not None else 0
    trace, steps_trace, launched = [], [], []
    real_launch = engine.runner.launch
    if trace_steps:
        def launch(batch):
            prompt = sum(max(0, min(s.start_position + s.num_new_tokens, s.seq.num_prompt_tokens) - s.start_position)
                         for s in batch.seqs)  # the positions of the prompt this step computes
            launched.append((prompt, batch.num_tokens - prompt, len({s.seq.group.lora_int_id for s in batch.seqs} - {0})))
            return real_launch(batch)

        engine.runner.launch = launch
    sync()
    pauses = GCPauses().__enter__()
    t0 = last = time.perf_counter()
    try:
        for i, (p, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(f"q{time.monotonic_ns()}-{i}", p, params, lora)
        steps = errors = 0
        while engine.has_unfinished_requests():
            errors += sum(1 for out in engine.step() if out.finished and out.error is not None)
            steps += 1
            now = time.perf_counter()
            if trace_loads:
                trace.append((now - t0, pool.loader.disk_loads - loads0))
            if trace_steps:
                shape = launched[-1] if len(launched) == steps else (0, 0, 0)  # a step may launch nothing
                installs = pool.slot_loads - installs0 if pool is not None else 0
                steps_trace.append((1e3 * (now - last), *shape, installs))
            last = now
    finally:
        engine.runner.launch = real_launch
        sync()
        pauses.__exit__()
    dt = time.perf_counter() - t0
    out = {"requests": len(prompts), "total_s": dt, "requests_per_s": len(prompts) / dt,
           "output_tokens_per_s": len(prompts) * out_len / dt, "steps": steps, "errors": errors,
           "triton_variants_after": triton_variants(), "gc_pauses": pauses.summary()}
    if trace_loads:
        out["load_trace"] = trace
    if trace_steps:
        out["step_trace"] = steps_trace
    return out


def step_split(row_trace: list[tuple], base_trace: list[tuple]) -> dict:
    """Where a row's time over the base run's goes: ms summed over steps that carry prompt tokens
    and over decode-only steps, the row's and the base's, the decode steps' mean distinct adapters,
    and the slot installs made in each kind of step (the two runs schedule the same requests; a
    row can take more steps)."""
    def sums(trace):
        installs = [t[4] - (trace[i - 1][4] if i else 0) for i, t in enumerate(trace)]  # t[4]: so far
        prompt = [i for i, t in enumerate(trace) if t[1] > 0]
        decode = [i for i, t in enumerate(trace) if t[1] == 0 and t[2] > 0]
        decode_ms = [trace[i][0] for i in decode]
        return {"prompt_steps_ms": sum(trace[i][0] for i in prompt), "prompt_steps": len(prompt),
                "prompt_tokens": sum(trace[i][1] for i in prompt),
                "decode_steps_ms": sum(decode_ms), "decode_steps": len(decode),
                "decode_mean_distinct_adapters": statistics.mean(trace[i][3] for i in decode) if decode else 0.0,
                "prompt_step_installs": sum(installs[i] for i in prompt),
                "decode_step_installs": sum(installs[i] for i in decode),
                "decode_step_ms_median": statistics.median(decode_ms) if decode else float("nan")}

    row, base = sums(row_trace), sums(base_trace)
    return {**row, **{f"base_{k}": base[k] for k in ("prompt_steps_ms", "prompt_steps", "prompt_tokens", "decode_steps_ms",
                                                       "decode_steps", "decode_step_ms_median")}}


def profiled_run(llm: LLM, prompts: list[list[int]], out_len: int, loras: list) -> dict:
    """The same run under ``torch.profiler`` (CUDA activity only): kernel ms per class over the
    whole run (bench_decode's classes plus ``copy`` = memcpy/memset and ``install`` = the slot
    writes' multi-tensor copies), GPU busy, the top kernels."""
    from bench_decode import kernel_class, summarize_profile

    if not torch.cuda.is_available():
        return {"error": "no CUDA device to profile"}

    def classify(name: str) -> str:
        low = name.lower()
        if "memcpy" in low or "memset" in low:
            return "copy"
        if "foreach" in low or "multi_tensor" in low:
            return "install"
        return kernel_class(name)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        res = run_requests(llm, prompts, out_len, loras)
        sync()
    summary = summarize_profile(prof, 1, classify=classify, classes=("gemm", "attention", "lora", "copy",
                                                                       "install", "other"))
    return {"total_s": res["total_s"], "steps": res["steps"], **summary}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release(llm: LLM) -> None:
    """Hand the engine's device memory back before the next part builds its own (unfreezing the heap first:
    the engine sits in reference cycles, and a frozen cycle is never collected)."""
    llm.engine.close()
    llm.engine = None
    unfreeze_gc_heap()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_up(llm: LLM, adapters: list[LoRARequest]) -> None:
    """Compile the kernel variants a serving engine has compiled in its steady state (LoRA and
    base tokens; decode batches of <= 8 and of 32 tokens; prefill chunks of < 256 and > 256
    tokens), with adapters the measurement does not use. Not measured."""
    rng = random.Random(99)
    top = min(31000, llm.engine.spec.vocab_size - 1)
    loras = [adapters[i % len(adapters)] if i % 4 else None for i in range(32)]
    run_requests(llm, [[rng.randrange(10, top) for _ in range(64)] for _ in range(4)], 8, loras[:4])
    run_requests(llm, [[rng.randrange(10, top) for _ in range(300)] for _ in range(32)], 16, loras)
    run_requests(llm, [[rng.randrange(10, top) for _ in range(900)]], 4, loras[1:2])


def engine(model_dir: Path, max_loras: int, max_cpu_loras: int, max_model_len: int = 4096,
           enable_prefix_caching: bool = True) -> LLM:
    device = {} if torch.cuda.is_available() else {"device": "cpu", "dtype": "float32", "num_kv_blocks": 4096}
    llm = LLM(model=str(model_dir), dummy_weights=True, max_model_len=max_model_len,
              gpu_memory_utilization=0.85, enable_lora=True, max_loras=max_loras, max_lora_rank=16,
              max_cpu_loras=max_cpu_loras, max_num_seqs=256, max_num_batched_tokens=8192,
              async_scheduling=RESULTS["async_scheduling"], lora_target_modules=RESULTS.get("lora_target_modules"),
              lora_fold_shrink=RESULTS.get("lora_fold_shrink", "auto"), enable_prefix_caching=enable_prefix_caching,
              **({"dtype": "bfloat16"} | device))
    llm.engine.lora_pool.pin_host_cache = RESULTS["host_cache"] == "pinned"
    return llm


def scenario_prompts(rng: random.Random, name: str, count: int, in_len: int) -> list[list[int]]:
    if name.startswith("shared"):
        system = [rng.randrange(10, 31000) for _ in range(500)]
        return [system + [rng.randrange(10, 31000) for _ in range(50)] for _ in range(count)]
    return [[rng.randrange(10, 31000) for _ in range(in_len)] for _ in range(count)]


def part_scenarios(model_dir: Path, config: dict, adapters: list[LoRARequest], quick: bool) -> dict:
    rng = random.Random(0)
    llm = engine(model_dir, max_loras=64, max_cpu_loras=len(adapters))
    for a in adapters:  # warm host cache (a serving engine's steady state); loads are the scaling part's
        llm.engine.preload_lora(a)
    warm_up(llm, adapters[:2])
    results = {}
    for name, in_len, out_len in SCENARIOS:
        count = 32 if quick else (64 if in_len >= 1024 or out_len >= 512 else 128)
        prompts = scenario_prompts(rng, name, count, in_len)
        picks = zipf_choices(rng, len(adapters), count)
        loras = [None if rng.random() < 0.2 else adapters[k] for k in picks]
        results[name] = {"loraplex": run_requests(llm, prompts, out_len, loras),
                         "subset": (prompts[:8], loras[:8], out_len)}
    release(llm)
    hf = hf_peft_model(config, adapters, {l.lora_name for r in results.values() for l in r["subset"][1] if l})
    for name, r in results.items():
        prompts, loras, out_len = r.pop("subset")
        r["hf_peft"] = hf_peft_run(hf, prompts, loras, min(out_len, 32))
        r["speedup"] = r["loraplex"]["output_tokens_per_s"] / r["hf_peft"]["output_tokens_per_s"]
    del hf
    torch.cuda.empty_cache()
    return results


def hf_peft_model(config: dict, adapters: list[LoRARequest], names: set[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    lcfg = LoraConfig(r=16, lora_alpha=32, target_modules=ALL_TARGETS, lora_dropout=0.0)
    names = sorted(names) or ["a0"]
    peft = get_peft_model(model, lcfg, adapter_name=names[0])
    for n in names[1:]:
        peft.add_adapter(n, lcfg)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    return peft.eval()


def hf_peft_run(peft, prompts: list[list[int]], loras: list, out_len: int) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    names = [lora.lora_name if lora else "__base__" for lora in loras]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        peft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                      do_sample=False, adapter_names=names, pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"requests": len(prompts), "output_len": out_len, "total_s": dt,
            "output_tokens_per_s": len(prompts) * out_len / dt}


def part_scaling(model_dir: Path, config: dict, root: Path, quick: bool, counts: list[int] | None = None,
                 cold: bool = True, profile_rows: tuple[str, ...] = ()) -> dict:
    """Issue 17 goal 3. Rows 1/8/64/512/2000 adapters (uniform) and a Zipf row with every adapter
    already in the host cache (files in the page cache too: the serving engine's steady state),
    each against the base model on the same requests (throughput and engine steps: the base's
    steps are the batch math's minimum); a cold-start row whose adapters are read for the first
    time inside the run (first reads hash the content), with its cause; disk -> slot ms. Each row's
    time is split into prompt-carrying and decode-only steps against the base run's; the rows named
    in ``profile_rows`` run once more under the profiler, and so does their base run."""
    counts = counts or ([1, 8, 64] if quick else [1, 8, 64, 512, 2000])
    num_requests, in_len, out_len = (64, 64, 16) if quick else (512, 128, 32)
    num_cold = (64 if quick else 512) if cold else 0
    qv = ["q_proj", "v_proj"]
    # r=16 on q_proj and v_proj: 16.8 MB per adapter in bf16 (Llama-2-7B shapes).
    t0 = time.perf_counter()
    adapters = make_adapters(root / "scaling", config, max(counts), distinct_files=16 if quick else 64, targets=qv)
    cold_adapters = make_adapters(root / "cold", config, num_cold, distinct_files=16 if quick else 64, targets=qv,
                                  first_id=50001) if num_cold else []
    probes = make_adapters(root / "probe", config, 8, distinct_files=8, targets=qv, first_id=90001)
    print(f"[scaling] adapters written and hashed: {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(1)
    total = max(num_requests, max(counts))
    prompts = [[rng.randrange(10, config["vocab_size"] - 1) for _ in range(in_len)] for _ in range(total)]
    # As many GPU slots as max_num_seqs (q/v r=16 slots: 16.8 MB each, 4.3 GB for 256) and a host
    # cache for every adapter (issue 17's setting): one batch can hold one request per slot.
    # No prefix caching: the runs share prompts (the base runs of 512 and 2,000 requests their first 512; a row
    # and an earlier row their (prompt, adapter) pairs), and a run served from an earlier run's cached blocks
    # would do less prefill work than the run it is compared with (sessions 9-15: the 2,000 row's base run
    # took 31 prompt-carrying steps, not 39, its first 512 prompts cached by the 512 row's base run).
    llm = engine(model_dir, max_loras=256, max_cpu_loras=max(256, max(counts) + num_cold + 64), max_model_len=1024,
                 enable_prefix_caching=False)
    pool = llm.engine.lora_pool
    warm_up(llm, make_adapters(root / "warm", config, 2, distinct_files=2, targets=qv, first_id=200001))
    if RESULTS.get("gc_freeze"):  # as the server after its start-up: adapters registered later stay unfrozen
        freeze_gc_heap()
    t0 = time.perf_counter()
    for a in adapters + cold_adapters + probes:
        llm.engine.add_lora(a)
    registered_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    read_all(pool, [a.lora_int_id for a in adapters])  # the host cache holds every warm adapter
    preload = {"adapters": len(adapters), "registration_s": registered_s, "read_s": time.perf_counter() - t0}
    print(f"[scaling] preload: {preload}", flush=True)
    out: dict = {"preload": preload, "disk_to_slot": disk_to_slot(pool, [a.lora_int_id for a in probes])}
    print(f"[scaling] disk -> slot: {out['disk_to_slot']}", flush=True)
    base: dict[int, dict] = {}

    def base_row(n: int) -> dict:
        if n not in base:
            base[n] = run_requests(llm, prompts[:n], out_len, [None] * n, trace_steps=True)
            print(f"[scaling] base, {n} requests: {base[n]}", flush=True)
        return base[n]

    def row(name: str, loras: list, **extra) -> None:
        n = len(loras)
        reference = base_row(n)
        before = lora_counters(llm)
        chunks_before = pool.loader.arenas[True].chunk_allocations + pool.loader.arenas[False].chunk_allocations
        res = run_requests(llm, prompts[:n], out_len, loras, trace_loads=True, trace_steps=True)
        trace = res.pop("load_trace")
        res["split"] = step_split(res.pop("step_trace"), reference["step_trace"])
        res["base_gc_pauses"] = reference["gc_pauses"]
        res["host_arena_chunks_allocated"] = (pool.loader.arenas[True].chunk_allocations
                                              + pool.loader.arenas[False].chunk_allocations - chunks_before)
        if name.startswith("cold"):
            res["cause"] = cold_cause(res, trace, reference, pool)
        res.update(extra, fraction_of_base=res["output_tokens_per_s"] / reference["output_tokens_per_s"],
                   min_steps=reference["steps"], distinct_adapters=len({a.lora_int_id for a in loras}),
                   lora=diff_counters(lora_counters(llm), before))
        if name in profile_rows:  # after the measured run: the profiler slows the host
            res["profile"] = profiled_run(llm, prompts[:n], out_len, loras)
            base_profiles = out.setdefault("base_profiles", {})
            if str(n) not in base_profiles:
                base_profiles[str(n)] = profiled_run(llm, prompts[:n], out_len, [None] * n)
        out[name] = res
        print(f"[scaling] {name}: {res}", flush=True)

    for count in counts:
        n = max(num_requests, count)  # every adapter gets at least one request
        row(str(count), [adapters[i % count] for i in range(n)], popularity="uniform")
    zipf = zipf_choices(random.Random(3), max(counts), num_requests)
    row(f"zipf-{max(counts)}", [adapters[k] for k in zipf], popularity="zipf s=1.1")
    if num_cold:
        row(f"cold-{num_cold}", [cold_adapters[i % num_cold] for i in range(max(num_requests, num_cold))],
            popularity="uniform, first reads inside the run")
    release(llm)
    return out


def read_all(pool, int_ids: list[int]) -> None:
    """Read ``int_ids`` into the host cache through the pool's background readers (as the
    scheduler drives them: ``ensure_ready`` each round)."""
    pending = list(int_ids)
    while pending:
        pending = [i for i in pending if not pool.ensure_ready(i)]  # queues up to max_loads_in_flight reads
        while pool.loader.loads_in_flight:
            pool.wait_for_loads(timeout_s=0.01)
            pool.loader.poll()


def time_to_slot(pool, int_id: int) -> float:
    """ms from the readiness question to ``int_id`` written in its slot (``ensure_ready`` until True, then a pin
    in one install batch, device synchronized); unpinned after."""
    sync()
    t0 = time.perf_counter()
    while not pool.ensure_ready(int_id):
        pool.wait_for_loads(timeout_s=0.0002)
    with pool.batched_installs():
        pool.pin(int_id)
    sync()
    dt = 1e3 * (time.perf_counter() - t0)
    pool.unpin(int_id)
    return dt


def disk_to_slot(pool, int_ids: list[int]) -> dict:
    """Per adapter (files in the page cache, nothing else in flight), ms from the readiness question
    to the adapter written in its slot on the device (``ensure_ready`` until True, then a pin in
    one install batch, device synchronized): first the first read of a registration (its content
    hashed against the declared version id), then a re-read of the same adapter evicted from the
    host cache and its slot (the steady-state path: the registered id is trusted while the files'
    stat holds)."""
    once = functools.partial(time_to_slot, pool)
    first, again = [], []
    for int_id in int_ids:
        first.append(once(int_id))
        pool.loader.cache.pop(int_id)  # evicted from host memory and from its slot
        pool.slots.clear(pool.slots.slot_of(int_id))
        again.append(once(int_id))
    image_mb = pool.loader.cached(int_ids[0]).nbytes / 1e6
    return {"adapter_MB": image_mb, "first_read_ms": statistics.median(first),
            "reread_ms": statistics.median(again), "reread_ms_all": again}


def lora_counters(llm: LLM) -> dict:
    stats = llm.engine.get_stats().lora
    return {"disk_loads": stats.disk_loads, "slot_loads": stats.slot_loads, "cpu_evictions": stats.cpu_evictions,
            "slot_evictions": stats.slot_evictions, "install_batches": llm.engine.lora_pool.install_batches}


def diff_counters(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def cold_cause(row: dict, trace: list[tuple[float, int]], reference: dict, pool) -> str:
    """The measured cause of the cold row: when its first reads finished against the run."""
    reads = trace[-1][1] if trace else 0
    done_s = next((t for t, loads in trace if loads >= reads), trace[-1][0] if trace else 0.0)
    done_step = next((i for i, (_, loads) in enumerate(trace, start=1) if loads >= reads), len(trace))
    return (f"{reads} first reads (content hashed) on {pool.config.num_loader_threads} loader threads took "
            f"{done_s:.2f} s ({1e3 * done_s / max(1, reads):.1f} ms per adapter), until step {done_step} of "
            f"{row['steps']}, {row['host_arena_chunks_allocated']} host-arena chunks of "
            f"{pool.config.host_arena_chunk_bytes >> 20} MiB allocated (page-locked) meanwhile; the base run takes "
            f"{reference['total_s']:.2f} s and {reference['steps']} steps: steps before that admit only the "
            f"adapters read so far")


def part_decode(model_dir: Path, adapters: list[LoRARequest], floor_ms: float) -> dict:
    llm = engine(model_dir, max_loras=32, max_cpu_loras=64, max_model_len=1024)
    for a in adapters[:32]:  # warm in the host cache: the steps measured run full batches
        llm.engine.preload_lora(a)
    rng = random.Random(2)
    out = {}
    for batch in (1, 32, 128):
        prompts = [[rng.randrange(10, 31000) for _ in range(128)] for _ in range(batch)]
        for kind in ("base", "mixed"):
            loras = [None] * batch if kind == "base" else [adapters[i % 32] for i in range(batch)]
            out[f"{kind}-{batch}"] = decode_step_ms(llm, prompts, loras, floor_ms)
    release(llm)
    return out


def decode_step_ms(llm: LLM, prompts, loras, floor_ms: float, out_len: int = 64) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="final_only")
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params, lora)
    times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[3:]) * 1e3
    return {"decode_step_ms": step, "floor_fraction": floor_ms / step, "steps": len(times),
            "expected_steps": out_len}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="scenarios,scaling,decode")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--scaling-counts", default=None,
                    help="adapter counts of the scaling rows, e.g. 512,2000 (default 1,8,64,512,2000)")
    ap.add_argument("--no-cold", action="store_true", help="scaling without the cold-start row (fewer adapters to write)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="engines with async scheduling (step N+1 scheduled, and its adapter installs copied, "
                         "while step N runs); default: off, the engine default")
    ap.add_argument("--profile-rows", default=None,
                    help="scaling rows (e.g. 512,zipf-2000) run once more under torch.profiler, with their base run")
    ap.add_argument("--host-cache", choices=["pinned", "pageable"], default="pinned",
                    help="host memory of the adapter cache (LoRASlotPool.pin_host_cache)")
    ap.add_argument("--lora-target-modules", default=None,
                    help="the engines' lora_target_modules (e.g. q_proj,v_proj for the scaling part's q/v adapters: "
                         "the other linears launch no LoRA kernel); default: every module")
    ap.add_argument("--lora-fold-shrink", choices=["auto", "on", "off"], default="auto",
                    help="the engines' lora_fold_shrink (the LoRA shrink in the base GEMM)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="scaling: without the server's freeze_gc_heap() after the engine's warm-up (the default "
                         "freezes it before the adapters are registered, as the server does at start-up)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="the benchmark's logic on CPU with a tiny model (implies --quick; numbers mean nothing)")
    args = ap.parse_args()
    RESULTS["host_cache"] = args.host_cache
    RESULTS["async_scheduling"] = args.async_scheduling
    RESULTS["lora_target_modules"] = args.lora_target_modules
    RESULTS["lora_fold_shrink"] = args.lora_fold_shrink
    RESULTS["gc_freeze"] = not args.no_gc_freeze
    config = dict(LLAMA2_7B)
    if args.quick or args.cpu_check:
        args.quick = True
        config.update(num_hidden_layers=2)
    if args.cpu_check:
        config.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=512)
    root = Path(tempfile.mkdtemp())
    model_dir = make_model_dir(root / "model", config)
    bw = measure_copy_bandwidth() if torch.cuda.is_available() else float("nan")
    weight_bytes = 2 * (config["vocab_size"] * config["hidden_size"] * 2 + config["num_hidden_layers"] * (
        4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"] * config["intermediate_size"]))
    floor_ms = 1e3 * weight_bytes / bw
    RESULTS.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   copy_TBps=bw / 1e12, floor_ms=floor_ms)
    parts = args.parts.split(",")
    # 100 adapters with their own config (own version id); 16 distinct weight files, the rest
    # link to them (speed does not depend on the values; writing 100 x 80 MiB does not fit a run).
    count = 100 if "scenarios" in parts else 32
    adapters = []
    if "scenarios" in parts or "decode" in parts:
        adapters = make_adapters(root / "zipf", config, count, distinct_files=min(count, 8 if args.quick else 16))
    jobs = {"scenarios": lambda: part_scenarios(model_dir, config, adapters, args.quick),
            "scaling": lambda: part_scaling(model_dir, config, root, args.quick,
                                            [int(c) for c in args.scaling_counts.split(",")] if args.scaling_counts
                                            else None, not args.no_cold,
                                            tuple(args.profile_rows.split(",")) if args.profile_rows else ()),
            "decode": lambda: part_decode(model_dir, adapters, floor_ms)}
    for part in parts:
        t0 = time.perf_counter()
        try:
            RESULTS[part] = jobs[part]()
        except Exception as exc:
            traceback.print_exc()
            RESULTS[part] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            unfreeze_gc_heap()  # a part that failed after freezing (release() unfreezes otherwise)
        print(f"[{part}] {time.perf_counter() - t0:.1f} s", flush=True)
        suffix = (("" if args.host_cache == "pinned" else f"-{args.host_cache}") + ("-async" if args.async_scheduling else "")
                  + (f"-{args.lora_target_modules.replace(',', '-')}" if args.lora_target_modules else "")
                  + ("-no-gc-freeze" if args.no_gc_freeze else ""))
        (out_dir() / f"serving-{args.parts.replace(',', '-')}{suffix}.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    summarize()


def summarize() -> None:
    title = f"commit {RESULTS['commit']}, {RESULTS['device']}, floor {RESULTS['floor_ms']:.2f} ms/step"
    sc = RESULTS.get("scenarios", {})
    if "error" not in sc:
        print_table(f"Scenarios, 100 adapters Zipf + 20% base ({title})",
                    ["scenario", "req/s", "out tok/s", "HF+PEFT tok/s", "speed-up"],
                    [[n, f"{r['loraplex']['requests_per_s']:.2f}", f"{r['loraplex']['output_tokens_per_s']:.0f}",
                      f"{r['hf_peft']['output_tokens_per_s']:.1f}", f"{r['speedup']:.0f}x"] for n, r in sc.items()])
    scl = RESULTS.get("scaling", {})
    if scl and "error" not in scl:
        rows = {k: v for k, v in scl.items() if isinstance(v, dict) and "fraction_of_base" in v}
        print_table("Adapter-count scaling (q/v r=16, 256 slots; host cache holds every adapter unless cold; async "
                    f"scheduling {'on' if RESULTS['async_scheduling'] else 'off'}; lora_target_modules "
                    f"{RESULTS['lora_target_modules'] or 'all'}; "
                    f"lora_fold_shrink {RESULTS.get('lora_fold_shrink', 'auto')}; "
                    "gc.freeze after warm-up "
                    f"{'on' if RESULTS['gc_freeze'] else 'off'}; {title})",
                    ["row", "popularity", "requests", "distinct adapters", "out tok/s", "of base", "steps",
                     "min steps", "disk reads", "slot loads", "install batches"],
                    [[k, v["popularity"], v["requests"], v["distinct_adapters"], f"{v['output_tokens_per_s']:.0f}",
                      f"{v['fraction_of_base']:.2f}", v["steps"], v["min_steps"], v["lora"]["disk_loads"],
                      v["lora"]["slot_loads"], v["lora"]["install_batches"]] for k, v in rows.items()])
        d = scl["disk_to_slot"]
        print(f"disk -> slot, {d['adapter_MB']:.1f} MB adapter (median of {len(d['reread_ms_all'])}): "
              f"re-read {d['reread_ms']:.2f} ms, first read (content hashed) {d['first_read_ms']:.2f} ms")
        for k, v in rows.items():
            if "cause" in v:
                print(f"{k}: {v['cause']}")
        split = {k: v["split"] for k, v in rows.items() if "split" in v}
        print_table("Where each row's time goes against the base run (ms summed over the run's steps)",
                    ["row", "prompt-carrying steps ms (base)", "decode-only steps ms (base)",
                     "decode step median ms (base)", "distinct adapters per decode step",
                     "slot installs in prompt / decode steps", "GC pauses ms, full collections (base)"],
                    [[k, f"{v['prompt_steps_ms']:.0f} in {v['prompt_steps']} ({v['base_prompt_steps_ms']:.0f} in "
                         f"{v['base_prompt_steps']})", f"{v['decode_steps_ms']:.0f} in {v['decode_steps']} "
                         f"({v['base_decode_steps_ms']:.0f} in {v['base_decode_steps']})",
                      f"{v['decode_step_ms_median']:.2f} ({v['base_decode_step_ms_median']:.2f})",
                      f"{v['decode_mean_distinct_adapters']:.0f}",
                      f"{v['prompt_step_installs']} / {v['decode_step_installs']}",
                      _gc_cell(rows[k]["gc_pauses"], rows[k]["base_gc_pauses"])] for k, v in split.items()])
        profiled = {k: v["profile"] for k, v in rows.items() if "error" not in v.get("profile", {"error": 1})}
        profiled |= {f"base, {n} requests": v for n, v in scl.get("base_profiles", {}).items() if "error" not in v}
        if profiled:
            classes = ("gemm", "attention", "lora", "copy", "install", "other")
            print_table("Kernel ms over the whole run, by class (torch.profiler, a second run of the row)",
                        ["run", "wall s", "GPU busy", *classes],
                        [[k, f"{v['total_s']:.2f}", f"{v['gpu_busy']:.0%}", *(f"{v[c + '_ms']:.0f}" for c in classes)]
                         for k, v in profiled.items()])
    dec = RESULTS.get("decode", {})
    if "error" not in dec:
        print_table("Decode step vs weight-bandwidth floor", ["batch", "step ms", "floor / step"],
                    [[k, f"{v['decode_step_ms']:.2f}", f"{v['floor_fraction']:.2f}"] for k, v in dec.items()])
    for k in ("scenarios", "scaling", "decode"):
        if isinstance(RESULTS.get(k), dict) and "error" in RESULTS[k]:
            print(k, RESULTS[k]["error"])


if __name__ == "__main__":
    main()
