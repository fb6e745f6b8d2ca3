"""A decode layer's GEMMs with their neighbours inside (``dense_linear``'s norm / gated activation / residual add)
against the GEMMs and the separate kernels, 32 layers in a CUDA graph.

Issue 16: a Llama decode layer runs 2 RMSNorm (+ residual add) kernels and a SiLU-and-mul kernel beside its four
GEMMs, ~0.2 ms of a 5 ms step at batch 32. Fused (``LlamaForCausalLM.fuses_decode_layers``): qkv_proj takes the input
norm, o_proj the residual add, gate_up_proj the post-attention norm, down_proj the activation and the residual add.
Each linear of Llama-2-7B (or Llama-3-8B) over 32 distinct weight copies, captured in one graph and replayed:

- ``separate``: the table's plain launch (``MEASURED_CONFIGS``) plus the kernel the fusion replaces (``rms_norm`` with
  its residual add for qkv and gate_up, ``silu_and_mul`` for down; o's add is in the next norm, so nothing);
- ``fused``: the fused launch with every launch shape of ``diag_dense_linear.configs`` (token-major and GEMV; the
  table's own shape too), each checked against the reference first.

Times are the least of ``--rounds`` rounds (median of 10 replays each). ``--table F`` writes the best fused launch per
(token bucket, shape, fusion) where it beats ``separate`` (``dense_linear.FUSED_CONFIGS`` rows).
Usage (CUDA): ``python benchmarks/diag_fused_linear.py [--tokens 1,32] [--models llama2] [--out F] [--table F]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import graph_replay_ms  # noqa: E402
from diag_dense_linear import MODELS, configs  # noqa: E402
from loraplex.kernels._triton import device_name  # noqa: E402
from loraplex.kernels.dense_linear import (  # noqa: E402
    FUSIONS,
    TOKEN_BUCKETS,
    _launch_dense_linear,
    dense_linear_config,
    dense_linear_ref,
    fused_configs_to_json,
)
from loraplex.kernels.ops import Kernels  # noqa: E402

LAYERS = 32
FUSION_OF = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "gated+residual"}


def fusion_kwargs(fusion: str, g: torch.Tensor, residual: torch.Tensor) -> dict:
    if fusion == "norm":
        return {"norm_weight": g, "norm_eps": 1e-5}
    if fusion == "residual":
        return {"residual": residual}
    return {"activation": "silu", "residual": residual}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--models", default="llama2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    kernels = Kernels("triton")
    dev = torch.device("cuda")
    name = device_name(dev)
    report, table = {"device": name, "rows": []}, {}
    for model in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            layer = {"separate": 0.0, "fused_table": 0.0, "fused_best": 0.0}
            for lin, k, n in MODELS[model]:
                fusion = FUSION_OF[lin]
                ws = [(torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16) for _ in range(LAYERS)]
                g = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
                residual = torch.randn(tokens, n, device=dev, dtype=torch.bfloat16)
                x = torch.randn(tokens, 2 * k if "gated" in fusion else k, device=dev, dtype=torch.bfloat16)
                kw = fusion_kwargs(fusion, g, residual)
                plain_cfg = dense_linear_config(tokens, n, k, torch.bfloat16, dev)
                h = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
                xs = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
                if fusion == "norm":
                    def small():
                        return kernels.rms_norm(h, g, 1e-5, xs)
                elif "gated" in fusion:
                    def small():
                        return kernels.silu_and_mul(x)
                else:
                    small = None
                calls = []
                for w in ws:
                    if small is not None:
                        calls.append(small)
                    calls.append(lambda w=w: _launch_dense_linear(xs, w, config=plain_cfg))
                separate = min(graph_replay_ms(calls, warm_replays=3) for _ in range(args.rounds)) * 1e3 / LAYERS
                want = dense_linear_ref(x, ws[0], **kw).float()
                mag = want.abs().max().item()
                results = []
                candidates = [(c[0], c[1]) for c in configs(tokens) if c[0] in ("tm", "gemv")]
                if plain_cfg is not None:
                    candidates.insert(0, (plain_cfg[0], plain_cfg[1:]))
                for kind, cfg in dict.fromkeys(candidates):
                    config = (kind, *cfg)
                    try:
                        got = _launch_dense_linear(x, ws[0], config=config, **kw).float()
                    except Exception as exc:  # noqa: BLE001 - a shape that does not compile is reported, not fatal
                        results.append({"config": config, "error": str(exc)[:200]})
                        continue
                    err = (got - want).abs().max().item() / max(mag, 1.0)
                    if err > 2e-2:
                        results.append({"config": config, "error": f"relative error {err:.3g}"})
                        continue
                    us = min(graph_replay_ms([lambda w=w, c=config: _launch_dense_linear(x, w, config=c, **kw)
                                              for w in ws], warm_replays=3) for _ in range(args.rounds)) * 1e3 / LAYERS
                    results.append({"config": config, "us": us})
                timed = [r for r in results if "us" in r]
                if not timed:
                    raise SystemExit(f"{model} T={tokens} {lin}: no fused launch ran: {results[:3]}")
                best = min(timed, key=lambda r: r["us"])
                table_us = next((r["us"] for r in timed if plain_cfg and r["config"] == plain_cfg), float("nan"))
                row = {"model": model, "tokens": tokens, "linear": lin, "fusion": fusion, "N": n, "K": k,
                       "separate_us": separate, "plain_config": plain_cfg, "fused_table_us": table_us,
                       "best": best, "results": results}
                report["rows"].append(row)
                layer["separate"] += separate
                layer["fused_table"] += table_us
                layer["fused_best"] += best["us"]
                print(f"{model} T={tokens} {lin:7s} {fusion:15s} separate {separate:6.1f} us | fused, table's "
                      f"{plain_cfg}: {table_us:6.1f} | best {best['config']}: {best['us']:6.1f}", flush=True)
                bucket = next(b for b in TOKEN_BUCKETS if tokens <= b)
                if best["us"] < separate:
                    table[(name, bucket, n, k, fusion)] = tuple(best["config"])
                del ws
            print(f"{model} T={tokens} layer: separate {layer['separate']:.1f} us, fused with the table's launches "
                  f"{layer['fused_table']:.1f}, fused best {layer['fused_best']:.1f}", flush=True)
    path = Path(args.out) if args.out else out_dir / "fused_linear.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    if args.table:
        Path(args.table).write_text(fused_configs_to_json(table))


if __name__ == "__main__":
    assert set(FUSION_OF.values()) <= set(FUSIONS)
    main()
