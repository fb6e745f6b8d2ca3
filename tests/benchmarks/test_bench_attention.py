"""benchmarks/bench_attention.py on CPU: grid/byte accounting, config sweep, L2 rotation sizing, a tiny run
under the Triton interpreter that checks every config against the reference and writes the report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_attention as ba  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30


def test_grid_and_kv_bytes_match_the_issue():
    assert ba.CONTEXTS == (128, 1024, 4096, 32768) and ba.BATCHES == (1, 32, 128, 256)
    llama2 = ba.Case(ba.MODELS["llama2"], 128, 32, 16)
    assert llama2.kv_bytes == 64 * MIB  # 32 seqs x 128 positions x 16 KiB (K+V, 32 heads x 128 x bf16)
    llama3 = ba.Case(ba.MODELS["llama3"], 32768, 256, 16)
    assert llama3.kv_bytes == 32 * GIB and llama3.group == 4


def test_rotation_layers_cover_l2_and_respect_the_budget():
    assert ba.rotation_layers(2 * MIB, 256 * MIB, 256, 66 * GIB) == 128  # 2 MiB calls: 256 MiB read per replay
    assert ba.rotation_layers(512 * 1024, 256 * MIB, 256, 66 * GIB) == 256  # call cap: 128 MiB, still > L2
    assert ba.rotation_layers(64 * MIB, 256 * MIB, 256, 66 * GIB) == 4
    assert ba.rotation_layers(32 * GIB, 256 * MIB, 256, 66 * GIB) == 1
    assert ba.rotation_layers(64 * GIB, 256 * MIB, 256, 66 * GIB) == 1  # Llama-2 heads, 32k x 128
    assert ba.rotation_layers(128 * GIB, 256 * MIB, 256, 66 * GIB) == 0  # Llama-2 heads, 32k x 256: skipped
    assert ba.rotation_layers(10 * MIB, 256 * MIB, 256, 30 * MIB) == 3  # budget caps the rotation


def test_sweep_lists_default_first_without_duplicates():
    cpu = torch.device("cpu")
    mha = ba.sweep_configs(ba.Case(ba.SMOKE_MODELS["llama2"], 70, 3, 8), cpu, "sweep")
    assert len(mha) == len(set(mha)) > 4
    assert not mha[0].use_dot  # one-row FMA tiles for MHA by default, 16-row dot tiles swept too
    assert {c.use_dot for c in mha} == {True, False}
    assert {c.block_n for c in mha} == {16, 32}
    gqa = ba.sweep_configs(ba.Case(ba.SMOKE_MODELS["llama3"], 70, 3, 8), cpu, "sweep")
    assert all(c.use_dot for c in gqa) and len({c.num_splits for c in gqa}) > 1
    assert ba.sweep_configs(ba.Case(ba.SMOKE_MODELS["llama3"], 70, 3, 8), cpu, "default") == gqa[:1]


def test_sweep_keeps_the_default_grid_order(monkeypatch):
    """The swept tiles run in the default config's grid order (head-major for MHA on CUDA), so the sweep compares
    tiles, not grid orders; ``--head-major`` adds the other order, each config once."""
    from dataclasses import replace

    real = ba.decode_config
    monkeypatch.setattr(ba, "decode_config", lambda *a: replace(real(*a), head_major=True))
    configs = ba.sweep_configs(ba.Case(ba.SMOKE_MODELS["llama2"], 70, 3, 8), torch.device("cpu"), "sweep")
    assert len(configs) > 4 and all(c.head_major for c in configs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton loads")
def test_smoke_run_checks_every_config_and_writes_the_report(tmp_path):
    out = tmp_path / "attention.md"
    rows = ba.main(["--smoke", "--configs", "default", "--contexts", "20,70", "--batches", "3", "--out", str(out)])
    assert [(r.model, r.context, r.batch) for r in rows] == [
        ("tiny-MHA", 20, 3), ("tiny-MHA", 70, 3), ("tiny-GQA", 20, 3), ("tiny-GQA", 70, 3)]
    assert all(r.us > 0 and r.frac_copy > 0 and r.is_default for r in rows)
    assert rows[1].kv_mib * MIB == pytest.approx(2 * 3 * 70 * 2 * 16 * 2)  # K+V, 3 seqs x 70 x 2 KV heads x 16, bf16
    text = out.read_text()
    assert "| tiny-GQA | 70 | 3 |" in text and text.count("fraction of copy bandwidth") == 2
    raw = json.loads(Path(str(out) + ".json").read_text())
    assert len(raw["rows"]) == 4 and raw["copy_gbs"] > 0
    assert [(m["decodes"], m["chunk"]) for m in raw["mixed"]] == [(3, 9), (3, 9)]
    assert all(m["mixed_launcher_us"] > 0 and m["prefill_kernel_only_us"] > 0 for m in raw["mixed"])
    assert "| tiny-GQA | 3 x 20 | 9 @ 30 |" in text


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton loads")
def test_over_budget_case_is_skipped_and_a_wrong_kernel_aborts(tmp_path, monkeypatch):
    rows = ba.main(["--smoke", "--configs", "default", "--contexts", "20", "--batches", "3", "--models", "llama3",
                    "--max-kv-gib", str(1000 / GIB), "--no-mixed", "--out", str(tmp_path / "a.md")])
    assert rows[0].us is None and rows[0].note.startswith("skipped")
    real = ba.paged_decode_attention
    monkeypatch.setattr(ba, "paged_decode_attention", lambda *a, **k: real(*a, **k).mul_(1.5))
    with pytest.raises(SystemExit, match="disagrees with the reference"):
        ba.main(["--smoke", "--configs", "default", "--contexts", "20", "--batches", "1", "--models", "llama3",
                 "--no-mixed", "--out", str(tmp_path / "b.md")])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton loads")
def test_head_major_flag_adds_the_other_grid_order_once(tmp_path):
    rows = ba.main(["--smoke", "--configs", "default", "--head-major", "--heads-per-program", "1", "--contexts", "20",
                    "--batches", "3", "--models", "llama2", "--no-mixed", "--out", str(tmp_path / "a.md")])
    assert len(rows) == 2 and sorted(r.config.endswith(" hm") for r in rows) == [False, True]
