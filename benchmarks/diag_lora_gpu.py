"""Localise the GPU-only add_lora mismatch (RESULTS.md, session 5): each LoRA kernel alone against float32.

Prints one line per case: max |err| and the delta scale, for shrink partials (summed), expand fed the
reference v, the two-kernel add_lora and the fused kernel, over T, S, slice count, split_k and dtype.
Usage: ``python benchmarks/diag_lora_gpu.py`` (CUDA).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loraplex.kernels.lora_expand import _launch_lora_expand, lora_expand_ref  # noqa: E402
from loraplex.kernels.lora_fused import FUSED_LORA  # noqa: E402
from loraplex.kernels.lora_linear import ADD_LORA  # noqa: E402
from loraplex.kernels.lora_mapping import plan_segments  # noqa: E402
from loraplex.kernels.lora_shrink import lora_shrink_ref, shrink_partials  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def case(tokens, slots, widths, hidden, rank, dtype, split_k=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = min(round(0.2 * tokens), tokens - 1)
    ts = torch.tensor([-1] * base + [i % slots for i in range(tokens - base)], dtype=torch.int32)
    ts = ts[torch.randperm(tokens, generator=gen)].to(DEV)
    m = plan_segments(ts, slots)
    x = torch.randn(tokens, hidden, generator=gen).to(DEV, dtype)
    y = torch.randn(tokens, sum(widths), generator=gen).to(DEV, dtype)
    a = [(torch.randn(slots, rank, hidden, generator=gen) / hidden**0.5).to(DEV, dtype) for _ in widths]
    b = [(torch.randn(slots, w, rank, generator=gen) / rank**0.5).to(DEV, dtype) for w in widths]
    s = [torch.full((slots,), 2.0, device=DEV) for _ in widths]
    af, bf = [t.float() for t in a], [t.float() for t in b]
    v_ref = lora_shrink_ref(x.float(), af, m)
    lora_rows = (ts >= 0).nonzero().flatten()
    out = {}
    # shrink partials, summed, on LoRA rows
    p = shrink_partials(x, a, m, split_k=split_k)
    v = p.sum(0)
    out["shrink"] = ((v[:, lora_rows] - v_ref[:, lora_rows]).abs().max().item(), v_ref.abs().max().item())
    # expand fed the reference v (3-D), bf16 y
    ref = y.float().clone()  # y.float() of a float32 y is y itself
    lora_expand_ref(v_ref, bf, s, ref, m)
    delta = (ref - y.float()).abs().max().item()
    ours = y.clone()
    _launch_lora_expand(v_ref.contiguous(), b, s, ours, m)
    out["expand3d"] = ((ours.float() - ref).abs().max().item(), delta)
    ours = y.clone()
    _launch_lora_expand(p, b, s, ours, m)
    out["expand(p)"] = ((ours.float() - ref).abs().max().item(), delta)
    ours = y.clone()
    ADD_LORA.triton(x, a, b, s, ours, m, fused=False, split_k=split_k)
    out["two-kernel"] = ((ours.float() - ref).abs().max().item(), delta)
    ours = y.clone()
    FUSED_LORA.triton(x, a, b, s, ours, m)
    out["fused"] = ((ours.float() - ref).abs().max().item(), delta)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return out


def main() -> None:
    print(torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
    bad = 0
    grid = itertools.product((1, 2, 16, 17, 300), (1, 4), ((4096, 4096, 4096), (4096,), (11008, 11008)),
                             (torch.bfloat16, torch.float16, torch.float32), (None, 1, 2))
    for tokens, slots, widths, dtype, split_k in grid:
        if split_k is not None and (dtype != torch.bfloat16 or len(widths) != 3):
            continue
        r = case(tokens, slots, widths, 4096, 16, dtype, split_k)
        flags = [k for k, (e, d) in r.items() if not e <= 0.03 * d + 0.05]
        bad += bool(flags)
        print(f"T={tokens:4d} S={slots} widths={len(widths)}x{widths[0]} {str(dtype)[6:]:8s} split={split_k} "
              + " ".join(f"{k}={e:.3g}/{d:.3g}" for k, (e, d) in r.items()) + (f"  BAD {flags}" if flags else ""),
              flush=True)
    print("bad cases:", bad)


if __name__ == "__main__" and "--bench-repro" not in sys.argv:
    main()


def bench_repro() -> None:
    """bench_lora_kernels' first row exactly (seed 0, its copy-bandwidth probe, its tensors): per-kernel errors
    and where the two-kernel path's error sits; then the same after poisoning freed device memory with NaN."""
    import bench_lora_kernels as blk

    for poison in (False, True):
        torch.manual_seed(0)
        blk.copy_bandwidth(DEV)
        if poison:
            # freed at once: the caching allocator hands this NaN-filled memory out next
            torch.full(((4 << 30) if DEV.type == "cuda" else 1024,), float("nan"), device=DEV)
        lins = blk.make_linears(blk.LLAMA2_7B_LAYER, 1, 1, 16, torch.bfloat16, DEV)
        m = plan_segments(blk.token_slots(1, 1).to(DEV), 1)
        for lin in lins:
            af, bf = [t.float() for t in lin.lora_a], [t.float() for t in lin.lora_b]
            v_ref = lora_shrink_ref(lin.x.float(), af, m)
            p = shrink_partials(lin.x, lin.lora_a, m)
            ref = lin.y.to(torch.float32, copy=True)
            lora_expand_ref(v_ref, bf, lin.scaling, ref, m)
            res = {}
            for name, fn in (("two-kernel", lambda y: ADD_LORA.triton(lin.x, lin.lora_a, lin.lora_b, lin.scaling, y, m,
                                                                    fused=False)),
                             ("expand(v_ref)", lambda y: _launch_lora_expand(v_ref, lin.lora_b, lin.scaling, y, m)),
                             ("expand(p)", lambda y: _launch_lora_expand(p, lin.lora_b, lin.scaling, y, m)),
                             ("fused", lambda y: FUSED_LORA.triton(lin.x, lin.lora_a, lin.lora_b, lin.scaling, y, m))):
                ours = lin.y.clone()
                fn(ours)
                if DEV.type == "cuda":
                    torch.cuda.synchronize()
                err = (ours.float() - ref).abs()
                bad = (err > 0.1).nonzero()
                res[name] = f"{err.max().item():.3g} bad={bad.shape[0]} cols={bad[:6, 1].tolist()}"
            vp = (p.sum(0) - v_ref).abs().max().item()
            print(f"poison={poison} {lin.name}: shrink {vp:.3g} p.shape={tuple(p.shape)} " + " | ".join(
                f"{k}: {v}" for k, v in res.items()), flush=True)


if __name__ == "__main__" and "--bench-repro" in sys.argv:
    bench_repro()
