"""benchmarks/bench_structured.py end to end on CPU with a tiny random model: both runs generate
the same token count, every constrained sequence runs to max_tokens inside the schema's grammar."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_structured as bs  # noqa: E402


def test_vocabulary_is_llama2_like():
    vocab = bs.byte_fallback_vocab(32000)
    assert len(vocab) == len(set(vocab)) == 32000
    assert vocab[:3] == ["<unk>", "<s>", "</s>"] and vocab[3 + 0x0A] == "<0x0A>"
    assert {'{"', '": ', "▁ab", "▁Abc", "A"} <= set(vocab)


def test_tiny_run_writes_comparable_results(tmp_path):
    out = tmp_path / "structured.json"
    result = bs.main(["--tiny", "--batch", "3", "--in-len", "8", "--out-len", "24", "--repeat", "1",
                      "--out", str(out)])
    assert json.loads(out.read_text())["ratio"] == result["ratio"] > 0
    free, constrained = result["runs"]["unconstrained"][0], result["runs"]["json_schema"][0]
    assert free["output_tokens"] == constrained["output_tokens"] == 3 * 24
    assert constrained["finished_by_length"] == 3 and constrained["mask_steps"] == constrained["steps"]
    assert constrained["first_text"].startswith('{"order_id": ')
    assert free["mask_steps"] == 0
