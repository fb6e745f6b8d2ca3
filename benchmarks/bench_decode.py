"""Decode step against its full memory floor, with a profile breakdown (issue 16; issue 17 goal 2).

Llama-2-7B shapes, random bf16 weights, CUDA graphs on, prompt 128 random token ids, output ``--out-len``
(greedy, ``ignore_eos``). For batch B in (1, 32, 128), kinds ``base`` (no adapter) and ``mixed`` (request i
on adapter i mod 32: 32 distinct r=16 adapters on all 7 projections, resident in GPU slots), with
``async_scheduling`` off and on (one engine each).

- **Step time**: the median gap between successive returns of ``LLMEngine.step`` over the steps whose
  launch and the launch before it were decode-only (B tokens). The host reads each step's samples back
  once, so in steady state the gap is the step's time, sync or async, host work included.
- **Full floor** (Williams et al., "Roofline", 2009; bytes at the copy bandwidth measured in this run):
  weights read once per step (all linear layers, norms and ``lm_head``; of the embedding only B rows) +
  K and V read at the steps' mean context (``B x (prompt + out_len / 2) x layers x 2 x kv_heads x
  head_dim x 2 bytes``) + the distinct adapters' A and B (``min(B, 32) x 80 MB``). ``floor_fraction`` =
  floor / step (goal: >= 0.80 base, >= 0.75 mixed).
- **Profile** (``torch.profiler``, ``--profile-steps`` decode steps of a second run of the same
  configuration): GPU busy = union of kernel intervals / (last kernel end - first kernel start), and kernel
  time per class: GEMM (cuBLAS/cuBLASLt/CUTLASS/nvjet, FP8 linears), attention (paged attention kernels),
  LoRA (shrink/expand/fused/DoRA), other (norms, rotary, activation, sampling, copies).

Adapter types (issue 19), ``--kinds base,mixed,dora,vocab,head-copy,mixed-ranks``: ``dora`` = 32 DoRA adapters,
``vocab`` = 32 adapters that add LoRA on ``embed_tokens`` and ``lm_head``, ``head-copy`` = 4 adapters that
add an ``lm_head`` ``modules_to_save`` copy (4 full-module slots), ``mixed-ranks`` = 32 adapters of ranks
24 x 8 + 4 x 16 + 4 x 64 (the bytes of ``mixed``; issue 17's ranks without padding, with ``--lora-page-rows 8``
every adapter holds pages for its own rank); each floor counts its type's bytes (``kind_adapter_bytes``).

Usage: ``python benchmarks/bench_decode.py [--batches 1 32 128] [--out-len 64]`` (CUDA; writes
``$OUT/decode.json`` and prints a markdown table last); ``--quick`` runs the logic on CPU with a tiny model
(numbers mean nothing, no profile).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA2_7B, git_commit, make_model_dir, measure_copy_bandwidth, out_dir  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine import cuda_graphs  # noqa: E402
from loraplex.engine.models import llama  # noqa: E402
from loraplex.kernels._triton import (DEFAULT_PDL_TRIGGERS, use_pdl, use_pdl_kv_prefetch,  # noqa: E402
                                      use_pdl_prefetch, use_pdl_trigger)
from loraplex.kernels import attention_decode  # noqa: E402
from loraplex.kernels.lora_delta import use_consumer_launch  # noqa: E402

PROMPT_LEN = 128
NUM_ADAPTERS = 32
RANK = 16
KINDS = ("base", "mixed")
# Adapter types (issue 19), ``--kinds``: name -> (distinct adapters, make_random_adapter options, first int id).
# Each is r=16 on all 7 projections plus its type's part; request i takes adapter i mod the count.
ADAPTER_KINDS = {
    "mixed": (NUM_ADAPTERS, {}, 1),
    "dora": (NUM_ADAPTERS, {"use_dora": True}, 101),
    "vocab": (NUM_ADAPTERS, {"vocab_lora": True}, 201),  # + LoRA on embed_tokens and lm_head
    "head-copy": (4, {"head_copy": True}, 301),  # + an lm_head modules_to_save copy (4 full-module slots)
    # ranks without padding (issue 17 goal 4): the bytes of ``mixed`` (32 x r16) in 24 x r8 + 4 x r16 + 4 x r64
    "mixed-ranks": (NUM_ADAPTERS, {}, 401),
}
MIXED_RANKS = (8,) * 24 + (16,) * 4 + (64,) * 4  # rank of adapter i of ``mixed-ranks``; sum 512 = 32 x 16
CLASSES = ("gemm", "attention", "lora", "other")
# kernel files whose launches take programmatic dependent launches (their ``_OP`` names are --pdl's op names)
PDL_MODULES = ("activation", "attention_decode", "attention_prefill", "dense_linear", "fp8_linear", "lora_expand",
               "lora_fused", "lora_shrink", "reshape_and_cache", "rms_norm", "rotary", "rotary_and_cache")
# --pdl-trigger: when PDL kernels let the next one launch (kernels._triton.use_pdl_trigger), by name: every kernel at
# "start" / "exit"; "late": the kernels that trigger late by default (the GEMMs, decode attention) late, the rest at
# exit; "mixed": the engine's default (those late, the rest at start; the split-K reductions launched under the late
# ops' names, which have no trigger point, at exit).
PDL_TRIGGER_POLICIES = {"start": "start", "exit": "exit",
                        "late": {op: "late" for op in DEFAULT_PDL_TRIGGERS} | {"*": "exit"},
                        "mixed": dict(DEFAULT_PDL_TRIGGERS)}


def pdl_ops() -> list[str]:
    """The op names of :data:`PDL_MODULES`' kernels (``_OP`` of each file)."""
    import importlib

    return [importlib.import_module(f"loraplex.kernels.{m}")._OP for m in PDL_MODULES]


