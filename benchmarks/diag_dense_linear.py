"""bf16 decode GEMMs as the engine runs them: cuBLAS, cuBLASLt and Triton launch shapes, 32 layers in a CUDA graph.

Issue 16: at batch 32 the GEMMs of a Llama-2-7B decode step take 3.75 ms against 3.2 ms of weight bytes at copy
bandwidth (cuBLAS at ~0.85 of copy). This measures whether another GEMM gets closer, the way a decode step runs them:
each linear (Llama-2-7B and Llama-3-8B shapes) over 32 distinct weight copies (one per layer, so no weight is in L2),
captured in one CUDA graph and replayed back to back (warm clocks, no launch gaps). Variants:

- ``cublas``: ``F.linear`` (what the engine calls), ``cublaslt``: the same through
  ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
- ``loraplex.kernels.dense_linear``'s kernels: ``tm`` token-major (token tile x weight tile^T, mma), ``swap`` the
  weight tile as the dot's 64/128-row side (Hopper wgmma), ``gemv`` one-token rows without tensor cores (T = 1
  only); each over a grid of launch shapes, every shape checked against a float32 product first (relative error
  < 1e-2). (Session 19 also tried a persistent token-major variant, k programs per SM taking column tiles
  p, p + P, ...: never the best, and dropped.) With ``--streamk P,...``: ``streamk`` / ``streamk_tma``, stream-K
  over grids of P programs (equal shares of the tile x K-tile iterations, pointer or TMA loads; ``tiles``: one
  program per output tile).

The LM head is measured the same way, and counted once in a whole step's GEMMs (4 linears x 32 layers + head
in one graph): cuBLAS, cuBLASLt, and each linear's best variant.
Times are the least of ``--rounds`` interleaved rounds, each the median of 10 replays; fraction of copy =
weight bytes / copy bandwidth / time (a read-only kernel can pass 1.0: copy counts read + write).
``--table F`` writes ``dense_linear.MEASURED_CONFIGS`` rows (``bench_decode.py --dense-configs F`` runs with them);
``--extra name:K:N,...`` adds shapes (a folded LoRA linear's), ``--only`` measures the named ones alone, ``--merged F``
writes ``MEASURED_CONFIGS`` with this run's verdict on every (token bucket, shape) it measured: its best product
launch, or no row where cuBLAS won. ``--jobs N`` compiles every launch first in N worker processes (Triton's disk
cache then serves this one; a serial compile of a few hundred launch shapes takes minutes).
Usage (CUDA): ``python benchmarks/diag_dense_linear.py [--tokens 1,16,32,64] [--models llama2,llama3] [--out F]
[--table F] [--extra ...] [--only ...] [--merged F] [--splits 1,2,4] [--streamk 132,264,tiles] [--jobs N]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.testing  # noqa: E402

from common import graph_replay_ms  # noqa: E402
from loraplex.kernels._triton import SM90_SHARED_MEMORY_BYTES  # noqa: E402
from loraplex.kernels.dense_linear import (  # noqa: E402
    KINDS,
    MEASURED_CONFIGS,
    STREAMK_KINDS,
    TOKEN_BUCKETS,
    _launch_dense_linear,
    configs_to_json,
)

LAYERS = 32
MODELS = {
    "llama2": (("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096)),
    "llama3": (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)),
}
HEADS = {"llama2": ("head", 4096, 32000), "llama3": ("head", 4096, 128256)}  # once per step


def launch(kind: str, cfg: tuple, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ w [N, K]^T`` with ``dense_linear``'s kernel ``kind`` and ``cfg`` = (BLOCK_T, BLOCK_N, BLOCK_K,
    warps, stages[, split_k | programs]); ``out`` is unused (the launcher allocates)."""
    return _launch_dense_linear(x, w, config=(kind, *cfg))


def configs(tokens: int, budget: int = SM90_SHARED_MEMORY_BYTES, splits: tuple[int, ...] = (1,),
            in_features: int = 0, streamk: tuple[int, ...] = ()):
    """(kind, cfg) launch shapes for ``tokens`` whose pipelined tiles fit ``budget`` bytes of shared memory; with
    ``splits`` beyond 1, each tiled shape also split over K that many ways (a seventh cfg entry) where
    ``in_features`` holds at least two K tiles per split; with ``streamk`` (grid sizes), the stream-K shapes."""
    for kind, cfg in _configs(tokens, budget):
        yield kind, cfg
        if kind != "gemv":
            for split in splits:
                if split > 1 and in_features >= 2 * split * cfg[2]:
                    yield kind, (*cfg, split)
    yield from streamk_configs(tokens, budget, streamk)


