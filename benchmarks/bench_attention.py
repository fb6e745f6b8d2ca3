"""Paged decode attention over a grid of contexts x batch sizes, timed by CUDA-graph replay, as a
fraction of device-to-device copy bandwidth measured in the same run.

Usage (on a CUDA machine, from the repository root)::

    python benchmarks/bench_attention.py --out attention.md              # full grid, default configs (~1 min)
    python benchmarks/bench_attention.py --out attention.md --configs sweep  # + tiles x splits (~10 min)
    python benchmarks/bench_attention.py --smoke --out /tmp/a.md         # tiny grid; on CPU set TRITON_INTERPRET=1

Grid: contexts 128, 1k, 4k, 32k x batch 1, 32, 128, 256, for Llama-2-7B heads (32 query / 32 KV heads,
head_dim 128) and Llama-3-8B heads (32 / 8, GQA), bf16, KV block size 16 (the engine's default), every
sequence at the full context, block tables shuffled. Cases whose K+V exceed ``--max-kv-gib`` are skipped
(Llama-2 heads at 32k x 128/256 need 64/128 GiB).

For each case and config the benchmark:

- checks the kernel's output on two sequences against the float32 reference (aborts on a mismatch);
- captures one CUDA graph that runs the kernel over ``L`` different caches in turn (like the layers of a
  model step: each call reads K/V that the previous calls have not left in L2; ``L`` is chosen so the
  graph reads at least 256 MiB, 4x an H100/H200 L2, up to 256 calls), replays it and reports microseconds
  per call (median of 3 timings of >= 10 ms);
- reports ``KV bytes read / time`` and its fraction of the copy bandwidth (bytes read + written per second
  of a 1 GiB device-to-device copy, measured at the start), and for cases up to 1 GiB the time of a copy
  moving the same number of bytes, timed the same way.

A last table times mixed steps (decode rows + one prompt chunk): the mixed launcher against the prefill
kernel over every row.

Output: a table of the default config (:func:`~loraplex.kernels.attention_decode.decode_config`) and the best
swept config per grid point, then one ``fraction of copy bandwidth`` matrix per config (contexts x batches),
printed and written to ``--out`` (markdown) and ``--out``.json (every measurement).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.kernels.attention import PAGED_ATTENTION, paged_attention_ref  # noqa: E402
from loraplex.kernels.attention_decode import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
    decode_config,
    paged_decode_attention,
)
from loraplex.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from loraplex.kernels.attention_prefill import paged_prefill_attention  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class HeadShape:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = {
    "llama2": HeadShape("Llama-2-7B", 32, 32, 128),
    "llama3": HeadShape("Llama-3-8B", 32, 8, 128),
}
SMOKE_MODELS = {"llama2": HeadShape("tiny-MHA", 2, 2, 16), "llama3": HeadShape("tiny-GQA", 4, 1, 16)}
CONTEXTS = (128, 1024, 4096, 32768)
BATCHES = (1, 32, 128, 256)
SMOKE_CONTEXTS = (20, 70)
SMOKE_BATCHES = (1, 3)

# (block_n, num_warps, num_stages) tiles and programs-per-SM split targets of the sweep (0 = no split).
SWEEP_TILES = ((16, 4, 3), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2))
SWEEP_SPLIT_TARGETS = (0, 2, 4, 8)


@dataclass(frozen=True)
class Case:
    """One grid point: ``batch`` sequences, each with ``context`` positions of K/V, decoding one token."""

    heads: HeadShape
    context: int
    batch: int
    page: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the kernel must read: every position of every sequence, once per KV head."""
        h = self.heads
        return 2 * self.batch * self.context * h.num_kv_heads * h.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def group(self) -> int:
        return self.heads.num_q_heads // self.heads.num_kv_heads


@dataclass
class Row:
    """One measurement."""

    model: str
    context: int
    batch: int
    kv_mib: float
    config: str
    is_default: bool
    us: float | None
    gbs: float | None
    frac_copy: float | None
    copy_same_us: float | None
    layers: int
    note: str = ""


