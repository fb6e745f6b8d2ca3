"""FP8 (W8A16) linear launch shapes on the GPU: the Llama-2-7B layer's four linears at decode token counts.

For T in (1, 32, 128) and each linear (qkv 4096->12288, o 4096->4096, gate_up 4096->22016, down
11008->4096): every launch shape of a grid (BLOCK_T, BLOCK_N, BLOCK_K, warps, stages; and for the
swapped-operand kernel, whose weight tile is the dot's M side, also SPLIT_K) is checked against
the float32 reference (relative error < 1e-2), then timed with ``triton.testing.do_bench`` (median, µs,
rotating over weight copies that span at least twice the L2, :func:`copies_for`). Reported per (T, linear): the
default shape, the best, the bytes floor (weight bytes + scales at the copy bandwidth measured here) and
cuBLAS's bf16 ``F.linear`` of the same shape as the peer. Usage: ``python benchmarks/bench_fp8_linear.py
[--out FILE]`` (CUDA).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.kernels.fp8_linear import _block_sizes, _launch_fp8_linear, fp8_linear_ref  # noqa: E402

LINEARS = (("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096))
TOKENS = (1, 32, 128)
COPIES = 4
L2_BYTES = 60 << 20  # H100/H200 L2 is 50/60 MB: the rotated copies of a linear span at least twice that


def copies_for(weight_bytes: int) -> int:
    """Weight copies to rotate so that a call never finds its weights in L2: at least :data:`COPIES`, and at least
    ``2 * L2_BYTES`` of the smallest copies (session 13: o_proj's 16 MB x 4 copies partly stayed in L2 and two
    shapes differing only in pipeline stages timed 23.8 and 45.6 us)."""
    return max(COPIES, -(-2 * L2_BYTES // weight_bytes))


def configs(tokens: int):
    """Token-major shapes (5-tuples), then swapped-operand shapes with split-K (6-tuples)."""
    block_ts = [16] if tokens <= 16 else ([32, 64] if tokens <= 64 else [64, 128])
    for bt, bn, bk, w, s in itertools.product(block_ts, (16, 32, 64, 128), (256, 512), (4,), (3, 4)):
        if bn * bk > 64 * 512 or (bt >= 128 and bn == 16):
            continue
        yield (bt, bn, bk, w, s)
    swap_ts = [16] if tokens <= 16 else ([32] if tokens <= 32 else [64] if tokens <= 64 else [128])
    for bt, bn, bk, s, split in itertools.product(swap_ts, (64, 128), (128, 256, 512), (3, 4), (1, 2, 4, 8)):
        if bn * bk > 128 * 256:
            continue
        yield (bt, bn, bk, 4, s, split)


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    results = []
    for tokens in TOKENS:
        for name, k, n in LINEARS:
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            copies = copies_for(n * k)  # the fp8 weights; the bf16 peer's are twice as large
            ws = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
            scales = [torch.rand(n, device=dev) + 0.5 for _ in range(copies)]
            w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            ref = fp8_linear_ref(x.float(), ws[0], scales[0]).float()
            floor_us = (n * k + 4 * n) / bw * 1e6
            i = [0]

            def timed(fn) -> float:
                def call():
                    i[0] = (i[0] + 1) % copies
                    fn(i[0])
                return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median") * 1e3

            default = _block_sizes(tokens, n, k, dev)
            times = {}
            for cfg in dict.fromkeys([default, *configs(tokens)]):
                try:
                    out = _launch_fp8_linear(x, ws[0], scales[0], config=cfg).float()
                except Exception as exc:  # noqa: BLE001 - a shape that does not compile (shared memory) is skipped
                    times[str(cfg)] = f"failed: {type(exc).__name__}"
                    continue
                rel = ((out - ref).norm() / ref.norm()).item()
                if not rel < 1e-2:
                    times[str(cfg)] = f"wrong: rel {rel:.3g}"
                    continue
                times[str(cfg)] = timed(lambda j, cfg=cfg: _launch_fp8_linear(x, ws[j], scales[j], config=cfg))
            cublas = timed(lambda j: torch.nn.functional.linear(x, w16[j]))
            ok = {c: t for c, t in times.items() if isinstance(t, float)}
            best = min(ok, key=ok.get)
            row = {"tokens": tokens, "linear": name, "floor_us": floor_us, "default": str(default),
                   "default_us": times[str(default)], "best": best, "best_us": ok[best], "cublas_bf16_us": cublas,
                   "all": times}
            results.append(row)
            swap = {c: t for c, t in ok.items() if c.count(",") == 5}
            row["best_swap"] = min(swap, key=swap.get) if swap else None
            row["best_swap_us"] = swap[row["best_swap"]] if swap else None
            print(f"T={tokens:4d} {name:8s} floor {floor_us:7.1f} default {row['default_us']:7.1f} "
                  f"best {ok[best]:7.1f} {best}  best swapped {row['best_swap_us'] or float('nan'):7.1f} "
                  f"{row['best_swap']}  cublas-bf16 {cublas:7.1f}", flush=True)
    out = {"copy_TBps": bw / 1e12, "device": torch.cuda.get_device_name(), "rows": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
