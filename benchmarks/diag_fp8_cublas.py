"""FP8 split-activation GEMMs: the Triton kernel against cuBLAS's e4m3 GEMM with row-wise scales (issue 19).

``fp8_linear``'s split path writes each token's activations as two e4m3 rows, ``x[t] ~= s[t] * (h[t] + l[t] / 16)``
(``ActivationSplit``: ``q [T, 2, K]``, ``s [T]``), and its Triton GEMM sums both rows' products in the epilogue. The
same product from cuBLAS: ``torch._scaled_mm(q.view(2T, K), w.t(), scale_a=[s, s / 16] per row, scale_b=scale[n])``
gives ``Y [2T, N]`` bf16 (row-wise scaling outputs bf16 only), and ``out[t] = Y[2t] + Y[2t + 1]``. At 128 tokens the
Triton GEMM runs at ~0.4 of the copy bandwidth (870 TFLOPS at gate_up, session 27); is cuBLAS's faster there?

For T in ``--tokens`` and each Llama-2-7B linear: µs per call (least of 3 replays of a CUDA graph of back-to-back
calls over weight copies spanning twice the L2) of the Triton split GEMM (default launch shape), ``_scaled_mm``
alone (fast accumulation off and on), and ``_scaled_mm`` plus the pair sum; each one's relative error against the
exact product of the e4m3 weights and the bf16 activations. Usage (CUDA)::

    python benchmarks/diag_fp8_cublas.py [--tokens 32,64,128,256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import measure_copy_bandwidth  # noqa: E402
from diag_fp8_split_act import L2_BYTES, LINEARS, graph_us  # noqa: E402

from loraplex.kernels.fp8_linear import (  # noqa: E402
    ActivationSplit,
    _split_block_sizes,
    fp8_linear_ref,
    split_activations,
    split_gemm,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,64,128,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(1 << 30)
    report = {"copy_TBps": bw / 1e12, "rows": []}
    print(json.dumps(report), flush=True)
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, k, n in LINEARS:
            torch.manual_seed(0)
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            x[:, 7] *= 30
            copies = max(4, -(-2 * L2_BYTES // (n * k)))
            ws = [(torch.randn(n, k, device=dev) * 40).to(torch.float8_e4m3fn) for _ in range(copies)]
            scales = [torch.rand(n, device=dev) * 1e-3 + 5e-4 for _ in range(copies)]
            scales_b = [s.view(1, n) for s in scales]
            exact = fp8_linear_ref(x.float(), ws[0], scales[0]).float()
            split = ActivationSplit.empty(tokens, k, dev)
            split_activations(x, split)
            out = torch.empty((tokens, n), dtype=torch.bfloat16, device=dev)
            config = _split_block_sizes(tokens, n, k)
            rows = split.q.view(2 * tokens, k)
            scale_a = torch.stack((split.s, split.s * 0.0625), 1).reshape(2 * tokens, 1).contiguous()

            def err(got):
                return ((got.float() - exact).norm() / exact.norm()).item()

            row = {"tokens": tokens, "linear": name, "floor_us": (n * k + 4 * n) / bw * 1e6, "us": {}, "err": {}}
            row["err"]["triton"] = err(split_gemm(ws[0], split, scales[0], None, out, config))
            row["us"]["triton"] = graph_us(
                [lambda j=j: split_gemm(ws[j], split, scales[j], None, out, config) for j in range(copies)], copies)
            for fast in (False, True):
                key = "cublas fast" if fast else "cublas"
                try:
                    y = torch._scaled_mm(rows, ws[0].t(), scale_a=scale_a, scale_b=scales_b[0],
                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
                except Exception as exc:  # noqa: BLE001 - reported, the row goes on
                    row["us"][key] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    continue
                row["err"][key] = err(y.view(tokens, 2, n).sum(1, dtype=torch.float32))
                row["us"][key] = graph_us(
                    [lambda j=j: torch._scaled_mm(rows, ws[j].t(), scale_a=scale_a, scale_b=scales_b[j],
                                                  out_dtype=torch.bfloat16, use_fast_accum=fast)
                     for j in range(copies)], copies)
                row["us"][key + " + pair sum"] = graph_us(
                    [lambda j=j: torch.sum(torch._scaled_mm(rows, ws[j].t(), scale_a=scale_a, scale_b=scales_b[j],
                                                            out_dtype=torch.bfloat16,
                                                            use_fast_accum=fast).view(tokens, 2, n), 1, out=out)
                     for j in range(copies)], copies)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
