"""benchmarks/bench_lora_kernels.py on the CPU: its workload, bytes floor, correctness gate and table
(Triton kernels under the interpreter, a call-counting timer instead of CUDA graphs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_lora_kernels as bl  # noqa: E402


def test_workload_has_20_percent_base_tokens_and_round_robin_adapters():
    slots = bl.token_slots(32, 8).tolist()
    assert slots.count(-1) == 6  # round(0.2 * 32)
    assert sorted(s for s in slots if s >= 0) == sorted(i % 8 for i in range(26))
    assert slots != sorted(slots), "positions are shuffled"
    assert bl.token_slots(1, 1).tolist() == [0], "a one-token batch keeps its LoRA token"
    assert bl.token_slots(512, 32).tolist().count(-1) == 102


def test_bytes_floor_of_a_llama2_7b_layer_at_32_tokens_and_32_adapters():
    # per adapter: A 16 x (3*4096 + 4096 + 2*4096 + 11008) + B 16 x (3*4096 + 4096 + 2*11008 + 4096), bf16
    adapter = 2 * 16 * (35584 + 42496)
    # per LoRA token: x of each projection, y read and written
    token = 2 * (23296 + 2 * 42496)
    assert bl.floor_bytes(bl.LLAMA2_7B_LAYER, 26, 32, 16) == 32 * adapter + 26 * token == 85_584_896


def test_qv_targets_leave_k_untargeted_and_out_of_the_floor():
    # a q/v adapter at 256 tokens (205 on 256 adapters, 205 distinct): A and B of q and v only, x once, y of q and v
    adapter = 2 * 16 * (2 * 4096 + 2 * 4096)
    token = 2 * (4096 + 2 * 8192)
    assert bl.floor_bytes(bl.LLAMA2_7B_QV, 205, 205, 16) == 205 * adapter + 205 * token
    (lin,) = bl.make_linears(bl.SMOKE_QV, 5, 3, 4, torch.float32, torch.device("cpu"))
    assert [s.tolist() for s in lin.scaling] == [[bl.SCALING] * 3, [0.0] * 3, [bl.SCALING] * 3]
    mapping = bl.plan_segments(bl.token_slots(5, 3), 3)
    bl.check(lin, mapping, bl.add_lora_ref)
    ref = lin.y0.clone()
    bl.add_lora_ref(lin.x, lin.lora_a, lin.lora_b, lin.scaling, ref, mapping)
    assert torch.equal(ref[:, 24:32], lin.y0[:, 24:32]), "the k slice is untouched"
    assert not torch.equal(ref[:, :24], lin.y0[:, :24])


def test_qv_layer_floor_is_the_qv_floor_and_untargeted_projections_are_left_alone():
    """--targets qv-layer: o, gate_up and down are launched with scaling 0 everywhere; they add no bytes to the floor
    and their outputs stay as they are."""
    assert bl.floor_bytes(bl.LLAMA2_7B_QV_LAYER, 205, 205, 16) == bl.floor_bytes(bl.LLAMA2_7B_QV, 205, 205, 16)
    qkv, down = bl.make_linears(bl.SMOKE_QV_LAYER, 5, 3, 4, torch.float32, torch.device("cpu"))
    assert [s.tolist() for s in down.scaling] == [[0.0] * 3]
    mapping = bl.plan_segments(bl.token_slots(5, 3), 3)
    out = down.y0.clone()
    bl.add_lora_ref(down.x, down.lora_a, down.lora_b, down.scaling, out, mapping)
    assert torch.equal(out, down.y0)


def test_check_rejects_a_wrong_kernel():
    mapping = bl.plan_segments(bl.token_slots(5, 3), 3)
    (lin,) = bl.make_linears(bl.SMOKE_LAYER[:1], 5, 3, 4, torch.float32, torch.device("cpu"))
    bl.check(lin, mapping, bl.add_lora_ref)

    def forgets_scaling(x, a, b, s, y, m):
        bl.add_lora_ref(x, a, b, [t * 0.5 for t in s], y, m)

    with pytest.raises(SystemExit, match="max error"):
        bl.check(lin, mapping, forgets_scaling)


@pytest.mark.interpreter
def test_smoke_run_times_every_implementation_and_prints_the_table(tmp_path, capsys):
    from loraplex.kernels._triton import HAS_TRITON

    if not HAS_TRITON or torch.cuda.is_available():
        pytest.skip("CPU interpreter run")
    out = tmp_path / "lora.json"
    result = bl.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert [(r["tokens"], r["adapters"]) for r in rows] == [(1, 1), (1, 3), (5, 1), (5, 3)]
    assert all(set(r["times_us"]) == {"old", "new", "fused"} for r in rows)
    assert result["vllm"] == "not asked (--vllm)"
    table = capsys.readouterr().out
    assert "| 5 × 3 | 4 |" in table and "| tokens × adapters | LoRA tokens | bytes floor µs | old µs" in table


@pytest.mark.interpreter
def test_sweep_times_every_tile_shape_and_names_the_best(monkeypatch):
    from loraplex.kernels._triton import HAS_TRITON

    if not HAS_TRITON or torch.cuda.is_available():
        pytest.skip("CPU interpreter run")
    calls = []

    def counting_timer(fn):
        calls.append(fn)
        return float(len(calls))  # later configs look slower: the default (timed first) is the best

    result = bl.sweep_fused(bl.SMOKE_LAYER[:1], 5, 3, 4, torch.float32, torch.device("cpu"), counting_timer)
    qkv = result["qkv"]
    assert len(qkv["all"]) == 2 + 3 * 3 * 3 == len(calls)  # default, default with 8 warps, K x N x stages
    assert qkv["best"] == "default" and qkv["best_us"] == qkv["default_us"] == 1e3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_variant_equals_the_reference_with_base_tokens_and_unused_slots(dtype):
    """The cuBLAS-over-every-slot variant (``--dense``): base tokens get nothing, slots no token uses
    contribute nothing, per-slot scalings hold (folded into B), y's slices are updated in place."""
    mapping = bl.plan_segments(torch.tensor([2, -1, 0, 2, -1], dtype=torch.int32), 4)  # slots 1 and 3 unused
    (lin,) = bl.make_linears(bl.SMOKE_LAYER[:1], 5, 4, 4, dtype, torch.device("cpu"))
    lin.scaling = [torch.tensor([0.5, 3.0, 2.0, 7.0]) for _ in lin.lora_b]
    bl.check(lin, mapping, bl.dense_impl())
    ours = lin.y0.clone()
    bl.dense_impl()(lin.x, lin.lora_a, lin.lora_b, lin.scaling, ours, mapping)
    assert torch.equal(ours[[1, 4]], lin.y0[[1, 4]])  # base rows untouched
    assert not torch.equal(ours[[0, 2, 3]], lin.y0[[0, 2, 3]])


def test_dense_variant_stays_right_across_rows_whose_objects_reuse_ids(monkeypatch):
    """One ``dense_impl`` serves every row of the table; each row's mapping and weights are freed before the
    next is made, so the allocator hands their addresses to the next row's tensors. The variant's caches must not serve
    one row's slot mask or weight layout to another (session 8's first GPU run: 7 rows "WRONG", one crash)."""
    monkeypatch.setattr(bl, "KEEP_GOING", False)  # a wrong row raises SystemExit
    fn = bl.dense_impl()
    for tokens, adapters in [(5, 1), (5, 3), (7, 2), (5, 3), (3, 4)] * 3:
        mapping = bl.plan_segments(bl.token_slots(tokens, adapters), max(adapters, 2))
        (lin,) = bl.make_linears(bl.SMOKE_LAYER[:1], tokens, max(adapters, 2), 4, torch.float32,
                                 torch.device("cpu"))
        bl.check(lin, mapping, fn)
        del mapping, lin  # freed: the next row's tensors may take their addresses (the old cache key)
