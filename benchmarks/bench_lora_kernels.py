"""LoRA kernels side by side: one layer's four LoRA'd projections, old (two-kernel SGMV) vs new (fused).

For every (tokens T, distinct adapters) in {1, 32, 128, 512} x {1, 8, 32}: 20% of the tokens
use no adapter (slot -1), the rest take the adapters round-robin (positions shuffled once,
seeded), r=16, Llama-2-7B shapes (qkv 4096 -> 3x4096, o 4096 -> 4096, gate_up 4096 ->
2x11008, down 11008 -> 4096), bf16. Each call is checked against the float32 reference first.

Timing: a CUDA graph of ``CALLS`` x (L2 flush, the layer's four LoRA deltas) minus a graph of
``CALLS`` x (L2 flush) alone, so every call starts with a cold L2 (the engine replays decode
steps from graphs, and a layer's adapter weights are not in L2 when it starts). Columns (µs per
layer): the bytes floor (the distinct adapters' A and B of the four projections, x read,
y read and written for the LoRA tokens, at the copy bandwidth measured in the same run),
``old`` = split-K shrink + expand (two launches per projection), ``new`` = ``add_lora``
as the model calls it (fused shrink+expand up to 256 tokens), ``fused`` = the fused kernel
at every size; with ``--vllm``, vLLM's Triton ``lora_shrink``/``lora_expand`` (default configs) when
``vllm`` imports and its call checks out, else the reason. ``--sweep`` instead times fused-kernel tile shapes per
projection at 32 adapters (1, 32 and 128 tokens) and reports the best.

``--dense`` adds ``dense`` = :func:`dense_impl` (LoRA through cuBLAS over every slot, a design not in the
product; docs/ARCHITECTURE.md).

``--mixed-ranks`` instead times "ranks without padding" (S-LoRA's paged pool, :func:`run_mixed_ranks`): one layer,
T=32 decode tokens, one per adapter, 32 adapters, as (a) rectangles r=16 (the path of a pool with one page per slot), (b) pages of 16 with every
rank 16, (c) pages (PAGE 8 and 16) with mixed ranks of the same total rank rows (24 x r=8, 4 x r=16, 4 x r=64:
512 = 32 x 16), (d) that mixed batch in rectangles zero-padded to R=64 (a padded pool; also with ``ranks``), and
the mixed batch in pools sized for max_lora_rank 256 (pages, and rectangles padded to 256). Goal: time(c) <=
time(b) / 0.9.

Usage: ``python benchmarks/bench_lora_kernels.py --out FILE [--vllm] [--dense] [--sweep | --mixed-ranks]`` (CUDA;
the table alone compiles a dozen kernel variants and takes well under a minute on an H200);
``--smoke`` runs tiny shapes (on CPU under ``TRITON_INTERPRET=1``, wall-clock timer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import graph_replay_ms  # noqa: E402
from loraplex.kernels.lora_fused import FUSED_LORA, _block_sizes, fused_launch_shape  # noqa: E402
from loraplex.kernels.lora_linear import ADD_LORA, add_lora_ref  # noqa: E402
from loraplex.kernels.lora_mapping import LoRAMapping, plan_segments  # noqa: E402
from loraplex.kernels.lora_expand import _launch_lora_expand  # noqa: E402
from loraplex.kernels.lora_shrink import shrink_partials  # noqa: E402

TOKENS = (1, 32, 128, 512)
ADAPTERS = (1, 8, 32)
BASE_FRACTION = 0.2
CALLS = 10
SCALING = 2.0  # every slot's alpha / r (vLLM's shrink takes one scaling for all slots)
# (name, H, slice widths): the four LoRA'd linears of a Llama-2-7B layer.
LLAMA2_7B_LAYER = (("qkv", 4096, (4096, 4096, 4096)), ("o", 4096, (4096,)), ("gate_up", 4096, (11008, 11008)),
                   ("down", 11008, (4096,)))
SMOKE_LAYER = (("qkv", 40, (24, 8, 8)), ("down", 56, (40,)))
# --targets qv: the layer of a q/v adapter as the engine runs it (the scaling benchmark's adapters): the fused qkv
# linear whose k slice the adapter does not target (its scaling 0: the kernels skip it), no other projection.
LLAMA2_7B_QV = (("qkv", 4096, (4096, 4096, 4096), (1,)),)
SMOKE_QV = (("qkv", 40, (24, 8, 8), (1,)),)
# --targets qv-layer: the whole layer as the engine runs it for q/v adapters: add_lora still launches for o, gate_up
# and down (CUDA graphs hold every launch), whose programs find scaling 0 and exit. Measures what those launches cost.
LLAMA2_7B_QV_LAYER = (("qkv", 4096, (4096, 4096, 4096), (1,)), ("o", 4096, (4096,), (0,)),
                      ("gate_up", 4096, (11008, 11008), (0, 1)), ("down", 11008, (4096,), (0,)))
SMOKE_QV_LAYER = (("qkv", 40, (24, 8, 8), (1,)), ("down", 56, (40,), (0,)))
Timer = Callable[[Callable[[], object]], float]  # ms per call of a function, L2 cold


@dataclass
class Linear:
    """One LoRA'd projection's slot tensors and activations."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    scaling: list[torch.Tensor]
    y0: torch.Tensor | None = None  # y as made (the checks start from it; timing accumulates into y)
    ranks: torch.Tensor | None = None  # [S] int32, passed to the op when set (required with page_table)
    page_table: torch.Tensor | None = None  # [S, max_pages] int32: lora_a / lora_b are pages

    def __post_init__(self) -> None:
        if self.y0 is None:
            self.y0 = self.y.clone()

    def layout_kwargs(self) -> dict[str, torch.Tensor]:
        """``ranks`` / ``page_table`` keywords of the op, only those that are set."""
        return {k: v for k, v in (("ranks", self.ranks), ("page_table", self.page_table)) if v is not None}


