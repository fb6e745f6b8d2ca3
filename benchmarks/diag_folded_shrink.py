"""The LoRA shrink folded into the base GEMM, against the SGMV pair (issue 17, lever "LoRA folded into the base GEMM
for small token counts").

Per row (tokens T, distinct adapters, slots S, targets): a Llama-2-7B layer's LoRA'd linears, each timed three
ways, µs per layer (CUDA-graph replay, L2 flushed before every call, as ``bench_lora_kernels.py``):

- ``base``: ``F.linear(x, W)`` only (cuBLAS);
- ``sgmv``: ``F.linear(x, W)`` then ``add_lora`` (shrink + expand, what the engine runs);
- ``folded``: one ``F.linear(x, [W; A_0; ...; A_{n-1}])`` (every slot's A of every slice under W, ``N + n·S·R`` output
  columns): its first N columns are the base output, the rest every slot's shrink per token, which the expand reads
  (``slot_rows``: token t takes its own slot's R columns). One launch fewer per linear; the GEMM reads all S
  slots' A, whatever the batch uses.

Each variant's output is checked against the float32 reference first. ``--targets all`` (the four linears, all seven
projections) or ``qv`` (the fused qkv linear of a q/v adapter, k untargeted: scaling 0, its slice still held,
as the engine's pool holds a fused linear whole).

Usage: ``python benchmarks/diag_folded_shrink.py [--rows all:32x32x32,qv:256x256x256,...] [--out FILE]`` (CUDA);
``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (checks only, wall-clock times).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_lora_kernels as blk  # noqa: E402
from loraplex.kernels.lora_expand import _launch_lora_expand, slot_rows_view  # noqa: E402
from loraplex.kernels.lora_linear import ADD_LORA, add_lora_ref  # noqa: E402

DEFAULT_ROWS = ("all:1x1x32,all:32x32x32,all:32x8x32,all:128x32x32,qv:32x32x256,qv:128x128x256,qv:256x256x256,"
                "qv:256x16x256,qv:256x64x256")
LAYERS = {("all", False): blk.LLAMA2_7B_LAYER, ("qv", False): blk.LLAMA2_7B_QV,
          ("all", True): blk.SMOKE_LAYER, ("qv", True): blk.SMOKE_QV}


def folded_weight(w: torch.Tensor, lora_a: list[torch.Tensor]) -> torch.Tensor:
    """``[N + n·S·R, H]``: W's rows, then slice 0's slots' A rows (slot-major), slice 1's, ..."""
    return torch.cat([w] + [a.reshape(-1, a.shape[-1]) for a in lora_a])


def run_row(layer, tokens: int, adapters: int, slots: int, rank: int, dtype, device, timer) -> dict:
    slots_host, mapping, linears = blk.workload(layer, tokens, adapters, rank, dtype, device, min_slots=slots)
    weights = [(torch.randn(lin.y.shape[1], lin.x.shape[1], device=device) / lin.x.shape[1] ** 0.5).to(dtype)
               for lin in linears]
    folded = [folded_weight(w, lin.lora_a) for w, lin in zip(weights, linears)]

    def base():
        return [F.linear(lin.x, w) for lin, w in zip(linears, weights)]

    def sgmv():
        ys = base()
        for lin, y in zip(linears, ys):
            ADD_LORA.triton(lin.x, lin.lora_a, lin.lora_b, lin.scaling, y, mapping)
        return ys

    def fold():
        ys = []
        for lin, w, wf in zip(linears, weights, folded):
            out = F.linear(lin.x, wf)
            y = out[:, : w.shape[0]]
            _launch_lora_expand(slot_rows_view(out, w.shape[0], len(lin.lora_a), *lin.lora_a[0].shape[:2]), lin.lora_b,
                                lin.scaling, y, mapping, slot_rows=True)
            ys.append(y)
        return ys

    errors = {}
    for name, fn in (("sgmv", sgmv), ("folded", fold)):
        for lin, w, y in zip(linears, weights, fn()):
            ref = F.linear(lin.x.float(), w.float())
            add_lora_ref(lin.x.float(), [a.float() for a in lin.lora_a], [b.float() for b in lin.lora_b],
                         lin.scaling, ref, mapping)
            err = (y.float() - ref).abs().max().item()
            bound = 0.02 * ref.abs().max().item() + 0.05
            if not err <= bound:
                errors[name] = f"{lin.name}: max error {err:.4g} > {bound:.4g}"
    times = {name: timer(fn) * 1e3 for name, fn in (("base", base), ("sgmv", sgmv), ("folded", fold))}
    extra_bytes = sum((f.shape[0] - w.shape[0]) * w.shape[1] * w.element_size() for w, f in zip(weights, folded))
    row = {"targets": None, "tokens": tokens, "adapters": adapters, "slots": slots,
           "lora_tokens": int((slots_host >= 0).sum()), "times_us": times,
           "sgmv_lora_us": times["sgmv"] - times["base"], "folded_lora_us": times["folded"] - times["base"],
           "folded_extra_weight_MB": extra_bytes / 1e6, "errors": errors}
    return row


NORM_VARIANTS = ((1024, 4), (1024, 8), (1024, 16), (2048, 8), (2048, 16), (4096, 8), (4096, 16), (4096, 32))
ACT_VARIANTS = ((128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (1024, 8))


def consumer_sweep(tokens: int, slots: int, rank: int, dtype, device, timer, hidden: int = 4096,
                   inter: int = 11008) -> dict:
    """The expands of o_proj/down_proj and gate_up left to the next kernel: ``rms_norm(y, residual, lora=delta)``
    and ``silu_and_mul(y, lora=delta)`` per launch shape, against the expand launch plus the plain op. µs per call;
    every token on its own adapter (tokens <= slots), checked against the reference first."""
    from loraplex.kernels.lora_delta import LoRADelta, lora_delta_ref
    from loraplex.kernels.lora_mapping import plan_segments
    from loraplex.kernels.ops import Kernels

    kernels = Kernels("triton")
    slots_host = torch.arange(tokens, dtype=torch.int32) % slots
    mapping = plan_segments(slots_host.to(device), slots, has_lora=True)

    def folded(widths):
        out = torch.randn(tokens, sum(widths) + len(widths) * slots * rank, device=device).to(dtype)
        n = sum(widths)
        v = slot_rows_view(out, n, len(widths), slots, rank)
        b = [(torch.randn(slots, w, rank, device=device) / rank**0.5).to(dtype) for w in widths]
        s = [torch.full((slots,), 0.5, device=device) for _ in widths]
        return out[:, :n], LoRADelta(v, b, s, mapping)

    result: dict = {"tokens": tokens, "slots": slots}
    y, delta = folded([hidden])
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    weight = torch.rand(hidden, device=device).to(dtype) + 0.5
    want = kernels.rms_norm(lora_delta_ref(delta, y), weight, 1e-6, residual)[0].float()

    def expand_then_norm():
        yy = y.clone()
        kernels.lora_expand_slot_rows(delta.v, delta.lora_b, delta.scaling, yy, mapping)
        return kernels.rms_norm(yy, weight, 1e-6, residual)

    result["norm: clone (subtract)"] = timer(lambda: y.clone()) * 1e3
    result["norm: expand + rms_norm"] = timer(expand_then_norm) * 1e3
    result["norm: rms_norm alone"] = timer(lambda: kernels.rms_norm(y, weight, 1e-6, residual)) * 1e3
    for blocks in NORM_VARIANTS:
        fn = lambda b=blocks: kernels.rms_norm(y, weight, 1e-6, residual, lora=delta, lora_blocks=b)  # noqa: E731
        err = (fn()[0].float() - want).abs().max().item()
        result[f"norm: fused {blocks}"] = timer(fn) * 1e3 if err < 0.1 else f"wrong ({err:.3g})"
    y2, delta2 = folded([inter, inter])
    want2 = kernels.silu_and_mul(lora_delta_ref(delta2, y2)).float()

    def expand_then_act():
        yy = y2.clone()
        kernels.lora_expand_slot_rows(delta2.v, delta2.lora_b, delta2.scaling, yy, mapping)
        return kernels.silu_and_mul(yy)

    result["act: clone (subtract)"] = timer(lambda: y2.clone()) * 1e3
    result["act: expand + silu_and_mul"] = timer(expand_then_act) * 1e3
    result["act: silu_and_mul alone"] = timer(lambda: kernels.silu_and_mul(y2)) * 1e3
    for blocks in ACT_VARIANTS:
        fn = lambda b=blocks: kernels.silu_and_mul(y2, lora=delta2, lora_blocks=b)  # noqa: E731
        err = (fn().float() - want2).abs().max().item()
        result[f"act: fused {blocks}"] = timer(fn) * 1e3 if err < 0.1 else f"wrong ({err:.3g})"
    return result


def parse_rows(text: str) -> list[tuple[str, int, int, int]]:
    out = []
    for item in text.split(","):
        targets, dims = item.split(":")
        t, a, s = (int(v) for v in dims.split("x"))
        out.append((targets, t, a, s))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="targets:TxAxS,... (targets all|qv)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, checks and wall-clock times")
    parser.add_argument("--consumers", default=None,
                        help="TxS,...: sweep the norm and activation that apply a folded linear's expand instead")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    timer = blk.wall_timer if smoke else blk.graph_timer()
    if args.consumers:
        out = []
        for item in args.consumers.split(","):
            t, slots = (int(v) for v in item.split("x"))
            out.append(consumer_sweep(t, slots, args.rank, dtype, device, timer,
                                      *((24, 20) if smoke else ())))
            print(json.dumps(out[-1]), flush=True)
        return out
    rows = parse_rows("all:4x2x3,qv:6x3x4" if smoke else args.rows)
    results = []
    for targets, t, a, s in rows:
        row = run_row(LAYERS[(targets, smoke)], t, a, s, args.rank, dtype, device, timer)
        row["targets"] = targets
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| targets | T × adapters (slots) | base µs | sgmv µs (LoRA) | folded µs (LoRA) | folded extra weight MB |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        tm = r["times_us"]
        print(f"| {r['targets']} | {r['tokens']} × {r['adapters']} ({r['slots']}) | {tm['base']:.1f} | "
              f"{tm['sgmv']:.1f} ({r['sgmv_lora_us']:.1f}) | {tm['folded']:.1f} ({r['folded_lora_us']:.1f}) | "
              f"{r['folded_extra_weight_MB']:.1f} |" + (f" errors: {r['errors']}" if r["errors"] else ""))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
