"""Where the FP8 (W8A16) linear's time goes: the e4m3 -> bf16 widening, against W8A8 on FP8 tensor cores.

For T in (1, 32, 128) and each Llama-2-7B linear: the Triton kernel with each widening of the weight tile
(``fp8_linear._widen_e4m3``: 0 = Triton's conversion, 1 = bit operations, 2 = inline PTX, four bytes per
register), at its default launch shape and, for widen 0 and 2, over a small shape sweep; cuBLAS bf16
``F.linear`` (the peer); and ``torch._scaled_mm`` over e4m3 activations with one scale per token (W8A8,
activations quantized beforehand, not timed). µs per call: median of ``do_bench`` over rotating weight copies
(cold L2), the least of ``--rounds`` interleaved rounds over all variants (after a clock warm-up). First, each widening is checked on a weight holding every
finite e4m3 byte (subnormals included) against the float32 reference. Usage (CUDA)::

    python benchmarks/diag_fp8_widen.py [--out FILE] [--tokens 1,32,128] [--no-sweep] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fp8_linear import LINEARS, copies_for  # noqa: E402

from loraplex.kernels.fp8_linear import _block_sizes, _launch_fp8_linear, fp8_linear_ref  # noqa: E402


def check_every_byte(dev: torch.device) -> dict:
    """Relative error of each widening on weights made of every finite e4m3 byte, and on subnormals only."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    full = codes.repeat(64, 5)[:, :1024].contiguous().view(torch.float8_e4m3fn).to(dev)  # [64, 1016->1024]
    sub = torch.tensor([b for b in range(256) if (b & 0x78) == 0], dtype=torch.uint8)
    subn = sub.repeat(64, 1024 // len(sub) + 1)[:, :1024].contiguous().view(torch.float8_e4m3fn).to(dev)
    out = {}
    x = torch.randn(32, 1024, device=dev, dtype=torch.bfloat16)
    scale = torch.rand(64, device=dev) + 0.5
    for name, w in (("every byte", full), ("subnormals only", subn)):
        ref = fp8_linear_ref(x.float(), w, scale).float()
        for widen in (0, 1, 2):
            got = _launch_fp8_linear(x, w, scale, widen=widen).float()
            out[f"{name}, widen {widen}"] = ((got - ref).norm() / ref.norm()).item()
    return out


def sweep_configs(tokens: int):
    bt = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    for bn in (16, 32, 64):
        for bk in (128, 256, 512):
            for stages in (3, 4):
                if bn * bk <= 64 * 512:
                    yield (bt, bn, bk, 4, stages)
    if tokens > 64:
        for split in (1, 4):
            yield (128, 64, 128, 4, 3, split)


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    report = {"copy_TBps": bw / 1e12, "device": torch.cuda.get_device_name(), "checks": check_every_byte(dev),
              "rows": []}
    print(json.dumps(report["checks"], indent=1), flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, k, n in LINEARS:
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            copies = copies_for(n * k)
            ws = [(torch.randn(n, k, device=dev) * 40).to(torch.float8_e4m3fn) for _ in range(copies)]
            scales = [torch.rand(n, device=dev) * 1e-3 + 5e-4 for _ in range(copies)]
            w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ref = fp8_linear_ref(x.float(), ws[0], scales[0]).float()
            i = [0]

            def timed(fn) -> float:
                def call():
                    i[0] = (i[0] + 1) % copies
                    fn(i[0])
                return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3

            row = {"tokens": tokens, "linear": name, "floor_us": (n * k + 4 * n) / bw * 1e6}
            default = _block_sizes(tokens, n, k, dev)
            candidates = {}  # label -> fn(j); each checked against the reference first
            for widen in (0, 1, 2):
                cfgs = [default] + ([] if widen == 1 or args.no_sweep else
                                    [c for c in sweep_configs(tokens) if c != default])
                for cfg in cfgs:
                    label = f"widen {widen} {cfg}"
                    try:
                        got = _launch_fp8_linear(x, ws[0], scales[0], config=cfg, widen=widen).float()
                    except Exception as exc:  # noqa: BLE001 - a shape that does not compile is skipped
                        row[label] = f"failed: {type(exc).__name__}"
                        continue
                    rel = ((got - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        row[label] = f"wrong: rel {rel:.3g}"
                        continue
                    candidates[label] = (lambda j, cfg=cfg, widen=widen:
                                         _launch_fp8_linear(x, ws[j], scales[j], config=cfg, widen=widen))
            candidates["cublas bf16"] = lambda j: torch.nn.functional.linear(x, w16[j])
            # W8A8: e4m3 activations with one scale per token (quantized beforehand, not timed), e4m3 weights.
            sa = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            xq = (x.float() / sa).to(torch.float8_e4m3fn)
            sbs = [s.view(1, -1) for s in scales]
            got = torch._scaled_mm(xq, ws[0].t(), scale_a=sa, scale_b=sbs[0], out_dtype=torch.bfloat16).float()
            row["w8a8_rel_err"] = ((got - ref).norm() / ref.norm()).item()
            candidates["scaled_mm w8a8"] = lambda j: torch._scaled_mm(xq, ws[j].t(), scale_a=sa, scale_b=sbs[j],
                                                                      out_dtype=torch.bfloat16)
            spin = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
            for _ in range(20):  # clocks up before the first timing
                spin @ spin
            times = {label: [] for label in candidates}
            for _ in range(args.rounds):  # interleaved rounds: a slow moment hits one round of each, not one variant
                for label, fn in candidates.items():
                    times[label].append(timed(fn))
            row["us"] = {label: min(t) for label, t in times.items()}
            for widen in (0, 1, 2):
                mine = {lb: t for lb, t in row["us"].items() if lb.startswith(f"widen {widen} ")}
                if mine:
                    best = min(mine, key=mine.get)
                    row[f"widen{widen}_default_us"] = mine.get(f"widen {widen} {default}")
                    row[f"widen{widen}_best"] = (best, mine[best])
            row["cublas_bf16_us"] = row["us"]["cublas bf16"]
            row["scaled_mm_us"] = row["us"]["scaled_mm w8a8"]
            report["rows"].append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "us"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
