"""benchmarks/stack_sampler.py: counts each thread's innermost and on-stack functions, per thread name.

Deterministic: the threads under test park in known functions (waiting on events), and samples
are taken with ``sample_once`` (no timing involved)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from stack_sampler import StackSampler, format_report, function_key  # noqa: E402


def _parked_in_inner(started: threading.Event, release: threading.Event) -> None:
    _inner(started, release)


def _inner(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait()


def test_samples_name_each_threads_stack():
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_parked_in_inner, args=(started, release), name="parked-worker")
    worker.start()
    try:
        assert started.wait(30)
        sampler = StackSampler()
        for _ in range(7):
            sampler.sample_once()
    finally:
        release.set()
        worker.join()
    report = sampler.report(top=50)
    entry = report["parked-worker"]
    assert entry["samples"] == 7
    # Innermost Python frame: Event.wait -> Condition.wait in threading.py, on every sample.
    assert len(entry["self"]) == 1 and entry["self"][0][0].endswith("/threading.py:Condition.wait")
    assert entry["self"][0][1] == 1.0 and entry["seconds"] == 7.0  # sample_once credits 1 s by default
    totals = dict((k, v) for k, v in entry["total"])
    here = Path(__file__).parent.name + "/" + Path(__file__).name
    assert totals[f"{here}:_parked_in_inner"] == 1.0 and totals[f"{here}:_inner"] == 1.0
    # The calling thread is never sampled.
    assert threading.current_thread().name not in report
    table = format_report(report, ("parked-worker", "no-such-thread"))
    assert table.startswith("thread 'parked-worker': 7 samples") and "no-such-thread" not in table
    assert f"{here}:_inner | 1.0" in table


def test_function_key_and_interval_check():
    frame = sys._getframe()
    assert function_key(frame) == f"{Path(__file__).parent.name}/{Path(__file__).name}:test_function_key_and_interval_check"
    with pytest.raises(ValueError, match="interval_s=0"):
        StackSampler(interval_s=0)


def test_background_sampling_starts_and_stops():
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_parked_in_inner, args=(started, release), name="parked-worker")
    worker.start()
    assert started.wait(30)
    try:
        with StackSampler(interval_s=0.001) as sampler:
            while sampler.samples["parked-worker"] < 3:  # counts samples, no time bound
                release.wait(0.001)
    finally:
        release.set()
        worker.join()
    assert sampler._thread is None and sampler.samples["parked-worker"] >= 3


def _first_then_second(at_first, go_on, at_second, release) -> None:
    at_first.set()
    go_on.wait()
    _second(at_second, release)


def _second(at_second, release) -> None:
    at_second.set()
    release.wait()


def test_samples_are_weighted_by_the_seconds_they_stand_for():
    """3 s credited while the thread waits in _first_then_second, 1 s while it waits in _second:
    shares 0.75 / 0.25 (a plain sample count would say 0.5 / 0.5)."""
    events = [threading.Event() for _ in range(4)]
    at_first, go_on, at_second, release = events
    worker = threading.Thread(target=_first_then_second, args=events, name="two-phase")
    worker.start()
    try:
        assert at_first.wait(30)
        sampler = StackSampler()
        sampler.sample_once(3.0)
        go_on.set()
        assert at_second.wait(30)
        sampler.sample_once(1.0)
    finally:
        release.set()
        worker.join()
    here = Path(__file__).parent.name + "/" + Path(__file__).name
    total = dict((k, v) for k, v in sampler.report(top=50)["two-phase"]["total"])
    assert total[f"{here}:_first_then_second"] == 1.0
    assert total[f"{here}:_second"] == 0.25