@dataclass
class Row:
    tokens: int
    adapters: int
    lora_tokens: int
    floor_us: float
    times_us: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def token_slots(num_tokens: int, adapters: int, seed: int = 0) -> torch.Tensor:
    """``[T] int32``: ``round(0.2 T)`` tokens (at most T - 1) with slot -1, the rest round-robin over
    ``adapters`` slots, positions shuffled with ``seed``."""
    base = min(round(BASE_FRACTION * num_tokens), num_tokens - 1)
    slots = [-1] * base + [i % adapters for i in range(num_tokens - base)]
    order = torch.randperm(num_tokens, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(slots, dtype=torch.int32)[order]


def untargeted(spec) -> tuple[int, ...]:
    """Slice indices of a layer entry ``(name, hidden, widths[, untargeted])`` whose scaling is 0."""
    return spec[3] if len(spec) > 3 else ()


def floor_bytes(layer, num_tokens_lora: int, distinct: int, rank: int, itemsize: int = 2) -> int:
    """Compulsory bytes of the layer's LoRA deltas: distinct adapters' A and B, x of the LoRA tokens,
    y of the LoRA tokens read and written (targeted slices only)."""
    total = 0
    for spec in layer:
        hidden, widths = spec[1], [w for i, w in enumerate(spec[2]) if i not in untargeted(spec)]
        if not widths:  # no slice targeted: nothing need be read
            continue
        total += distinct * rank * (hidden * len(widths) + sum(widths)) * itemsize
        total += num_tokens_lora * (hidden + 2 * sum(widths)) * itemsize
    return total


def make_linears(layer, num_tokens: int, slots: int, rank: int, dtype, device) -> list[Linear]:
    out = []
    for spec in layer:
        name, hidden, widths = spec[:3]
        out.append(Linear(
            name,
            torch.randn(num_tokens, hidden, device=device).to(dtype),
            torch.randn(num_tokens, sum(widths), device=device).to(dtype),
            [(torch.randn(slots, rank, hidden, device=device) / hidden**0.5).to(dtype) for _ in widths],
            [(torch.randn(slots, w, rank, device=device) / rank**0.5).to(dtype) for w in widths],
            [torch.full((slots,), 0.0 if i in untargeted(spec) else SCALING, device=device)
             for i in range(len(widths))],
        ))
    return out


def workload(layer, num_tokens: int, adapters: int, rank: int, dtype, device, min_slots: int = 0):
    """A row's inputs: the token slots (host), their segment mapping and the layer's linears, with
    ``max(adapters, min_slots)`` slots per linear (an engine's ``max_loras``: only the dense variant reads the
    unused ones)."""
    slots = max(adapters, min_slots)
    slots_host = token_slots(num_tokens, adapters)
    return (slots_host, plan_segments(slots_host.to(device), slots),
            make_linears(layer, num_tokens, slots, rank, dtype, device))


KEEP_GOING = False  # --keep-going: a failed check is recorded in the row and timing goes on


def check(lin: Linear, mapping: LoRAMapping, fn: Callable) -> None:
    """``fn(x, a, b, scaling, y, mapping)`` agrees with the float32 reference on this projection
    (raises SystemExit naming the projection). Checked on ``lin.y0``, the untouched output: timing adds
    the delta into ``lin.y`` over and over, and at |y| ~ 1000 bf16's own rounding (ulp 4-8) would exceed
    the tolerance (session 5's "mismatch" of 1.96 was that)."""
    ours, ref = lin.y0.clone(), lin.y0.to(torch.float32, copy=True)
    layout = lin.layout_kwargs()
    fn(lin.x, lin.lora_a, lin.lora_b, lin.scaling, ours, mapping, **layout)
    add_lora_ref(lin.x.float(), [a.float() for a in lin.lora_a], [b.float() for b in lin.lora_b], lin.scaling, ref,
                 mapping, **layout)
    err = (ours.float() - ref).abs().max().item()
    scale = (ref - lin.y0.float()).abs().max().item()
    if not err <= 0.03 * scale + 0.05:
        raise SystemExit(f"{lin.name}: max error {err} against the float32 reference (delta scale {scale})")


def _add_lora(x, a, b, s, y, m, **layout):
    """``add_lora`` as the model calls it (the two-kernel SGMV pair), rectangles or pages."""
    ADD_LORA.triton(x, a, b, s, y, m, **layout)


def _old(x, a, b, s, y, m):
    ADD_LORA.triton(x, a, b, s, y, m, fused=False)


def _new(x, a, b, s, y, m):
    ADD_LORA.triton(x, a, b, s, y, m)


def _fused(x, a, b, s, y, m):
    FUSED_LORA.triton(x, a, b, s, y, m)


def dense_impl() -> Callable:
    """The lever of docs/ARCHITECTURE.md (not in the product): LoRA at decode through cuBLAS over *every*
    slot. Per linear: one GEMM ``v = x @ [A_0; ...; A_{n-1}]ᵀ`` (each slice's ``[S, R, H]`` slots viewed
    as ``[S·R, H]``), one multiply by the step's one-hot slot mask (built once per step and shared by
    every layer, so made outside the timing here), and per slice ``y_i += v_i @ B_iᵀ`` with B stored
    ``[out_i, S·R]`` and the scaling folded in (layouts made once per linear, outside the timing, as an
    install would). Reads every slot's A and B, used or not."""
    # Keyed by id() with the object kept in the value: a freed object's id (or address) can be reused by the
    # next row's tensors, and a cache keyed by it alone served one row's layouts and masks to the next (the
    # "WRONG" dense rows of the first run).
    prepared: dict[int, tuple] = {}
    masks: dict[int, tuple] = {}

    def run(x, a, b, scaling, y, mapping):
        key = id(a[0])
        prep = prepared.get(key)
        if prep is not None and prep[0] is not a[0]:
            prep = None
        if prep is None:
            slots, rank, hidden = a[0].shape
            a_all = torch.cat([t.reshape(slots * rank, hidden) for t in a], 0)
            b_mats = [(t.float() * sc[:, None, None]).to(t.dtype).permute(1, 0, 2).reshape(t.shape[1], slots * rank)
                      .contiguous() for t, sc in zip(b, scaling)]
            if len(prepared) >= 8:  # one row's linears at a time; older rows' copies are freed
                prepared.clear()
                masks.clear()
            prep = prepared[key] = (a[0], a_all, b_mats, slots, rank)
        _, a_all, b_mats, slots, rank = prep
        held = masks.get(id(mapping))
        if held is None or held[0] is not mapping:
            ids = torch.arange(slots, device=x.device, dtype=mapping.token_slots.dtype)
            held = masks[id(mapping)] = (mapping, (mapping.token_slots[:, None] == ids[None, :]).to(x.dtype))
        mask = held[1]
        tokens = x.shape[0]
        v = (x @ a_all.T).view(tokens, len(b_mats), slots, rank) * mask[:, None, :, None]
        offset = 0
        for i, bm in enumerate(b_mats):
            width = bm.shape[0]
            y[:, offset:offset + width].addmm_(v[:, i].reshape(tokens, slots * rank), bm.T)
            offset += width

    return run


def vllm_impl() -> tuple[Callable | None, str]:
    """vLLM's Triton shrink/expand as ``fn(x, a, b, scaling, y, mapping)``, or (None, why not)."""
    try:
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    except Exception as exc:  # noqa: BLE001 - any import failure means: no column
        return None, f"vllm not importable: {type(exc).__name__}: {exc}"
    metas: dict[int, tuple] = {}  # id -> (mapping kept alive, so its id is not reused; meta)

    def run(x, a, b, scaling, y, mapping):
        held = metas.get(id(mapping))
        if held is None or held[0] is not mapping:
            meta = LoRAKernelMeta.make(a[0].shape[0], x.shape[0], x.device)
            meta.prepare_tensors(mapping.token_slots.long())
            held = metas[id(mapping)] = (mapping, meta)
        meta = held[1]
        v = torch.zeros((len(a), x.shape[0], a[0].shape[1]), dtype=torch.float32, device=x.device)
        lora_shrink(x, a, v, *meta.meta_args(x.shape[0]), SCALING)  # one scaling for all slots
        lora_expand(v, b, y, *meta.meta_args(x.shape[0]), offset_start=0, add_inputs=True)

    return run, ""


def bench_row(layer, num_tokens: int, adapters: int, rank: int, dtype, device, timer: Timer, copy_bps: float,
              impls: dict[str, Callable], min_slots: int = 0) -> Row:
    """One table row over :func:`workload`."""
    slots_host, mapping, linears = workload(layer, num_tokens, adapters, rank, dtype, device, min_slots)
    lora_tokens = int((slots_host >= 0).sum())
    distinct = len(set(slots_host.tolist()) - {-1})
    row = Row(num_tokens, adapters, lora_tokens, floor_bytes(layer, lora_tokens, distinct, rank) / copy_bps * 1e6)
    for name, fn in impls.items():
        for lin in linears:
            try:
                check(lin, mapping, fn)
            except SystemExit as exc:
                if not KEEP_GOING:
                    raise
                row.errors[name] = str(exc)
        row.times_us[name] = timer(lambda fn=fn: [fn(l.x, l.lora_a, l.lora_b, l.scaling, l.y, mapping)
                                                  for l in linears]) * 1e3
    return row


def sweep_fused(layer, num_tokens: int, adapters: int, rank: int, dtype, device, timer: Timer) -> dict:
    """µs per projection of the fused kernel for each tile shape; the default shape first."""
    _, mapping, linears = workload(layer, num_tokens, adapters, rank, dtype, device)
    results = {}
    for lin in linears:
        widths = [b.shape[1] for b in lin.lora_b]
        block_m, block_k, block_n = _block_sizes(lin.x.shape[1], rank, device)
        n_iters, _ = fused_launch_shape(mapping, widths, device, block_m, block_n)
        configs = {"default": {}, f"default-n{block_n}x{n_iters}-w8": dict(num_warps=8)}
        for bk in (128, 256, 512):
            for bn in (32, 64, 128):
                auto_iters, _ = fused_launch_shape(mapping, widths, device, block_m, bn)
                for stages in (2, 3, 4):
                    configs[f"k{bk}-n{bn}x{auto_iters}-s{stages}"] = dict(blocks=(block_m, bk, bn, auto_iters),
                                                                           num_stages=stages)
        times = {}
        for name, kw in configs.items():
            def fn(x, a, b, s, y, m, kw=kw):
                FUSED_LORA.triton(x, a, b, s, y, m, **kw)
            check(lin, mapping, fn)
            times[name] = timer(lambda fn=fn: fn(lin.x, lin.lora_a, lin.lora_b, lin.scaling, lin.y, mapping)) * 1e3
        best = min(times, key=times.get)
        results[lin.name] = {"default_us": times["default"], "best": best, "best_us": times[best], "all": times}
    return results


def profile_kernels(layer, num_tokens: int, adapters: int, rank: int, dtype, device, fn: Callable,
                    min_slots: int = 0, iters: int = 20) -> dict[str, dict[str, float]]:
    """µs per call of each GPU kernel ``fn`` launches, per projection (torch.profiler, eager launches, warm
    L2): where one layer's LoRA time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    _, mapping, linears = workload(layer, num_tokens, adapters, rank, dtype, device, min_slots)
    out: dict[str, dict[str, float]] = {}
    for lin in linears:
        for _ in range(3):
            fn(lin.x, lin.lora_a, lin.lora_b, lin.scaling, lin.y, mapping)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(lin.x, lin.lora_a, lin.lora_b, lin.scaling, lin.y, mapping)
            torch.cuda.synchronize()
        per: dict[str, float] = {}
        for evt in prof.key_averages():
            total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
            if total and evt.count:
                per[evt.key] = per.get(evt.key, 0.0) + total / iters
        out[lin.name] = per
    return out


def sgmv_variants(num_tokens: int, hidden: int = 4096) -> dict[str, dict]:
    """Launch overrides of ``ADD_LORA.triton``'s two-kernel path: split-K and shrink (BLOCK_M, BLOCK_K) with the
    default expand, then expand (BLOCK_M, BLOCK_N, N_ITERS) with the default shrink, then a few pairs of both; the
    default first."""
    block_m = 16 if num_tokens <= 256 else 64
    variants: dict[str, dict] = {"default": {}}
    for split in (1, 2, 4, 8, 16, 32):
        for bk in (64, 128, 256):
            variants[f"split{split}-k{bk}"] = dict(split_k=split, shrink_blocks=(block_m, bk))
    for bm in sorted({16, block_m}):
        for bn in (32, 64, 128, 256):
            for iters in (1, 2, 4, 8):
                variants[f"exp-m{bm}-n{bn}x{iters}"] = dict(expand_blocks=(bm, bn, iters))
    # both parts changed at once: the shrink and expand shapes that won a part each at 256 x 256 (session 13), and
    # the shapes that were the default from 9 to 256 tokens before session 13 (512-element H chunks in 256-element
    # K tiles, one 256-column expand tile per program)
    variants["before-session-13"] = dict(split_k=min(-(-hidden // 512), 32), shrink_blocks=(block_m, 256),
                                         expand_blocks=(16, 256, 1))
    for split, bk in ((1, 256), (2, 128), (4, 128)):
        for bn, iters in ((64, 8), (128, 4), (128, 8)):
            variants[f"split{split}-k{bk}+exp-m16-n{bn}x{iters}"] = dict(
                split_k=split, shrink_blocks=(block_m, bk), expand_blocks=(16, bn, iters))
    # warps and pipeline stages of the 129-256-token decode shapes (session 13's): 1024-element H chunks in 128-element
    # K tiles, eight 128-column expand tiles per program; the shrink's, the expand's, then both changed
    split = min(-(-hidden // 1024), 32)
    for warps in (2, 4, 8):
        for stages in (2, 3, 4):
            shrink = dict(split_k=split, shrink_blocks=(block_m, 128, warps, stages))
            expand = dict(expand_blocks=(16, 128, 8, warps, stages))
            variants[f"shrink-w{warps}-s{stages}"] = shrink
            variants[f"expand-w{warps}-s{stages}"] = expand
            variants[f"both-w{warps}-s{stages}"] = shrink | expand
    return variants


def sweep_sgmv(layer, num_tokens: int, adapters: int, rank: int, dtype, device, timer: Timer,
               min_slots: int = 0, only: tuple[str, ...] = ()) -> dict:
    """µs per projection of each :func:`sgmv_variants` launch shape (each checked first); the best per part."""
    _, mapping, linears = workload(layer, num_tokens, adapters, rank, dtype, device, min_slots)
    results = {}
    for lin in linears:
        times = {}
        for name, kw in sgmv_variants(num_tokens, lin.x.shape[1]).items():
            if only and name not in only:
                continue
            def fn(x, a, b, s, y, m, kw=kw):
                ADD_LORA.triton(x, a, b, s, y, m, **kw)
            try:
                check(lin, mapping, fn)
            except (SystemExit, Exception) as exc:  # noqa: BLE001 - a shape that does not compile is skipped
                times[name] = float("nan")
                results.setdefault("_errors", {})[f"{lin.name}/{name}"] = str(exc)[:200]
                continue
            times[name] = timer(lambda fn=fn: fn(lin.x, lin.lora_a, lin.lora_b, lin.scaling, lin.y, mapping)) * 1e3
        ok = {k: v for k, v in times.items() if v == v}
        if not ok:
            raise SystemExit(f"sweep_sgmv {lin.name}: every variant failed: {results.get('_errors')}")
        best = min(ok, key=ok.get)
        results[lin.name] = {"default_us": times.get("default", float("nan")), "best": best, "best_us": ok[best],
                             "all": times}
    return results


# -- ranks without padding (--mixed-ranks) -------------------------------------------------------------------


@dataclass
class MixedVariant:
    """One row of the --mixed-ranks table: a rank per adapter and the pool layout holding them."""

    name: str
    ranks: list[int]
    pool_rank: int  # R: rectangles' padded rank, or max_pages * page
    page: int | None = None  # rank rows per page; None = rectangles
    pass_ranks: bool = False  # rectangles only: give the kernels ``ranks`` (pages always do)


def mixed_ranks(adapters: int, rank: int, seed: int = 0) -> list[int]:
    """``3/4`` of the adapters at ``rank / 2``, ``1/8`` at ``rank``, ``1/8`` at ``4 rank`` (sum ``adapters * rank``;
    24 x 8, 4 x 16, 4 x 64 at 32 adapters and r=16), positions shuffled with ``seed``."""
    eighth = adapters // 8
    ranks = [rank // 2] * (adapters - 2 * eighth) + [rank] * eighth + [4 * rank] * eighth
    order = torch.randperm(adapters, generator=torch.Generator().manual_seed(seed)).tolist()
    return [ranks[i] for i in order]


def mixed_variants(adapters: int, rank: int) -> list[MixedVariant]:
    """The --mixed-ranks rows: (a) rectangles r, (b) pages all-r, (c) pages mixed (PAGE r/2 and r), (d) the mixed
    batch padded to 4r (as a padded pool: no ranks; and with ranks), and pools sized for 16r (max_lora_rank 256)."""
    same, mixed = [rank] * adapters, mixed_ranks(adapters, rank)
    big = 16 * rank
    return [
        MixedVariant(f"(a) rectangles r={rank}", same, rank),
        MixedVariant(f"(b) pages all r={rank}, PAGE {rank}", same, 4 * rank, page=rank),
        MixedVariant(f"(c) pages mixed, PAGE {rank // 2}", mixed, 4 * rank, page=rank // 2),
        MixedVariant(f"(c) pages mixed, PAGE {rank}", mixed, 4 * rank, page=rank),
        MixedVariant(f"(d) rectangles mixed, padded to R={4 * rank}", mixed, 4 * rank),
        MixedVariant(f"(d) rectangles mixed, R={4 * rank} + ranks", mixed, 4 * rank, pass_ranks=True),
        MixedVariant(f"(e) pages mixed, PAGE {rank}, pool R={big}", mixed, big, page=rank),
        MixedVariant(f"(e) rectangles mixed, padded to R={big}", mixed, big),
    ]


def make_mixed_linear(name: str, hidden: int, widths, num_tokens: int, variant: MixedVariant, dtype,
                      device) -> Linear:
    """One projection's slot weights in ``variant``'s layout: rectangles zero-padded past each rank, or pages
    (ids shuffled, NaN in every row no adapter uses, -1 past each slot's pages in the page table)."""
    ranks = variant.ranks
    slots = len(ranks)
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    y = torch.randn(num_tokens, sum(widths), device=device).to(dtype)
    scaling = [torch.full((slots,), SCALING, device=device) for _ in widths]
    rank_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    inv_sqrt = torch.tensor([max(r, 1) ** -0.5 for r in ranks], device=device)
    if variant.page is None:
        used = torch.arange(variant.pool_rank, device=device)[None, :] < rank_t[:, None]  # [S, R]
        lora_a = [(torch.randn(slots, variant.pool_rank, hidden, device=device) * used[:, :, None] / hidden**0.5)
                  .to(dtype) for _ in widths]
        lora_b = [(torch.randn(slots, w, variant.pool_rank, device=device) * (used * inv_sqrt[:, None])[:, None, :])
                  .to(dtype) for w in widths]
        return Linear(name, x, y, lora_a, lora_b, scaling, ranks=rank_t if variant.pass_ranks else None)
    page = variant.page
    max_pages = variant.pool_rank // page
    needed = [-(-r // page) for r in ranks]
    ids = torch.randperm(sum(needed), generator=torch.Generator().manual_seed(1)).tolist()
    table, start = [], 0
    for n in needed:
        table.append(ids[start : start + n] + [-1] * (max_pages - n))
        start += n
    pages = torch.tensor([table[s][r // page] for s in range(slots) for r in range(ranks[s])], device=device)
    offsets = torch.tensor([r % page for s in range(slots) for r in range(ranks[s])], device=device)
    row_scale = torch.cat([inv_sqrt[s].expand(ranks[s]) for s in range(slots)])
    lora_a, lora_b = [], []
    for w in widths:
        a = torch.full((len(ids), page, hidden), float("nan"), device=device, dtype=dtype)
        a[pages, offsets] = (torch.randn(len(pages), hidden, device=device) / hidden**0.5).to(dtype)
        b = torch.full((len(ids), w, page), float("nan"), device=device, dtype=dtype)
        b[pages, :, offsets] = (torch.randn(len(pages), w, device=device) * row_scale[:, None]).to(dtype)
        lora_a.append(a)
        lora_b.append(b)
    return Linear(name, x, y, lora_a, lora_b, scaling, ranks=rank_t,
                  page_table=torch.tensor(table, dtype=torch.int32, device=device))


def time_parts(linears: list[Linear], mapping: LoRAMapping, timer: Timer) -> tuple[float, float]:
    """µs per layer of the shrink alone (split-K partials) and of the expand alone (from partials made once)."""
    def shrink(lin: Linear) -> torch.Tensor:
        return shrink_partials(lin.x, lin.lora_a, mapping, lin.ranks, page_table=lin.page_table)

    partials = [shrink(lin) for lin in linears]
    shrink_us = timer(lambda: [shrink(lin) for lin in linears]) * 1e3
    expand_us = timer(lambda: [_launch_lora_expand(p, lin.lora_b, lin.scaling, lin.y, mapping, **lin.layout_kwargs())
                               for p, lin in zip(partials, linears)]) * 1e3
    return shrink_us, expand_us


def mixed_floor_bytes(layer, num_tokens: int, ranks: list[int], itemsize: int = 2) -> int:
    """Compulsory bytes of the layer's LoRA deltas with every token on an adapter: each adapter's own rank rows of
    A and B, x read, y read and written."""
    total = 0
    for _, hidden, widths in layer:
        total += sum(ranks) * (hidden * len(widths) + sum(widths)) * itemsize
        total += num_tokens * (hidden + 2 * sum(widths)) * itemsize
    return total


def run_mixed_ranks(layer, adapters: int, rank: int, dtype, device, timer: Timer) -> dict:
    """µs per layer of each :func:`mixed_variants` row, each projection checked against the float32 reference
    first; ``speed_vs_b`` = time(b) / time(row) (the goal: >= 0.9 for the (c) rows); ``shrink_us`` / ``expand_us``:
    each kernel alone (:func:`time_parts`)."""
    copy_bps = copy_bandwidth(device)
    num_tokens = adapters  # one decode token per adapter
    slots_host = torch.randperm(adapters, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    mapping = plan_segments(slots_host.to(device), adapters)
    rows = []
    for variant in mixed_variants(adapters, rank):
        linears = [make_mixed_linear(name, hidden, widths, num_tokens, variant, dtype, device)
                   for name, hidden, widths in layer]
        for lin in linears:
            check(lin, mapping, _add_lora)
        us = timer(lambda: [_add_lora(l.x, l.lora_a, l.lora_b, l.scaling, l.y, mapping, **l.layout_kwargs())
                            for l in linears]) * 1e3
        shrink_us, expand_us = time_parts(linears, mapping, timer)
        floor = mixed_floor_bytes(layer, num_tokens, variant.ranks, torch.finfo(dtype).bits // 8)
        rows.append({"variant": variant.name, "layout": "rectangles" if variant.page is None else "pages",
                     "page": variant.page, "pool_rank": variant.pool_rank, "ranks_passed": variant.page is not None
                     or variant.pass_ranks, "rank_rows": sum(variant.ranks), "max_rank": max(variant.ranks),
                     "us": us, "shrink_us": shrink_us, "expand_us": expand_us, "floor_us": floor / copy_bps * 1e6})
        print(json.dumps(rows[-1]), flush=True)
        linears.clear()  # this variant's weights go before the next one's are made
    base = next(r["us"] for r in rows if r["variant"].startswith("(b)"))
    for r in rows:
        r["speed_vs_b"] = base / r["us"] if r["us"] > 0 else float("nan")
    goal = {r["variant"]: r["speed_vs_b"] for r in rows if r["variant"].startswith("(c)")}
    return {"copy_TBps": copy_bps / 1e12, "tokens": num_tokens, "adapters": adapters, "rank": rank,
            "rows": rows, "goal_speed_vs_b": 0.9, "speed_c_vs_b": goal,
            "goal_met": all(v >= 0.9 for v in goal.values())}


def format_mixed_table(result: dict, note: str) -> str:
    lines = [note, "", "| variant | rank rows | pool R | µs per layer | shrink µs | expand µs | bytes floor µs "
             "| speed vs (b) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['rank_rows']} | {r['pool_rank']} | {r['us']:.1f} | {r['shrink_us']:.1f} "
                     f"| {r['expand_us']:.1f} | {r['floor_us']:.1f} | {r['speed_vs_b']:.2f} |")
    verdict = ", ".join(f"{k}: {v:.2f}" for k, v in result["speed_c_vs_b"].items())
    lines += ["", f"time(b) / time(c) (goal >= {result['goal_speed_vs_b']}): {verdict} -> "
              f"{'met' if result['goal_met'] else 'NOT met'}"]
    return "\n".join(lines)


def format_table(rows: list[Row], header_note: str) -> str:
    names = sorted({k for r in rows for k in r.times_us}, key=["old", "new", "fused", "dense", "vllm"].index)
    lines = [header_note, "",
             "| tokens × adapters | LoRA tokens | bytes floor µs | " + " | ".join(f"{n} µs" for n in names)
             + " | new / floor |",
             "|---" * (4 + len(names)) + "|"]
    for r in rows:
        cells = [(f"{r.times_us[n]:.1f}" + (" (WRONG)" if n in r.errors else "")) if n in r.times_us else "–"
                 for n in names]
        ratio = r.times_us.get("new", float("nan")) / r.floor_us if r.floor_us else float("nan")
        lines.append(f"| {r.tokens} × {r.adapters} | {r.lora_tokens} | {r.floor_us:.1f} | " + " | ".join(cells)
                     + f" | {ratio:.1f} |")
    return "\n".join(lines)


def graph_timer(flush_bytes: int = 256 << 20) -> Timer:
    """ms per call from CUDA-graph replays of CALLS x (L2 flush, fn) minus CALLS x (L2 flush)."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def replay_ms(body: Callable[[], None]) -> float:
        return graph_replay_ms([body] * CALLS, replays=10)

    def timer(fn: Callable[[], object]) -> float:
        both = replay_ms(lambda: (flush.zero_(), fn()))
        alone = replay_ms(lambda: flush.zero_())
        return max(both - alone, 0.0) / CALLS

    return timer


def wall_timer(fn: Callable[[], object]) -> float:
    """ms of one call by the wall clock (smoke runs on CPU)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write, ``common.measure_copy_bandwidth``); a nominal
    4.2e12 off CUDA."""
    if device.type != "cuda":
        return 4.2e12
    from common import measure_copy_bandwidth  # noqa: PLC0415 - benchmarks/ is on sys.path when run

    return measure_copy_bandwidth()


def run(layer, tokens, adapters, rank, dtype, device, timer: Timer, sweep: bool, with_vllm: bool = False,
        with_dense: bool = False, min_slots: int = 0, pairs: list[tuple[int, int]] | None = None) -> dict:
    """The side-by-side rows, or (``sweep``) only the fused-kernel tile sweep at the largest adapter count."""
    copy_bps = copy_bandwidth(device)
    if sweep:
        return {"copy_TBps": copy_bps / 1e12, "rank": rank, "rows": [],
                "sweep": {str(t): sweep_fused(layer, t, max(adapters), rank, dtype, device, timer)
                          for t in tokens if t <= 256}}
    impls: dict[str, Callable] = {"old": _old, "new": _new, "fused": _fused}
    if with_dense:
        impls["dense"] = dense_impl()
    if not with_vllm:
        vllm_fn, why = None, "not asked (--vllm)"
    else:
        vllm_fn, why = vllm_impl() if device.type == "cuda" else (None, "CPU run")
    if vllm_fn is not None:
        try:  # its API moves between releases: one small checked call decides whether the column is kept
            probe = plan_segments(token_slots(8, 2).to(device), 2)
            for lin in make_linears(layer, 8, 2, rank, dtype, device):
                check(lin, probe, vllm_fn)
            impls["vllm"] = vllm_fn
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            vllm_fn, why = None, f"vllm call failed: {type(exc).__name__}: {exc}"
    rows = []
    for t, n in pairs or [(t, n) for t in tokens for n in adapters]:
        rows.append(bench_row(layer, t, n, rank, dtype, device, timer, copy_bps, impls, min_slots))
        print(json.dumps(asdict(rows[-1])), flush=True)
    result = {"copy_TBps": copy_bps / 1e12, "rank": rank, "min_slots": min_slots, "rows": [asdict(r) for r in rows],
              "vllm": "timed" if vllm_fn is not None else why, "sglang": "not wired in this benchmark"}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--sweep", action="store_true", help="instead of the table, time fused-kernel tile shapes "
                        "at 32 adapters")
    parser.add_argument("--vllm", action="store_true", help="add vLLM's kernels as a column when vllm imports")
    parser.add_argument("--dense", action="store_true", help="add the cuBLAS-over-every-slot variant (dense_impl)")
    parser.add_argument("--slots", type=int, default=0, help="slots per layer at least this many (an engine's "
                        "max_loras; default: as many as the row's adapters); only --dense reads unused slots")
    parser.add_argument("--profile", type=str, default="", help="TxA[,TxA] (e.g. 32x32): also print the µs per call "
                        "of each kernel `add_lora` launches, per projection (CUDA only)")
    parser.add_argument("--sweep-sgmv", type=str, default="", help="TxA[,TxA]: also time the SGMV pair's launch "
                        "shapes (split-K, shrink and expand tiles) per projection, each variant checked")
    parser.add_argument("--sweep-only", type=str, default="", help="NAME[,NAME]: --sweep-sgmv times only these "
                        "variants (e.g. default,before-session-13)")
    parser.add_argument("--mixed-ranks", action="store_true", help="instead of the table, time rectangles against "
                        "pages (ranks without padding) at 32 tokens x 32 adapters, mixed ranks (run_mixed_ranks)")
    parser.add_argument("--rows", type=str, default="", help="TxA[,TxA]: the table's rows instead of {1, 32, 128, "
                        "512} x {1, 8, 32} (e.g. 256x256: a decode batch of many adapters)")
    parser.add_argument("--targets", choices=("all", "qv", "qv-layer"), default="all",
                        help="qv: only the fused qkv linear, its k slice untargeted (scaling 0), as the engine runs a "
                             "q/v adapter (the scaling benchmark's); qv-layer: the four projections with only q and v "
                             "targeted (the others' launches find scaling 0 and exit, as in the engine)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: set TRITON_INTERPRET=1)")
    parser.add_argument("--keep-going", action="store_true", help="record a failed check in the row, time anyway")
    args = parser.parse_args(argv)
    global KEEP_GOING
    KEEP_GOING = args.keep_going
    torch.manual_seed(0)
    if torch.cuda.is_available() and not args.smoke:
        device, timer, layer, tokens, adapters, rank, dtype = (torch.device("cuda"), graph_timer(), LLAMA2_7B_LAYER,
                                                               TOKENS, ADAPTERS, 16, torch.bfloat16)
    elif args.smoke:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        timer = graph_timer() if device.type == "cuda" else wall_timer
        layer, tokens, adapters, rank, dtype = SMOKE_LAYER, (1, 5), (1, 3), 4, torch.float32
    else:
        raise SystemExit("bench_lora_kernels: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    if args.targets == "qv":
        layer = SMOKE_QV if args.smoke else LLAMA2_7B_QV
    elif args.targets == "qv-layer":
        layer = SMOKE_QV_LAYER if args.smoke else LLAMA2_7B_QV_LAYER
    pairs = [tuple(int(v) for v in spec.split("x")) for spec in filter(None, args.rows.lower().split(","))]
    if args.mixed_ranks:
        if args.targets != "all":
            raise SystemExit("--mixed-ranks times all four projections: leave --targets at all")
        return mixed_main(args, layer, rank, dtype, device, timer)
    result = run(layer, tokens, adapters, rank, dtype, device, timer, args.sweep, args.vllm, args.dense, args.slots,
                 pairs or None)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result["device"] = name
    if args.sweep:
        for t, per in result["sweep"].items():
            for lin, s in per.items():
                print(f"sweep T={t} {lin}: default {s['default_us']:.1f} µs, best {s['best']} {s['best_us']:.1f} µs")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
        return result
    what = {"qv": "the q/v adapter's qkv linear (k untargeted)",
            "qv-layer": "one layer's four projections, only q and v targeted"}.get(args.targets,
                                                                                 "one layer's four projections")
    note = (f"LoRA deltas of {what}, r={rank}, {BASE_FRACTION:.0%} base tokens, "
            f"CUDA-graph replay, cold L2 ({name}, copy {result['copy_TBps']:.2f} TB/s; vllm: {result['vllm']}; "
            f"slots per layer: {f'at least {args.slots}' if args.slots else 'as many as adapters'})")
    result["table"] = format_table([Row(**r) for r in result["rows"]], note)
    print(result["table"])
    result["profile"] = {}
    for spec in filter(None, args.profile.lower().split(",")):
        if device.type != "cuda":
            print("--profile: needs CUDA (torch.profiler's kernel times); skipped", flush=True)
            break
        t, n = (int(v) for v in spec.split("x"))
        per_proj = result["profile"][spec] = profile_kernels(layer, t, n, rank, dtype, device, _new, args.slots)
        for proj, per in per_proj.items():
            print(f"profile {spec} {proj}: " + ", ".join(f"{k[:60]} {v:.1f} µs" for k, v in sorted(per.items())))
    result["sgmv_sweep"] = {}
    for spec in filter(None, args.sweep_sgmv.lower().split(",")):
        t, n = (int(v) for v in spec.split("x"))
        per_proj = result["sgmv_sweep"][spec] = sweep_sgmv(layer, t, n, rank, dtype, device, timer, args.slots,
                                                           tuple(filter(None, args.sweep_only.split(","))))
        for proj, res in per_proj.items():
            if proj == "_errors":
                print(f"sgmv sweep {spec}: {len(res)} variants failed, e.g. {next(iter(res.items()))}")
                continue
            print(f"sgmv sweep {spec} {proj}: default {res['default_us']:.1f} µs, best {res['best']} "
                  f"{res['best_us']:.1f} µs")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


def mixed_main(args, layer, rank: int, dtype, device, timer: Timer) -> dict:
    """--mixed-ranks: 32 adapters (8 with --smoke), print the table, write ``--out``."""
    result = run_mixed_ranks(layer, 8 if args.smoke else 32, rank, dtype, device, timer)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result["device"] = name
    timing = "CUDA-graph replay, cold L2" if device.type == "cuda" else "wall clock"
    note = (f"LoRA deltas of one layer's four projections, {result['tokens']} decode tokens, one per adapter, "
            f"{str(dtype).removeprefix('torch.')}, {timing} ({name}, copy {result['copy_TBps']:.2f} TB/s)")
    result["table"] = format_mixed_table(result, note)
    print(result["table"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
