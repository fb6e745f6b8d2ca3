"""benchmarks/bench_fairness.py on the CPU with a tiny random model: both policies serve the
same requests (every output token accounted to its tenant), and while all tenants are
backlogged the fair policy serves the 40%-share tenant no more than FCFS does and the
10%-share tenant no less."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_fairness as bf  # noqa: E402


def test_tiny_run_accounts_every_token_and_compares_policies(tmp_path):
    out = tmp_path / "fairness.json"
    results = bf.main(["--tiny", "--out", str(out), "--requests", "48"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    requests = bf.workload(__import__("random").Random(0), 48, 16, bf.TINY["vocab_size"], 2)
    per_tenant = Counter(tenant for tenant, _, _ in requests)
    for policy in ("fcfs", "fair"):
        (run,) = results["runs"][policy]
        assert run["errors"] == 0 and run["requests"] == 48
        assert run["output_tokens_served"] == {t: 8 * n for t, n in per_tenant.items()}
        assert all(v >= 0 for v in run["queued_s_p99"].values())
    fcfs, fair = (results["runs"][p][0]["output_tokens_while_all_backlogged"] for p in ("fcfs", "fair"))
    assert sum(fair.values()) > 0 and sum(fcfs.values()) > 0
    share = {p: {t: v / sum(r.values()) for t, v in r.items()} for p, r in (("fcfs", fcfs), ("fair", fair))}
    assert share["fair"]["t1"] <= share["fcfs"]["t1"] and share["fair"]["t4"] >= share["fcfs"]["t4"]
    assert results["fair_over_fcfs"] == results["median_output_tokens_per_s"]["fair"] / \
        results["median_output_tokens_per_s"]["fcfs"]
    assert results["goal_met"] == (results["fair_over_fcfs"] >= 0.97)
