"""Per-step CPU overhead of the engine (issue 9), measured on CPU with a tiny model.

A 1-layer, hidden-32 random Llama makes the model's own cost negligible, so
what remains of a decode step is the engine's Python/CPU work. Each step is
split into stages by timers wrapped around the engine's methods:

- ``schedule``: ``Scheduler.schedule`` (who runs, block allocation);
- ``prepare``: the rest of ``ModelRunner.launch`` (input tensors / CUDA-graph
  buffer fill, block moves);
- ``forward``: the model forward (``LlamaForCausalLM.forward``; zero in graph mode);
- ``sample``: ``ModelRunner._sample`` (logits, sampling batch, sampler);
- ``post``: the rest of ``LLMEngine.step`` (samples read back, ``Scheduler.commit`` and
  ``update_from_output``: tokens, stop checks, detokenize, prefix-cache hashing; outputs);
- ``step``: the whole ``LLMEngine.step``.

Two modes:

- ``eager``: the CPU engine as is (prepare_inputs + eager forward);
- ``graph``: the decode path of a CUDA machine, emulated on CPU: a
  :class:`~loraplex.engine.cuda_graphs.CudaGraphRunner` with CPU buffers whose
  graphs are no-ops returning a fixed hidden state. That measures exactly the
  host work of a CUDA-graph decode step (buffer fill, sampling, postprocess);
  on a GPU the replay itself is asynchronous.

Workload: ``B`` requests with 12-token random prompts, greedy, ``ignore_eos``,
``max_tokens = decode_steps + 1``, all added at once; only decode-only steps
(one new token per sequence) are timed, the first two are skipped. Variants:
base model or every row on one LoRA adapter (``enable_lora=True`` either way),
``output_kind`` ``final_only`` or ``cumulative``.

Times are this thread's CPU time by default (``--clock cpu``): on a shared
machine it leaves out time spent waiting for a core, though cache and SMT
contention still add noise. Each configuration runs ``--repeats`` times
(configurations interleaved); every run gives one median per stage over its
decode steps. The table shows the best run (minimum over runs of that median,
the least disturbed estimate) per stage and the median over runs of the step;
the JSON keeps every run, and ``--report`` merges saved files, e.g. before/after
runs made alternately in the same time window. Usage::

    python benchmarks/bench_step_overhead.py [--batches 1 32 128] [--repeats 3]
        [--modes graph eager] [--decode-steps 48] [--json out.json]
    python benchmarks/bench_step_overhead.py --report after*.json --baseline before*.json
    python benchmarks/bench_step_overhead.py --ablate --batches 32 128 --repeats 5
    python benchmarks/bench_step_overhead.py --ablate-functions --batches 32 128

GPU decode step, async scheduling off / on, against the full floor (issue 16; Llama-2-7B
shapes, random bf16 weights, prompt 128, CUDA graphs on; ``base`` and ``lora`` = every
row on one of ``min(batch, 32)`` distinct r=16 adapters on all 7 projections)::

    python benchmarks/bench_step_overhead.py --gpu-decode --out step_async.json [--batches 1 32 128]

Each (variant, async) engine runs in its own process. The step time is the wall time of
the decode-only steps divided by their number, with no device sync between steps (a sync
per step would undo the overlap). Full floor = (weight bytes + KV bytes read at the
measured steps' mean context + the distinct adapters' A/B bytes) / measured device copy
bandwidth. ``--quick`` (2 layers, hidden 256, CPU works) checks the logic.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiny_models import make_peft_adapter, make_tiny_model  # noqa: E402

from loraplex.engine.config import EngineConfig  # noqa: E402
from loraplex.engine.cuda_graphs import CudaGraphRunner, _Graph  # noqa: E402
from loraplex.engine.llm_engine import LLMEngine  # noqa: E402
from loraplex.adapters.lora_request import LoRARequest  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402

STAGES = ("schedule", "prepare", "forward", "sample", "post", "step")
PROMPT_TOKENS = 12
MAX_NUM_SEQS = 128


class _NoopGraph:
    """Stands in for a captured CUDA graph: replay does nothing (the GPU would run it asynchronously)."""

    def replay(self) -> None:
        pass


def attach_graph_emulation(engine: LLMEngine) -> None:
    """Give the runner CUDA-graph decode buffers on the CPU with no-op graphs."""
    runner = engine.runner
    graphs = CudaGraphRunner(engine.model, engine.kv_cache.layers, engine.config.block_size, engine.max_model_len,
                             engine.config.max_num_seqs, engine.config.max_loras if engine.lora_pool else 0,
                             engine.device)
    gen = torch.Generator().manual_seed(0)
    variants = [(False, False), (True, False), (True, True)] if graphs.num_lora_slots else [(False, False)]
    for size in graphs.sizes:
        hidden = torch.randn(size, engine.spec.hidden_size, generator=gen, dtype=engine.dtype)
        for (with_lora, with_dora), context in itertools.product(variants, graphs.context_buckets):
            graphs.graphs[(size, with_lora, with_dora, context)] = _Graph(_NoopGraph(), hidden)
    runner.graphs = graphs


class StageTimers:
    """Wraps the engine's step methods with timers; keeps the stage times of decode-only steps."""

    def __init__(self, engine: LLMEngine, clock=time.thread_time) -> None:
        self.clock = clock
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self._decode_only = False
        self._wrap(engine.scheduler, "schedule", "schedule", after=self._note_batch)
        self._wrap(engine.runner, "launch", "execute")
        self._wrap(engine.model, "forward", "forward")
        self._wrap(engine.runner, "_sample", "sample")
        self._wrap(engine, "step", "step", after=self._finish_step)

    def _wrap(self, obj, name: str, stage: str, after=None) -> None:
        inner = getattr(obj, name)
        current, clock = self.current, self.clock

        def timed(*args, **kwargs):
            t0 = clock()
            out = inner(*args, **kwargs)
            current[stage] = current.get(stage, 0.0) + clock() - t0
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)

    def _note_batch(self, batch) -> None:
        self._decode_only = bool(batch.seqs) and all(s.num_new_tokens == 1 and s.num_samples == 1
                                                     for s in batch.seqs)

    def _finish_step(self, _outputs) -> None:
        c = self.current
        if self._decode_only:
            execute = c.get("execute", 0.0)
            forward, sample = c.get("forward", 0.0), c.get("sample", 0.0)
            self.steps.append({
                "schedule": c.get("schedule", 0.0), "prepare": execute - forward - sample, "forward": forward,
                "sample": sample, "post": c["step"] - c.get("schedule", 0.0) - execute, "step": c["step"]})
        c.clear()


