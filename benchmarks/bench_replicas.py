"""Replicas (issue 18): output tokens/s of 1 engine replica vs N replicas (one GPU each) with
adapter-aware routing, chatbot scenario (128 prompt tokens, 64 output tokens, greedy,
``ignore_eos``), 100 adapters r=16 on all 7 projections with Zipf(1.1) popularity plus 20%
base-model requests, Llama-2-7B shapes with random bf16 weights (``bench_serving``'s setup).

Closed loop: ``--concurrency`` requests in flight per replica (N x that over N replicas, so
the offered load scales with the replicas; a new request is routed as soon as one finishes),
``--requests`` in all; a warm-up round (every adapter once, not
measured) first. Two variants, say which with ``--variant``:

- ``processes`` (no Ray; what the H200 machine can run): one engine process per GPU
  (``CUDA_VISIBLE_DEVICES``), this process routes every request with the same policy as the
  Ray Serve router (``loraplex.platform.cluster.routing.rank_replicas`` over each engine's
  residency report, sent after its steps, its requests in flight and routing hints).
  ``--policy`` picks ``adapter-aware`` (default), ``least-loaded`` or ``random`` for comparison.
- ``ray``: the real deployment (``loraplex.platform.cluster.launch.start_replicas``: Ray Serve
  replicas, the adapter-aware ``RequestRouter``, requests through ``ReplicaEngineClient``);
  needs the ``cluster`` extra.

Usage: ``python benchmarks/bench_replicas.py --out FILE [--variant processes|ray] [--replicas 1,2]
[--requests 2000] [--concurrency 256] [--quick]``. ``--quick``: a tiny random Llama on CPU (2
replicas as 2 CPU processes; numbers meaningless, the path is the real one). Writes ``FILE``
(JSON); prints a markdown table last. Goal (issue 18): 2 replicas >= 1.8x 1 replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

IN_LEN, OUT_LEN, NUM_ADAPTERS, BASE_FRACTION, ZIPF_S = 128, 64, 100, 0.2, 1.1
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, torch_dtype="float32")


# -- workload --------------------------------------------------------------------------------------
def workload(seed: int, count: int, vocab: int, num_adapters: int, in_len: int) -> list[tuple[list[int], int | None]]:
    """(prompt token ids, adapter index or None for the base model) per request."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** ZIPF_S for i in range(num_adapters)]
    out = []
    for _ in range(count):
        adapter = None if rng.random() < BASE_FRACTION else rng.choices(range(num_adapters), weights)[0]
        out.append(([rng.randrange(10, vocab - 10) for _ in range(in_len)], adapter))
    return out


def engine_kwargs(quick: bool) -> dict:
    if quick:
        return dict(device="cpu", dtype="float32", max_model_len=256, enable_lora=True, max_loras=4, max_lora_rank=16,
                    max_cpu_loras=128, max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=256)
    return dict(dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.85, enable_lora=True, max_loras=64,
                max_lora_rank=16, max_cpu_loras=128, max_num_seqs=256, max_num_batched_tokens=8192)


