"""GPU microbenchmarks of the loraplex Triton kernels, checked for correctness before timing.

Usage (on a CUDA machine, from the repository root)::

    python benchmarks/bench_kernels.py            # full shapes (H100/H200-class GPU, ~20 GB)
    python benchmarks/bench_kernels.py --smoke    # tiny shapes; on CPU needs TRITON_INTERPRET=1

Measures, with ``triton.testing.do_bench`` (median of repeated runs):

- decode attention, Llama-3-8B heads (32 query / 8 KV heads, head_dim 128), bf16,
  batch 64, contexts 4096 and 32768: achieved KV-cache bytes/s against a
  device-to-device copy bandwidth measured in the same run;
- prefill attention (causal, no cached prefix), same heads: TFLOP/s against
  ``torch.nn.functional.scaled_dot_product_attention`` on the same shapes;
- LoRA shrink/expand, Llama-2-7B hidden 4096, fused q/k/v (3 x 4096), rank 16,
  32 distinct adapters, 32 decode tokens and 4096 prefill tokens: achieved
  bytes/s (compulsory traffic: activations, the adapters' weights, outputs).

Every case first compares the kernel output with the float32 reference
(``*_ref``) or SDPA and aborts on a mismatch. A table is printed at the end.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.kernels.attention import PAGED_ATTENTION, paged_attention_ref
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_expand import LORA_EXPAND, lora_expand_ref
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import LORA_SHRINK, lora_shrink_ref
from loraplex.kernels.reshape_and_cache import RESHAPE_AND_CACHE

Timer = Callable[[Callable[[], object]], float]  # returns the median time of one call in ms


@dataclass(frozen=True)
class Shapes:
    """Benchmark shapes (``full`` for GPUs, ``smoke`` to exercise the script quickly)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batch: int
    decode_contexts: tuple[int, ...]
    prefill_cases: tuple[tuple[int, int], ...]  # (batch, seq_len)
    lora_hidden: int
    lora_rank: int
    lora_adapters: int
    lora_slices: int
    lora_token_counts: tuple[int, ...]
    copy_bytes: int
    ref_check_seqs: int  # decode sequences checked against the reference


FULL = Shapes(32, 8, 128, 16, 64, (4096, 32768), ((4, 4096), (1, 16384)), 4096, 16, 32, 3, (32, 4096), 1 << 30, 8)
SMOKE = Shapes(4, 2, 16, 8, 3, (20, 45), ((2, 24),), 64, 8, 4, 3, (4, 40), 1 << 16, 3)


@dataclass(frozen=True)
class Result:
    """One row of the final table."""

    kernel: str
    shape: str
    time_ms: float
    achieved: float
    unit: str  # "GB/s" or "TFLOP/s"
    baseline: str
    baseline_value: float

    @property
    def ratio(self) -> float:
        return self.achieved / self.baseline_value if self.baseline_value else float("nan")