def run_workload(engine: LLMEngine, timers: StageTimers, batch: int, lora: LoRARequest | None, output_kind: str,
                 decode_steps: int, rng: random.Random) -> dict[str, float]:
    """Median ms per stage over the decode-only steps of one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True, output_kind=output_kind)
    vocab = engine.spec.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora)
    timers.steps.clear()
    while engine.has_unfinished_requests():
        engine.step()
    steps = timers.steps[2:]
    return {s: statistics.median(step[s] for step in steps) * 1e3 for s in STAGES}


def build_engine(model_dir: Path, mode: str) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=256, block_size=16,
                          num_kv_blocks=MAX_NUM_SEQS * 256 // 16 + 64, max_num_seqs=MAX_NUM_SEQS,
                          max_num_batched_tokens=2048, enable_lora=True, max_loras=4)
    engine = LLMEngine(config)
    if mode == "graph":
        attach_graph_emulation(engine)
    return engine


# -- GPU decode step: async scheduling off / on against the full floor -------------------------
GPU_PROMPT, GPU_OUTPUT, GPU_MAX_ADAPTERS, GPU_RANK = 128, 64, 32, 16


def _gpu_config(quick: bool) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import LLAMA2_7B

    config = dict(LLAMA2_7B)
    if quick:
        config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4)
    return config


def gpu_decode_case(variant: str, async_scheduling: bool, batches: list[int], quick: bool) -> dict:
    """One engine (this process): per batch, decode ms per step and the full floor's parts."""
    from common import make_model_dir, make_random_adapter, measure_copy_bandwidth

    from loraplex import LLM

    cuda = torch.cuda.is_available()
    config = _gpu_config(quick)
    root = Path(tempfile.mkdtemp(prefix="loraplex-async-"))
    folder = make_model_dir(root / "model", config)
    num_adapters = min(max(batches), GPU_MAX_ADAPTERS) if variant == "lora" else 0
    llm = LLM(model=str(folder), dummy_weights=True, dtype="bfloat16" if cuda else "float32",
              max_model_len=GPU_PROMPT + GPU_OUTPUT + 16, max_num_seqs=max(batches), gpu_memory_utilization=0.85,
              **(dict(enable_lora=True, max_loras=num_adapters, max_lora_rank=GPU_RANK, max_cpu_loras=num_adapters)
                 if variant == "lora" else {}), async_scheduling=async_scheduling,
              max_num_batched_tokens=max(2048, max(batches) * GPU_PROMPT),
              **({} if cuda else {"num_kv_blocks": 1024}))
    engine = llm.engine
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_random_adapter(root / f"a{i}", config, GPU_RANK, seed=i)))
                for i in range(num_adapters)]
    for lora in adapters:
        engine.preload_lora(lora)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    elem = torch.empty((), dtype=engine.dtype).element_size()
    spec = engine.spec
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["hidden_size"] // config["num_attention_heads"]
    outs = [h, config["num_key_value_heads"] * d, config["num_key_value_heads"] * d, h, inter, inter, h]
    ins = [h, h, h, h, h, h, inter]
    adapter_bytes = config["num_hidden_layers"] * GPU_RANK * sum(i + o for i, o in zip(ins, outs)) * elem
    bandwidth = measure_copy_bandwidth() if cuda else float("nan")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = {}
    gen = torch.Generator().manual_seed(0)
    for warm, batch in [(True, min(batches)), *[(False, b) for b in batches]]:
        output = 8 if warm else GPU_OUTPUT
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True, output_kind="final_only")
        for i in range(batch):
            prompt = torch.randint(10, config["vocab_size"] - 10, (GPU_PROMPT,), generator=gen).tolist()
            engine.add_request(f"b{batch}-{warm}-{i}", prompt, params, adapters[i % len(adapters)] if adapters else None)
        step = 0
        start = None
        contexts = []
        overlapped_before = engine.num_overlapped_steps
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            running = engine.scheduler.running
            if step == 4:  # the prompts are in (one step, or a few chunks), decodes flow
                sync()
                start, first = time.perf_counter(), step
            if start is not None and running:
                contexts.append(sum(s.num_computed_tokens for s in running) / len(running))
        sync()
        if warm or start is None:
            continue
        steps = step - first
        step_ms = 1e3 * (time.perf_counter() - start) / steps
        mean_context = statistics.fmean(contexts) if contexts else float(GPU_PROMPT)
        distinct = min(batch, num_adapters)
        floor_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token + distinct * adapter_bytes
        floor_ms = 1e3 * floor_bytes / bandwidth
        rows[str(batch)] = {"step_ms": step_ms, "steps": steps, "mean_context_tokens": mean_context,
                            "weight_bytes": weight_bytes, "kv_read_bytes": batch * mean_context * kv_bytes_per_token,
                            "adapter_bytes": distinct * adapter_bytes, "distinct_adapters": distinct,
                            "full_floor_ms": floor_ms, "floor_fraction": floor_ms / step_ms,
                            "overlapped_steps": engine.num_overlapped_steps - overlapped_before}
    return {"variant": variant, "async_scheduling": async_scheduling, "copy_bandwidth_TBps": bandwidth / 1e12,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}