def streamk_configs(tokens: int, budget: int, programs: tuple[int, ...]):
    """Stream-K launch shapes (``dense_linear``'s ``streamk`` and ``streamk_tma``) for ``tokens`` >= 2: one token
    tile (the power of two at or above ``tokens``, at least 16), column tiles of 64-256 (the wgmma M side), K tiles
    of 64-256, pipelined tiles within ``budget`` bytes, at most 128 fp32 accumulators per thread and 8 warps only
    for tiles of 64 x 128 or more, for each grid size in ``programs``."""
    if tokens < 2:
        return
    bt = max(16, 1 << (tokens - 1).bit_length())
    for kind, bn, bk, w, s, p in itertools.product(("streamk", "streamk_tma"), (64, 128, 256), (64, 128, 256),
                                                   (4, 8), (3, 4), programs):
        if (bt + bn) * bk * 2 * s > budget or bn * bt > 128 * 32 * w or (w == 8 and bn * bt < 128 * 64):
            continue
        yield kind, (bt, bn, bk, w, s, p)


def _configs(tokens: int, budget: int):
    """The unsplit launch shapes of :func:`configs`."""
    block_ts = [16] if tokens <= 16 else [32] if tokens <= 32 else [64, 128]
    for bt, bn, bk, w, s in itertools.product(block_ts, (16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4)):
        if (bt + bn) * bk * 2 * s > budget or bn * bk > 128 * 256 or (w == 8 and bt * bn < 64 * 128):
            continue
        yield "tm", (bt, bn, bk, w, s)
    for bt, bn, bk, w, s in itertools.product(block_ts, (64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if (bt + bn) * bk * 2 * s > budget or (w == 8 and bn * bt < 128 * 32):
            continue
        yield "swap", (bt, bn, bk, w, s)
    if tokens == 1:
        for bn, bk, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (4,), (1, 3)):
            if bn * bk > 16 * 512:
                continue
            yield "gemv", (1, bn, bk, w, s)


def measured_linears(model: str, extras: tuple, only: set[str]) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of the linears a run measures for ``model``: its four, its head and the ``extras``, those
    named in ``only`` where it is not empty."""
    return [(name, k, n) for name, k, n in (*MODELS[model], HEADS[model], *extras) if not only or name in only]


def launch_shapes(tokens: int, k: int, n: int, splits: tuple[int, ...], streamk: tuple[int, ...] = ()):
    """The :func:`configs` launch shapes of a ``[tokens, k] x [n, k]^T`` product whose column tiles divide ``n``; a
    stream-K grid of 0 programs becomes one program per output tile (each takes a whole tile: the data-parallel
    launch through the same kernel)."""
    shapes = []
    for kind, cfg in configs(tokens, splits=splits, in_features=k, streamk=streamk):
        if n % cfg[1]:
            continue
        if kind in STREAMK_KINDS and cfg[5] == 0:
            cfg = (*cfg[:5], -(-n // cfg[1]) * -(-tokens // cfg[0]))
        shapes.append((kind, cfg))
    return list(dict.fromkeys(shapes))


_WORKER_TENSORS: dict = {}


def _compile_one(task: tuple) -> str | None:
    """Worker of :func:`precompile`: launch ``(kind, cfg, tokens, k, n)`` once; None, or why it failed."""
    kind, cfg, tokens, k, n = task
    key = (tokens, k, n)
    if key not in _WORKER_TENSORS:
        _WORKER_TENSORS.clear()
        torch.cuda.empty_cache()
        _WORKER_TENSORS[key] = (torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16),
                                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x, w = _WORKER_TENSORS[key]
    try:
        launch(kind, cfg, x, w, None)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the measuring process records it again
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return None


def precompile(tasks: list[tuple], jobs: int, worker=_compile_one) -> dict[tuple, str]:
    """Compile every ``(kind, cfg, tokens, k, n)`` launch in ``jobs`` spawned processes (one CUDA context each),
    so the measuring process loads the kernels from Triton's disk cache instead of compiling them one by one.
    Returns the launches that failed, with why. A launch that faults (an illegal address) leaves its process's CUDA
    context unusable, failing the launches after it there too, so each failure is tried again in a process of its
    own; the measuring process then skips those that fail alone, which would otherwise end its own context.
    ``worker`` (a module-level function, for tests): what runs one launch, None or why it failed."""
    t0 = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs) as pool:
        failed = {task: why for task, why in zip(tasks, pool.imap(worker, tasks, chunksize=2)) if why}
    if failed:
        with context.Pool(jobs, maxtasksperchild=1) as pool:
            failed = {task: why for task, why in zip(failed, pool.map(worker, list(failed), chunksize=1)) if why}
    print(f"precompiled {len(tasks)} launches in {time.perf_counter() - t0:.0f} s ({len(failed)} failed) with {jobs} "
          "processes", flush=True)
    return failed


def graph_ms(calls) -> float:
    """Median ms of one replay of a CUDA graph running ``calls`` (a list of no-arg callables), after 3 warm ones."""
    return graph_replay_ms(calls, replays=10, warm_replays=3)


def blas(lib: str):
    def run(x, w, out):
        torch.backends.cuda.preferred_blas_library(lib)
        return torch.matmul(x, w.t(), out=out)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,32,64")
    ap.add_argument("--models", default="llama2,llama3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--merged", default=None, help="write dense_linear.MEASURED_CONFIGS with this run's verdict on "
                    "every (token bucket, shape) it measured: its best launch, or no row where cuBLAS won (JSON, for "
                    "bench_decode.py --dense-configs)")
    ap.add_argument("--only", default="", help="measure only these linears (names, comma-separated; no whole step)")
    ap.add_argument("--extra", default="", help="more shapes, measured per call only (not in the step): "
                    "name:K:N,... (e.g. a folded LoRA linear's [W; A pages])")
    ap.add_argument("--splits", default="1", help="K splits to try besides the whole K (e.g. 1,2,4: each tiled "
                    "launch shape also split 2 and 4 ways; serial split-K, dense_linear's seventh config entry)")
    ap.add_argument("--streamk", default="", help="stream-K grid sizes to try (e.g. 132,264,tiles: one and two "
                    "programs per H200 SM, and one per output tile; dense_linear's streamk and streamk_tma kinds); "
                    "none by default")
    ap.add_argument("--jobs", type=int, default=0, help="compile every launch first in this many processes")
    ap.add_argument("--table", default=None, help="write dense_linear's table (JSON): per token bucket and shape, "
                    "the best product kernel launch where it beat cuBLAS by >= 2%%")
    args = ap.parse_args()
    table, measured = {}, set()

    def save(report: dict, table: dict) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        if args.table:
            Path(args.table).write_text(configs_to_json(table))
        if args.merged:  # this run's verdict replaces the table's on every key it measured
            merged = {key: c for key, c in MEASURED_CONFIGS.items() if key not in measured}
            merged.update(table)
            Path(args.merged).write_text(configs_to_json(merged))

    only = set(filter(None, args.only.split(",")))
    splits = tuple(int(v) for v in args.splits.split(","))
    streamk = tuple(0 if v == "tiles" else int(v) for v in args.streamk.split(",") if v)
    extras = tuple((name, int(k), int(n)) for name, k, n in (e.split(":") for e in args.extra.split(",") if e))
    dev = torch.device("cuda")
    if args.jobs:
        tasks = [(kind, cfg, int(t), k, n) for model in args.models.split(",") for t in args.tokens.split(",")
                 for _, k, n in measured_linears(model, extras, only)
                 for kind, cfg in launch_shapes(int(t), k, n, splits, streamk)]
        failed = precompile(list(dict.fromkeys(tasks)), args.jobs)  # shapes the models share compile once
    else:
        failed = {}
    torch.manual_seed(0)
    spin = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(50):
        spin @ spin  # clocks up
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() / (copy_ms * 1e-3)  # session 19's first run timed a 2 GB copy in a graph, cold: 2.7 TB/s
    del src, dst
    report = {"copy_TBps": bw / 1e12, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": os.environ.get("LORAPLEX_COMMIT", "?"), "rows": [], "steps": []}
    print(f"copy {bw / 1e12:.3f} TB/s", flush=True)
    for model in args.models.split(","):
        linears = (*MODELS[model], HEADS[model])
        weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
                   for name, k, n in measured_linears(model, extras, only)}
        step_bytes = sum(n * k * 2 * LAYERS for _, k, n in MODELS[model]) + HEADS[model][1] * HEADS[model][2] * 2
        for tokens in (int(t) for t in args.tokens.split(",")):
            best = {}
            for name, k, n in measured_linears(model, extras, only):
                ws = weights[name]
                x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
                outs = [torch.empty(tokens, n, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
                ref = (x.float() @ ws[0].float().t())
                variants = {"cublas": blas("cublas"), "cublaslt": blas("cublaslt")}
                launches = {}
                row = {"model": model, "tokens": tokens, "linear": name, "floor_us": n * k * 2 / bw * 1e6}
                t0 = time.perf_counter()
                for kind, cfg in launch_shapes(tokens, k, n, splits, streamk):
                    if (kind, cfg, tokens, k, n) in failed:
                        row[f"{kind} {cfg}"] = f"failed (compile process): {failed[(kind, cfg, tokens, k, n)]}"
                        continue
                    try:
                        got = launch(kind, cfg, x, ws[0], outs[0])
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - a shape that does not compile is recorded and skipped
                        row[f"{kind} {cfg}"] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
                        continue
                    rel = ((got.float() - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        row[f"{kind} {cfg}"] = f"wrong: rel {rel:.3g}"
                        continue
                    variants[f"{kind} {cfg}"] = (lambda x_, w_, o_, kind=kind, cfg=cfg: launch(kind, cfg, x_, w_, o_))
                    launches[f"{kind} {cfg}"] = (kind, *cfg)
                row["compile_s"] = time.perf_counter() - t0
                times = {}
                for _ in range(args.rounds):
                    for label, fn in variants.items():
                        try:
                            ms = graph_ms([lambda j=j, fn=fn: fn(x, ws[j], outs[j]) for j in range(LAYERS)])
                        except Exception as exc:  # noqa: BLE001
                            row[label] = f"graph failed: {type(exc).__name__}"
                            continue
                        times[label] = min(times.get(label, ms), ms)
                torch.backends.cuda.preferred_blas_library("cublas")
                us = {label: ms * 1e3 / LAYERS for label, ms in times.items()}
                ranked = sorted(us.items(), key=lambda kv: kv[1])
                row["us"] = dict(ranked[:12])
                row["cublas_us"], row["cublaslt_us"] = us.get("cublas"), us.get("cublaslt")
                row["best"], row["best_us"] = ranked[0]
                for kind in KINDS:
                    mine = [kv for kv in ranked if kv[0].startswith(kind + " ")]
                    if mine:
                        row[f"best_{kind}"], row[f"best_{kind}_us"] = mine[0]
                best[name] = (ranked[0][0], variants[ranked[0][0]])
                product = [kv for kv in ranked if kv[0] in launches]
                if tokens in TOKEN_BUCKETS:  # the last measurement of a shape (models may share one) decides
                    key = (report["device"], tokens, n, k)
                    measured.add(key)
                    if product and product[0][1] < 0.98 * us["cublas"]:
                        table[key] = launches[product[0][0]]
                        row["table"] = product[0][0]
                    else:
                        table.pop(key, None)
                report["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "us"}), flush=True)
                del outs
            if only:
                save(report, table)
                continue
            # a whole step's GEMMs: 4 linears x 32 layers and the head once, in one graph
            xs = {name: torch.randn(tokens, k, device=dev, dtype=torch.bfloat16) for name, k, n in linears}
            outs = {name: torch.empty(tokens, n, device=dev, dtype=torch.bfloat16) for name, k, n in linears}
            step = {"model": model, "tokens": tokens, "floor_ms": step_bytes / bw * 1e3,
                    "best_per_linear": {name: label for name, (label, _) in best.items()}}
            plans = {"cublas": {name: blas("cublas") for name in xs},
                     "cublaslt": {name: blas("cublaslt") for name in xs},
                     "best": {name: fn for name, (_, fn) in best.items()}}
            for _ in range(args.rounds):
                for plan, fns in plans.items():
                    calls = [lambda j=j, name=name: fns[name](xs[name], weights[name][j], outs[name])
                             for j in range(LAYERS) for name, _, _ in MODELS[model]]
                    calls.append(lambda: fns["head"](xs["head"], weights["head"][0], outs["head"]))
                    ms = graph_ms(calls)
                    step[f"{plan}_ms"] = min(step.get(f"{plan}_ms", ms), ms)
            torch.backends.cuda.preferred_blas_library("cublas")
            for plan in plans:
                step[f"{plan}_of_copy"] = step["floor_ms"] / step[f"{plan}_ms"]
            report["steps"].append(step)
            print(json.dumps(step), flush=True)
            save(report, table)
        del weights
        torch.cuda.empty_cache()
    save(report, table)


if __name__ == "__main__":
    main()