def build_engine(model_dir: str, kwargs: dict):
    """An ``LLMEngine`` with random weights (``dummy_weights``) for ``model_dir``'s config."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, **kwargs), dummy_weights=True)


# -- variant "processes": one engine process per GPU, routing here -------------------------------
def _worker(index: int, gpu: int | None, model_dir: str, kwargs: dict, inbox, outbox) -> None:
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.async_engine import stats_to_dict
    from loraplex.platform.cluster.routing import adapter_routing_key, routing_stats_from_engine

    engine = build_engine(model_dir, kwargs)
    keys: dict[str, str] = {}
    params = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True, output_kind="final_only")

    def report(done):
        stats = routing_stats_from_engine(stats_to_dict(engine.get_stats()), keys).to_dict()
        outbox.put(("step", index, done, stats))

    outbox.put(("ready", index, None, None))
    steps = 0
    while True:
        try:
            message = inbox.get(block=not engine.has_unfinished_requests())
        except queue.Empty:
            message = None
        while message is not None:
            if message[0] == "stop":
                engine.close()
                return
            _, request_id, prompt, lora = message
            if lora is not None:
                keys[lora.lora_name] = adapter_routing_key(lora)
            engine.add_request(request_id, prompt, params, lora)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        outputs = engine.step()
        steps += 1
        done = [(o.request_id, len(o.outputs[0].token_ids), o.error) for o in outputs if o.finished]
        if done or steps % 8 == 0:
            report(done)


def run_processes(n: int, model_dir: str, kwargs: dict, requests, loras, concurrency: int, policy: str,
                  gpus: list[int | None], max_imbalance: int) -> dict:
    from loraplex.platform.cluster.routing import (BASE_MODEL_KEY, ReplicaRoutingStats, ReplicaView, RoutingHints,
                                                   adapter_routing_key, rank_replicas)

    mp = multiprocessing.get_context("spawn")
    outbox = mp.Queue()
    inboxes = [mp.Queue() for _ in range(n)]
    procs = [mp.Process(target=_worker, args=(i, gpus[i], model_dir, kwargs, inboxes[i], outbox), daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    ready = 0
    while ready < n:
        ready += outbox.get(timeout=900)[0] == "ready"
    stats: list[ReplicaRoutingStats | None] = [None] * n
    load = [0] * n
    hints = RoutingHints(ttl_s=1.0)
    rng = random.Random(1)
    placed: dict[str, int] = {}

    def route(lora) -> int:
        key = adapter_routing_key(lora) if policy == "adapter-aware" else BASE_MODEL_KEY
        if policy == "random":
            return rng.randrange(n)
        views = [ReplicaView(str(i), stats[i], load[i]) for i in range(n)]
        ranks = rank_replicas(views, key, max_imbalance=max_imbalance, hinted=hints.replicas_for(key))
        chosen = int(ranks[0][0])
        hints.record(key, str(chosen))
        return chosen

    def run(batch, tag: str) -> dict:
        sent = finished = tokens = errors = 0
        t0 = time.perf_counter()
        while finished < len(batch):
            while sent < len(batch) and sent - finished < concurrency:
                prompt, adapter = batch[sent]
                lora = loras[adapter] if adapter is not None else None
                replica = route(lora)
                request_id = f"{tag}-{sent}"
                placed[request_id] = replica
                load[replica] += 1
                inboxes[replica].put(("add", request_id, prompt, lora))
                sent += 1
            _, index, done, report = outbox.get(timeout=900)
            stats[index] = ReplicaRoutingStats.from_dict(report)
            for request_id, num_tokens, error in done:
                load[placed.pop(request_id)] -= 1
                finished += 1
                tokens += num_tokens
                errors += error is not None
        dt = time.perf_counter() - t0
        return {"requests": len(batch), "total_s": dt, "output_tokens_per_s": tokens / dt, "errors": errors}

    try:
        run([(requests[0][0], a) for a in range(len(loras))] + [(requests[0][0], None)], "warm")
        result = run(requests, "run")
    finally:
        for box in inboxes:
            box.put(("stop",))
        for p in procs:
            p.join(60)
    return result


# -- variant "ray": the Ray Serve deployment ----------------------------------------------------------
def run_ray(n: int, model_dir: str, kwargs: dict, requests, loras, concurrency: int, max_imbalance: int,
            data_dir: Path, quick: bool) -> dict:
    import functools

    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.platform.cluster.launch import start_replicas
    from loraplex.platform.settings import Settings

    settings = Settings(model=model_dir, replicas=n, data_dir=data_dir, routing_max_imbalance=max_imbalance,
                        replica_max_ongoing_requests=kwargs["max_num_seqs"], replica_num_gpus=0.0 if quick else 1.0,
                        replica_num_cpus=1.0, stats_interval_s=0.5)
    client = start_replicas(settings, app_name=f"bench{n}",
                            engine_factory=functools.partial(_factory, model_dir, kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True, output_kind="final_only")

    async def run(batch, tag: str) -> dict:
        client.start()
        limit = asyncio.Semaphore(concurrency)
        tokens = errors = 0

        async def one(i: int, prompt, adapter) -> None:
            nonlocal tokens, errors
            async with limit:
                try:
                    async for output in client.generate(f"{tag}-{i}", prompt, params,
                                                        loras[adapter] if adapter is not None else None):
                        if output.finished:
                            tokens += len(output.outputs[0].token_ids)
                except Exception:  # noqa: BLE001 - counted
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p, a) for i, (p, a) in enumerate(batch)))
        dt = time.perf_counter() - t0
        return {"requests": len(batch), "total_s": dt, "output_tokens_per_s": tokens / dt, "errors": errors,
                "requests_routed": {f"{k}@{r}": c for (k, r), c in client.requests_routed.items()}}

    try:
        asyncio.run(run([(requests[0][0], a) for a in range(len(loras))] + [(requests[0][0], None)], "warm"))
        client.requests_routed.clear()
        return asyncio.run(run(requests, "run"))
    finally:
        client.shutdown()


def _factory(model_dir: str, kwargs: dict, settings):
    return build_engine(model_dir, kwargs)


# -- main ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "replicas.json")
    ap.add_argument("--variant", choices=["processes", "ray"], default="processes")
    ap.add_argument("--replicas", default="1,2", help="replica counts to run, e.g. 1,2")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight per replica")
    ap.add_argument("--policy", choices=["adapter-aware", "least-loaded", "random"], default="adapter-aware")
    ap.add_argument("--max-imbalance", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny random Llama on CPU")
    args = ap.parse_args(argv)

    from bench_serving import make_adapters
    from common import LLAMA2_7B, git_commit, make_model_dir

    config = TINY if args.quick else dict(LLAMA2_7B)
    root = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    model_dir = str(make_model_dir(root / "model", config))
    num_adapters = 8 if args.quick else NUM_ADAPTERS
    loras = make_adapters(root / "adapters", config, num_adapters, distinct_files=min(num_adapters, 16))
    requests = workload(0, args.requests, config["vocab_size"], num_adapters, 16 if args.quick else IN_LEN)
    kwargs = engine_kwargs(args.quick)
    results: dict = {"commit": git_commit(), "variant": args.variant, "policy": args.policy,
                     "requests": args.requests, "concurrency": args.concurrency, "adapters": num_adapters,
                     "quick": args.quick, "runs": {}}
    for n in [int(x) for x in args.replicas.split(",")]:
        print(f"[replicas={n}] {args.variant}", flush=True)
        if args.variant == "processes":
            gpus = [None] * n if args.quick else list(range(n))
            run = run_processes(n, model_dir, kwargs, requests, loras, n * args.concurrency, args.policy, gpus,
                                args.max_imbalance)
        else:
            run = run_ray(n, model_dir, kwargs, requests, loras, n * args.concurrency, args.max_imbalance,
                          root / f"data{n}", args.quick)
        results["runs"][str(n)] = run
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    runs = results["runs"]
    if "1" in runs and len(runs) > 1:
        top = max(runs, key=int)
        results["speedup"] = runs[top]["output_tokens_per_s"] / runs["1"]["output_tokens_per_s"]
        results["goal_met"] = results["speedup"] >= 1.8 * int(top) / 2
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\n| replicas | variant | policy | output tok/s | errors |\n|---|---|---|---|---|")
    for n, run in runs.items():
        print(f"| {n} | {args.variant} | {args.policy} | {run['output_tokens_per_s']:.0f} | {run['errors']} |")
    if "speedup" in results:
        print(f"\nspeedup {results['speedup']:.2f}x (goal >= 1.8x for 2 replicas)")
    return results


if __name__ == "__main__":
    main()
