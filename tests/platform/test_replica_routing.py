"""Adapter-aware replica ranking (issue 18), without Ray: tiers GPU slot > host cache > empty
slot > idle slot > least loaded, the imbalance bound, routing hints with an injected clock,
the replica's report from an engine snapshot, and the merged stats of several replicas."""

from __future__ import annotations

import pytest

from loraplex.adapters.lora_request import LoRARequest
from loraplex.platform.cluster.routing import (
    BASE_MODEL_KEY,
    ReplicaRoutingStats,
    ReplicaView,
    RoutingHints,
    adapter_routing_key,
    rank_replicas,
    routing_stats_from_engine,
)
from loraplex.platform.cluster.stats import merge_replica_stats

A, B = "7:aaaa", "8:bbbb"


def view(replica_id, load=0, *, gpu=(), cpu=(), empty=0, idle=0, reported=True) -> ReplicaView:
    stats = ReplicaRoutingStats(frozenset(gpu), frozenset(cpu), empty, idle, load) if reported else None
    return ReplicaView(replica_id, stats, load)


def test_routing_key_is_the_adapter_version():
    v1 = LoRARequest("3/support@1", 7, "/x", version_id="a" * 64)
    v2 = LoRARequest("3/support@2", 8, "/y", version_id="b" * 64)
    assert adapter_routing_key(v1) == "7:" + "a" * 64 and adapter_routing_key(v2) == "8:" + "b" * 64
    assert adapter_routing_key(LoRARequest("x", 9, "/z")) == "9:"
    assert adapter_routing_key(None) == BASE_MODEL_KEY == ""


def test_tiers_slot_then_host_cache_then_empty_then_idle_slot_then_everyone():
    replicas = [view("r-idle", idle=1), view("r-cpu", cpu=[A]), view("r-full"), view("r-gpu", gpu=[A]),
                view("r-empty", empty=1)]
    assert rank_replicas(replicas, A, max_imbalance=4) == [
        ["r-gpu"], ["r-cpu"], ["r-empty"], ["r-idle"], ["r-empty", "r-cpu", "r-full", "r-gpu", "r-idle"]]
    # Another adapter: nobody holds it.
    assert rank_replicas(replicas, B, max_imbalance=4) == [
        ["r-empty"], ["r-idle"], ["r-empty", "r-cpu", "r-full", "r-gpu", "r-idle"]]


def test_within_a_tier_least_loaded_then_most_empty_slots_first():
    replicas = [view("r1", 2, gpu=[A]), view("r2", 1, gpu=[A]), view("r3", 1, empty=1), view("r4", 1, empty=2)]
    assert rank_replicas(replicas, A, max_imbalance=4)[0] == ["r2", "r1"]
    assert rank_replicas(replicas, B, max_imbalance=4) == [["r4", "r3"], ["r4", "r3", "r2", "r1"]]


def test_a_replica_past_the_imbalance_bound_keeps_only_its_least_loaded_rank():
    replicas = [view("hot", 5, gpu=[A]), view("cold", 1, empty=1)]
    assert rank_replicas(replicas, A, max_imbalance=4) == [["hot"], ["cold"], ["cold", "hot"]]
    assert rank_replicas(replicas, A, max_imbalance=3) == [["cold"], ["cold", "hot"]]  # 5 > 1 + 3
    with pytest.raises(ValueError, match="max_imbalance=-1"):
        rank_replicas(replicas, A, max_imbalance=-1)


def test_base_model_goes_to_the_least_loaded_and_unreported_replicas_only_last():
    replicas = [view("r1", 3, gpu=[A]), view("r2", 0, reported=False), view("r3", 1)]
    assert rank_replicas(replicas, BASE_MODEL_KEY, max_imbalance=0) == [["r2", "r3", "r1"]]
    assert rank_replicas(replicas, A, max_imbalance=10) == [["r1"], ["r2", "r3", "r1"]]
    assert rank_replicas([], A, max_imbalance=1) == []


def test_hints_count_as_resident_until_their_ttl_passes():
    now = [100.0]
    hints = RoutingHints(ttl_s=2.0, clock=lambda: now[0])
    hints.record(A, "r2")
    hints.record(BASE_MODEL_KEY, "r1")  # the base model needs no affinity
    replicas = [view("r1", 0, empty=2), view("r2", 1, empty=1)]
    assert rank_replicas(replicas, A, max_imbalance=4, hinted=hints.replicas_for(A))[0] == ["r2"]
    now[0] = 102.0
    assert hints.replicas_for(A) == {"r2"}
    now[0] = 102.5
    assert hints.replicas_for(A) == set() and hints.replicas_for(BASE_MODEL_KEY) == set()
    hints.record(A, "r2")
    hints.forget_replica("r2")
    assert hints.replicas_for(A) == set()


