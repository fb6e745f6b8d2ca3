"""Programmatic dependent launch variants on a decode step's graph: when kernels let the next one launch, and weight
prefetch before the wait.

Issue 16, session 20: PDL on every kernel of a Llama-2-7B decode graph saves 0.19 ms at batch 1 and loses 0.37 ms
at batch 32, cause unknown. Every kernel let the next one launch right after its own wait ("start"), so the next
kernel's programs take SM slots (shared memory, warps) and wait there while this kernel still runs. This measures,
on the engine's own model and decode graph (the layers: embedding, 32 decoder layers, final norm; the LM head and
sampling run outside it), one CUDA graph per variant:

- ``off``: no PDL (session 20's engine above batch 1);
- trigger modes (``_triton.use_pdl_trigger``, ``bench_decode.PDL_TRIGGER_POLICIES``): ``start`` (session 20's),
  ``exit`` (no explicit trigger: each program lets go when it ends), ``late`` (the GEMMs and decode attention after
  their main loop, the rest at exit), and ``mixed`` (GEMMs and attention late, the small kernels at start: the
  engine's default since session 21);
- ``+pf N``: each Triton GEMM program prefetches the first N columns of its weight rows into L2 before its wait
  (``_triton.use_pdl_prefetch``), while the kernel before it runs;
- ``+kv N``: each decode attention program reads the step's metadata and prefetches the K/V lines of its chunk's
  first N positions into L2 before its wait (``_triton.use_pdl_kv_prefetch``);
- ``mixed/OP-MODE``: the engine's default with those ops' trigger changed (session 22: which op's mode matters).

Inputs: ``--batches`` sequences of ``--context`` positions each (distinct KV blocks), one decode token each. Each
variant's graph output is compared with ``off``'s (bitwise: the kernels and their configs are the same). Times:
the least over ``--rounds`` interleaved rounds of the median of 20 replays (CUDA events), after a clock warm-up.
Usage (CUDA): ``python benchmarks/diag_pdl.py [--batches 1,32,128] [--variants off,start,...] [--out F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode import pdl_trigger_spec  # noqa: E402
from common import LLAMA2_7B, make_model_dir, replay_ms  # noqa: E402
from loraplex.engine.cuda_graphs import CudaGraphRunner  # noqa: E402
from loraplex.engine.llm import LLM  # noqa: E402
from loraplex.kernels._triton import (DEFAULT_PDL_TRIGGERS, pdl_launches, use_pdl,  # noqa: E402
                                      use_pdl_kv_prefetch, use_pdl_prefetch, use_pdl_trigger)

VARIANTS = {  # name: (PDL on, bench_decode.PDL_TRIGGER_POLICIES name or {op: trigger} over "mixed", prefetch
    # columns, decode attention's K/V prefetch positions)
    "off": (False, "start", 0, 0),
    "start": (True, "start", 0, 0),
    "exit": (True, "exit", 0, 0),
    "late": (True, "late", 0, 0),
    "mixed": (True, "mixed", 0, 0),
    "start+pf512": (True, "start", 512, 0),
    "mixed+pf512": (True, "mixed", 512, 0),
    "late+pf512": (True, "late", 512, 0),
    "start+pf1024": (True, "start", 1024, 0),
    "mixed+kv64": (True, "mixed", 0, 64),
    "mixed+kv128": (True, "mixed", 0, 128),
    "mixed/attn-start": (True, {"paged_decode_attention": "start"}, 0, 0),
    "mixed/attn-start+kv64": (True, {"paged_decode_attention": "start"}, 0, 64),
    "mixed/attn-exit": (True, {"paged_decode_attention": "exit"}, 0, 0),
    "mixed/gemm-exit": (True, {"dense_linear": "exit"}, 0, 0),
    "mixed/small-exit": (True, {"rms_norm": "exit", "rotary_and_cache": "exit", "silu_and_mul": "exit"}, 0, 0),
}


def trigger_spec(trigger: str | dict[str, str]) -> str | dict[str, str]:
    """A variant's trigger setting for ``use_pdl_trigger``: a policy by name, or the "mixed" policy with ``trigger``'s
    ops changed."""
    if isinstance(trigger, str):
        return pdl_trigger_spec(trigger)
    return {**pdl_trigger_spec("mixed"), **trigger}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, eager forwards: checks the logic only")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("diag_pdl.py needs a CUDA GPU (--quick checks the logic on CPU)")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    config, device_kw = dict(LLAMA2_7B), {"dtype": "bfloat16", "gpu_memory_utilization": 0.85}
    if args.quick:
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=512)
        device_kw = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 2048}
    model_dir = make_model_dir(Path(tempfile.mkdtemp()) / "model", config)
    llm = LLM(model=str(model_dir), dummy_weights=True, max_model_len=ctx + 64, max_num_seqs=max(batches),
              enforce_eager=True, **device_kw)
    engine = llm.engine
    dev = engine.device
    graphs = CudaGraphRunner(engine.model, engine.kv_cache.layers, engine.runner.block_size, ctx + 64, max(batches),
                             0, dev, None, dora=False)
    spin = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) if not args.quick else None
    report = {"commit": os.environ.get("LORAPLEX_COMMIT", "?"),
              "device": str(dev) if args.quick else torch.cuda.get_device_name(), "context": ctx, "rows": []}
    block = engine.runner.block_size
    # each variant sets its own; the engine's settings come back after each batch
    engine_settings = use_pdl_trigger(DEFAULT_PDL_TRIGGERS), use_pdl_prefetch(0), use_pdl_kv_prefetch(0)
    per_seq = -(-(ctx + 1) // block)
    context = next(c for c in graphs.context_buckets if c >= ctx)  # the decode graph the engine replays at ctx
    for b in batches:
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(b)]
        pos = ctx - 1
        slots = [t[pos // block] * block + pos % block for t in tables]
        graphs._fill(b, b, [100 + i for i in range(b)], [pos] * b, slots, [ctx] * b, tables)
        graphs._i64.upload(graphs._i64.host.numel())
        graphs._i32.upload(graphs._i32.host.numel())
        captured = {}  # name -> (graph or None on the CPU, a copy of its output)
        for name in names:
            on, trigger, prefetch, kv_prefetch = VARIANTS[name]
            use_pdl(True)
            use_pdl_trigger(trigger_spec(trigger))
            use_pdl_prefetch(prefetch)
            use_pdl_kv_prefetch(kv_prefetch)
            with pdl_launches(on), torch.inference_mode():
                if args.quick:  # no graphs on the CPU: the forward itself
                    captured[name] = (None, graphs._forward(b, False, False, context).clone())
                    continue
                for _ in range(2):
                    graphs._forward(b, False, False, context)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # a pool of its own: the graphs of a batch are freed after it
                    hidden = graphs._forward(b, False, False, context)
            graph.replay()
            torch.cuda.synchronize()
            captured[name] = (graph, hidden.clone())
        use_pdl_trigger(engine_settings[0])
        use_pdl_prefetch(engine_settings[1])
        use_pdl_kv_prefetch(engine_settings[2])
        ref = captured[names[0]][1]
        row = {"batch": b, "equal_to_" + names[0]: {n: bool(torch.equal(c[1], ref)) for n, c in captured.items()}}
        if args.quick:
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            continue
        for _ in range(30):
            spin @ spin  # clocks up
        times: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, (graph, _) in captured.items():
                graph.replay()
                times[name] = min(times.get(name, float("inf")), replay_ms(graph, 20))
        row["ms"] = times
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        del captured
        torch.cuda.synchronize()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    engine.close()
    return report


if __name__ == "__main__":
    main()