def gpu_decode(out: Path, batches: list[int], quick: bool) -> None:
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import git_commit, print_table

    cases = []
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-async-runs-"))
    for variant in ("base", "lora"):
        for on in (False, True):
            part = tmp / f"{variant}-{on}.json"
            subprocess.run([sys.executable, __file__, "--gpu-decode-case", variant, str(int(on)), "--out", str(part),
                            "--batches", *map(str, batches)] + (["--quick"] if quick else []), check=True)
            cases.append(json.loads(part.read_text()))
    result = {"commit": git_commit(), "prompt_tokens": GPU_PROMPT, "output_tokens": GPU_OUTPUT, "cases": cases}
    out.write_text(json.dumps(result, indent=2))
    table = []
    for variant in ("base", "lora"):
        off, on = (next(c for c in cases if c["variant"] == variant and c["async_scheduling"] is a) for a in (False, True))
        for b in map(str, batches):
            r0, r1 = off["rows"][b], on["rows"][b]
            table.append([variant, b, f"{r0['step_ms']:.2f}", f"{r1['step_ms']:.2f}", f"{r1['full_floor_ms']:.2f}",
                          f"{r0['floor_fraction']:.2f}", f"{r1['floor_fraction']:.2f}",
                          f"{r1['mean_context_tokens']:.0f}", r1["distinct_adapters"]])
    print_table(f"Decode step, async scheduling off / on, vs the full floor (commit {result['commit']}, "
                f"{cases[0]['device']}, copy {cases[0]['copy_bandwidth_TBps']:.2f} TB/s)",
                ["variant", "batch", "sync ms", "async ms", "full floor ms", "floor/sync", "floor/async",
                 "mean context", "adapters"], table)


