"""FP8 (W8A16) linear launch shapes on the GPU: the Llama-2-7B layer's four linears at decode token counts.

The weights-widened path (``activations="exact"``) throughout; the split-activation path the engine takes on Hopper
for bf16 steps of up to 128 tokens is swept by ``benchmarks/diag_fp8_split_act.py``.

For T in ``--tokens`` (default 1, 32, 128) and each linear (qkv 4096->12288, o 4096->4096, gate_up
4096->22016, down 11008->4096): every launch shape of a grid (BLOCK_T, BLOCK_N, BLOCK_K, warps, stages; and for
the swapped-operand kernel, whose weight tile is the dot's M side, also SPLIT_K), for each weight widening in
``--widen`` (``fp8_linear._widen_e4m3``: 0 = Triton's conversion, 1 = bit moves, 2 = inline PTX; default: the
launcher's own), is checked against the float32 reference (relative error < 1e-2), then timed with
``triton.testing.do_bench`` (median, µs, rotating over weight copies that span at least twice the L2,
:func:`copies_for`). After a clock warm-up every variant of a (T, linear) is timed in ``--rounds`` interleaved
rounds and keeps its least time (session 18: timed one after another, the first variants of a row read 2-3x
slower than the same shapes later). Peers: cuBLAS's bf16 ``F.linear`` of the same shape, and ``torch._scaled_mm``
over e4m3 activations with one scale per token (W8A8, activations quantized beforehand, not timed). First, each
widening is checked on weights holding every finite e4m3 byte. Reported per (T, linear): the default shape, the
best per widening, the bytes floor (weight bytes + scales at the copy bandwidth measured here) and the peers.
Usage (CUDA)::

    python benchmarks/bench_fp8_linear.py [--out FILE] [--tokens 1,32,128] [--widen 0,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.kernels.fp8_linear import (  # noqa: E402
    _block_sizes,
    _fit_shared_memory,
    _launch_fp8_linear,
    default_widen,
    fp8_linear_ref,
    shared_memory_budget,
)

LINEARS = (("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096))
COPIES = 4
L2_BYTES = 60 << 20  # H100/H200 L2 is 50/60 MB: the rotated copies of a linear span at least twice that


def copies_for(weight_bytes: int) -> int:
    """Weight copies to rotate so that a call never finds its weights in L2: at least :data:`COPIES`, and at least
    ``2 * L2_BYTES`` of the smallest copies (session 13: o_proj's 16 MB x 4 copies partly stayed in L2 and two
    shapes differing only in pipeline stages timed 23.8 and 45.6 us)."""
    return max(COPIES, -(-2 * L2_BYTES // weight_bytes))


def configs(tokens: int):
    """Token-major shapes (5-tuples) whose bf16 x and fp8 weight tiles fit an H100/H200's shared memory, then
    swapped-operand shapes with split-K (6-tuples)."""
    budget = shared_memory_budget(torch.device("cpu"))  # off CUDA: the sm_90 figure
    block_ts = [16] if tokens <= 16 else ([32, 64] if tokens <= 64 else [64, 128])
    for bt, bn, bk, w, s in itertools.product(block_ts, (16, 32, 64, 128), (128, 256, 512), (4,), (3, 4)):
        if bn * bk > 64 * 512 or (bt >= 128 and bn == 16) or (bt * 2 + bn) * bk * s > budget:
            continue
        yield (bt, bn, bk, w, s)
    swap_ts = [16] if tokens <= 16 else ([32] if tokens <= 32 else [64] if tokens <= 64 else [128])
    for bt, bn, bk, s, split in itertools.product(swap_ts, (64, 128), (128, 256, 512), (3, 4), (1, 2, 4, 8)):
        if bn * bk > 128 * 256:
            continue
        yield (bt, bn, bk, 4, s, split)


def check_every_byte(dev: torch.device, widens: list[int]) -> dict:
    """Relative error of each widening on weights made of every finite e4m3 byte, and of subnormals only."""
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    subnormals = torch.tensor([b for b in range(256) if (b & 0x78) == 0], dtype=torch.uint8)
    x = torch.randn(32, 1024, device=dev, dtype=torch.bfloat16)
    scale = torch.rand(64, device=dev) + 0.5
    out = {}
    for name, values in (("every byte", codes), ("subnormals only", subnormals)):
        w = values.repeat(64, 1024 // len(values) + 1)[:, :1024].contiguous().view(torch.float8_e4m3fn).to(dev)
        ref = fp8_linear_ref(x.float(), w, scale).float()
        for widen in widens:
            got = _launch_fp8_linear(x, w, scale, widen=widen, activations="exact").float()
            out[f"{name}, widen {widen}"] = ((got - ref).norm() / ref.norm()).item()
    return out


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--widen", default=None, help="comma list of 0/1/2 (default: the launcher's choice)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    widens = ([int(w) for w in args.widen.split(",")] if args.widen else [default_widen(torch.bfloat16, dev)])
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    report = {"copy_TBps": bw / 1e12, "device": torch.cuda.get_device_name(), "widens": widens,
              "checks": check_every_byte(dev, widens), "rows": []}
    print(json.dumps(report["checks"]), flush=True)
    spin = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, k, n in LINEARS:
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            copies = copies_for(n * k)  # the fp8 weights; the bf16 peer's are twice as large
            ws = [(torch.randn(n, k, device=dev) * 40).to(torch.float8_e4m3fn) for _ in range(copies)]
            scales = [torch.rand(n, device=dev) * 1e-3 + 5e-4 for _ in range(copies)]
            w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ref = fp8_linear_ref(x.float(), ws[0], scales[0]).float()
            default = _fit_shared_memory(_block_sizes(tokens, n, k, dev), 2, shared_memory_budget(dev))
            row = {"tokens": tokens, "linear": name, "floor_us": (n * k + 4 * n) / bw * 1e6, "default": str(default)}
            candidates = {}  # label -> fn(copy index), each checked against the reference first
            for widen in widens:
                for cfg in dict.fromkeys([default, *configs(tokens)]):
                    label = f"widen {widen} {cfg}"
                    try:
                        got = _launch_fp8_linear(x, ws[0], scales[0], config=cfg, widen=widen,
                                                 activations="exact").float()
                    except Exception as exc:  # noqa: BLE001 - a shape that does not compile (shared memory) is skipped
                        row[label] = f"failed: {type(exc).__name__}"
                        continue
                    rel = ((got - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:
                        row[label] = f"wrong: rel {rel:.3g}"
                        continue
                    candidates[label] = (lambda j, cfg=cfg, widen=widen:
                                         _launch_fp8_linear(x, ws[j], scales[j], config=cfg, widen=widen,
                                                            activations="exact"))
            candidates["cublas bf16"] = lambda j: torch.nn.functional.linear(x, w16[j])
            sa = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            xq = (x.float() / sa).to(torch.float8_e4m3fn)
            sbs = [s.view(1, -1) for s in scales]
            got = torch._scaled_mm(xq, ws[0].t(), scale_a=sa, scale_b=sbs[0], out_dtype=torch.bfloat16).float()
            row["w8a8_rel_err"] = ((got - ref).norm() / ref.norm()).item()
            candidates["scaled_mm w8a8"] = lambda j: torch._scaled_mm(xq, ws[j].t(), scale_a=sa, scale_b=sbs[j],
                                                                      out_dtype=torch.bfloat16)
            i = [0]

            def timed(fn) -> float:
                def call():
                    i[0] = (i[0] + 1) % copies
                    fn(i[0])
                return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3

            for _ in range(20):  # clocks up before the first timing
                spin @ spin
            times = {label: [] for label in candidates}
            for _ in range(args.rounds):  # interleaved: a slow moment costs one round of each variant, not one variant
                for label, fn in candidates.items():
                    times[label].append(timed(fn))
            row["us"] = {label: min(t) for label, t in times.items()}
            for widen in widens:
                mine = {lb: t for lb, t in row["us"].items() if lb.startswith(f"widen {widen} ")}
                if mine:
                    best = min(mine, key=mine.get)
                    row[f"widen{widen}_default_us"] = mine.get(f"widen {widen} {default}")
                    row[f"widen{widen}_best"] = [best.split(" ", 2)[2], mine[best]]
            row["cublas_bf16_us"] = row["us"]["cublas bf16"]
            row["scaled_mm_us"] = row["us"]["scaled_mm w8a8"]
            report["rows"].append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "us" and not key.startswith("widen ")}),
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
