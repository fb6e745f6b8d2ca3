"""A sampling profiler of this process's Python threads, for finding where a server's host time goes.

Every ``interval_s`` a daemon thread reads every other thread's current stack
(``sys._current_frames``, the method of py-spy and of the standard library's ``faulthandler``,
without ptrace) and counts, per thread name, one *self* sample for the innermost frame's function
and one *total* sample for each distinct function on the stack. A thread blocked in a C call
(``select``, a lock, a CUDA synchronize) shows that call's Python caller as its innermost frame,
so idle time is visible as such (e.g. ``threading.py:wait``). The sampler needs the GIL for each
sample, so it runs when another thread releases it: at a blocking call or at the interpreter's
switch interval (5 ms) of a thread running Python; shares are of wall time, not of CPU time, and a
thread running Python is seen at those switch points.

Imports only the standard library (the load-generator processes of ``bench_online`` import it).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType


def function_key(frame: FrameType) -> str:
    """``<parent folder>/<file>:<function>`` of ``frame`` (e.g. ``engine/scheduler.py:schedule``)."""
    path = Path(frame.f_code.co_filename)
    return f"{path.parent.name}/{path.name}:{frame.f_code.co_name}"


class StackSampler:
    """Per-thread self / total sample counts of every Python thread but its own.

    Use as a context manager or with :meth:`start` / :meth:`stop`; :meth:`report` gives the
    shares. ``interval_s`` (seconds between samples, > 0) trades overhead (one GIL acquisition and
    a walk of every stack per sample) against resolution.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.interval_s = interval_s
        self.samples: Counter[str] = Counter()  # thread name -> samples taken
        self.self_counts: dict[str, Counter[str]] = {}
        self.total_counts: dict[str, Counter[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StackSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> StackSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def sample_once(self) -> None:
        """Count one sample of every thread but the calling one."""
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, f"thread-{ident}")
            self.samples[name] += 1
            self.self_counts.setdefault(name, Counter())[function_key(frame)] += 1
            seen: set[str] = set()
            f: FrameType | None = frame
            while f is not None:
                seen.add(function_key(f))
                f = f.f_back
            self.total_counts.setdefault(name, Counter()).update(seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            time.sleep(self.interval_s)

    def report(self, top: int = 15) -> dict[str, dict]:
        """``{thread name: {"samples": n, "self": [[function, share], ...], "total": [...]}}``, the
        ``top`` functions of each by share of that thread's samples (0..1), threads by samples."""
        out: dict[str, dict] = {}
        for name, n in self.samples.most_common():
            out[name] = {"samples": n,
                         "self": [[k, round(c / n, 4)] for k, c in self.self_counts[name].most_common(top)],
                         "total": [[k, round(c / n, 4)] for k, c in self.total_counts[name].most_common(top)]}
        return out


def format_report(report: dict[str, dict], threads: tuple[str, ...] | None = None, top: int = 12) -> str:
    """Markdown: for each thread of ``threads`` that was sampled (default: every thread, most sampled
    first), its ``top`` self and total functions with their shares of its samples."""
    lines = []
    for name in threads if threads is not None else tuple(report):
        entry = report.get(name)
        if entry is None:
            continue
        lines += [f"thread {name!r}: {entry['samples']} samples", "", "| self | share | total | share |",
                  "|---|---|---|---|"]
        rows_self, rows_total = entry["self"][:top], entry["total"][:top]
        for i in range(max(len(rows_self), len(rows_total))):
            s = rows_self[i] if i < len(rows_self) else ["", ""]
            t = rows_total[i] if i < len(rows_total) else ["", ""]
            lines.append(f"| {s[0]} | {s[1]} | {t[0]} | {t[1]} |")
        lines.append("")
    return "\n".join(lines)