def pdl_trigger_spec(policy: str) -> str | dict[str, str]:
    """:data:`PDL_TRIGGER_POLICIES`' ``policy`` as ``use_pdl_trigger`` takes it ("*": every op not named)."""
    spec = PDL_TRIGGER_POLICIES[policy]
    if isinstance(spec, str):
        return spec
    return {op: spec.get(op, spec.get("*", "start")) for op in pdl_ops()}


def kernel_class(name: str) -> str:
    """The profile class of a CUDA kernel, by name."""
    low = name.lower()
    if any(k in low for k in ("lora", "dora")):
        return "lora"
    if any(k in low for k in ("attention", "attn", "paged_decode", "paged_prefill")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "fp8_linear", "sm90_",
                                      "dense_linear", "dense_gemv")):
        return "gemm"
    return "other"


def weight_bytes(config: dict, batch: int, itemsize: int = 2, fp8_linears: bool = False) -> int:
    """Bytes of weights a decode step must read: every layer's linears and norms, the final norm, ``lm_head``
    and ``batch`` rows of the embedding. ``fp8_linears``: the layers' linears as e4m3 (1 byte) with one
    float32 scale per output channel (``quantization="fp8"``; embedding, norms and ``lm_head`` stay 16-bit)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    linears = h * (h + 2 * kv) + h * h + 3 * h * inter
    out_channels = (h + 2 * kv) + h + 2 * inter + h
    linear_bytes = linears + 4 * out_channels if fp8_linears else itemsize * linears
    head = config["vocab_size"] * h
    return layers * (linear_bytes + itemsize * 2 * h) + itemsize * (h + head + batch * h)


def kv_bytes(config: dict, batch: int, mean_context_tokens: float, itemsize: int = 2) -> float:
    d = config["hidden_size"] // config["num_attention_heads"]
    return batch * mean_context_tokens * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * d * itemsize


def projection_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) features of the 7 projections of a layer: q, k, v, o, gate, up, down."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    return [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]


def adapter_bytes(config: dict, rank: int = RANK, itemsize: int = 2) -> int:
    """A and B of one adapter on all 7 projections."""
    return itemsize * config["num_hidden_layers"] * rank * sum(a + b for a, b in projection_shapes(config))


def make_adapters(root: Path, config: dict, count: int, first_id: int = 1, ranks: tuple[int, ...] = (), **adapter_kw):
    """``count`` r=16 all-projection adapters (4 weight files, the rest linked with their own config);
    ``adapter_kw``: ``make_random_adapter``'s type options. ``ranks``: adapter i's rank instead (one weight
    file per distinct rank, 4 at most)."""
    import bench_serving  # noqa: PLC0415 - the shared maker

    if not ranks:
        return bench_serving.make_adapters(root, config, count, distinct_files=min(count, 4), first_id=first_id,
                                           **adapter_kw)
    made = {}
    for rank in sorted(set(ranks)):
        n = ranks.count(rank)
        made[rank] = iter(bench_serving.make_adapters(root / f"r{rank}", config, n, distinct_files=min(n, 4),
                                                      first_id=first_id + len(made) * count, rank=rank, **adapter_kw))
    return [next(made[rank]) for rank in ranks]


def kind_adapter_bytes(config: dict, kind: str, rank: int = RANK, itemsize: int = 2) -> int:
    """Bytes one adapter of ``kind`` adds to a decode step: A and B of the 7 projections, plus for ``dora`` the
    float32 magnitudes, for ``vocab`` the head's A and B and the embedding's B (its A: one row per token,
    left out), for ``head-copy`` the whole ``[V, H]`` head copy."""
    h, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    if kind == "mixed-ranks":
        rank = sum(MIXED_RANKS) // len(MIXED_RANKS)  # the mean (per adapter when all 32 are in the batch)
    total = adapter_bytes(config, rank, itemsize)
    if kind == "dora":
        total += 4 * layers * sum(out for _, out in projection_shapes(config))
    elif kind == "vocab":
        total += itemsize * rank * (h + vocab + h)
    elif kind == "head-copy":
        total += itemsize * vocab * h
    return total


def build(model_dir: Path, async_scheduling: bool, max_model_len: int, device_kw: dict,
          quantization: str | None = None, kinds: tuple[str, ...] = KINDS, page_rows: int = 16,
          fold_shrink: str = "auto", max_pages: int | None = None) -> LLM:
    """The engine of a run; with ``mixed-ranks`` among ``kinds`` its pool takes ranks up to 64 in pages of
    ``page_rows`` rows (every kind of the run shares that pool), ``max_pages`` pages in all (None: the engine's
    default, every slot a max-rank adapter)."""
    adapters = sum(ADAPTER_KINDS[k][0] for k in kinds if k in ADAPTER_KINDS)
    full_slots = ADAPTER_KINDS["head-copy"][0] if "head-copy" in kinds else 0
    max_rank = max(MIXED_RANKS) if "mixed-ranks" in kinds else RANK
    return LLM(model=str(model_dir), dummy_weights=True, max_model_len=max_model_len, gpu_memory_utilization=0.85,
               quantization=quantization, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=max_rank,
               lora_page_rows=page_rows, lora_fold_shrink=fold_shrink, max_lora_pages=max_pages,
               max_cpu_loras=max(2 * NUM_ADAPTERS, adapters), max_full_module_slots=full_slots,
               max_num_seqs=256, max_num_batched_tokens=8192, async_scheduling=async_scheduling, **device_kw)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(llm: LLM, prompts: list[list[int]], loras: list, out_len: int, profile_steps: int = 0) -> dict:
    """Submit all, step to the end; gaps between step returns and the launched token counts."""
    engine = llm.engine
    launched: list[int] = []
    real_launch = engine.runner.launch

    def launch(batch):
        launched.append(batch.num_tokens)
        return real_launch(batch)

    engine.runner.launch = launch
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="final_only")
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params, lora)
    batch = len(prompts)
    returns, prof, prof_range = [], None, None
    sync()
    try:
        while engine.has_unfinished_requests():
            calls = len(returns)
            decode_now = len(launched) >= 2 and launched[-1] == batch and launched[-2] == batch
            if profile_steps and prof is None and decode_now and calls >= 4:
                # one warm-up step first: the tracer's start stalls the host (~0.5 ms of idle GPU, not the engine's)
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA],
                                              schedule=torch.profiler.schedule(wait=0, warmup=1,
                                                                               active=profile_steps))
                prof.__enter__()
                prof_range = calls
            engine.step()
            returns.append(time.perf_counter())
            if prof is not None and prof_range is not None:
                if len(returns) - prof_range > profile_steps:
                    sync()
                    prof.__exit__(None, None, None)
                    prof_range = None
                else:
                    prof.step()
    finally:
        engine.runner.launch = real_launch
        if prof is not None and prof_range is not None:  # the requests ended inside the window
            sync()
            prof.__exit__(None, None, None)
    gaps = [returns[i] - returns[i - 1] for i in range(1, len(returns) - 2)
            if i < len(launched) and launched[i] == batch and launched[i - 1] == batch]
    out = {"steps": len(returns), "decode_steps_timed": len(gaps),
           "step_ms": statistics.median(gaps) * 1e3 if gaps else float("nan")}
    if prof is not None:
        out["profile"] = summarize_profile(prof, profile_steps,
                                           step_marker=("_paged_decode_kernel", engine.spec.num_layers))
    return out


def idle_gaps(events: list[tuple[float, float, str]], steps: int, top: int = 10) -> dict:
    """Where the GPU idles: ``events`` (start µs, end µs, name) of device activity; idle µs per step in gaps under
    5 µs (launch gaps) and from 5 µs on, and the ``top`` longest gaps with the activity before and after each."""
    events = sorted(events)
    gaps, end, before = [], events[0][1], events[0][2]
    for start, stop, name in events[1:]:
        if start > end:
            gaps.append((start - end, before[:60], name[:60]))
        if stop > end:
            end, before = stop, name
    small = sum(g for g, _, _ in gaps if g < 5)
    large = sum(g for g, _, _ in gaps) - small
    return {"idle_small_us_per_step": small / steps, "idle_large_us_per_step": large / steps,
            "longest_gaps": [(round(g, 1), a, b) for g, a, b in sorted(gaps, reverse=True)[:top]]}


def summarize_profile(prof, steps: int, classify=kernel_class, classes: tuple[str, ...] = CLASSES,
                      step_marker: tuple[str, int] | None = None) -> dict:
    """Kernel time per class (ms per step; ``classify(name)`` gives a kernel's class, one of
    ``classes``) and GPU busy (union of kernel intervals over their span).

    ``step_marker``: (kernel name, launches per step): the steps are counted from that kernel's launches (with
    async scheduling a window's kernels are not whole steps: the GPU runs the step launched before the window
    while it opens), else ``steps``. The profiler's step annotations (``ProfilerStep#k`` ranges on the GPU
    timeline) are not kernels and are skipped."""
    intervals, per_class, per_kernel, named = [], dict.fromkeys(classes, 0.0), {}, []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith("ProfilerStep"):
            continue
        start, end = ev.time_range.start, ev.time_range.end
        if end <= start:
            continue
        intervals.append((start, end))
        named.append((start, end, ev.name))
        per_class[classify(ev.name)] += (end - start) / 1e3
        total, count = per_kernel.get(ev.name, (0.0, 0))
        per_kernel[ev.name] = (total + (end - start) / 1e3, count + 1)
    if not intervals:
        return {"error": "no CUDA kernels recorded"}
    intervals.sort()
    busy, cur_s, cur_e = 0.0, *intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = intervals[-1][1] - intervals[0][0]
    if step_marker and per_kernel.get(step_marker[0]):
        steps = per_kernel[step_marker[0]][1] / step_marker[1]
    return {"gpu_busy": busy / span, "profiled_steps": steps, "span_ms_per_step": span / 1e3 / steps,
            **idle_gaps(named, steps), **{f"{k}_ms": v / steps for k, v in per_class.items()},
            "kernels": len(intervals),
            "top_kernels": [(name[:80], round(ms / steps, 4), round(n / steps, 2)) for name, (ms, n) in
                            sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--async-modes", default="off,on")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 (e4m3) base linears")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"rows per batch, comma-separated, of base,{','.join(ADAPTER_KINDS)} (issue 19's adapter "
                         "types: DoRA, LoRA on embed_tokens + lm_head, an lm_head modules_to_save copy)")
    ap.add_argument("--lora-page-rows", type=int, default=16,
                    help="rank rows per adapter weight page (mixed-ranks: 8 gives every rank its own bytes)")
    ap.add_argument("--lora-fold-shrink", default="auto", choices=["auto", "on", "off"],
                    help="EngineConfig.lora_fold_shrink (the LoRA shrink in the base GEMM)")
    ap.add_argument("--max-lora-pages", "--lora-max-pages", dest="max_lora_pages", type=int, default=None,
                    help="EngineConfig.max_lora_pages (--lora-max-pages: its earlier name): adapter weight pages "
                         "in the pool (a folded pool reads every page's A each LoRA step; 64 pages of 8 rows hold "
                         "mixed-ranks' 512 rank rows exactly)")
    ap.add_argument("--dense-configs", default=None,
                    help="JSON from diag_dense_linear.py --table: Triton GEMM launches to use instead of the measured "
                         "table (dense_linear.use_configs); 'none' = cuBLAS everywhere")
    ap.add_argument("--fused-configs", default=None,
                    help="JSON from diag_fused_linear.py --table: the fused launches to use instead of the measured "
                         "ones (dense_linear.use_fused_configs)")
    ap.add_argument("--pdl", default="on",
                    help="programmatic dependent launches of the Triton kernels (kernels._triton.use_pdl): on, off, or "
                         "the ops that use them, comma-separated (e.g. rms_norm,silu_and_mul)")
    ap.add_argument("--pdl-max-batch", type=int, default=None,
                    help="largest decode graph captured with them (cuda_graphs.pdl_max_decode_batch; default: the "
                         "engine's, 256: every decode graph)")
    ap.add_argument("--pdl-trigger", default=None, choices=sorted(PDL_TRIGGER_POLICIES),
                    help="when PDL kernels let the next launch (PDL_TRIGGER_POLICIES; default: the engine's)")
    ap.add_argument("--pdl-kv-prefetch", type=int, default=None,
                    help="context positions each PDL decode attention program prefetches into L2 before its wait "
                         "(kernels._triton.use_pdl_kv_prefetch; default: the engine's)")
    ap.add_argument("--pdl-prefetch", type=int, default=None,
                    help="weight columns each PDL GEMM program prefetches into L2 before its wait "
                         "(kernels._triton.use_pdl_prefetch; default: the engine's)")
    ap.add_argument("--decode-max-heads", type=int, default=None,
                    help="most KV heads a decode attention program walks (kernels.attention_decode."
                         "MAX_HEADS_PER_PROGRAM; default: the engine's)")
    ap.add_argument("--decode-head-major", choices=("on", "off"), default=None,
                    help="decode attention grid with the KV heads fastest (kernels.attention_decode.HEAD_MAJOR; "
                         "default: the engine's)")
    ap.add_argument("--decode-three-stages-from", type=int, default=None,
                    help="max_seq_len from which decode attention takes 3 pipeline stages (kernels.attention_decode."
                         "THREE_STAGES_FROM; a decode graph's is the top of its context bucket; default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"the engine's max_model_len (default: prompt {PROMPT_LEN} + --out-len + 16)")
    ap.add_argument("--decode-context-buckets", choices=("on", "off"), default=None,
                    help="decode graphs per context bucket (engine.cuda_graphs.use_context_buckets; off: graphs "
                         "for max_model_len only; default: the engine's)")
    ap.add_argument("--fp8-fold-max-tokens", type=int, default=None,
                    help="largest FP8 step that folds the LoRA shrink (engine.models.llama.FP8_FOLD_MAX_TOKENS; "
                         "default: the engine's)")
    ap.add_argument("--fused-layers", default="on", choices=["on", "off"],
                    help="base steps' decode layers in four GEMMs (norms, activation and residual adds inside them; "
                         "llama.fuse_decode_layers), or the separate kernels")
    ap.add_argument("--consumer-launch", default=None,
                    help="how the LoRA consumers walk a paged pool: JSON {op: use_consumer_launch keywords}, or a "
                         "file of it (diag_lora_consumers.py --best-out; default: the engine's)")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model: checks the logic only")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/decode.json)")
    args = ap.parse_args(argv)
    if args.dense_configs:
        from loraplex.kernels import dense_linear

        dense_linear.use_configs({} if args.dense_configs == "none"
                                 else dense_linear.configs_from_json(Path(args.dense_configs).read_text()))
    if args.fused_configs:
        from loraplex.kernels import dense_linear

        dense_linear.use_fused_configs(dense_linear.fused_configs_from_json(Path(args.fused_configs).read_text()))
    llama.fuse_decode_layers(args.fused_layers == "on")
    if args.fp8_fold_max_tokens is not None:
        llama.FP8_FOLD_MAX_TOKENS = args.fp8_fold_max_tokens
    if args.decode_max_heads is not None:
        attention_decode.MAX_HEADS_PER_PROGRAM = args.decode_max_heads
    if args.decode_three_stages_from is not None:
        attention_decode.THREE_STAGES_FROM = args.decode_three_stages_from
    if args.decode_context_buckets is not None:
        cuda_graphs.use_context_buckets(args.decode_context_buckets == "on")
    if args.decode_head_major is not None:
        attention_decode.HEAD_MAJOR = args.decode_head_major == "on"
    if args.pdl in ("on", "off"):
        use_pdl(args.pdl == "on")
    else:
        known = set(pdl_ops())
        if set(args.pdl.split(",")) - known:
            raise SystemExit(f"--pdl: unknown ops {sorted(set(args.pdl.split(',')) - known)}; known: {sorted(known)}")
        use_pdl(frozenset(args.pdl.split(",")))
    if args.pdl_max_batch is not None:
        cuda_graphs.pdl_max_decode_batch(args.pdl_max_batch)
    if args.pdl_trigger is not None:
        use_pdl_trigger(pdl_trigger_spec(args.pdl_trigger))
    if args.pdl_prefetch is not None:
        use_pdl_prefetch(args.pdl_prefetch)
    if args.pdl_kv_prefetch is not None:
        use_pdl_kv_prefetch(args.pdl_kv_prefetch)
    consumer_launch = {}
    if args.consumer_launch:
        text = args.consumer_launch
        consumer_launch = json.loads(text if text.lstrip().startswith("{") else Path(text).read_text())
        for op, keywords in consumer_launch.items():
            use_consumer_launch(op, **keywords)
    config = dict(LLAMA2_7B)
    device_kw: dict = {"dtype": "bfloat16"}
    if args.quick:
        config.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=512)
        device_kw = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 2048}
        args.profile_steps = 0
    elif not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU (--quick checks the logic on CPU)")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = [k for k in kinds if k != "base" and k not in ADAPTER_KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; choose from base,{','.join(ADAPTER_KINDS)}")
    root = Path(tempfile.mkdtemp())
    model_dir = make_model_dir(root / "model", config)
    adapters_of = {k: make_adapters(root / k, config, ADAPTER_KINDS[k][0], ADAPTER_KINDS[k][2],
                                    ranks=MIXED_RANKS if k == "mixed-ranks" else (), **ADAPTER_KINDS[k][1])
                   for k in kinds if k in ADAPTER_KINDS}
    bw = float("nan") if args.quick else measure_copy_bandwidth()
    max_model_len = args.max_model_len or PROMPT_LEN + args.out_len + 16
    result = {"commit": git_commit(), "device": torch.cuda.get_device_name() if not args.quick else "cpu",
              "quantization": args.quantization, "lora_fold_shrink": args.lora_fold_shrink,
              "lora_page_rows": args.lora_page_rows, "max_lora_pages": args.max_lora_pages,
              "dense_configs": args.dense_configs, "fused_layers": args.fused_layers, "pdl": args.pdl,
              "pdl_max_batch": args.pdl_max_batch, "pdl_trigger": args.pdl_trigger, "pdl_prefetch": args.pdl_prefetch,
              "pdl_kv_prefetch": args.pdl_kv_prefetch, "consumer_launch": consumer_launch,
              "fused_configs": args.fused_configs, "fp8_fold_max_tokens": llama.FP8_FOLD_MAX_TOKENS,
              "decode_max_heads": attention_decode.MAX_HEADS_PER_PROGRAM,
              "decode_head_major": attention_decode.HEAD_MAJOR,
              "decode_three_stages_from": attention_decode.THREE_STAGES_FROM,
              "max_model_len": max_model_len,
              "decode_context_buckets": args.decode_context_buckets or "default",
              "copy_TBps": bw / 1e12, "out_len": args.out_len, "rows": []}
    rng = random.Random(0)
    top = config["vocab_size"] - 1
    mean_ctx = PROMPT_LEN + args.out_len / 2
    for mode in args.async_modes.split(","):
        llm = build(model_dir, mode == "on", max_model_len, device_kw, args.quantization, kinds,
                    args.lora_page_rows, args.lora_fold_shrink, args.max_lora_pages)
        for kind_adapters in adapters_of.values():
            for a in kind_adapters:
                llm.engine.preload_lora(a)
        # warm-up: compiles the kernel variants of every row (not measured)
        for b in args.batches:
            for kind_adapters in adapters_of.values() or [[]]:
                run_once(llm, [[rng.randrange(10, top) for _ in range(PROMPT_LEN)] for _ in range(b)],
                         [kind_adapters[i % len(kind_adapters)] if i % 2 and kind_adapters else None
                          for i in range(b)], 4)
        for b in args.batches:
            prompts = [[rng.randrange(10, top) for _ in range(PROMPT_LEN)] for _ in range(b)]
            for kind in kinds:
                pool = adapters_of.get(kind, [])
                loras = [None] * b if kind == "base" else [pool[i % len(pool)] for i in range(b)]
                row = {"batch": b, "kind": kind + ("-fp8" if args.quantization else ""), "async": mode}
                row.update(run_once(llm, prompts, loras, args.out_len))
                if args.profile_steps:
                    row["profile"] = run_once(llm, prompts, loras, min(args.out_len, 24),
                                              args.profile_steps).get("profile")
                distinct = 0 if kind == "base" else min(b, len(pool))
                per_adapter = kind_adapter_bytes(config, kind) if distinct else 0
                lora_bytes = distinct * per_adapter
                if kind == "mixed-ranks":  # the batch's own adapters' ranks
                    lora_bytes = sum(adapter_bytes(config, MIXED_RANKS[i]) for i in range(distinct))
                floor_bytes = (weight_bytes(config, b, fp8_linears=args.quantization == "fp8")
                               + kv_bytes(config, b, mean_ctx) + lora_bytes)
                row["floor_ms"] = floor_bytes / bw * 1e3
                row["floor_fraction"] = row["floor_ms"] / row["step_ms"]
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
        llm.engine.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = {(r["batch"], r["async"]): r["step_ms"] for r in result["rows"] if r["kind"].startswith("base")}
    for r in result["rows"]:
        key = (r["batch"], r["async"])
        r["of_base"] = base[key] / r["step_ms"] if key in base else float("nan")  # no base row in this run
    path = Path(args.out) if args.out else out_dir() / "decode.json"
    path.write_text(json.dumps(result, indent=1))
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    lines = [f"commit {result['commit']}, {result['device']}, copy {result['copy_TBps']:.2f} TB/s, "
             f"prompt {PROMPT_LEN}, output {result['out_len']}", "",
             "| batch | kind | async | step ms | full floor ms | floor / step | of base | GPU busy | GEMM ms "
             "| attention ms | LoRA ms | other ms |", "|" + "---|" * 12]
    for r in result["rows"]:
        p = r.get("profile") or {}
        cells = [p.get("gpu_busy"), *(p.get(f"{c}_ms") for c in CLASSES)]
        prof = [f"{c:.0%}" if i == 0 else f"{c:.2f}" for i, c in enumerate(cells) if c is not None] or ["–"] * 5
        lines.append(f"| {r['batch']} | {r['kind']} | {r['async']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['floor_fraction']:.2f} | {r['of_base']:.2f} | " + " | ".join(prof) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