def do_bench_median(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, via ``triton.testing.do_bench``."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def wall_clock_median(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall-clock milliseconds per call (for ``--smoke`` on CPU, where do_bench needs a GPU)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int, device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _shuffled_tables(num_seqs: int, blocks_per_seq: int) -> list[list[int]]:
    ids = list(range(num_seqs * blocks_per_seq))
    random.Random(0).shuffle(ids)
    return [ids[b * blocks_per_seq : (b + 1) * blocks_per_seq] for b in range(num_seqs)]


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    if not torch.isfinite(actual).all():
        raise SystemExit(f"{name}: kernel output has NaN/Inf")
    try:
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
    except AssertionError as err:
        raise SystemExit(f"{name}: kernel disagrees with the reference\n{err}") from err


def bench_decode(shapes: Shapes, context: int, device: torch.device, timer: Timer, copy_gbs: float) -> Result:
    """Decode attention over a paged bf16 cache; bytes = the K and V of every context position."""
    b, hq, hkv, d, bs = shapes.decode_batch, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size
    blocks_per_seq = -(-context // bs)
    cache_shape = (b * blocks_per_seq, bs, hkv, d)
    key_cache = torch.empty(cache_shape, dtype=torch.bfloat16, device=device).normal_()
    value_cache = torch.empty(cache_shape, dtype=torch.bfloat16, device=device).normal_()
    meta = AttentionMetadata.build([1] * b, [context] * b, _shuffled_tables(b, blocks_per_seq), bs, device)
    query = torch.randn(b, hq, d, device=device).to(torch.bfloat16)
    scale = d**-0.5
    out = PAGED_ATTENTION.triton(query, key_cache, value_cache, meta, scale)
    n = shapes.ref_check_seqs
    sub = AttentionMetadata.build([1] * n, [context] * n, _shuffled_tables(b, blocks_per_seq)[:n], bs, device)
    _check(
        f"decode ctx={context}", out[:n], paged_attention_ref(query[:n], key_cache, value_cache, sub, scale), 2e-2, 2e-2
    )
    ms = timer(lambda: PAGED_ATTENTION.triton(query, key_cache, value_cache, meta, scale))
    nbytes = 2 * b * context * hkv * d * key_cache.element_size()
    return Result(
        "decode attention",
        f"B={b} ctx={context} H={hq}/{hkv} D={d} bf16",
        ms,
        nbytes / (ms * 1e-3) / 1e9,
        "GB/s",
        "d2d copy",
        copy_gbs,
    )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA over [B, H, S, D]; GQA through ``enable_gqa`` when this torch has it."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True, scale=scale)


def bench_prefill(shapes: Shapes, batch: int, seq_len: int, device: torch.device, timer: Timer) -> list[Result]:
    """Causal prefill from an empty prefix: ours (paged) and SDPA (dense) on the same q/k/v."""
    hq, hkv, d, bs = shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.block_size
    q = torch.randn(batch, seq_len, hq, d, device=device).to(torch.bfloat16)
    k = torch.randn(batch, seq_len, hkv, d, device=device).to(torch.bfloat16)
    v = torch.randn(batch, seq_len, hkv, d, device=device).to(torch.bfloat16)
    blocks_per_seq = -(-seq_len // bs)
    key_cache = torch.zeros((batch * blocks_per_seq, bs, hkv, d), dtype=torch.bfloat16, device=device)
    value_cache = torch.zeros_like(key_cache)
    meta = AttentionMetadata.build(
        [seq_len] * batch, [seq_len] * batch, _shuffled_tables(batch, blocks_per_seq), bs, device
    )
    RESHAPE_AND_CACHE.triton(k.flatten(0, 1), v.flatten(0, 1), key_cache, value_cache, meta.slot_mapping)
    query = q.flatten(0, 1)
    scale = d**-0.5
    ours = PAGED_ATTENTION.triton(query, key_cache, value_cache, meta, scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    dense = _sdpa(qt, kt, vt, scale).transpose(1, 2).flatten(0, 1)
    _check(f"prefill B={batch} S={seq_len}", ours, dense, 2e-2, 2e-2)
    flops = 4 * batch * hq * d * seq_len * (seq_len + 1) / 2  # QK^T and PV over the causal triangle
    ms_ours = timer(lambda: PAGED_ATTENTION.triton(query, key_cache, value_cache, meta, scale))
    ms_sdpa = timer(lambda: _sdpa(qt, kt, vt, scale))
    shape = f"B={batch} S={seq_len} H={hq}/{hkv} D={d} bf16"
    sdpa_tflops = flops / (ms_sdpa * 1e-3) / 1e12
    return [
        Result("prefill attention", shape, ms_ours, flops / (ms_ours * 1e-3) / 1e12, "TFLOP/s", "SDPA", sdpa_tflops),
        Result("prefill SDPA", shape, ms_sdpa, sdpa_tflops, "TFLOP/s", "SDPA", sdpa_tflops),
    ]


def bench_lora(shapes: Shapes, num_tokens: int, device: torch.device, timer: Timer, copy_gbs: float) -> list[Result]:
    """LoRA shrink and expand for fused q/k/v with ``lora_adapters`` distinct adapters (round-robin over tokens)."""
    h, r, s, n = shapes.lora_hidden, shapes.lora_rank, shapes.lora_adapters, shapes.lora_slices
    dt = torch.bfloat16
    lora_a = [(torch.randn(s, r, h, device=device) / h**0.5).to(dt) for _ in range(n)]
    lora_b = [(torch.randn(s, h, r, device=device) / r**0.5).to(dt) for _ in range(n)]
    scaling = [torch.full((s,), 2.0, device=device) for _ in range(n)]
    slots = (torch.arange(num_tokens, device=device) % s).to(torch.int32)
    mapping = LoRAMapping.from_token_slots(slots)
    x = torch.randn(num_tokens, h, device=device).to(dt)
    y = torch.randn(num_tokens, n * h, device=device).to(dt)

    v = LORA_SHRINK.triton(x, lora_a, mapping)
    _check(f"lora_shrink T={num_tokens}", v, lora_shrink_ref(x, lora_a, mapping), 2e-2, 2e-2)
    y_ours, y_ref = y.clone(), y.clone()
    LORA_EXPAND.triton(v, lora_b, scaling, y_ours, mapping)
    lora_expand_ref(v, lora_b, scaling, y_ref, mapping)
    _check(f"lora_expand T={num_tokens}", y_ours, y_ref, 5e-2, 2e-2)

    used = min(s, num_tokens)
    weight_bytes = n * used * r * h * 2
    shrink_bytes = num_tokens * h * 2 + weight_bytes + n * num_tokens * r * 4
    expand_bytes = n * num_tokens * r * 4 + weight_bytes + 2 * num_tokens * n * h * 2
    ms_shrink = timer(lambda: LORA_SHRINK.triton(x, lora_a, mapping))
    y_bench = y.clone()
    ms_expand = timer(lambda: LORA_EXPAND.triton(v, lora_b, scaling, y_bench, mapping))
    shape = f"T={num_tokens} H={h} r={r} adapters={used} slices={n} bf16"
    return [
        Result("lora_shrink", shape, ms_shrink, shrink_bytes / (ms_shrink * 1e-3) / 1e9, "GB/s", "d2d copy", copy_gbs),
        Result("lora_expand", shape, ms_expand, expand_bytes / (ms_expand * 1e-3) / 1e9, "GB/s", "d2d copy", copy_gbs),
    ]


def format_table(results: list[Result]) -> str:
    """The results as a fixed-width text table."""
    header = (
        f"{'kernel':<18} {'shape':<44} {'ms':>9} {'achieved':>10} {'unit':<8} {'baseline':<9} {'base':>9} {'ratio':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.kernel:<18} {r.shape:<44} {r.time_ms:>9.4f} {r.achieved:>10.1f} {r.unit:<8} "
            f"{r.baseline:<9} {r.baseline_value:>9.1f} {r.ratio:>6.2f}"
        )
    return "\n".join(lines)


def run(shapes: Shapes, device: torch.device, timer: Timer) -> list[Result]:
    """All benchmarks of the Triton kernels; returns the table rows."""
    results: list[Result] = []
    copy_gbs = copy_bandwidth_gbs(shapes.copy_bytes, device, timer)
    results.append(
        Result("d2d copy", f"{shapes.copy_bytes / 2**20:.3g} MiB", 0.0, copy_gbs, "GB/s", "d2d copy", copy_gbs)
    )
    for context in shapes.decode_contexts:
        results.append(bench_decode(shapes, context, device, timer, copy_gbs))
        _free(device)
    for batch, seq_len in shapes.prefill_cases:
        results.extend(bench_prefill(shapes, batch, seq_len, device, timer))
        _free(device)
    for num_tokens in shapes.lora_token_counts:
        results.extend(bench_lora(shapes, num_tokens, device, timer, copy_gbs))
    return results


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: set TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device, timer = torch.device("cuda"), do_bench_median
    else:
        if not args.smoke:
            raise SystemExit("bench_kernels: needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
        device, timer = torch.device("cpu"), wall_clock_median
    torch.manual_seed(0)
    results = run(SMOKE if args.smoke else FULL, device, timer)
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