def main() -> None:
    if "--gpu-decode" in sys.argv or "--gpu-decode-case" in sys.argv:
        gpu = argparse.ArgumentParser()
        gpu.add_argument("--gpu-decode", action="store_true")
        gpu.add_argument("--gpu-decode-case", nargs=2, default=None)
        gpu.add_argument("--out", type=Path, required=True)
        gpu.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
        gpu.add_argument("--quick", action="store_true", help="2 layers, hidden 256 (logic check; CPU works)")
        args = gpu.parse_args()
        if args.gpu_decode_case:
            variant, on = args.gpu_decode_case
            args.out.write_text(json.dumps(gpu_decode_case(variant, bool(int(on)), args.batches, args.quick)))
        else:
            gpu_decode(args.out, args.batches, args.quick)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--modes", nargs="+", default=["graph", "eager"], choices=["graph", "eager"])
    parser.add_argument("--kinds", nargs="+", default=["final_only", "cumulative"],
                        choices=["final_only", "cumulative", "delta"])
    parser.add_argument("--loras", nargs="+", default=["base", "lora"], choices=["base", "lora"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=48)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this thread's CPU time (robust on a shared machine); wall: perf_counter")
    parser.add_argument("--json", type=Path, default=None, help="save every run's stage medians here")
    parser.add_argument("--report", type=Path, nargs="+", default=None,
                        help="no benchmark: print the table of saved runs (files merged)")
    parser.add_argument("--baseline", type=Path, nargs="+", default=None,
                        help="with --report: saved runs of the code before; prints before -> after")
    parser.add_argument("--ablate", action="store_true",
                        help="graph mode, base model: switch each fast path off in turn (rows 'off: NAME')")
    parser.add_argument("--ablate-functions", action="store_true",
                        help="per function, each fast path off in turn, at each of --batches (ms per call)")
    args = parser.parse_args()
    if args.report:
        after = load_runs(args.report)
        if args.baseline:
            print_comparison(load_runs(args.baseline), after)
        else:
            print_table(after)
        return
    torch.set_num_threads(1)

    root = Path(tempfile.mkdtemp(prefix="loraplex-overhead-"))
    model_dir = make_tiny_model(root / "model", "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                num_attention_heads=4, num_key_value_heads=2)
    adapter = LoRARequest("bench", 1, str(make_peft_adapter(model_dir, root / "adapter")))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.ablate_functions:
        print("| function | batch | fast path off | ms per call |")
        print("|---|---:|---|---:|")
        for batch in args.batches:
            for (name, off), ms in run_function_ablation(model_dir, batch).items():
                print(f"| {name} | {batch} | {off} | {ms:.3f} |")
        return
    if args.ablate:
        runs = run_ablation(model_dir, args.batches, args.kinds, args.repeats, args.decode_steps, clock)
        print_table(runs)
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
        return
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    rng = random.Random(0)
    for mode in args.modes:
        engine = build_engine(model_dir, mode)
        timers = StageTimers(engine, clock)
        run_workload(engine, timers, 4, adapter, "cumulative", 8, rng)  # warm up
        for _ in range(args.repeats):  # interleave configurations so load changes hit all alike
            for batch in args.batches:
                for lora in args.loras:
                    for kind in args.kinds:
                        key = f"{mode}|{batch}|{lora}|{kind}"
                        runs[key].append(run_workload(engine, timers, batch, adapter if lora == "lora" else None,
                                                      kind, args.decode_steps, rng))
        del engine
    print_table(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


# -- ablation: switch one fast path back to the general code at a time -----------------


def _ablations() -> dict:
    """name -> function that switches one fast path off and returns its undo.

    Each restores the code path the engine used before issue 9 for that piece
    (``output_without_top`` approximately: rows without logprobs get empty top
    dicts, the old cost)."""
    from loraplex.engine import detokenizer, model_runner, sampler
    from loraplex.engine.kv_cache_manager import KVCacheManager

    def patch(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        return lambda: setattr(obj, name, old)

    def sliced_rows(self, seq):  # a new row every step, with a copy of the output ids
        group = seq.group
        return sampler.SamplingRow(group.params, group.prompt_token_ids, seq.token_ids[seq.num_prompt_tokens:],
                                   seq.generator, self.eos_token_ids)

    def check_then_allocate(self, seq, num_new_tokens):
        if not self.can_allocate(seq, num_new_tokens):
            return False
        self.allocate_slots(seq, num_new_tokens)
        return True

    build_output = sampler._build_output
    fill = CudaGraphRunner._fill

    def fill_all_rows(self, *args):
        self._table_rows = [[] for _ in self._table_rows]
        fill(self, *args)

    return {
        "backend_decode": lambda: patch(detokenizer, "_backend_decode", lambda tokenizer: None),
        "greedy_batch": lambda: patch(sampler, "_is_plain_greedy", lambda row: False),
        "output_without_top": lambda: patch(
            sampler, "_build_output", lambda raw, ids, num: build_output(raw, ids, [n or 0 for n in num])),
        "sampling_row_cache": lambda: patch(model_runner.ModelRunner, "_sampling_row", sliced_rows),
        "decode_alloc_fast_path": lambda: patch(KVCacheManager, "try_allocate_slots", check_then_allocate),
        "table_row_cache": lambda: patch(CudaGraphRunner, "_fill", fill_all_rows),
    }


def run_ablation(model_dir: Path, batches: list[int], kinds: list[str], repeats: int, decode_steps: int,
                 clock) -> dict[str, list[dict[str, float]]]:
    """Graph mode, base model: every configuration with all fast paths, then with each one off."""
    ablations = _ablations()
    engine = build_engine(model_dir, "graph")
    timers = StageTimers(engine, clock)
    rng = random.Random(0)
    run_workload(engine, timers, 4, None, "cumulative", 8, rng)
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(repeats):
        for batch in batches:
            for kind in kinds:
                for name in ["none", *ablations]:
                    undo = ablations[name]() if name != "none" else (lambda: None)
                    try:
                        runs[f"off: {name}|{batch}|base|{kind}"].append(
                            run_workload(engine, timers, batch, None, kind, decode_steps, rng))
                    finally:
                        undo()
    return runs


def run_function_ablation(model_dir: Path, batch: int, rounds: int = 4) -> dict[tuple[str, str], float]:
    """Fixed decode batch, graph mode: ms per call of ``_sample``, the graph fill and the
    allocation checks of all running sequences, with all fast paths and with each
    relevant one off; minimum over ``rounds`` x 3 x 100 calls (variants interleaved)."""
    ablations = _ablations()
    engine = build_engine(model_dir, "graph")
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind="final_only")
    for i in range(batch):
        engine.add_request(f"f{i}", [rng.randrange(3, engine.spec.vocab_size) for _ in range(PROMPT_TOKENS)], params)
    for _ in range(3):
        engine.step()
    plan = engine.scheduler.schedule()  # the next decode step, planned but not run
    runner, kv, seqs = engine.runner, engine.kv_manager, [item.seq for item in plan.seqs]
    with torch.inference_mode():
        hidden = runner._run_graph(runner.plan_step(plan))
    rows = list(range(len(plan.seqs)))
    functions = {
        "_sample": (lambda: runner._sample(plan, rows, hidden),
                    ["greedy_batch", "output_without_top", "sampling_row_cache"]),
        "graph fill": (lambda: runner._run_graph(runner.plan_step(plan)), ["table_row_cache"]),
        "allocation checks": (lambda: [kv.try_allocate_slots(seq, 1) for seq in seqs], ["decode_alloc_fast_path"]),
    }
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):
        for name, (fn, offs) in functions.items():
            for off in ["none", *offs]:
                undo = ablations[off]() if off != "none" else (lambda: None)
                try:
                    with torch.inference_mode():
                        for _ in range(3):
                            t0 = time.thread_time()
                            for _ in range(100):
                                fn()
                            ms = (time.thread_time() - t0) * 10
                            best[(name, off)] = min(ms, best.get((name, off), ms))
                finally:
                    undo()
    return best


def load_runs(paths: list[Path]) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for path in paths:
        for key, values in json.loads(path.read_text()).items():
            runs[key].extend(values)
    return runs


def best(values: list[dict[str, float]], stage: str) -> float:
    """The least disturbed run: minimum over runs of the per-run median (ms)."""
    return min(v[stage] for v in values)


def print_table(runs: dict[str, list[dict[str, float]]]) -> None:
    """Per stage the best run median; then the step's median over runs and the run count."""
    print("| mode | batch | adapter | output_kind | " + " | ".join(STAGES) + " | step (median of runs) | runs |")
    print("|---|---:|---|---|" + "---:|" * (len(STAGES) + 2))
    for key, values in runs.items():
        cells = " | ".join(f"{best(values, s):.3f}" for s in STAGES)
        median = statistics.median(v["step"] for v in values)
        print(f"| {' | '.join(key.split('|'))} | {cells} | {median:.3f} | {len(values)} |")


def print_comparison(before: dict[str, list[dict[str, float]]], after: dict[str, list[dict[str, float]]]) -> None:
    """Best run median per stage, before -> after, and the step's speed-up (best and median of runs)."""
    print("| mode | batch | adapter | output_kind | " + " | ".join(STAGES) + " | speed-up best / median |")
    print("|---|---:|---|---|" + "---:|" * (len(STAGES) + 1))
    for key, values in after.items():
        if key not in before:
            continue
        old = before[key]
        cells = " | ".join(f"{best(old, s):.3f} → {best(values, s):.3f}" for s in STAGES)
        med_old = statistics.median(v["step"] for v in old)
        med_new = statistics.median(v["step"] for v in values)
        speedup = f"{best(old, 'step') / best(values, 'step'):.2f}x / {med_old / med_new:.2f}x"
        print(f"| {' | '.join(key.split('|'))} | {cells} | {speedup} |")


if __name__ == "__main__":
    main()
