"""benchmarks/bench_serving.py: the split of a scaling row's time against the base run, and the scaling
part's logic on CPU (a tiny model: its numbers mean nothing, its counts and traces must hold)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serving as bs  # noqa: E402


def test_step_split_sums_prompt_and_decode_steps_apart():
    # (ms, prompt tokens, decode tokens, distinct adapters, installs so far)
    row = [(30.0, 256, 0, 2, 2), (20.0, 128, 2, 3, 3), (5.0, 0, 3, 3, 3), (7.0, 0, 3, 2, 3), (1.0, 0, 0, 0, 3)]
    base = [(25.0, 256, 0, 0, 0), (15.0, 128, 2, 0, 0), (4.0, 0, 3, 0, 0), (4.0, 0, 3, 0, 0)]
    split = bs.step_split(row, base)
    assert split == {
        "prompt_steps_ms": 50.0, "prompt_steps": 2, "base_prompt_steps_ms": 40.0, "base_prompt_steps": 2,
        "prompt_tokens": 384, "base_prompt_tokens": 384,
        "decode_steps_ms": 12.0, "decode_steps": 2, "base_decode_steps_ms": 8.0, "base_decode_steps": 2,
        "decode_mean_distinct_adapters": 2.5, "prompt_step_installs": 3, "decode_step_installs": 0,
        "decode_step_ms_median": 6.0, "base_decode_step_ms_median": 4.0}
    # an install in a decode step counts there (and the installs are per step, not cumulative)
    split = bs.step_split([(5.0, 64, 0, 1, 1), (4.0, 0, 2, 2, 2), (4.0, 0, 2, 2, 2)], base)
    assert (split["prompt_step_installs"], split["decode_step_installs"]) == (1, 1)


def test_step_split_without_decode_steps():
    split = bs.step_split([(9.0, 64, 0, 1, 1)], [(8.0, 64, 0, 0, 0)])
    assert (split["decode_steps"], split["decode_steps_ms"], split["decode_mean_distinct_adapters"]) == (0, 0, 0.0)
    assert split["decode_step_ms_median"] != split["decode_step_ms_median"]  # nan: no decode step to take it from


@pytest.mark.slow
def test_scaling_rows_trace_every_step_on_cpu(tmp_path, monkeypatch):
    """``part_scaling`` with the CPU-check model: every row's split covers all its steps, its decode steps
    carry as many distinct adapters as the row has (at most), and the base runs of the split are the
    rows' references; profiling a row on CPU says why it did not."""
    import torch

    config = dict(bs.LLAMA2_7B, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
    monkeypatch.setitem(bs.RESULTS, "host_cache", "pinned")
    monkeypatch.setitem(bs.RESULTS, "async_scheduling", False)
    monkeypatch.setitem(bs.RESULTS, "gc_freeze", True)  # as the GPU runs: frozen after warm-up
    model_dir = bs.make_model_dir(tmp_path / "model", config)
    torch.manual_seed(0)
    out = bs.part_scaling(model_dir, config, tmp_path, quick=True, counts=[8, 80], cold=False, profile_rows=("8",))
    import gc

    assert gc.get_freeze_count() == 0  # release() unfroze the heap: the engine's cycles can be collected
    # every run computes every prompt token: the 80 row's base run shares its first 64 prompts with the 8 row's
    # (a prefix-cached engine served them from cache: less prefill than the row it is compared with)
    assert out["80"]["split"]["base_prompt_tokens"] == out["80"]["split"]["prompt_tokens"] == 80 * 64
    row = out["8"]
    split = row["split"]
    assert split["prompt_steps"] + split["decode_steps"] <= row["steps"]
    assert split["prompt_steps"] >= 1 and split["decode_steps"] >= 1
    assert 1 <= split["decode_mean_distinct_adapters"] <= 8
    assert split["prompt_step_installs"] + split["decode_step_installs"] == row["lora"]["slot_loads"]
    assert split["base_prompt_steps"] + split["base_decode_steps"] <= row["min_steps"]
    assert row["profile"] == {"error": "no CUDA device to profile"}
    assert split["decode_step_ms_median"] > 0 and split["base_decode_step_ms_median"] > 0


def test_gc_pauses_are_counted_by_generation_while_entered():
    import gc

    with bs.GCPauses() as pauses:
        gc.collect(2)
        gc.collect(2)
    assert pauses._callback not in gc.callbacks
    gc.collect(2)  # after exit: not counted
    summary = pauses.summary()
    assert summary["gen2"][0] == 2
    assert summary["gen2"][1] >= summary["gen2"][2] > 0
    assert summary["total_ms"] == pytest.approx(sum(v[1] for k, v in summary.items() if k.startswith("gen")))
