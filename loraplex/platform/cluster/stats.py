"""One stats snapshot for all engine replicas (plain Python, no Ray): what ``/admin/stats``,
``/metrics`` and the console show in ``--replicas`` mode."""

from __future__ import annotations

from typing import Any


def merge_replica_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats snapshot for all replicas (``stats_to_dict`` form) from each replica's.

    Counts and rates are summed (``prefix_hit_rate`` recomputed from the sums); per-tenant
    service is summed by tenant; per-adapter request counts by adapter; the LoRA pools' slot
    lists and host-cache lists are concatenated (each slot gains ``replica_id``), their counters
    summed. ``replicas``: ``[{replica_id, num_running, num_waiting, kv_blocks_used}]``.
    Raises ``ValueError`` for an empty list.
    """
    if not snapshots:
        raise ValueError("no replica stats to merge")
    first = snapshots[0]
    merged: dict[str, Any] = {}
    for name, value in first.items():
        if name in ("lora", "tenants", "replica_id") or isinstance(value, (str, bool)) or value is None:
            merged[name] = value
        elif isinstance(value, (int, float)):
            merged[name] = sum(s[name] for s in snapshots)
        elif isinstance(value, dict):
            merged[name] = _sum_counts(s[name] for s in snapshots)
        else:
            merged[name] = value
    merged.pop("replica_id", None)
    merged["block_size"] = first["block_size"]
    queries = merged["prefix_queries_tokens"]
    merged["prefix_hit_rate"] = merged["prefix_hits_tokens"] / queries if queries else 0.0
    merged["tenants"] = _merge_tenants([t for s in snapshots for t in s.get("tenants") or []])
    loras = [(s.get("replica_id"), s["lora"]) for s in snapshots if s.get("lora")]
    merged["lora"] = _merge_lora(loras) if loras else None
    merged["replicas"] = [{"replica_id": s.get("replica_id"), "num_running": s["num_running"],
                           "num_waiting": s["num_waiting"], "kv_blocks_used": s["kv_blocks_used"]} for s in snapshots]
    return merged


def _sum_counts(dicts) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for counts in dicts:
        for key, value in counts.items():
            total[key] = total.get(key, 0) + value
    return total


def _merge_tenants(tenants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        seen = by_id.get(tenant["tenant_id"])
        if seen is None:
            by_id[tenant["tenant_id"]] = dict(tenant)
            continue
        for name in ("num_waiting", "num_running", "prompt_tokens_served", "output_tokens_served", "virtual_counter"):
            seen[name] += tenant[name]
    return [by_id[name] for name in sorted(by_id)]


def _merge_lora(loras: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"slots": [], "cpu_cache_lru": [], "registered": [], "pending_removal": []}
    for replica_id, lora in loras:
        merged["slots"] += [{**slot, "replica_id": replica_id} for slot in lora["slots"]]
        merged["cpu_cache_lru"] += lora["cpu_cache_lru"]
        for name in ("registered", "pending_removal"):
            merged[name] += [n for n in lora[name] if n not in merged[name]]
        for name, value in lora.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[name] = merged.get(name, 0) + value
    return merged
