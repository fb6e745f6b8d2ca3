"""benchmarks/sim_placement.py with its TINY config: the adapter-aware router keeps more requests'
adapters resident on the GPU than random routing (counted requests, seeded, so deterministic),
every request of the trace is served, and the same seed gives the same numbers."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import sim_placement as sp  # noqa: E402


def test_trace_is_seeded_and_zipf_skewed():
    trace = sp.make_trace(sp.TINY, 4)
    assert trace == sp.make_trace(sp.TINY, 4)
    assert len(trace) == 4 * sp.TINY.requests_per_replica
    assert all(a.arrival_s < b.arrival_s for a, b in zip(trace, trace[1:]))
    counts = [sum(r.adapter == i for r in trace) for i in range(3)]
    assert counts[0] > counts[1] > counts[2] > 0  # the most popular adapters come first
    assert trace != sp.make_trace(replace(sp.TINY, seed=1), 4)


def test_adapter_aware_beats_random_on_gpu_hits(tmp_path):
    out = tmp_path / "sim.json"
    report = sp.main(["--tiny", "--replicas", "1", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    results = {(r["replicas"], r["policy"]): r for r in report["results"]}
    counted = int(8 * sp.TINY.requests_per_replica * (1 - sp.TINY.warmup_fraction))
    assert all(r["requests"] == counted for (n, _), r in results.items() if n == 8)
    # One replica: routing has no choice, so every policy sees the same run.
    assert len({(r["gpu_hits"], r["p99_delay_ms"]) for (n, _), r in results.items() if n == 1}) == 1
    aware, rand = results[8, "adapter-aware"], results[8, "random"]
    assert (aware["gpu_hits"], rand["gpu_hits"]) == (403, 133)
    assert aware["gpu_hits"] > 2 * rand["gpu_hits"]
    assert aware["p99_delay_ms"] < rand["p99_delay_ms"]
    assert sp.main(["--tiny", "--replicas", "1", "8"]) == report  # deterministic with the seed


def test_adapter_aware_router_tiers():
    sim = sp.Simulation(sp.TINY, 3, "adapter-aware")
    r0, r1, r2 = sim.replicas
    r0.gpu[7] = 0
    r1.host[7] = None
    assert sim.route(7) is r0  # resident in a GPU slot first
    r0.waiting.extend([sp.Request(i, 0.0, 1, 1.0) for i in range(sp.TINY.max_batch)])  # r0 saturated
    assert sim.route(7) is r1  # then the host cache
    r1.running = 2
    assert sim.route(7) is r1  # still the host cache, although r2 is less loaded
    assert sim.route(8) is r2  # no replica holds 8: one with a free slot, the least loaded
    for adapter, replica in enumerate((r1, r2)):  # fill every slot of r1 and r2 with running adapters
        replica.gpu.update({100 + 10 * adapter + i: 1 for i in range(sp.TINY.gpu_slots)})
    r2.running = 3
    assert sim.route(8) is r1  # no free slot anywhere open: the least loaded open replica
    r1.running = r2.running = sp.TINY.max_batch + 1
    assert sim.route(7) is r0  # every replica saturated: the least loaded of all
