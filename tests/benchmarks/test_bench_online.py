"""benchmarks/bench_online.py: its statistics against numpy / closed forms, its SSE reading on
synthetic events, and the --quick run end to end on CPU (real app, uvicorn, worker processes),
checked against the server's own counters."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))  # the load-generator processes import bench_online by this path

import bench_online as bo  # noqa: E402

BASE = bo.Target("base", "key-0", "base")


def _result(ttft_s: float, gaps_s: list[float], sent_at: float = 0.0, tokens: int = 4, error: str | None = None):
    finished = sent_at + ttft_s + sum(gaps_s)
    return bo.RequestResult(BASE, sent_at, 0.0, ttft_s=ttft_s, itl_s=list(gaps_s), text_chunks=len(gaps_s) + 1,
                            completion_tokens=tokens, finished_at=finished, error=error)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_linear(n):
    rng = np.random.default_rng(n)
    values = rng.exponential(10.0, n).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert bo.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12)
    assert math.isnan(bo.percentile([], 50))


def test_poisson_offsets_have_exponential_gaps():
    offsets = bo.poisson_offsets_s(random.Random(7), 8.0, 20000)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)  # mean of Exp(8) = 0.125 s
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)   # exponential: std = mean
    assert bo.poisson_offsets_s(random.Random(7), 8.0, 50) == offsets[:50]  # seeded: reproducible
    with pytest.raises(ValueError, match="rate_per_s=0"):
        bo.poisson_offsets_s(random.Random(0), 0, 3)


def test_targets_follow_zipf_with_20_percent_base():
    adapters = [bo.Target(f"a{i}", "k", f"t/a{i}") for i in range(100)]
    base = [bo.Target("base", f"k{i}", "base") for i in range(4)]
    picks = bo.pick_targets(random.Random(3), adapters, base, 40000)
    counts = {t.label: 0 for t in adapters + base[:1]}
    for t in picks:
        counts[t.label] += 1
    assert counts["base"] / len(picks) == pytest.approx(0.2, abs=0.01)
    assert {t.api_key for t in picks if t.model == "base"} == {"k0", "k1", "k2", "k3"}
    weights = [1 / (i + 1) ** 1.1 for i in range(100)]
    for i in (0, 1, 9):  # P(a_i) = 0.8 * w_i / sum(w)
        assert counts[f"t/a{i}"] / len(picks) == pytest.approx(0.8 * weights[i] / sum(weights), rel=0.08)


def test_make_specs_draws_prompts_inside_the_vocabulary():
    specs = bo.make_specs(random.Random(0), [BASE] * 5, [0.0, 0.1, 0.2, 0.3, 0.4], 128, 512)
    assert [len(s.prompt) for s in specs] == [128] * 5
    assert all(10 <= t < 502 for s in specs for t in s.prompt)
    assert bo.requests_per_rate(bo.FULL, 2) == 40 and bo.requests_per_rate(bo.FULL, 64) == 640


def test_stream_recorder_times_text_chunks_and_reads_usage():
    result = bo.RequestResult(bo.Target("a1", "k", "t/a1"), sent_at=10.0, send_lag_s=0.0)
    rec = bo._StreamRecorder(result)

    def chunk(text, model="a1"):
        return json.dumps({"model": model, "choices": [{"index": 0, "text": text, "finish_reason": None}],
                           "usage": None})

    assert rec.event(chunk("t5"), 10.25)
    assert rec.event(chunk(""), 10.26)          # no text: not a token chunk
    assert rec.event(chunk(" t6"), 10.30)
    assert rec.event(chunk(" t7"), 10.32)
    assert rec.event(json.dumps({"model": "a1", "choices": [], "usage": {"completion_tokens": 3}}), 10.33)
    assert not rec.event("[DONE]", 10.34)
    assert result.ttft_s == pytest.approx(0.25)
    assert result.itl_s == pytest.approx([0.05, 0.02])
    assert (result.text_chunks, result.completion_tokens, result.error) == (3, 3, None)

    assert rec.event(chunk(" t8", model="a2"), 10.4)
    assert result.error == "response model 'a2', expected 'a1'"
    failed = bo.RequestResult(BASE, 0.0, 0.0)
    assert not bo._StreamRecorder(failed).event(json.dumps({"error": {"message": "boom"}}), 1.0)
    assert failed.error == "error event: boom"


def test_request_body_asks_for_exactly_n_streamed_tokens():
    spec = bo.RequestSpec(bo.Target("a3", "k", "t/a3"), (11, 12), 0.0)
    assert bo.request_body(spec, 64) == {
        "model": "a3", "prompt": [11, 12], "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


def test_summarize_rate_pools_gaps_and_counts_errors():
    ok = [_result(0.1 * (i + 1), [0.01 * (i + 1)] * 3, sent_at=float(i)) for i in range(10)]
    bad = _result(0.5, [], sent_at=3.0, error="timeout")
    row = bo.summarize_rate(4.0, ok + [bad])
    ttft = [1e3 * r.ttft_s for r in ok]
    itl = [1e3 * g for r in ok for g in r.itl_s]
    span = max(r.finished_at for r in ok) - 0.0
    assert (row["requests"], row["completed"], row["errors"], row["error_examples"]) == (11, 10, 1, ["timeout"])
    assert row["ttft_ms"]["p50"] == pytest.approx(np.percentile(ttft, 50))
    assert row["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttft, 99))
    assert row["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99)) and row["itl_ms"]["count"] == 30
    assert row["achieved_requests_per_s"] == pytest.approx(10 / span)
    assert row["output_tokens_per_s"] == pytest.approx(40 / span)
    assert row["tokens_per_chunk"] == pytest.approx(1.0)
    assert row["requests_by_target"] == {"base": 11}


def _row(rate, ttft_p99, itl_p99, errors=0, requests=10):
    return {"rate_per_s": rate, "requests": requests, "completed": requests - errors, "errors": errors,
            "ttft_ms": {"p99": ttft_p99}, "itl_ms": {"p99": itl_p99}}


def test_slo_and_saturation_rules():
    rows = [_row(2, 300, 20), _row(4, 999, 49.9), _row(8, 1000, 30), _row(16, 400, 50.0), _row(32, 100, 10, 1)]
    assert [bo.meets_slo(r) for r in rows] == [True, True, False, False, False]
    assert bo.highest_passing_rate(rows) == 4
    assert bo.highest_passing_rate([_row(2, 2000, 10)]) is None
    assert "none of [2]" in bo.slo_line(None, [_row(2, 2000, 10)])
    assert bo.saturated(_row(8, 5001, 10)) and bo.saturated(_row(8, 100, 10, errors=2))
    assert bo.saturated(_row(8, math.nan, math.nan, errors=0, requests=0))
    assert not bo.saturated(_row(8, 4999, 200, errors=1))


def test_routing_check_reports_differing_labels():
    rows = [{"requests_by_target": {"t/a1": 3, "base": 2}}, {"requests_by_target": {"t/a1": 1}}]
    assert bo.routing_check(rows, {"t/a1": 4, "base": 2}) == {"labels": 2, "requests": 6, "mismatches": {}}
    assert bo.routing_check(rows, {"t/a1": 3, "base": 2, "t/a9": 1})["mismatches"] == {
        "t/a1": {"sent": 4, "routed": 3}, "t/a9": {"sent": 0, "routed": 1}}


def test_report_of_a_run_that_measured_nothing_still_prints_the_table(capsys):
    result = bo.new_result(bo.QUICK, "cpu", "abc1234")
    bo.report(result, bo.QUICK)
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[0].startswith("### Online serving via REST, 12 adapters r=16") and "abc1234" in lines[0]
    assert lines[1].startswith("| rate req/s | achieved req/s | out tok/s | TTFT p50 ms")
    assert lines[-1].endswith(": none of [] req/s")


def test_wheel_list_pins_every_direct_server_dependency_once():
    lines = [ln for ln in (BENCH_DIR / "online_wheels.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    pins = dict(ln.split("==") for ln in lines)
    assert len(pins) == len(lines) and all(re.fullmatch(r"[0-9][0-9a-z.]*", v) for v in pins.values())
    for name in ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "pydantic-settings", "sqlalchemy",
                 "alembic", "prometheus-client", "python-multipart", "httpx"):
        assert name in pins, name
    assert not {"torch", "numpy", "transformers", "triton", "gradio"} & pins.keys()


@pytest.mark.slow
def test_quick_run_end_to_end_matches_server_counters(tmp_path, capsys):
    out = tmp_path / "online.json"
    result = bo.main(["--quick", "--rates", "1.5,3", "--no-engine-process", "--out", str(out)])
    assert json.loads(out.read_text())["rates"] == json.loads(json.dumps(result["rates"]))
    profile = bo.QUICK
    rows = result["rates"]
    assert [r["rate_per_s"] for r in rows] == [1.5, 3.0] and result["skipped_rates"] == []
    for row in rows:
        n = bo.requests_per_rate(profile, row["rate_per_s"])
        assert (row["requests"], row["completed"], row["errors"]) == (n, n, 0), row["error_examples"]
        # the engine generated exactly what the clients counted, and read nothing from disk while measured
        assert row["engine"]["generated_tokens_total"] == n * profile.output_tokens
        assert row["engine"]["prompt_tokens_total"] == n * profile.prompt_tokens
        assert row["engine"]["disk_loads"] == 0
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
        chunks = n * profile.output_tokens / row["tokens_per_chunk"]
        assert row["itl_ms"]["count"] == round(chunks) - n  # one gap per text chunk after the first
        assert row["achieved_requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        assert {"loraplex-engine", "uvicorn", "process"} <= set(row["server_cpu"])  # the engine is a thread here
    # every adapter was used by the warm-up; the server routed each label as often as it was sent
    assert result["routing"]["mismatches"] == {}
    assert result["routing"]["labels"] == profile.num_adapters + 1
    assert result["engine_totals"]["disk_loads"] == profile.num_adapters
    expected_best = bo.highest_passing_rate(rows)
    assert result["best_rate_per_s"] == expected_best
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("highest rate with TTFT p99 < 1000 ms and ITL p99 < 50 ms")
    assert printed[-3].startswith("| 1.5 ") and printed[-2].startswith("| 3 ")


def test_emulated_gpu_with_the_engine_process_end_to_end(tmp_path, capsys):
    """``--emulate-gpu-ms`` (the GPU profile's workload, device time slept) through the engine process
    (the default, as the server's): it generated what the clients counted, and its CPU is reported
    beside the event loop's."""
    out = tmp_path / "online.json"
    result = bo.main(["--quick", "--emulate-gpu-ms", "2", "--rates", "4", "--seconds-per-rate", "2", "--out", str(out)])
    profile = dataclasses.replace(bo.FULL, seconds_per_rate=2.0)
    (row,) = result["rates"]
    n = bo.requests_per_rate(profile, 4)
    assert (row["requests"], row["completed"], row["errors"]) == (n, n, 0), row["error_examples"]
    assert row["engine"]["generated_tokens_total"] == n * bo.FULL.output_tokens
    assert row["engine"]["prompt_tokens_total"] == n * bo.FULL.prompt_tokens
    assert {"engine-process", "uvicorn", "process"} <= set(row["server_cpu"])
    assert "loraplex-engine" not in row["server_cpu"]  # no engine thread in the server process
    assert all(v["busy"] > 0 and v["us_per_token"] > 0 for v in row["server_cpu"].values())
    assert result["routing"]["mismatches"] == {}
    assert "engine process, GPU emulated (2 ms steps)" in capsys.readouterr().out


def test_online_wheels_cover_every_module_level_import_of_the_benchmark():
    """benchmarks/online_wheels.txt is what the GPU machine (no FastAPI there) gets: every third-party
    distribution imported at module level by the modules ``bench_online`` loads (loraplex's, the
    benchmark's own) is listed there or on the image's ``gpu-image:`` line. Session 8's GPU run died on
    ``import sse_starlette``, a runtime import the list still called unneeded."""
    import ast
    import importlib.metadata
    import subprocess

    # The loraplex modules a fresh interpreter loads for bench_online's server (this process has whatever
    # the other tests imported: the console, the CLI).
    probe = ("import sys, loraplex.platform.main\n"
             "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items())\n"
             "                 if n.startswith('loraplex') and getattr(m, '__file__', None)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=BENCH_DIR.parent,
                          timeout=300)
    assert done.returncode == 0, f"importing the server failed:\n{done.stderr[-3000:]}"
    loaded = done.stdout.split()
    text = (BENCH_DIR / "online_wheels.txt").read_text()
    listed = {line.split("==")[0].strip().lower() for line in text.splitlines() if "==" in line
              and not line.startswith("#")}
    image = next(line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("# gpu-image:"))
    provided = listed | {name.lower() for name in image}
    owners = importlib.metadata.packages_distributions()
    files = [Path(f) for f in loaded] + [BENCH_DIR / "bench_online.py", BENCH_DIR / "common.py"]
    assert any(f.name == "completions.py" for f in files), "the probe did not load the API routes"
    missing: dict[str, str] = {}
    for path in files:
        for stmt in ast.parse(path.read_text()).body:  # module level only (function bodies import lazily)
            for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top in sys.stdlib_module_names or top in ("loraplex", "__future__", "common", "bench_serving"):
                        continue
                    for dist in owners.get(top, [top]):
                        if dist.lower().replace("_", "-") not in provided:
                            missing[dist] = str(path)
    assert "fastapi" in listed and "torch" in provided  # the parse found both lists
    assert not missing, f"imported at module level but neither in online_wheels.txt nor on the image: {missing}"


def test_engine_counters_wait_for_the_snapshot_sent_behind_the_last_outputs():
    """A window's engine counters are read once the gateway holds a snapshot of the idle engine with at least the
    tokens its clients received: the clients see a request's last output before the reader thread takes the
    snapshot sent after it (CI: a burst's last 55 tokens were counted in the next rate's window)."""
    def snapshot(generated: int, running: int) -> dict:
        return {"num_running": running, "num_waiting": 0, "generated_tokens_total": generated,
                "prompt_tokens_total": 0, "num_preemptions": 0, "lora": {}}

    # what the gateway holds at each read: a busy snapshot, the idle one of before the window, then the fresh one
    held = [snapshot(50, 3), snapshot(40, 0), snapshot(40, 0), snapshot(52, 0)]

    class Engine:
        def stats_dict(self):
            return held.pop(0) if len(held) > 1 else held[0]

    ctx = type("Ctx", (), {"engine": Engine()})()
    before = {"generated_tokens_total": 40}
    results = [_result(0.1, [0.01] * 5, tokens=6), _result(0.1, [0.01] * 5, tokens=6), _result(0.1, [], error="x")]
    after = bo.settled_engine_counters(ctx, before, results, timeout_s=30.0)
    assert after["generated_tokens_total"] == 52 and held == [snapshot(52, 0)]
    # without the fresh snapshot it gives up after its timeout with what there is
    held[:] = [snapshot(40, 0)]
    assert bo.settled_engine_counters(ctx, before, results, timeout_s=0.0)["generated_tokens_total"] == 40