def sweep_configs(case: Case, device: torch.device, which: str, tiles: tuple | None = None) -> list[DecodeConfig]:
    """The default config first, then (``which == "sweep"``) tiles (``tiles``, else :data:`SWEEP_TILES`) x split
    targets in the default's grid order (``head_major``), without duplicates."""
    h = case.heads
    default = decode_config(case.batch, h.num_kv_heads, case.group, h.head_dim, case.page, case.context, case.dtype,
                            device)
    configs = [default]
    if which == "sweep":
        tiles = tiles or (SWEEP_TILES if device.type == "cuda" else ((16, 4, 1), (32, 4, 1)))
        programs = case.batch * h.num_kv_heads
        for block_n, warps, stages in tiles:
            if block_n % case.page and case.page % block_n:
                continue
            for target in SWEEP_SPLIT_TARGETS:
                # splits of at least 4 tiles, and (split targets >= 4) of one tile each
                chunks = (4 * block_n, block_n) if device.type == "cuda" and target >= 4 else (
                    (4 * block_n,) if device.type == "cuda" else (block_n,))
                for min_chunk in chunks:
                    splits = 1 if target == 0 else choose_num_splits(programs, case.context, device,
                                                                      programs_per_sm=target, min_chunk=min_chunk)
                    configs.append(DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                                num_splits=splits, min_chunk=min_chunk, use_dot=default.use_dot,
                                                head_major=default.head_major))
            if case.group == 1:  # MHA: also the 16-row tl.dot tile at the default split count
                configs.append(DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                            num_splits=default.num_splits,
                                            min_chunk=4 * block_n if device.type == "cuda" else block_n, use_dot=True,
                                            head_major=default.head_major))
    unique: list[DecodeConfig] = []
    for c in configs:
        if c not in unique:
            unique.append(c)
    return unique


