"""Discrete-event simulation of adapter placement across engine replicas (issue 18 part 3).

Many replicas serve many adapters with Zipf popularity; each replica has ``gpu_slots``
adapter slots on its GPU (``max_loras``: distinct adapters one step can run) and a host
(CPU) LRU cache of ``host_slots`` adapters; everything else is fetched from the adapter store
(object storage / NVMe). The question: how does the router's choice of replica change the
GPU-residency hit rate and the queueing delay as replicas grow from 1 to 64?

Model (one process, no engine; times in seconds of simulated time):

- Requests arrive as a Poisson process at ``utilization`` x the fleet's capacity
  (``replicas * max_batch / service_s``); each names one adapter drawn from Zipf(``zipf_s``)
  over ``num_adapters`` and runs for an exponential time of mean ``service_s`` once it starts.
  The trace (arrival times, adapters, run times) depends only on ``seed`` and the replica count,
  so every policy serves exactly the same requests.
- A replica runs at most ``max_batch`` requests at once. Its scheduler scans the waiting
  queue in arrival order (the first ``scan_depth`` entries, as a step's admission does): a
  request whose adapter is resident starts now; a request whose adapter is not takes a GPU
  slot (an empty one, else the least recently used slot no running request uses) and starts
  when the load finishes (``h2d_s`` from the host cache, ``fetch_s + h2d_s`` from the store;
  the adapter then enters the host cache too); a request whose adapter finds no slot waits.
- Queueing delay of a request: start time minus arrival time (waiting for a batch place,
  a slot and the load). GPU hit: the adapter was resident in a GPU slot of the chosen
  replica when the request was routed. Counted after the first ``warmup_fraction`` of requests.

Routing policies (``load`` = running + waiting requests of a replica; ties go to the replica
with the lowest index after a seeded random rotation):

- ``random``: a uniformly random replica.
- ``least-loaded``: the replica with the least load.
- ``adapter-aware``: the router of issue 18 part 2 (loraplex's Ray Serve router): among the
  replicas that are not saturated (``load < max_batch``), prefer one where the adapter is in a
  GPU slot, then one where it is in the host cache, then one with a free GPU slot (empty or not
  used by a running request), then any; least loaded within the first non-empty tier. When
  every replica is saturated: the least loaded. A hot adapter thus spreads over more replicas
  as the ones holding it fill up (replication), while a cold adapter stays on the one replica
  that loaded it (consolidation).

Usage: ``python benchmarks/sim_placement.py [--out FILE] [--replicas 1 2 4 ...]`` (< 1 minute
on one CPU core with the defaults); ``--tiny`` runs a small config for tests.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

POLICIES = ("random", "least-loaded", "adapter-aware")
DEFAULT_REPLICAS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class SimConfig:
    """Fleet, workload and cost model of one simulation.

    - ``num_adapters``: distinct adapters; popularity of the i-th (1-based) is ``i ** -zipf_s``.
    - ``gpu_slots``: adapters resident on one replica's GPU (``max_loras``).
    - ``host_slots``: adapters in one replica's host LRU cache (``max_cpu_loras``).
    - ``max_batch``: requests one replica runs at once.
    - ``service_s``: mean run time of a request (prefill + decode), exponential.
    - ``utilization``: offered load / fleet capacity.
    - ``h2d_s``: host -> GPU copy of one adapter; ``fetch_s``: adapter store -> host.
    - ``requests_per_replica``: trace length is this times the replica count.
    - ``scan_depth``: waiting requests the scheduler looks at per pass.
    """

    num_adapters: int = 100_000
    zipf_s: float = 1.0
    gpu_slots: int = 32
    host_slots: int = 512
    max_batch: int = 64
    service_s: float = 4.0
    utilization: float = 0.7
    h2d_s: float = 0.002
    fetch_s: float = 0.05
    requests_per_replica: int = 400
    warmup_fraction: float = 0.25
    scan_depth: int = 256
    seed: int = 0


TINY = SimConfig(num_adapters=200, gpu_slots=4, host_slots=16, max_batch=8, requests_per_replica=150)
"""A config small enough for a CPU test (well under a second per run)."""


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float
    adapter: int
    run_s: float


@dataclass(frozen=True)
class SimResult:
    """Counted over the requests after warm-up; delays in milliseconds."""

    policy: str
    replicas: int
    requests: int
    gpu_hits: int
    host_hits: int
    store_fetches: int
    p50_delay_ms: float
    p99_delay_ms: float

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hits / self.requests


def make_trace(config: SimConfig, replicas: int) -> list[Request]:
    """The requests of one run, in arrival order (seeded by ``config.seed`` and ``replicas``)."""
    rng = random.Random(f"{config.seed}-trace-{replicas}")
    cumulative = list(itertools.accumulate(i ** -config.zipf_s for i in range(1, config.num_adapters + 1)))
    total = cumulative[-1]
    rate_per_s = config.utilization * replicas * config.max_batch / config.service_s
    now, requests = 0.0, []
    for index in range(config.requests_per_replica * replicas):
        now += rng.expovariate(rate_per_s)
        adapter = min(bisect.bisect_left(cumulative, rng.random() * total), config.num_adapters - 1)
        requests.append(Request(index, now, adapter, rng.expovariate(1.0 / config.service_s)))
    return requests


class Replica:
    """One engine replica: batch places, GPU slots (LRU, pinned while used) and a host LRU cache."""

    def __init__(self, index: int, config: SimConfig) -> None:
        self.index = index
        self.config = config
        self.running = 0
        self.waiting: deque[Request] = deque()
        self.gpu: OrderedDict[int, int] = OrderedDict()  # adapter -> running requests using it (LRU order)
        self.loading: set[int] = set()  # adapters whose GPU load is in flight (they hold a slot)
        self.host: OrderedDict[int, None] = OrderedDict()

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)

    def resident(self, adapter: int) -> bool:
        return adapter in self.gpu and adapter not in self.loading

    def has_free_slot(self) -> bool:
        if len(self.gpu) < self.config.gpu_slots:
            return True
        return any(pins == 0 and a not in self.loading for a, pins in self.gpu.items())

    def take_slot(self, adapter: int) -> bool:
        """Give ``adapter`` a GPU slot (evicting the LRU unused one); False when every slot is in use."""
        if len(self.gpu) >= self.config.gpu_slots:
            victim = next((a for a, pins in self.gpu.items() if pins == 0 and a not in self.loading), None)
            if victim is None:
                return False
            del self.gpu[victim]
        self.gpu[adapter] = 0
        return True


class Simulation:
    """One policy over one trace; :meth:`run` returns the counted result."""

    def __init__(self, config: SimConfig, replicas: int, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: expected one of {POLICIES}")
        self.config = config
        self.policy = policy
        self.replicas = [Replica(i, config) for i in range(replicas)]
        self.rng = random.Random(f"{config.seed}-router-{replicas}")
        self.events: list[tuple[float, int, str, int, object]] = []
        self.sequence = itertools.count()
        self.warmup = int(config.warmup_fraction * config.requests_per_replica * replicas)
        self.delays_s: list[float] = []
        self.gpu_hits = self.host_hits = self.store_fetches = 0

    # -- routing --------------------------------------------------------------------------------
    def least_loaded(self, candidates: list[Replica]) -> Replica:
        offset = self.rng.randrange(len(candidates))
        rotated = candidates[offset:] + candidates[:offset]
        return min(rotated, key=lambda r: r.load)

    def route(self, adapter: int) -> Replica:
        if self.policy == "random":
            return self.replicas[self.rng.randrange(len(self.replicas))]
        if self.policy == "least-loaded":
            return self.least_loaded(self.replicas)
        open_ = [r for r in self.replicas if r.load < self.config.max_batch]
        for tier in (lambda r: adapter in r.gpu, lambda r: adapter in r.host, Replica.has_free_slot):
            candidates = [r for r in open_ if tier(r)]
            if candidates:
                return self.least_loaded(candidates)
        return self.least_loaded(open_ or self.replicas)

    # -- events ---------------------------------------------------------------------------------
    def push(self, time_s: float, kind: str, replica: int, payload: object) -> None:
        heapq.heappush(self.events, (time_s, next(self.sequence), kind, replica, payload))

    def schedule(self, replica: Replica, now: float) -> None:
        """Start what can start on ``replica`` now; begin the loads the waiting requests need."""
        kept: list[Request] = []
        scanned = 0
        while replica.waiting and scanned < self.config.scan_depth and replica.running < self.config.max_batch:
            request = replica.waiting.popleft()
            scanned += 1
            adapter = request.adapter
            if replica.resident(adapter):
                self.start(replica, request, now)
                continue
            if adapter not in replica.loading and replica.take_slot(adapter):
                replica.loading.add(adapter)
                from_host = adapter in replica.host
                if not from_host:
                    self.store_fetches += request.index >= self.warmup
                replica.host[adapter] = None
                replica.host.move_to_end(adapter)
                while len(replica.host) > self.config.host_slots:
                    replica.host.popitem(last=False)
                load_s = self.config.h2d_s + (0.0 if from_host else self.config.fetch_s)
                self.push(now + load_s, "loaded", replica.index, adapter)
            kept.append(request)
        replica.waiting.extendleft(reversed(kept))

    def start(self, replica: Replica, request: Request, now: float) -> None:
        replica.running += 1
        replica.gpu[request.adapter] += 1
        replica.gpu.move_to_end(request.adapter)
        if request.index >= self.warmup:
            self.delays_s.append(now - request.arrival_s)
        self.push(now + request.run_s, "finished", replica.index, request)

    def run(self, trace: list[Request]) -> SimResult:
        for request in trace:
            self.push(request.arrival_s, "arrived", -1, request)
        while self.events:
            now, _, kind, index, payload = heapq.heappop(self.events)
            if kind == "arrived":
                replica = self.route(payload.adapter)
                if payload.index >= self.warmup:
                    self.gpu_hits += replica.resident(payload.adapter)
                    self.host_hits += (not replica.resident(payload.adapter)) and payload.adapter in replica.host
                replica.waiting.append(payload)
            elif kind == "loaded":
                replica = self.replicas[index]
                replica.loading.discard(payload)
            else:  # finished
                replica = self.replicas[index]
                replica.running -= 1
                replica.gpu[payload.adapter] -= 1
            self.schedule(replica, now)
        delays = sorted(self.delays_s)
        return SimResult(self.policy, len(self.replicas), len(delays), self.gpu_hits, self.host_hits,
                         self.store_fetches, 1e3 * percentile(delays, 50), 1e3 * percentile(delays, 99))


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def simulate(config: SimConfig, replicas: int, policy: str) -> SimResult:
    """One policy on the trace of ``replicas`` replicas."""
    return Simulation(config, replicas, policy).run(make_trace(config, replicas))


def sweep(config: SimConfig, replica_counts: tuple[int, ...]) -> list[SimResult]:
    return [simulate(config, n, policy) for n in replica_counts for policy in POLICIES]


def format_table(results: list[SimResult]) -> str:
    """Markdown table: one row per replica count, GPU hit rate and p99 delay per policy."""
    by_key = {(r.replicas, r.policy): r for r in results}
    counts = sorted({r.replicas for r in results})
    header = "| replicas | " + " | ".join(f"GPU hit {p}" for p in POLICIES) + " | " + \
        " | ".join(f"p99 delay {p} (ms)" for p in POLICIES) + " |"
    lines = [header, "|" + "---:|" * (1 + 2 * len(POLICIES))]
    for n in counts:
        hits = " | ".join(f"{100 * by_key[n, p].gpu_hit_rate:.1f}%" for p in POLICIES)
        delays = " | ".join(f"{by_key[n, p].p99_delay_ms:.0f}" for p in POLICIES)
        lines.append(f"| {n} | {hits} | {delays} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=list(DEFAULT_REPLICAS))
    parser.add_argument("--tiny", action="store_true", help="the small TINY config (for tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    config = replace(TINY if args.tiny else SimConfig(), seed=args.seed)
    results = sweep(config, tuple(args.replicas))
    print(format_table(results))
    report = {"config": asdict(config), "results": [dict(asdict(r), gpu_hit_rate=r.gpu_hit_rate) for r in results]}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
