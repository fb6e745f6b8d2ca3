"""benchmarks/bench_decode.py: the floor's byte counts for Llama-2-7B, the kernel classes, and the logic on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_decode as bd  # noqa: E402


def test_floor_bytes_for_llama2_7b():
    # r=16 on all 7 projections, bf16: 32 layers x 16 x (4 x (4096 + 4096) + 3 x (4096 + 11008)) x 2 bytes
    assert bd.adapter_bytes(bd.LLAMA2_7B) == 79_953_920
    # 6.74e9 parameters less 31,999 of the embedding's 32,000 rows
    assert bd.weight_bytes(bd.LLAMA2_7B, 1) == 2 * (6_738_415_616 - 31_999 * 4096)
    # FP8 linears: 6.48e9 weights at 1 byte + a float32 scale per output channel (32 x 42,496)
    linears = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    assert bd.weight_bytes(bd.LLAMA2_7B, 1, fp8_linears=True) == (
        2 * (6_738_415_616 - 31_999 * 4096 - linears) + linears + 4 * 32 * 42_496)
    # 0.5 MiB of K and V per token of context
    assert bd.kv_bytes(bd.LLAMA2_7B, 32, 160) == 32 * 160 * 524_288


def test_profile_summary_counts_steps_from_a_marker_kernel_and_skips_step_annotations():
    """GPU busy is the kernels' union over their span (the profiler's ``ProfilerStep#`` range on the GPU timeline,
    which covers the idle gap, is not a kernel); per-step times divide by the steps the marker kernel's launches
    count (3 launches at 2 a step: 1.5 steps), not by the window's step calls."""
    from types import SimpleNamespace as NS
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end))

    events = [ev("ProfilerStep#2", 0, 50), ev("_paged_decode_kernel", 0, 10), ev("_dense_linear_kernel", 10, 20),
              ev("_paged_decode_kernel", 20, 30), ev("_paged_decode_kernel", 40, 50), ev("aten::mm", 0, 50, cpu)]
    summary = bd.summarize_profile(NS(events=lambda: events), 4, step_marker=("_paged_decode_kernel", 2))
    assert summary["gpu_busy"] == pytest.approx(40 / 50)
    assert summary["profiled_steps"] == 1.5
    assert summary["attention_ms"] == pytest.approx(0.030 / 1.5) and summary["gemm_ms"] == pytest.approx(0.010 / 1.5)
    assert summary["idle_large_us_per_step"] == pytest.approx(10 / 1.5) and summary["kernels"] == 4
    assert bd.summarize_profile(NS(events=lambda: events), 4)["attention_ms"] == pytest.approx(0.030 / 4)


def test_kernel_classes():
    assert [bd.kernel_class(n) for n in ("_fused_lora_kernel", "_lora_shrink_kernel", "_dora_scale",
                                         "nvjet_tst_64x8_64x16_2x1_v_bz_TNT", "sm90_xmma_gemm_bf16",
                                         "_paged_decode_kernel", "_paged_prefill_kernel", "_rms_norm_kernel",
                                         "_rotary_and_cache_kernel")] == \
        ["lora", "lora", "lora", "gemm", "gemm", "attention", "attention", "other", "other"]


