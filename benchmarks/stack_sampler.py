"""A sampling profiler of this process's Python threads, for finding where a server's host time goes.

Every ``interval_s`` a daemon thread reads every other thread's current stack
(``sys._current_frames``, the method of py-spy and of the standard library's ``faulthandler``,
without ptrace) and credits, per thread name, the seconds since its previous sample to the
innermost frame's function (*self*) and to each distinct function on the stack (*total*). A thread blocked in a C call
(``select``, a lock, a CUDA synchronize) shows that call's Python caller as its innermost frame,
so idle time is visible as such (e.g. ``threading.py:wait``). The sampler needs the GIL for each
sample, so samples come every ``interval_s`` while the other threads are blocked but only at the
interpreter's switch interval (5 ms) while one runs Python: counting samples would over-weight
blocked time 3-4 times; weighting each sample by the seconds since the previous one makes the
shares shares of wall time (a thread 50% busy in Python, 50% asleep read 19-21% busy unweighted,
49% weighted). A thread running Python is seen at the switch points.

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
    """``<parent folder>/<file>:<qualified function>`` of ``frame`` (e.g. ``engine/scheduler.py:Scheduler.schedule``)."""
    path = Path(frame.f_code.co_filename)
    return f"{path.parent.name}/{path.name}:{getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}"


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
        self.seconds: Counter[str] = Counter()  # thread name -> seconds credited
        self.self_counts: dict[str, Counter[str]] = {}  # thread -> function -> seconds innermost
        self.total_counts: dict[str, Counter[str]] = {}  # thread -> function -> seconds on the stack
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

    def sample_once(self, weight_s: float = 1.0) -> None:
        """Take one sample of every thread but the calling one, crediting ``weight_s`` seconds."""
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, f"thread-{ident}")
            self.samples[name] += 1
            self.seconds[name] += weight_s
            self.self_counts.setdefault(name, Counter())[function_key(frame)] += weight_s
            seen: set[str] = set()
            f: FrameType | None = frame
            while f is not None:
                seen.add(function_key(f))
                f = f.f_back
            totals = self.total_counts.setdefault(name, Counter())
            for key in seen:
                totals[key] += weight_s

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self.interval_s)
            now = time.perf_counter()
            self.sample_once(now - last)
            last = now

    def report(self, top: int = 15) -> dict[str, dict]:
        """``{thread name: {"samples": n, "seconds": s, "self": [[function, share], ...], "total": [...]}}``,
        the ``top`` functions of each by share of that thread's credited seconds (0..1), threads by samples."""
        out: dict[str, dict] = {}
        for name, n in self.samples.most_common():
            w = self.seconds[name] or 1.0
            out[name] = {"samples": n, "seconds": round(self.seconds[name], 4),
                         "self": [[k, round(c / w, 4)] for k, c in self.self_counts[name].most_common(top)],
                         "total": [[k, round(c / w, 4)] for k, c in self.total_counts[name].most_common(top)]}
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