def rotation_layers(kv_bytes: int, min_total_bytes: int, max_layers: int, budget_bytes: int) -> int:
    """Calls per graph, each over its own cache: enough to read ``min_total_bytes`` (so L2 holds no reuse),
    at most ``max_layers`` and within ``budget_bytes``; 0 when one cache already exceeds the budget."""
    if kv_bytes > budget_bytes:
        return 0
    wanted = -(-min_total_bytes // kv_bytes)
    return max(1, min(wanted, max_layers, budget_bytes // kv_bytes))


def _shuffled_tables(num_seqs: int, blocks_per_seq: int, seed: int = 0) -> list[list[int]]:
    ids = list(range(num_seqs * blocks_per_seq))
    random.Random(seed).shuffle(ids)
    return [ids[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(num_seqs)]


class GraphTimer:
    """Microseconds per call of a list of calls, captured in one CUDA graph and replayed."""

    def __init__(self, target_ms: float = 10.0, trials: int = 3) -> None:
        self.target_ms, self.trials = target_ms, trials

    def __call__(self, calls: list[Callable[[], object]]) -> float:
        from common import capture_graph  # noqa: PLC0415 - benchmarks/ is on sys.path when run

        graph = capture_graph(calls)  # each call compiled / warmed up outside the capture
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        reps = max(1, min(1000, int(self.target_ms / max(start.elapsed_time(end), 1e-3))))
        times = []
        for _ in range(self.trials):
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
        del graph
        return sorted(times)[len(times) // 2]


class WallTimer:
    """CPU stand-in for :class:`GraphTimer` (``--smoke`` under the interpreter): wall time of one pass."""

    def __call__(self, calls: list[Callable[[], object]]) -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)


def copy_bandwidth_gbs(nbytes: int, device: torch.device, timer) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + bytes written per second: on CUDA
    ``common.measure_copy_bandwidth`` (a byte copy timed eagerly, as every other benchmark measures it;
    session 7 measured 2.76 TB/s for a bf16 copy replayed from a CUDA graph on an H200 where that gives
    4.1-4.2 TB/s), elsewhere one copy under ``timer``."""
    if device.type == "cuda":
        from common import measure_copy_bandwidth  # noqa: PLC0415 - benchmarks/ is on sys.path when run

        return measure_copy_bandwidth(nbytes) / 1e9
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer([lambda: dst.copy_(src)]) * 1e-6) / 1e9


def copy_same_bytes_us(nbytes: int, layers: int, device: torch.device, timer) -> float:
    """Microseconds of a copy that reads ``nbytes / 2`` and writes ``nbytes / 2`` (as many bytes moved as the
    attention call reads), rotated over ``layers`` buffers like the attention calls."""
    half = max(nbytes // 4, 1)  # bf16 elements per half
    src = torch.empty(layers, half, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return timer([lambda i=i: dst[i].copy_(src[i]) for i in range(layers)])


def check_output(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    """Abort the run when the kernel disagrees with the reference (bf16 tolerance)."""
    if not torch.isfinite(out).all():
        raise SystemExit(f"{name}: kernel output has NaN/Inf")
    try:
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    except AssertionError as err:
        raise SystemExit(f"{name}: kernel disagrees with the reference\n{err}") from err


def run_case(case: Case, configs: list[DecodeConfig], device: torch.device, timer, copy_gbs: float,
             budget_bytes: int, min_rotation_bytes: int, max_layers: int) -> list[Row]:
    """Every config on one grid point; one row each (or one 'skipped' row)."""
    h = case.heads
    base = dict(model=h.name, context=case.context, batch=case.batch, kv_mib=case.kv_bytes / MIB)
    layers = rotation_layers(case.kv_bytes, min_rotation_bytes, max_layers, budget_bytes)
    if layers == 0:
        return [Row(**base, config="-", is_default=True, us=None, gbs=None, frac_copy=None, copy_same_us=None,
                    layers=0, note=f"skipped: K+V {case.kv_bytes / GIB:.1f} GiB > budget")]
    copy_us = None
    if case.kv_bytes <= GIB:
        copy_us = copy_same_bytes_us(case.kv_bytes, layers, device, timer)
        _free(device)
    blocks_per_seq = -(-case.context // case.page)
    num_blocks = case.batch * blocks_per_seq
    shape = (layers * num_blocks, case.page, h.num_kv_heads, h.head_dim)
    key_cache = torch.empty(shape, dtype=case.dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=case.dtype, device=device).normal_()
    tables = _shuffled_tables(case.batch, blocks_per_seq)
    meta = AttentionMetadata.build([1] * case.batch, [case.context] * case.batch, tables, case.page, device)
    query = torch.randn(case.batch, h.num_q_heads, h.head_dim, device=device).to(case.dtype)
    out = torch.empty_like(query)
    scale = h.head_dim ** -0.5
    n_check = min(2, case.batch)
    sub = AttentionMetadata.build([1] * n_check, [case.context] * n_check, tables[:n_check], case.page, device)
    expected = paged_attention_ref(query[:n_check], key_cache[:num_blocks], value_cache[:num_blocks], sub, scale)
    rows = []
    for i, config in enumerate(configs):
        def call(layer: int, config: DecodeConfig = config) -> torch.Tensor:
            lo = layer * num_blocks
            return paged_decode_attention(query, key_cache[lo:lo + num_blocks], value_cache[lo:lo + num_blocks],
                                          meta, scale, out=out, config=config)

        out.fill_(float("nan"))
        call(0)
        check_output(f"{h.name} ctx={case.context} B={case.batch} [{config.label()}]", out[:n_check], expected)
        us = timer([lambda layer=layer: call(layer) for layer in range(layers)])
        gbs = case.kv_bytes / (us * 1e-6) / 1e9
        rows.append(Row(**base, config=config.label(), is_default=i == 0, us=us, gbs=gbs, frac_copy=gbs / copy_gbs,
                        copy_same_us=copy_us, layers=layers))
    key_cache = value_cache = None  # the closures above hold them until here
    _free(device)
    return rows


MIXED_CASES = ((32, 1024, 512, 2048), (128, 1024, 512, 2048), (256, 128, 512, 512))  # decodes, ctx, chunk, ctx
SMOKE_MIXED_CASES = ((3, 20, 9, 30),)


def run_mixed(heads: HeadShape, num_decodes: int, decode_ctx: int, chunk: int, chunk_ctx: int, page: int,
              device: torch.device, timer, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A mixed step (``num_decodes`` 1-token rows at ``decode_ctx`` + one prompt chunk of ``chunk`` tokens
    ending at ``chunk_ctx``): the mixed launcher (decode kernel + prefill kernel) against the prefill kernel
    over every row (1-token rows in 64-row tiles), both checked against the reference first."""
    query_lens = [1] * num_decodes + [chunk]
    seq_lens = [decode_ctx] * num_decodes + [chunk_ctx]
    blocks = [-(-s // page) for s in seq_lens]
    ids = list(range(sum(blocks)))
    random.Random(1).shuffle(ids)
    tables, i = [], 0
    for n in blocks:
        tables.append(ids[i:i + n])
        i += n
    shape = (sum(blocks), page, heads.num_kv_heads, heads.head_dim)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, page, device)
    query = torch.randn(sum(query_lens), heads.num_q_heads, heads.head_dim, device=device).to(dtype)
    scale = heads.head_dim ** -0.5
    expected = paged_attention_ref(query, key_cache, value_cache, meta, scale)
    out = torch.empty_like(query)
    result = {"model": heads.name, "decodes": num_decodes, "decode_ctx": decode_ctx, "chunk": chunk,
              "chunk_ctx": chunk_ctx}
    for name, fn in (("mixed_launcher", PAGED_ATTENTION.triton), ("prefill_kernel_only", paged_prefill_attention)):
        out.fill_(float("nan"))
        fn(query, key_cache, value_cache, meta, scale, out=out)
        check_output(f"mixed {name}", out, expected)
        result[name + "_us"] = timer([lambda fn=fn: fn(query, key_cache, value_cache, meta, scale, out=out)])
    return result


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_report(rows: list[Row], copy_gbs: float, device_name: str, commit: str) -> str:
    """Markdown: the default-vs-best table, then one fraction-of-copy matrix per config and model."""
    lines = [f"# Paged decode attention ({device_name}, commit {commit})", "",
             f"d2d copy bandwidth (1 GiB, read + write): {copy_gbs:.0f} GB/s. Times: CUDA-graph replay, "
             "microseconds per call, cold L2 (each call reads another cache).", "",
             "## Default config and best swept config per grid point", "",
             "| model | context | batch | K+V MiB | copy same bytes µs | default config | µs | frac of copy "
             "| best config | µs | frac of copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    cases: dict[tuple, list[Row]] = {}
    for r in rows:
        cases.setdefault((r.model, r.context, r.batch), []).append(r)
    for (model, ctx, batch), case_rows in cases.items():
        first = case_rows[0]
        if first.us is None:
            lines.append(f"| {model} | {ctx} | {batch} | {first.kv_mib:.1f} | - | {first.note} | - | - | - | - | - |")
            continue
        default = next(r for r in case_rows if r.is_default)
        best = min(case_rows, key=lambda r: r.us)
        lines.append(f"| {model} | {ctx} | {batch} | {first.kv_mib:.1f} | {_fmt(first.copy_same_us, '.1f')} "
                     f"| {default.config} | {default.us:.1f} | {default.frac_copy:.2f} "
                     f"| {best.config} | {best.us:.1f} | {best.frac_copy:.2f} |")
    models = list(dict.fromkeys(r.model for r in rows))
    for model in models:
        model_rows = [r for r in rows if r.model == model and r.us is not None]
        contexts = sorted({r.context for r in rows if r.model == model})
        batches = sorted({r.batch for r in rows if r.model == model})
        for config in dict.fromkeys(r.config for r in model_rows):
            by_point = {(r.context, r.batch): r for r in model_rows if r.config == config}
            lines += ["", f"### {model}, config `{config}`: fraction of copy bandwidth (µs)", "",
                      "| context \\ batch | " + " | ".join(str(b) for b in batches) + " |",
                      "|---|" + "---|" * len(batches)]
            for ctx in contexts:
                cells = []
                for b in batches:
                    r = by_point.get((ctx, b))
                    cells.append("-" if r is None else f"{r.frac_copy:.2f} ({r.us:.1f})")
                lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    import os
    import subprocess

    if os.environ.get("LORAPLEX_COMMIT"):  # runs from an exported tree (the GPU machine's copy)
        return os.environ["LORAPLEX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).resolve().parents[1]).strip()
    except Exception:
        return "unknown"


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="markdown report path (raw rows go to OUT.json)")
    parser.add_argument("--models", default="llama2,llama3", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--contexts", default=None, help="comma list (default 128,1024,4096,32768)")
    parser.add_argument("--batches", default=None, help="comma list (default 1,32,128,256)")
    parser.add_argument("--configs", choices=("default", "sweep"), default="default",
                        help="default: the heuristic's config only (~1 min on an H200); sweep: tiles x split targets")
    parser.add_argument("--tiles", default=None,
                        help="with --configs sweep: the tiles, BLOCK_NxWARPSxSTAGES comma list (default SWEEP_TILES)")
    parser.add_argument("--heads-per-program", default="",
                        help="comma list: also run each case's default config with this many KV heads a program")
    parser.add_argument("--head-major", action="store_true",
                        help="also run every config with the other grid order (DecodeConfig.head_major toggled)")
    parser.add_argument("--page", type=int, default=16, help="KV block size in tokens (engine default 16)")
    parser.add_argument("--max-kv-gib", type=float, default=66.0, help="skip cases whose K+V exceed this")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: set TRITON_INTERPRET=1)")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed decode + prefill-chunk table")
    args = parser.parse_args(argv)
    tiles = tuple(tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")) if args.tiles else None
    if tiles and any(len(t) != 3 for t in tiles):
        raise SystemExit(f"--tiles {args.tiles!r}: BLOCK_NxWARPSxSTAGES, comma-separated")
    if torch.cuda.is_available():
        device, timer = torch.device("cuda"), GraphTimer()
        device_name = torch.cuda.get_device_name()
        min_rotation, max_layers, copy_bytes = 256 * MIB, 256, GIB
    else:
        if not args.smoke:
            raise SystemExit("bench_attention: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device, timer, device_name = torch.device("cpu"), WallTimer(), "cpu (interpreter)"
        min_rotation, max_layers, copy_bytes = 64 * 1024, 2, 1 << 16
    models = SMOKE_MODELS if args.smoke else MODELS
    page = 8 if args.smoke and args.page == 16 else args.page
    contexts = _ints(args.contexts) or (SMOKE_CONTEXTS if args.smoke else CONTEXTS)
    batches = _ints(args.batches) or (SMOKE_BATCHES if args.smoke else BATCHES)
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(copy_bytes, device, timer)
    print(f"d2d copy: {copy_gbs:.0f} GB/s", flush=True)
    rows: list[Row] = []
    for key in args.models.split(","):
        heads = models[key]
        for ctx in contexts:
            for batch in batches:
                case = Case(heads, ctx, batch, page)
                configs = sweep_configs(case, device, args.configs, tiles)
                configs += [replace(configs[0], heads_per_program=k) for k in _ints(args.heads_per_program)
                            if k != configs[0].heads_per_program and heads.num_kv_heads % k == 0]
                if args.head_major:
                    configs += [t for c in configs if (t := replace(c, head_major=not c.head_major)) not in configs]
                case_rows = run_case(case, configs, device, timer, copy_gbs, int(args.max_kv_gib * GIB),
                                     min_rotation, max_layers)
                for r in case_rows:
                    print(f"{r.model} ctx={r.context} B={r.batch} {r.config}: {_fmt(r.us, '.1f')} us "
                          f"frac={_fmt(r.frac_copy, '.2f')} {r.note}", flush=True)
                rows += case_rows
    report = format_report(rows, copy_gbs, device_name, _commit())
    mixed = []
    if not args.no_mixed:
        for key in args.models.split(","):
            for case in (SMOKE_MIXED_CASES if args.smoke else MIXED_CASES):
                mixed.append(run_mixed(models[key], *case, page, device, timer))
                _free(device)
        report += ("\n## Mixed step: decode rows + one prompt chunk (µs per call, CUDA-graph replay of one call)\n\n"
                   "| model | decodes x context | chunk tokens @ context | mixed launcher "
                   "| prefill kernel for all rows |\n"
                   "|---|---|---|---|---|\n")
        for m in mixed:
            report += (f"| {m['model']} | {m['decodes']} x {m['decode_ctx']} | {m['chunk']} @ {m['chunk_ctx']} "
                       f"| {m['mixed_launcher_us']:.1f} | {m['prefill_kernel_only_us']:.1f} |\n")
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    Path(str(out) + ".json").write_text(json.dumps({"copy_gbs": copy_gbs, "device": device_name,
                                                    "rows": [asdict(r) for r in rows], "mixed": mixed}, indent=1))
    return rows


def _ints(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",")) if text else ()


if __name__ == "__main__":
    main()