def _slot(slot, lora_name=None, pin_count=0):
    return {"slot": slot, "lora_name": lora_name, "lora_int_id": None, "version_id": None, "pin_count": pin_count}


def _engine_stats(slots, cpu, running=0, waiting=0, swapped=0, **more):
    stats = {"num_running": running, "num_waiting": waiting, "num_swapped": swapped,
             "lora": {"slots": slots, "cpu_cache_lru": cpu, "registered": [], "pending_removal": [],
                      "disk_loads": 2, "slot_loads": 3, "cpu_evictions": 0, "slot_evictions": 1,
                      "slot_memory_bytes": 1000, "loads_in_flight": 0, "load_failures": 0}}
    stats.update(more)
    return stats


def test_replica_report_from_an_engine_snapshot():
    keys = {"1/a@1": A, "1/b@1": B}
    stats = _engine_stats([_slot(0, "1/a@1", 2), _slot(1, "1/b@1", 0), _slot(2), _slot(3, "9/other@1", 0)],
                          ["1/b@1", "1/a@1", "9/other@1"], running=2, waiting=3, swapped=1)
    report = routing_stats_from_engine(stats, keys)
    assert report == ReplicaRoutingStats(frozenset({A, B}), frozenset({A, B}), 1, 2, 6)
    assert ReplicaRoutingStats.from_dict(report.to_dict()) == report
    assert ReplicaRoutingStats.from_dict({}) is None and ReplicaRoutingStats.from_dict(None) is None
    assert routing_stats_from_engine(None, keys) == ReplicaRoutingStats(frozenset(), frozenset(), 0, 0, 0)


def test_merged_stats_sum_counts_and_concatenate_slots():
    tenants = lambda w, r: [{"tenant_id": "acme", "weight": 1.0, "num_waiting": w, "num_running": r,  # noqa: E731
                             "prompt_tokens_served": 10 * r, "output_tokens_served": 20 * r, "virtual_counter": 50.0 * r}]
    common = dict(kv_blocks_total=96, kv_blocks_used=10, kv_blocks_cached=0, kv_blocks_free=86, block_size=16,
                  num_preemptions=0, generated_tokens_total=100, prompt_tokens_total=50, tokens_per_s=5.0,
                  scheduling_policy="fair")
    one = _engine_stats([_slot(0, "1/a@1", 1), _slot(1)], ["1/a@1"], running=1, waiting=2, prefix_queries_tokens=100,
                        prefix_hits_tokens=50, prefix_hit_rate=0.5, tenants=tenants(2, 1),
                        running_lora_adapters={"1/a@1": 1}, waiting_lora_adapters={"1/a@1": 2},
                        replica_id="r1", **common)
    two = _engine_stats([_slot(0, "1/b@1", 0), _slot(1, "1/a@1", 0)], ["1/a@1", "1/b@1"], running=3,
                        prefix_queries_tokens=300, prefix_hits_tokens=0, prefix_hit_rate=0.0, tenants=tenants(0, 3),
                        running_lora_adapters={"1/a@1": 3}, waiting_lora_adapters={}, replica_id="r2", **common)
    merged = merge_replica_stats([one, two])
    assert (merged["num_running"], merged["num_waiting"], merged["kv_blocks_total"]) == (4, 2, 192)
    assert merged["block_size"] == 16 and merged["scheduling_policy"] == "fair"
    assert merged["prefix_hit_rate"] == 50 / 400
    assert merged["running_lora_adapters"] == {"1/a@1": 4} and merged["waiting_lora_adapters"] == {"1/a@1": 2}
    assert merged["tenants"] == [{"tenant_id": "acme", "weight": 1.0, "num_waiting": 2, "num_running": 4,
                                  "prompt_tokens_served": 40, "output_tokens_served": 80, "virtual_counter": 200.0}]
    lora = merged["lora"]
    assert [(s["replica_id"], s["slot"], s["lora_name"]) for s in lora["slots"]] == [
        ("r1", 0, "1/a@1"), ("r1", 1, None), ("r2", 0, "1/b@1"), ("r2", 1, "1/a@1")]
    assert lora["cpu_cache_lru"] == ["1/a@1", "1/a@1", "1/b@1"]
    assert (lora["slot_loads"], lora["slot_evictions"], lora["slot_memory_bytes"]) == (6, 2, 2000)
    assert merged["replicas"] == [{"replica_id": "r1", "num_running": 1, "num_waiting": 2, "kv_blocks_used": 10},
                                  {"replica_id": "r2", "num_running": 3, "num_waiting": 0, "kv_blocks_used": 10}]
    assert "replica_id" not in merged
    with pytest.raises(ValueError):
        merge_replica_stats([])
