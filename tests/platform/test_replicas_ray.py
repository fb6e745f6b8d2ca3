"""Replicas on Ray Serve (issue 18): the gateway (auth, registry, quotas) in front of 2 engine
replicas of the tiny Llama on a local Ray cluster, routed by the adapter-aware request router.

- affinity: under light load, requests for an adapter land on the replica that holds it (>= 90%);
- saturation: a burst for one adapter spreads over both replicas;
- failure: killing the replica that serves a request mid-stream ends the stream with a 503
  ``replica_failed`` error event (a non-streaming request in flight gets the 503), new requests
  are served by the live replica, the registry keeps every adapter, and Ray starts a new replica.

One cluster for the module (starting Ray and two replicas is most of its time).
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import openai
import pytest
from platform_testlib import ADMIN_KEY, adapter_members, make_peft_adapter, make_settings, new_tenant, run_server, zip_bytes

if os.environ.get("CI") != "true":
    pytest.importorskip("ray", reason="the `cluster` extra (Ray Serve) is not installed")
import ray  # noqa: E402
from ray import serve  # noqa: E402

MAX_ONGOING = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama_dir):
    """A live gateway over 2 replicas (2 slots, 4 requests in flight each, imbalance bound 2)."""
    from loraplex.platform.main import create_app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tmp = tmp_path_factory.mktemp("replicas")
    settings = make_settings(tmp, model=str(tiny_llama_dir), served_model_name="tiny", device="cpu", replicas=2,
                             replica_num_cpus=1, replica_max_ongoing_requests=MAX_ONGOING, routing_max_imbalance=2,
                             max_loras=2, max_lora_rank=8, max_cpu_loras=4, max_num_seqs=8, max_model_len=512)
    live = run_server(create_app(settings))
    key = new_tenant(live, "acme")
    for i, name in enumerate(("alpha", "beta")):
        adapter = make_peft_adapter(tiny_llama_dir, tmp / name, seed=i + 1)
        with live.admin() as admin:
            response = admin.post("/admin/tenants/acme/adapters", data={"name": name},
                                  files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")})
            assert response.status_code == 201, response.text
    yield live, key
    live.stop()
    ray.shutdown()


def routing_key(live, name: str) -> str:
    from loraplex.platform.cluster.routing import adapter_routing_key
    from loraplex.platform.services.adapters import lora_request, resolve_adapter

    tenant_id = 1  # acme, the only tenant
    return adapter_routing_key(lora_request(resolve_adapter(ctx=live.ctx, tenant_id=tenant_id, name=name)))


def routed(live, key: str) -> dict[str, int]:
    """Requests of routing key ``key`` accepted per replica so far."""
    return {replica: n for (k, replica), n in live.ctx.engine.requests_routed.items() if k == key}


def wait_for(condition, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def complete(client: openai.OpenAI, model: str, max_tokens: int = 4) -> None:
    client.completions.create(model=model, prompt="Paris is", max_tokens=max_tokens, extra_body={"ignore_eos": True})


def test_light_load_lands_on_the_replica_holding_the_adapter(cluster):
    live, key = cluster
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    keys = {name: routing_key(live, name) for name in ("alpha", "beta")}
    before = {name: routed(live, k) for name, k in keys.items()}
    for _ in range(10):  # sequential: at most one request in flight
        for name in ("alpha", "beta"):
            complete(client, name)
    homes = {}
    for name, k in keys.items():
        after = routed(live, k)
        counts = {replica: after[replica] - before[name].get(replica, 0) for replica in after}
        homes[name] = max(counts, key=counts.get)
        assert counts[homes[name]] >= 0.9 * 10, (name, counts)
    # The merged stats of both replicas show each adapter in a slot of its home replica.
    def slots_of_home_replicas():
        stats = live.ctx.engine.stats_dict()
        if stats is None:
            return None
        held = {(s["replica_id"], s["lora_name"]) for s in stats["lora"]["slots"]}
        return stats if all((homes[name], f"1/{name}@1") in held for name in keys) else None

    stats = wait_for(slots_of_home_replicas, "the replicas' stats to show the adapters")
    assert len(stats["replicas"]) == 2


def test_a_burst_for_one_adapter_spreads_over_both_replicas(cluster):
    live, key = cluster
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    k = routing_key(live, "alpha")
    before = routed(live, k)
    threads = [threading.Thread(target=complete, args=(client, "alpha", 64)) for _ in range(3 * MAX_ONGOING)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    after = routed(live, k)
    counts = {replica: after[replica] - before.get(replica, 0) for replica in after}
    assert sum(counts.values()) == 3 * MAX_ONGOING
    assert len([n for n in counts.values() if n > 0]) == 2, counts


def _stream_until_error(live, key: str, first_chunk: threading.Event, result: dict) -> None:
    body = {"model": "beta", "prompt": "Paris is", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                result.setdefault("lines", []).append(line)
                first_chunk.set()
    first_chunk.set()


def _complete_in_flight(live, key: str, result: dict) -> None:
    body = {"model": "beta", "prompt": "Paris is", "max_tokens": 480, "ignore_eos": True}
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        response = client.post("/v1/completions", json=body)
        result["status"], result["body"] = response.status_code, response.json()


def test_killing_a_replica_mid_request_fails_its_requests_with_503_and_the_rest_keeps_serving(cluster):
    live, key = cluster
    # beta sits in a slot of one replica only (the burst above was alpha's): both requests go there.
    k = routing_key(live, "beta")
    before = routed(live, k)
    streamed, completed, first_chunk = {}, {}, threading.Event()
    stream_thread = threading.Thread(target=_stream_until_error, args=(live, key, first_chunk, streamed))
    stream_thread.start()
    assert first_chunk.wait(60)
    blocking = threading.Thread(target=_complete_in_flight, args=(live, key, completed))
    blocking.start()
    wait_for(lambda: sum(routed(live, k).values()) == sum(before.values()) + 2, "the second request to start")
    new = {replica: n - before.get(replica, 0) for replica, n in routed(live, k).items() if n > before.get(replica, 0)}
    assert list(new.values()) == [2], f"both requests should run on beta's replica: {new}"
    victim = next(iter(new))

    ray.kill(ray.get_actor(f"SERVE_REPLICA::loraplex#engine#{victim}", namespace="serve"), no_restart=True)
    stream_thread.join(60)
    blocking.join(60)

    assert streamed["status"] == 200
    assert streamed["lines"][-1] == "data: [DONE]"
    error = json.loads(streamed["lines"][-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error", error
    assert completed["status"] == 503 and completed["body"]["error"]["code"] == "replica_failed", completed

    # New requests go to the live replica; the registry still has both adapters.
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    for name in ("beta", "alpha", "tiny"):
        complete(client, name)
    assert sorted(m.id for m in client.models.list().data) == ["alpha", "beta", "tiny"]
    with live.admin() as admin:
        assert sorted(a["name"] for a in admin.get("/admin/tenants/acme/adapters").json()) == ["alpha", "beta"]

    # Ray Serve replaces the dead replica.
    def two_running() -> bool:
        deployment = serve.status().applications["loraplex"].deployments["engine"]
        return deployment.replica_states.get("RUNNING", 0) == 2 and deployment.status == "HEALTHY"

    wait_for(two_running, "Ray Serve to replace the killed replica")
    ids = {replica for (_, replica) in live.ctx.engine.requests_routed}
    assert victim in ids
