"""FP8 linears with split activations (issue 19): launch shapes of the e4m3 GEMM, against W8A16 and cuBLAS bf16.

``fp8_linear``'s split path (``SPLIT_ACTIVATIONS``): the weights go to the e4m3 tensor cores as they are, and each
token's activation row is written once as ``x[t, :] ~= s[t] * (h[t, :] + l[t, :] / 16)`` (two e4m3 terms, ~7
mantissa bits), interleaved so that one e4m3 x e4m3 dot over the ``2T`` rows gives both sums. W8A16 (the weights
widened to bf16 inside the kernel) read the weights at ~0.4 of the copy bandwidth at 32 tokens (session 18).

For T in ``--tokens`` and each Llama-2-7B linear: every GEMM launch shape of a grid (BLOCK_R over the 2T rows,
BLOCK_N, BLOCK_K, warps, stages, SPLIT_K), checked against the exact product (relative error < 1e-2), timed alone;
then the best shape's activation split alone, split + GEMM, and the op as the engine calls it (``fp8_linear`` with
its defaults, buffers allocated per call). Each time is the least of 3 replays of a CUDA graph of back-to-back calls
over rotating weight copies (spanning twice the L2). Peers in the same graphs: W8A16's default launch and cuBLAS
bf16. Usage (CUDA)::

    python benchmarks/diag_fp8_split_act.py [--tokens 1,32,128] [--out FILE]
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
    ActivationSplit,
    _launch_fp8_linear,
    _split_block_sizes,
    fp8_linear_ref,
    fp8_linear_split_ref,
    split_activations,
    split_gemm,
)

LINEARS = (("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096))
L2_BYTES = 60 << 20


class SplitAct:
    """One (T, linear) shape's buffers, so that a CUDA graph captures fixed pointers: the activation split
    (``split_activations``) and the e4m3 GEMM (``split_gemm``) callable apart."""

    def __init__(self, x: torch.Tensor, out_features: int, config: tuple[int, ...]):
        self.x, self.config = x, config
        t, k = x.shape
        self.split = ActivationSplit.empty(t, k, x.device)
        self.out = torch.empty((t, out_features), dtype=x.dtype, device=x.device)

    def quantize(self) -> None:
        split_activations(self.x, self.split)

    def gemm(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return split_gemm(w, self.split, scale, None, self.out, self.config)

    def __call__(self, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.quantize()
        return self.gemm(w, scale)


def graph_us(fns, copies: int, reps: int = 20) -> float:
    """µs per call of ``fns[j]()`` (j over copies), back to back in one CUDA graph, least of 3 rounds."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(fns)))
    return best


def configs(tokens: int):
    block_rs = [16] if 2 * tokens <= 16 else [32] if 2 * tokens <= 32 else [64] if 2 * tokens <= 64 else [128, 256]
    for br, bn, bk, w, s, split in itertools.product(block_rs, (64, 128), (128, 256), (4,), (3, 4, 5), (1, 2, 4)):
        if (bn + br) * bk * s > 200 * 1024:
            continue
        yield (br, bn, bk, w, s, split)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,32,128")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    import triton.testing

    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    bw = 2 * src.numel() / (copy_ms * 1e-3)
    del src, dst
    report = {"copy_TBps": bw / 1e12, "rows": []}
    print(json.dumps(report), flush=True)
    spin = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, k, n in LINEARS:
            torch.manual_seed(0)
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            x[:, 7] *= 30  # an outlier channel, as LLM activations have
            copies = max(4, -(-2 * L2_BYTES // (n * k)))
            ws = [(torch.randn(n, k, device=dev) * 40).to(torch.float8_e4m3fn) for _ in range(copies)]
            scales = [torch.rand(n, device=dev) * 1e-3 + 5e-4 for _ in range(copies)]
            w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
            exact = fp8_linear_ref(x.float(), ws[0], scales[0]).float()
            row = {"tokens": tokens, "linear": name, "floor_us": (n * k + 4 * n) / bw * 1e6, "us": {}, "err": {}}
            for _ in range(10):
                spin @ spin
            w8a16_out = _launch_fp8_linear(x, ws[0], scales[0], activations="exact").float()
            row["err"]["w8a16"] = ((w8a16_out - exact).norm() / exact.norm()).item()
            row["us"]["w8a16 default"] = graph_us(
                [lambda j=j: _launch_fp8_linear(x, ws[j], scales[j], activations="exact") for j in range(copies)],
                copies)
            row["op_us"] = graph_us([lambda j=j: _launch_fp8_linear(x, ws[j], scales[j]) for j in range(copies)],
                                    copies)
            row["us"]["cublas bf16"] = graph_us(
                [lambda j=j: torch.nn.functional.linear(x, w16[j]) for j in range(copies)], copies)
            ref = fp8_linear_split_ref(x, ws[0], scales[0]).float()
            row["err"]["split ref vs exact"] = ((ref - exact).norm() / exact.norm()).item()
            default = _split_block_sizes(tokens, n, k)
            cfgs = list(dict.fromkeys([default, *configs(tokens)]))
            if args.quick:
                cfgs = cfgs[:: max(1, len(cfgs) // 6)]
            best = None
            for cfg in cfgs:
                try:
                    op = SplitAct(x, n, cfg)
                    got = op(ws[0], scales[0]).float()
                except Exception as exc:  # noqa: BLE001 - a shape that does not compile is skipped
                    row["us"][str(cfg)] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
                    continue
                err = ((got - exact).norm() / exact.norm()).item()
                if not err < 1e-2:
                    row["us"][str(cfg)] = f"wrong: {err:.3g}"
                    continue
                row["err"]["split kernel"] = err
                gemm = graph_us([lambda j=j: op.gemm(ws[j], scales[j]) for j in range(copies)], copies)
                row["us"][str(cfg)] = gemm
                if best is None or gemm < best[1]:
                    best = (cfg, gemm, op)
            if best is not None:
                op = best[2]
                row["best"] = [str(best[0]), best[1]]
                row["default"] = [str(default), row["us"].get(str(default))]
                row["quantize_us"] = graph_us([op.quantize], 1, reps=50)
                row["both_us"] = graph_us([lambda j=j: op(ws[j], scales[j]) for j in range(copies)], copies)
            report["rows"].append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "us"}
                             | {"w8a16": row["us"]["w8a16 default"], "cublas": row["us"]["cublas bf16"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
