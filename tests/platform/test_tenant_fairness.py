"""Per-tenant weights and queueing limits (issue 21): the admission gate with an injected
clock, the admin API round trip, 429/503 with ``Retry-After`` from a live server, the engine
getting the tenant's share, the fair policy as the server default, and per-tenant metrics."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest
from platform_testlib import new_tenant

from loraplex.platform.admission import TenantAdmission
from loraplex.platform.errors import QueueTimedOut, RateLimited
from loraplex.platform.schemas import TenantContext


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenant(**limits) -> TenantContext:
    return TenantContext(tenant_id=7, tenant_name="acme", key_id=1, requests_per_minute=None,
                         tokens_per_minute=None, max_adapters=1, max_upload_mb=1.0, **limits)


def test_admission_gate_concurrency_queue_length_and_queue_time():
    async def scenario():
        clock = FakeClock()
        gate = TenantAdmission(clock)
        tenant = _tenant(max_concurrent_requests=2, max_queued_requests=2, max_queue_time_s=5.0)
        first, second = await gate.acquire(tenant), await gate.acquire(tenant)
        assert (first.deadline, first.waited_s, gate.active(7)) == (1005.0, 0.0, 2)
        third = asyncio.ensure_future(gate.acquire(tenant))
        fourth = asyncio.ensure_future(gate.acquire(tenant))
        await asyncio.sleep(0)  # let them queue
        assert gate.queue_lengths() == {"acme": 2}
        with pytest.raises(RateLimited) as full:
            await gate.acquire(tenant)
        assert full.value.status_code == 429 and full.value.headers() == {"Retry-After": "5"}
        clock.now += 2
        gate.release(7)  # the slot moves to the oldest waiter
        ticket = await third
        assert ticket.waited_s == 2.0 and gate.active(7) == 2 and gate.queue_lengths() == {"acme": 1}
        clock.now += 3.5  # the fourth has now waited 5.5 s > 5 s
        assert gate.expire() == 1
        with pytest.raises(QueueTimedOut) as late:
            await fourth
        assert late.value.status_code == 503 and late.value.headers() == {"Retry-After": "5"}
        for _ in range(2):
            gate.release(7)
        assert gate.active(7) == 0 and gate.queue_lengths() == {}
        unlimited = _tenant()
        tickets = [await gate.acquire(unlimited) for _ in range(50)]
        assert all(t.deadline is None for t in tickets) and gate.active(7) == 50

    asyncio.run(scenario())


def test_tenant_weights_and_limits_in_the_admin_api(serve):
    live = serve()
    with live.admin() as admin:
        created = admin.post("/admin/tenants", json={"name": "gold", "weight": 3, "max_concurrent_requests": 4,
                                                     "max_queued_requests": 10, "max_queue_time_s": 2.5})
        assert created.status_code == 201, created.text
        body = created.json()
        assert (body["weight"], body["max_concurrent_requests"], body["max_queued_requests"],
                body["max_queue_time_s"]) == (3.0, 4, 10, 2.5)
        changed = admin.patch("/admin/tenants/gold", json={"weight": 0.5, "max_queue_time_s": None}).json()
        assert (changed["weight"], changed["max_queue_time_s"], changed["max_concurrent_requests"]) == (0.5, None, 4)
        assert admin.post("/admin/tenants", json={"name": "plain"}).json()["weight"] == 1.0
        bad = admin.patch("/admin/tenants/gold", json={"weight": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] is not None
        assert admin.patch("/admin/tenants/gold", json={"max_queued_requests": -1}).status_code == 400


def _stream_first_chunk(live, key: str, body: dict, started: threading.Event, release: threading.Event,
                        out: dict) -> None:
    with live.tenant(key) as client, client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        for _ in r.iter_lines():
            started.set()
            release.wait(60)
            break


def test_max_concurrent_and_queued_requests_give_429_with_retry_after(serve):
    live = serve()
    key = new_tenant(live, "acme", max_concurrent_requests=1, max_queued_requests=0, max_queue_time_s=7)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 200, "ignore_eos": True}
    started, release, out = threading.Event(), threading.Event(), {}
    holder = threading.Thread(target=_stream_first_chunk, args=(live, key, body, started, release, out))
    holder.start()
    assert started.wait(60)
    with live.tenant(key) as client:
        refused = client.post("/v1/completions", json={**body, "max_tokens": 1})
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "7"
        assert "max_queued_requests=0" in refused.json()["error"]["message"]
        release.set()  # the client hangs up: the engine aborts, the slot comes back
        holder.join(60)
        deadline = time.monotonic() + 30
        while live.ctx.admission.active_by_name() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.ctx.admission.active_by_name() == {}
        assert client.post("/v1/completions", json={**body, "max_tokens": 1}).status_code == 200
    with live.admin() as admin:
        metrics = admin.get("/metrics").text
    assert 'loraplex_tenant_refused_total{status="429",tenant="acme"} 1.0' in metrics


def test_engine_queue_time_gives_503_and_per_tenant_metrics(serve, tiny_llama_dir):
    """Tenant ``slow`` waits in the engine (1 sequence at a time) behind tenant ``big``; once
    its queue time has passed on the engine's clock it gets 503 with Retry-After."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.platform.async_engine import AsyncEngine

    clock = FakeClock()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_num_seqs=1, block_size=16,
                                    scheduling_policy="fair"))
    live = serve(engine=AsyncEngine(engine, stats_interval_s=0.2, clock=clock))
    big = new_tenant(live, "big", weight=3)
    slow = new_tenant(live, "slow", max_queue_time_s=30)
    long_body = {"model": "tiny", "prompt": "one two three", "max_tokens": 120, "ignore_eos": True}
    started, release, out = threading.Event(), threading.Event(), {}
    holder = threading.Thread(target=_stream_first_chunk, args=(live, big, long_body, started, release, out))
    holder.start()
    assert started.wait(60)
    result = {}

    def waiting_request() -> None:
        with live.tenant(slow) as client:
            result["response"] = client.post("/v1/completions", json={**long_body, "max_tokens": 2})

    waiter = threading.Thread(target=waiting_request)
    waiter.start()
    deadline = time.monotonic() + 30
    while not engine.scheduler.waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.scheduler.waiting) == 1  # slow's request waits behind big's running one
    clock.now += 31
    waiter.join(60)
    response = result["response"]
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "30" and response.json()["error"]["code"] == "queue_timeout"
    release.set()
    holder.join(60)
    assert engine.scheduler.vtc.weights == {"big": 3.0, "slow": 1.0}
    with live.tenant(slow) as client:  # served normally once the engine is free
        done = client.post("/v1/completions", json={**long_body, "max_tokens": 2})
        assert done.status_code == 200
    with live.admin() as admin:
        stats = admin.get("/admin/stats").json()["engine"]
        metrics = admin.get("/metrics").text
    tenants = {t["tenant_id"]: t for t in stats["tenants"]}
    assert stats["scheduling_policy"] == "fair"
    assert tenants["slow"]["output_tokens_served"] == 2
    assert f'loraplex_tenant_output_tokens_served_total{{tenant="slow"}} 2.0' in metrics
    assert 'loraplex_tenant_queueing_delay_seconds_count{tenant="slow"} 1.0' in metrics
    assert 'loraplex_tenant_queue_length{tenant="big"} 0.0' in metrics
    served = float(re.search(r'loraplex_tenant_prompt_tokens_served_total\{tenant="big"\} (\S+)', metrics).group(1))
    assert served == tenants["big"]["prompt_tokens_served"] > 0


def test_fair_policy_is_the_server_default(tmp_path):
    from platform_testlib import make_settings

    from loraplex import cli
    from loraplex.platform.cli import settings_from_args

    assert make_settings(tmp_path).scheduling_policy == "fair"
    args = cli.build_parser(cache_dir_default=cli.default_cache_dir()).parse_args(
        ["serve", "--model", "m", "--scheduling-policy", "fcfs", "--fair-output-token-weight", "3"])
    settings = settings_from_args(args)
    assert (settings.scheduling_policy, settings.fair_output_token_weight) == ("fcfs", 3.0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_settings(tmp_path, scheduling_policy="lottery")
