"""LoRA delta of one layer at decode batch sizes, Llama-2-7B shapes, r=16: the
model path (``add_lora``: split-K shrink partials summed inside the expand, work-item
list) against the previous path (``lora_shrink`` + ``lora_expand``) and the bytes floor.

Each token has its own adapter up to ``slots`` (round-robin), as in a mixed decode
batch. Timed as replays of a CUDA graph holding 20 calls (the engine replays decode
steps from graphs), checked against the float32 reference first. Also sweeps the
launch parameters of ``add_lora``.

Usage: ``python benchmarks/bench_lora_decode.py [--sweep]``; writes ``$OUT/lora_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, graph_replay_ms, measure_copy_bandwidth, out_dir, print_table  # noqa: E402

from loraplex.engine.models.llama import LinearWithLoRA, LoRABatch  # noqa: E402
from loraplex.kernels import lora_shrink as shrink_mod  # noqa: E402
from loraplex.kernels.lora_linear import ADD_LORA, add_lora_ref  # noqa: E402
from loraplex.kernels.lora_mapping import LoRAMapping  # noqa: E402
from loraplex.kernels.ops import Kernels  # noqa: E402

ops = Kernels("triton")
add_lora = ADD_LORA.triton  # with the launch overrides (split_k, expand_blocks) the sweep uses

# (name, H, slice widths): the four LoRA linears of a Llama-2-7B layer.
LAYERS = [("qkv", 4096, [4096, 4096, 4096]), ("o", 4096, [4096]), ("gate_up", 4096, [11008, 11008]),
          ("down", 11008, [4096])]
RANK = 16
CALLS_PER_GRAPH = 20


def graph_ms(fn) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    return graph_replay_ms([fn] * CALLS_PER_GRAPH, replays=30) / CALLS_PER_GRAPH


def layer_case(h: int, widths: list[int], tokens: int, slots: int):
    dev, dt = torch.device("cuda"), torch.bfloat16
    lora_a = [(torch.randn(slots, RANK, h, device=dev) / h**0.5).to(dt) for _ in widths]
    lora_b = [(torch.randn(slots, w, RANK, device=dev) / RANK**0.5).to(dt) for w in widths]
    scaling = [torch.full((slots,), 2.0, device=dev) for _ in widths]
    mapping = LoRAMapping.from_token_slots((torch.arange(tokens, device=dev) % slots).to(torch.int32))
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    y = torch.randn(tokens, sum(widths), device=dev, dtype=dt)
    distinct = min(tokens, slots)
    nbytes = distinct * RANK * 2 * (h * len(widths) + sum(widths))
    return lora_a, lora_b, scaling, mapping, x, y, nbytes


def check(lora_a, lora_b, scaling, mapping, x, y, **kw) -> float:
    ours, ref = y.clone(), y.to(torch.float32, copy=True)
    add_lora(x, lora_a, lora_b, scaling, ours, mapping, **kw)
    add_lora_ref(x.float(), [a.float() for a in lora_a], [b.float() for b in lora_b], scaling, ref, mapping)
    err = (ours.float() - ref).abs().max().item()
    scale = (ref - y.float()).abs().max().item()
    if err > 0.02 * scale + 0.05:
        raise AssertionError(f"add_lora max error {err} (delta scale {scale}) with {kw}")
    return err


def old_path(lora_a, lora_b, scaling, mapping, x, y) -> None:
    v = ops.lora_shrink(x, lora_a, mapping)
    ops.lora_expand(v, lora_b, scaling, y, mapping)


def layer_times(h, widths, lora_a, lora_b, scaling, mapping, x) -> dict:
    """Whole layer: base GEMM alone and the model's LinearWithLoRA (GEMM, then the LoRA delta)."""
    layer = LinearWithLoRA(h, widths, [f"m{i}" for i in range(len(widths))], False, x.dtype, x.device, ops)
    layer.weight.normal_(0, h**-0.5)
    layer.bind_lora(lora_a, lora_b, scaling)
    batch = LoRABatch(mapping)

    with torch.inference_mode():
        return {"gemm_ms": graph_ms(lambda: torch.nn.functional.linear(x, layer.weight)),
                "serial_ms": graph_ms(lambda: layer(x, batch))}


def run_case(name, h, widths, tokens, slots, copy_bps, sweep: bool) -> dict:
    lora_a, lora_b, scaling, mapping, x, y0, nbytes = layer_case(h, widths, tokens, slots)
    check(lora_a, lora_b, scaling, mapping, x, y0)
    y = y0.clone()  # timed calls accumulate into y; checks use the untouched y0
    floor_ms = nbytes / copy_bps * 1e3
    res = {"layer": name, "tokens": tokens, "slots": slots, "bytes": nbytes, "floor_ms": floor_ms,
           "old_ms": graph_ms(lambda: old_path(lora_a, lora_b, scaling, mapping, x, y)),
           "new_ms": graph_ms(lambda: add_lora(x, lora_a, lora_b, scaling, y, mapping))}
    res.update(layer_times(h, widths, lora_a, lora_b, scaling, mapping, x))
    if sweep:
        res["sweep"] = {}
        for k_chunk in (256, 512, 1024, 2048):
            split = min(-(-h // k_chunk), 32)
            for block_n, n_iters in ((64, 4), (128, 1), (128, 2), (128, 4), (128, 8), (256, 2)):
                kw = dict(split_k=split, expand_blocks=(16, block_n, n_iters))
                check(lora_a, lora_b, scaling, mapping, x, y0, **kw)
                ms = graph_ms(lambda kw=kw: add_lora(x, lora_a, lora_b, scaling, y, mapping, **kw))
                res["sweep"][f"k{k_chunk}-n{block_n}x{n_iters}"] = ms
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    copy_bps = measure_copy_bandwidth()
    results = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "copy_TBps": copy_bps / 1e12,
               "shrink_k_per_split": shrink_mod.SHRINK_K_PER_SPLIT, "cases": []}
    for tokens, slots in ((1, 32), (32, 32), (128, 32), (256, 128)):
        for name, h, widths in LAYERS:
            results["cases"].append(run_case(name, h, widths, tokens, slots, copy_bps, args.sweep))
            print(json.dumps(results["cases"][-1]), flush=True)
    (out_dir() / "lora_decode.json").write_text(json.dumps(results, indent=2))
    rows = []
    for c in results["cases"]:
        best = min(c.get("sweep", {"-": c["new_ms"]}).items(), key=lambda kv: kv[1])
        rows.append([c["layer"], c["tokens"], c["slots"], f"{c['floor_ms'] * 1e3:.1f}", f"{c['old_ms'] * 1e3:.1f}",
                     f"{c['new_ms'] * 1e3:.1f}", f"{best[0]} {best[1] * 1e3:.1f}",
                     f"{c['gemm_ms'] * 1e3:.1f}", f"{c['serial_ms'] * 1e3:.1f}"])
    print_table(f"LoRA delta per layer, bf16 r=16, CUDA-graph replay (commit {results['commit']}, "
                f"{results['device']}, copy {results['copy_TBps']:.2f} TB/s)",
                ["layer", "tokens", "slots", "LoRA floor us", "old us", "new us", "best sweep us", "GEMM us",
                 "GEMM+LoRA us"], rows)


if __name__ == "__main__":
    main()
