"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (no global state).

Request-side metrics are recorded by the serving layer; engine-side values
(queue lengths, KV blocks, prefix hit rate, adapter slot loads/evictions) are
read from the engine's latest stats snapshot at scrape time.

The engine values a Kubernetes router reads from vLLM pods are exported under vLLM's
names as well (labels ``model_name``, ``engine`` as vLLM's): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and the LoRA gauge
``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` whose
value is the wall-clock time of the snapshot (the newest series wins) and whose adapter
lists name adapters as requests do (``model``), comma-separated. Where an adapter is
resident: ``loraplex_lora_adapter_resident{adapter, level="gpu"|"cpu"}`` (vLLM has no such
metric), the number of engines holding that version in a device slot / in host memory. The
``/metrics`` route is for operators only (admin or metrics key), as it names every
tenant's adapters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.platform.lora_names import model_name_of

if TYPE_CHECKING:
    from loraplex.platform.engine_client import EngineClient

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class PlatformMetrics:
    """The app's metrics; ``render()`` gives the text exposition format."""

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        """``wall_clock``: seconds since the epoch, the value of ``vllm:lora_requests_info``."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("loraplex_requests", "Serving requests by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.request_latency = Histogram("loraplex_request_latency_seconds", "End-to-end serving latency.",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.inter_token = Histogram("loraplex_inter_token_latency_seconds",
                                     "Time between consecutive engine outputs of one completion, per token.",
                                     buckets=_TOKEN_GAP_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated.", registry=r)
        self.adapter_requests = Counter("loraplex_adapter_requests", "Serving requests per model/adapter "
                                        "(tenant/name; the base model's id for the base model).",
                                        ["adapter"], registry=r)
        self.rate_limited = Counter("loraplex_rate_limited", "Requests refused with HTTP 429.", registry=r)
        self.tenant_queueing_delay = Histogram(
            "loraplex_tenant_queueing_delay_seconds", "Time from arrival to the first scheduling step "
            "(admission gate + engine queue), per tenant.", ["tenant"], buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tenant_refused = Counter("loraplex_tenant_refused", "Requests refused by a tenant's queueing "
                                      "limits (429 queue full, 503 queue time), per tenant and status.",
                                      ["tenant", "status"], registry=r)
        self._engine_collector = _EngineCollector(wall_clock)
        r.register(self._engine_collector)

    def bind_engine(self, engine: EngineClient, *, model_name: str | None = None) -> None:
        """Export ``engine``'s stats snapshot at scrape time (``model_name``: the served model's
        id, the ``model_name`` label of the vLLM-named metrics)."""
        self._engine_collector.engine = engine
        self._engine_collector.model_name = model_name or ""

    def bind_admission(self, admission) -> None:
        """Export the admission gate's per-tenant queue lengths at scrape time."""
        self._engine_collector.admission = admission

    def render(self) -> bytes:
        return generate_latest(self.registry)


_ENGINE_GAUGES = {
    "num_running": "Sequences running.",
    "num_waiting": "Sequences waiting.",
    "num_swapped": "Sequences swapped out.",
    "kv_blocks_total": "KV blocks in the pool.",
    "kv_blocks_used": "KV blocks referenced by sequences.",
    "kv_blocks_cached": "Free KV blocks still holding a reusable prefix.",
    "kv_blocks_free": "KV blocks not referenced by any sequence.",
    "prefix_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens looked up.",
    "tokens_per_s": "Tokens processed per second (recent window).",
}
_ENGINE_COUNTERS = {
    "prefix_queries_tokens": "Prompt tokens looked up in the prefix cache.",
    "prefix_hits_tokens": "Prompt tokens found in the prefix cache.",
    "num_preemptions": "Sequences preempted.",
    "generated_tokens_total": "Tokens generated by the engine.",
    "prompt_tokens_total": "Prompt tokens admitted by the engine.",
}
_LORA_COUNTERS = {
    "disk_loads": "Adapters read and validated from disk.",
    "slot_loads": "Adapters written into a device slot.",
    "cpu_evictions": "Adapters dropped from the host cache for capacity.",
    "slot_evictions": "Resident adapters overwritten by another adapter.",
}


class _EngineCollector(Collector):
    """Engine and adapter-slot values from the engine's latest stats snapshot."""

    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self.engine: EngineClient | None = None
        self.admission = None
        self.model_name = ""
        self.wall_clock = wall_clock

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats_dict() if self.engine is not None else None
        if not stats:
            return
        for name, doc in _ENGINE_GAUGES.items():
            yield _gauge(f"loraplex_engine_{name}", doc, stats[name])
        for name, doc in _ENGINE_COUNTERS.items():
            yield _counter(f"loraplex_engine_{name.removesuffix('_total')}", doc, stats[name])
        total = stats["kv_blocks_total"]
        yield _gauge("loraplex_kv_cache_usage_ratio", "KV blocks used / KV blocks in the pool.",
                     stats["kv_blocks_used"] / total if total else 0.0)
        lora = stats.get("lora")
        if lora:
            yield from _lora_families(lora)
        gate = self.admission.queue_lengths() if self.admission is not None else {}
        yield from _tenant_families(stats.get("tenants") or [], gate)
        yield from _vllm_families(stats, self.model_name, self.wall_clock())


def _tenant_families(tenants: list[dict[str, Any]], gate: dict[str, int]) -> Iterator[Metric]:
    """Per-tenant service from the scheduler (label ``tenant``: the tenant's name)."""
    queue = GaugeMetricFamily("loraplex_tenant_queue_length", "Requests of the tenant waiting: at its "
                              "admission gate plus in the engine queue.", labels=["tenant"])
    running = GaugeMetricFamily("loraplex_tenant_running", "Sequences of the tenant running.", labels=["tenant"])
    prompt = CounterMetricFamily("loraplex_tenant_prompt_tokens_served", "Prompt tokens computed for the "
                                 "tenant (prefix-cache hits excluded).", labels=["tenant"])
    output = CounterMetricFamily("loraplex_tenant_output_tokens_served", "Tokens generated for the tenant.",
                                 labels=["tenant"])
    virtual = GaugeMetricFamily("loraplex_tenant_virtual_counter", "The fair scheduler's virtual token "
                                "counter of the tenant (weighted service / weight).", labels=["tenant"])
    names = {t["tenant_id"] for t in tenants} | set(gate)
    by_name = {t["tenant_id"]: t for t in tenants}
    for name in sorted(names):
        t = by_name.get(name, {})
        queue.add_metric([name], float(t.get("num_waiting", 0) + gate.get(name, 0)))
        running.add_metric([name], float(t.get("num_running", 0)))
        prompt.add_metric([name], float(t.get("prompt_tokens_served", 0)))
        output.add_metric([name], float(t.get("output_tokens_served", 0)))
        virtual.add_metric([name], float(t.get("virtual_counter", 0.0)))
    yield from (queue, running, prompt, output, virtual)


def _lora_families(lora: dict[str, Any]) -> Iterator[Metric]:
    for name, doc in _LORA_COUNTERS.items():
        yield _counter(f"loraplex_lora_{name}", doc, lora[name])
    slots = lora["slots"]
    yield _gauge("loraplex_lora_slots", "Adapter slots on the device.", len(slots))
    yield _gauge("loraplex_lora_slots_occupied", "Slots holding an adapter.",
                 sum(1 for s in slots if s["lora_int_id"] is not None))
    yield _gauge("loraplex_lora_slots_pinned", "Slots pinned by running requests.",
                 sum(1 for s in slots if s["pin_count"] > 0))
    yield _gauge("loraplex_lora_cpu_cached", "Adapters in the host-memory cache.", len(lora["cpu_cache_lru"]))


def _vllm_families(stats: dict[str, Any], model_name: str, now_s: float) -> Iterator[Metric]:
    """The engine values under vLLM's metric names (see the module docstring)."""
    engine_labels = ["model_name", "engine"]
    for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats["num_running"]),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats["num_waiting"] + stats["num_swapped"]),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats["kv_blocks_used"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0)):
        family = GaugeMetricFamily(name, doc, labels=engine_labels)
        family.add_metric([model_name, "0"], float(value))
        yield family
    lora = stats.get("lora")
    if not lora:
        return
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    info.add_metric([str(len(lora["slots"])), _adapter_list(stats.get("waiting_lora_adapters")),
                     _adapter_list(stats.get("running_lora_adapters"))], now_s)
    yield info
    resident = GaugeMetricFamily("loraplex_lora_adapter_resident", "Engines holding the adapter version "
                                 "(engine lora name) in a device slot (level=gpu) or in host memory (level=cpu).",
                                 labels=["adapter", "level"])
    gpu = _count(s["lora_name"] for s in lora["slots"] if s["lora_name"] is not None)
    cpu = _count(lora["cpu_cache_lru"])
    for level, counts in (("gpu", gpu), ("cpu", cpu)):
        for adapter in sorted(counts):
            resident.add_metric([adapter, level], float(counts[adapter]))
    yield resident


def _adapter_list(counts: dict[str, int] | None) -> str:
    """vLLM's label value: the adapters' request names, comma-separated ("" for none)."""
    return ",".join(sorted({model_name_of(name) for name in counts or {}}))


def _count(names) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family