def test_quick_run_times_decode_steps_of_every_row(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU logic check; a GPU runs the real benchmark")
    result = bd.main(["--quick", "--batches", "1", "3", "--out-len", "6", "--async-modes", "off,on",
                      "--out", str(tmp_path / "d.json")])
    rows = result["rows"]
    assert [(r["batch"], r["kind"], r["async"]) for r in rows] == [
        (b, k, m) for m in ("off", "on") for b in (1, 3) for k in bd.KINDS]
    # 6 output tokens: 1 prefill launch + 5 decode launches; the first decode gap and the last two returns are
    # left out, so at least 2 decode-only gaps are timed in every row
    assert all(r["decode_steps_timed"] >= 2 and r["step_ms"] > 0 for r in rows)
    assert all(r["of_base"] == 1.0 for r in rows if r["kind"] == "base")
    assert (tmp_path / "d.json").exists()


def test_adapter_type_bytes_for_llama2_7b():
    lora = bd.adapter_bytes(bd.LLAMA2_7B)
    # DoRA: a float32 magnitude per output channel of the 7 projections, 32 layers
    assert bd.kind_adapter_bytes(bd.LLAMA2_7B, "dora") == lora + 4 * 32 * (4 * 4096 + 2 * 11008 + 4096)
    # LoRA on the head (A [16, 4096], B [32000, 16]) and the embedding's B [4096, 16]
    assert bd.kind_adapter_bytes(bd.LLAMA2_7B, "vocab") == lora + 2 * 16 * (4096 + 32000 + 4096)
    # a modules_to_save copy of lm_head: [32000, 4096] bf16 = 262 MB
    assert bd.kind_adapter_bytes(bd.LLAMA2_7B, "head-copy") == lora + 2 * 32000 * 4096
    assert bd.kind_adapter_bytes(bd.LLAMA2_7B, "mixed") == lora


def test_adapter_type_files_are_what_the_engine_reads_them_as(tmp_path):
    """The benchmark's DoRA / vocabulary-LoRA / head-copy adapters pass the engine's header checks as those
    types (so their rows measure what they are named after)."""
    from common import make_random_adapter

    from loraplex.adapters import BaseModelSpec, inspect_peft_adapter
    from transformers import LlamaConfig

    config = dict(bd.LLAMA2_7B, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512)
    spec = BaseModelSpec.from_hf_config(LlamaConfig(**{k: v for k, v in config.items()
                                                       if k not in ("architectures", "model_type", "torch_dtype")}))
    layouts = {kind: inspect_peft_adapter(make_random_adapter(tmp_path / kind, config, 16, 0, **kw), spec, 16)
               for kind, (_, kw, _) in bd.ADAPTER_KINDS.items()}
    assert layouts["dora"].config.use_dora and not layouts["mixed"].config.use_dora
    assert len(layouts["dora"].modules) == len(layouts["mixed"].modules) == 2 * 7
    assert [plan.module for plan in layouts["vocab"].vocab_lora] == ["embed_tokens", "lm_head"]
    assert [module for module, _ in layouts["head-copy"].full_modules] == ["lm_head"]
    assert not layouts["mixed"].vocab_lora and not layouts["mixed"].full_modules


def test_quick_run_of_the_adapter_type_rows(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU logic check; a GPU runs the real benchmark")
    result = bd.main(["--quick", "--batches", "3", "--out-len", "6", "--async-modes", "off",
                      "--kinds", "base,dora,vocab,head-copy", "--out", str(tmp_path / "d.json")])
    assert [r["kind"] for r in result["rows"]] == ["base", "dora", "vocab", "head-copy"]
    assert all(r["decode_steps_timed"] >= 2 and r["step_ms"] > 0 for r in result["rows"])
    with pytest.raises(SystemExit, match="unknown"):
        bd.main(["--quick", "--kinds", "base,qlora"])


def test_pdl_trigger_policies_name_every_kernel_op():
    import importlib

    ops = {importlib.import_module(f"loraplex.kernels.{m}")._OP for m in bd.PDL_MODULES}
    assert bd.pdl_trigger_spec("start") == "start" and bd.pdl_trigger_spec("exit") == "exit"
    late, mixed = bd.pdl_trigger_spec("late"), bd.pdl_trigger_spec("mixed")
    assert set(late) == set(mixed) == ops
    assert late["dense_linear"] == late["paged_decode_attention"] == mixed["dense_linear"] == "late"
    assert late["rms_norm"] == "exit" and mixed["rms_norm"] == "start"


def test_diag_pdl_quick_run_compares_every_variant(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU logic check; a GPU runs the real diagnosis")
    import diag_pdl

    report = diag_pdl.main(["--quick", "--batches", "1,3", "--out", str(tmp_path / "p.json")])
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    # on the CPU no launch uses PDL, so every variant's forward is the same computation
    assert all(r["equal_to_off"] == {name: True for name in diag_pdl.VARIANTS} for r in report["rows"])


@pytest.mark.interpreter
def test_diag_lora_consumers_smoke_run_compares_every_setting():
    """benchmarks/diag_lora_consumers.py on CPU (tiny shapes, one token per adapter of the mixed-rank set, its
    rank-64 tokens split): every setting's output equals the first's, and the engine's settings come back."""
    if torch.cuda.is_available():
        pytest.skip("the CPU logic check; a GPU runs the real diagnosis")
    import diag_lora_consumers as dlc

    from loraplex.kernels.lora_delta import use_consumer_launch

    before = {op: use_consumer_launch(op) for op in dlc.CONSUMERS}
    report = dlc.main(["--smoke", "--tokens", "32", "--settings", "s23,split2,paired-p2"])
    assert [(r["op"], r["ranks"]) for r in report["rows"]] == [
        (op, ranks) for op in dlc.CONSUMERS for ranks in ("mixed", "r16")]
    for row in report["rows"]:
        assert len(row["max_diff_to_first"]) >= 2
        assert max(row["max_diff_to_first"].values()) < 1e-4, row
    assert {op: use_consumer_launch(op) for op in dlc.CONSUMERS} == before
