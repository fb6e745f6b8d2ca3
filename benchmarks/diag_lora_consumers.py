"""The kernels that add a folded linear's LoRA expand, over a pool paged by rank (issue 17 goal 4).

Session 23: in a batch of 24 x r8, 4 x r16 and 4 x r64 adapters (8-row pages) the consumers of the folded shrink
(``rms_norm`` after o_proj and down_proj, ``silu_and_mul`` after gate/up, ``rotary_and_cache`` after q/k/v) took
13.2 / 14.5 / 13.7 us per launch against 6.4 / 10.5 / 8.3 for 32 x r16 of the same bytes: a rank-64 token's
programs walk its 8 pages one after another. This times each consumer under each launch setting
(``lora_delta.use_consumer_launch``: the row split, two tiles' pages in one loop, pages loaded together) for both
rank sets, Llama-2-7B shapes, one token per adapter.

Per (consumer, setting, rank set): a CUDA graph of one launch per layer (``--layers`` pools of their own, so the B
pages come from HBM as in a step), launched with PDL as the engine's decode graphs are; us per launch = the least
over ``--rounds`` interleaved rounds of the median replay / layers. Each setting's output on the first layer is
compared with the first setting's (max abs difference reported; the kernel tests check them against the float32
loop). ``--best-out FILE`` writes, per consumer, the setting of least mixed-rank time among those
whose r16 time is within 3% of the first setting's (the engine's settings before this session), as
``bench_decode.py --consumer-launch`` reads it.

Usage: ``python benchmarks/diag_lora_consumers.py [--tokens 32] [--settings ...] [--out F] [--best-out F]`` (CUDA);
``--smoke``: tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (checks only).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import capture_graph, git_commit, replay_ms  # noqa: E402

from loraplex.kernels._triton import pdl_launches  # noqa: E402
from loraplex.kernels.lora_delta import LoRADelta, use_consumer_launch  # noqa: E402
from loraplex.kernels.lora_mapping import LoRAMapping  # noqa: E402
from loraplex.kernels.ops import Kernels  # noqa: E402

MIXED = (8,) * 24 + (16,) * 4 + (64,) * 4  # bench_decode.MIXED_RANKS: adapter i's rank
RANK_SETS = {"mixed": MIXED, "r16": (16,) * 32}
# name: {consumer: use_consumer_launch keywords}; the first is the engine before session 24
SETTINGS = {
    "s23": {"rms_norm": {"row_split": 1, "pages_at_once": 1},
            "silu_and_mul": {"row_split": 1, "paired": False, "pages_at_once": 1},
            "rotary_and_cache": {"paired": False, "pages_at_once": 4}},
    "split4": {"rms_norm": {"row_split": 4, "pages_at_once": 1},
               "silu_and_mul": {"row_split": 4, "paired": False, "pages_at_once": 1}},
    "split2": {"rms_norm": {"row_split": 2, "pages_at_once": 1},
               "silu_and_mul": {"row_split": 2, "paired": True, "pages_at_once": 1}},
    "paired": {"silu_and_mul": {"row_split": 1, "paired": True, "pages_at_once": 1},
               "rotary_and_cache": {"paired": True, "pages_at_once": 4}},
    "paired-p2": {"silu_and_mul": {"row_split": 1, "paired": True, "pages_at_once": 2},
                  "rotary_and_cache": {"paired": True, "pages_at_once": 2}},
    "paired-p1": {"rotary_and_cache": {"paired": True, "pages_at_once": 1}},
    "split4-paired": {"silu_and_mul": {"row_split": 4, "paired": True, "pages_at_once": 1}},
}
CONSUMERS = ("rms_norm", "silu_and_mul", "rotary_and_cache")
LLAMA2 = {"hidden": 4096, "inter": 11008, "heads": 32, "head_dim": 128}
SMOKE = {"hidden": 64, "inter": 96, "heads": 4, "head_dim": 16}


def paged_pool(ranks: tuple[int, ...], page_rows: int, widths: list[int], tokens: int, dtype, device, rng):
    """A pool of ``sum(ranks) / page_rows`` shuffled pages, slot s holding ``ranks[s]`` rank rows, and a
    :class:`LoRADelta` of token t -> slot t (v random: the folded GEMM's extra columns)."""
    pages = [n // page_rows for n in ranks]
    ids = list(range(sum(pages)))
    rng.shuffle(ids)
    width = max(pages)
    table, start = [], 0
    for n in pages:
        table.append(ids[start:start + n] + [-1] * (width - n))
        start += n
    num_pages = len(ids)
    lora_b = [(torch.randn(num_pages, w, page_rows, device=device) * 0.05).to(dtype) for w in widths]
    scaling = [torch.full((len(ranks),), 0.5, device=device) for _ in widths]
    v = torch.randn(len(widths), tokens, num_pages, page_rows, device=device).to(dtype)
    mapping = LoRAMapping.from_token_slots(torch.arange(tokens, dtype=torch.int32, device=device) % len(ranks))
    return LoRADelta(v, lora_b, scaling, mapping, page_table=torch.tensor(table, dtype=torch.int32, device=device),
                     ranks=torch.tensor(ranks, dtype=torch.int32, device=device))


def consumer_call(op: str, shape: dict, ranks, tokens: int, dtype, device, rng, backend: str = "triton"):
    """A no-argument call of consumer ``op`` on fresh inputs over a pool of ``ranks`` (its output returned)."""
    kernels = Kernels(backend)
    hidden, inter, heads, d = shape["hidden"], shape["inter"], shape["heads"], shape["head_dim"]
    if op == "rms_norm":
        delta = paged_pool(ranks, 8, [hidden], tokens, dtype, device, rng)
        x, res = (torch.randn(tokens, hidden, device=device).to(dtype) for _ in range(2))
        w = torch.ones(hidden, device=device, dtype=dtype)
        return lambda: kernels.rms_norm(x, w, 1e-5, res, lora=delta)[0]
    if op == "silu_and_mul":
        delta = paged_pool(ranks, 8, [inter, inter], tokens, dtype, device, rng)
        x = torch.randn(tokens, 2 * inter, device=device).to(dtype)
        return lambda: kernels.silu_and_mul(x, lora=delta)
    width = heads * d
    delta = paged_pool(ranks, 8, [width] * 3, tokens, dtype, device, rng)
    y = torch.randn(tokens, 3 * width, device=device).to(dtype)
    q0, k, v = y.split(width, dim=-1)
    blocks = tokens // 16 + 2
    key_cache = torch.zeros(blocks, 16, heads, d, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(tokens, dtype=torch.int64, device=device)
    positions = torch.full((tokens,), 150, dtype=torch.int64, device=device)
    cos_sin = torch.randn(4096, d, device=device)
    q = q0.clone()

    def call():
        q.copy_(q0)
        kernels.rotary_and_cache(positions, q, k, v, key_cache, value_cache, slots, cos_sin, lora=delta)
        return torch.cat([q, key_cache.flatten()[: tokens * width].view(tokens, width)], dim=1)
    return call


def apply(setting: dict, op: str) -> None:
    use_consumer_launch(op, **setting.get(op, {}))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--best-out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    names = args.settings.split(",")
    if unknown := [n for n in names if n not in SETTINGS]:
        raise SystemExit(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = SMOKE if args.smoke else LLAMA2
    layers = 1 if args.smoke else args.layers
    engine_launch = {op: use_consumer_launch(op) for op in CONSUMERS}
    report = {"commit": git_commit(), "device": "cpu" if args.smoke else torch.cuda.get_device_name(),
              "tokens": args.tokens, "layers": layers, "settings": {n: SETTINGS[n] for n in names}, "rows": []}
    for op in CONSUMERS:
        runs = [n for n in names if op in SETTINGS[n]]
        for set_name, ranks in RANK_SETS.items():
            rng = random.Random(0)
            torch.manual_seed(0)
            calls = [consumer_call(op, shape, ranks, args.tokens, dtype, device, rng) for _ in range(layers)]
            graphs, outs = {}, {}
            for name in runs:
                apply(SETTINGS[name], op)
                try:
                    with pdl_launches(not args.smoke), torch.inference_mode():
                        outs[name] = calls[0]().float().clone()
                        if not args.smoke:
                            graphs[name] = capture_graph(calls)
                finally:  # the engine's settings back (graphs keep the launches they captured)
                    use_consumer_launch(op, **{k: v for k, v in engine_launch[op].items() if v is not None})
            ref = outs[runs[0]]
            row = {"op": op, "ranks": set_name,
                   "max_diff_to_first": {n: float((o - ref).abs().max()) for n, o in outs.items()}}
            if not args.smoke:
                times: dict[str, float] = {}
                for _ in range(args.rounds):
                    for name, graph in graphs.items():
                        graph.replay()
                        times[name] = min(times.get(name, float("inf")), replay_ms(graph, 20) * 1000 / layers)
                row["us"] = times
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.best_out and not args.smoke:
        best = {}
        for op in CONSUMERS:
            mixed = next(r for r in report["rows"] if r["op"] == op and r["ranks"] == "mixed")["us"]
            r16 = next(r for r in report["rows"] if r["op"] == op and r["ranks"] == "r16")["us"]
            first = next(iter(r16))
            ok = [n for n in mixed if r16[n] <= 1.03 * r16[first]]
            best[op] = SETTINGS[min(ok, key=mixed.get)][op]
        report["best"] = best
        Path(args.best_out).write_text(json.dumps(best))
        print("best", json.dumps(best), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
