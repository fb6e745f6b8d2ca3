"""RoPE + KV-cache write per layer: the fused ``rotary_and_cache`` launch against the launches it replaced,
timed by CUDA-graph replay (issue 16).

Usage (on a CUDA machine, from the repository root)::

    python benchmarks/bench_rotary_cache.py --out rotary_cache.md      # ~1 min
    python benchmarks/bench_rotary_cache.py --smoke --out /tmp/r.md     # tiny shapes; on CPU set TRITON_INTERPRET=1

Cases: Llama-2-7B heads (32 query / 32 KV heads, head_dim 128) and Llama-3-8B heads (32 / 8), bf16, KV block
size 16, tokens per step 1, 32, 128, 256 (decode batches) and 2048 (a prefill chunk). Variants, each over
q/k/v as row-strided views of one fused qkv output, as the model has them:

- ``before``: what the model ran until issue 16: ``q.contiguous()``, ``k.contiguous()``, ``rotary_embedding``,
  ``reshape_and_cache`` (4 kernels);
- ``two launches``: ``rotary_embedding`` in place on the views, then ``reshape_and_cache`` (2 kernels);
- ``fused``: one ``rotary_and_cache`` (q rotated in place, k and v into the cache).

Each variant first checks its cache and rotated q against the fused kernel's (aborts on a mismatch), then
one CUDA graph runs it for 32 layers in turn (each layer its own qkv and caches, as in a model step) and is
replayed; the table gives microseconds per layer (median of 3 timings of >= 10 ms) and the saving per
32-layer step against ``before``. Written to ``--out`` (markdown) and ``--out``.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import GraphTimer  # noqa: E402

from loraplex.kernels.reshape_and_cache import RESHAPE_AND_CACHE  # noqa: E402
from loraplex.kernels.rotary import ROTARY_EMBEDDING, compute_cos_sin_cache, rope_inv_freq  # noqa: E402
from loraplex.kernels.rotary_and_cache import ROTARY_AND_CACHE  # noqa: E402

HEADS = {"Llama-2-7B": (32, 32, 128), "Llama-3-8B": (32, 8, 128)}
SMOKE_HEADS = {"tiny-MHA": (2, 2, 16), "tiny-GQA": (4, 1, 16)}
TOKENS = (1, 32, 128, 256, 2048)
SMOKE_TOKENS = (1, 5)
VARIANTS = ("before", "two launches", "fused")


@dataclass
class Row:
    model: str
    tokens: int
    variant: str
    kernels_per_layer: int
    us_per_layer: float
    step_saving_us: float  # 32 layers x (before - this)


@dataclass
class Layer:
    """One layer's step inputs: fused qkv output, its q/k/v views, and the layer's caches."""

    qkv: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor

    def views(self, hq: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv.split([hq * d, hkv * d, hkv * d], dim=-1)


def make_layers(num_layers: int, tokens: int, hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype,
                device: torch.device) -> tuple[list[Layer], torch.Tensor, torch.Tensor]:
    """Layers, positions (as at context ~128) and a shuffled slot mapping over ``ceil(T / bs) + 1`` blocks."""
    num_blocks = -(-tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    positions = torch.arange(128, 128 + tokens, device=device)
    layers = [Layer(torch.randn(tokens, (hq + 2 * hkv) * d, device=device).to(dtype),
                    torch.zeros(num_blocks, block_size, hkv, d, device=device, dtype=dtype),
                    torch.zeros(num_blocks, block_size, hkv, d, device=device, dtype=dtype))
              for _ in range(num_layers)]
    return layers, positions, slots


def variant_call(variant: str, layer: Layer, positions: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                 hq: int, hkv: int, d: int) -> Callable[[], torch.Tensor]:
    """One layer's call of ``variant``; returns the rotated q. (Rotating in place again and again only
    rotates further: the timing does not care, the check runs each variant once on fresh inputs.)"""
    t = layer.qkv.shape[0]
    q, k, v = layer.views(hq, hkv, d)

    def before() -> torch.Tensor:
        qc, kc = q.contiguous(), k.contiguous()
        ROTARY_EMBEDDING.triton(positions, qc, kc, cache, d)
        RESHAPE_AND_CACHE.triton(kc.view(t, hkv, d), v.reshape(t, hkv, d), layer.key_cache, layer.value_cache, slots)
        return qc

    def two_launches() -> torch.Tensor:
        ROTARY_EMBEDDING.triton(positions, q, k, cache, d)
        RESHAPE_AND_CACHE.triton(k.view(t, hkv, d), v.reshape(t, hkv, d), layer.key_cache, layer.value_cache, slots)
        return q

    def fused() -> torch.Tensor:
        return ROTARY_AND_CACHE.triton(positions, q, k, v, layer.key_cache, layer.value_cache, slots, cache)

    return {"before": before, "two launches": two_launches, "fused": fused}[variant]


KERNELS = {"before": 4, "two launches": 2, "fused": 1}


def check_variants(tokens: int, hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, cache: torch.Tensor) -> None:
    """Each variant on the same fresh inputs gives the fused kernel's q and caches (within an ulp or two)."""
    base, positions, slots = make_layers(1, tokens, hq, hkv, d, block_size, dtype, device)
    if int(positions.max()) >= cache.shape[0]:
        raise ValueError(f"positions reach {int(positions.max())} but the cos/sin cache has {cache.shape[0]} positions")
    results = {}
    for variant in VARIANTS:
        layer = Layer(base[0].qkv.clone(), base[0].key_cache.clone(), base[0].value_cache.clone())
        q = variant_call(variant, layer, positions, slots, cache, hq, hkv, d)()
        results[variant] = (q.clone(), layer.key_cache, layer.value_cache)
    q0, k0, v0 = results["fused"]
    for variant, (q, k, v) in results.items():
        if not torch.equal(v, v0):
            raise SystemExit(f"{variant}: value cache differs from the fused kernel's")
        try:
            torch.testing.assert_close(q.float(), q0.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(k.float(), k0.float(), atol=2e-2, rtol=2e-2)
        except AssertionError as err:
            raise SystemExit(f"{variant}: differs from the fused kernel\n{err}") from err


def wall_clock_timer(calls: list[Callable[[], object]]) -> float:
    """Microseconds per call, wall clock, one pass (``--smoke`` on CPU)."""
    for call in calls:
        call()
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def run(heads: dict[str, tuple[int, int, int]], token_counts: tuple[int, ...], num_layers: int,
        device: torch.device, timer: Callable[[list[Callable[[], object]]], float],
        dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> list[Row]:
    rows = []
    for model, (hq, hkv, d) in heads.items():
        cache = compute_cos_sin_cache(rope_inv_freq(d, 10000.0), 4096, device=device)
        for tokens in token_counts:
            check_variants(tokens, hq, hkv, d, block_size, dtype, device, cache)
            layers, positions, slots = make_layers(num_layers, tokens, hq, hkv, d, block_size, dtype, device)
            times = {}
            for variant in VARIANTS:
                calls = [variant_call(variant, layer, positions, slots, cache, hq, hkv, d) for layer in layers]
                times[variant] = timer(calls)
            for variant in VARIANTS:
                rows.append(Row(model, tokens, variant, KERNELS[variant], times[variant],
                                32 * (times["before"] - times[variant])))
            del layers
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| model | tokens | variant | kernels / layer | µs / layer | saving per 32-layer step, µs |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.tokens} | {r.variant} | {r.kernels_per_layer} | {r.us_per_layer:.2f} | "
                     f"{r.step_saving_us:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: set TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (and .json beside it)")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device, timer = torch.device("cuda"), GraphTimer()
    else:
        if not args.smoke:
            raise SystemExit("bench_rotary_cache: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device, timer = torch.device("cpu"), wall_clock_timer
    torch.manual_seed(0)
    rows = run(SMOKE_HEADS if args.smoke else HEADS, SMOKE_TOKENS if args.smoke else TOKENS,
               2 if args.smoke else 32, device, timer)
    table = format_table(rows)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
        args.out.with_suffix(args.out.suffix + ".json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
