"""A client that disconnects aborts its request (KV blocks and slot pin freed), and
``/metrics`` reports requests, tokens, latencies, KV usage and adapter slots."""

from __future__ import annotations

import time

import httpx
import openai
from platform_testlib import ADMIN_KEY, adapter_members, make_peft_adapter, new_tenant, zip_bytes
from prometheus_client.parser import text_string_to_metric_families


def wait_idle(live, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = live.ctx.engine.stats_dict()
        if stats and stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks_and_slot_pins(serve, tiny_llama_dir, tmp_path):
    live = serve()
    key = new_tenant(live, "acme")
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "a")
    with live.admin() as admin:
        assert admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                          files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")}
                          ).status_code == 201
    max_tokens = 400
    for model in ("tiny", "poet"):
        body = {"model": model, "prompt": "The quick brown fox " * 4, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = [next(lines) for _ in range(4)]
                assert all(line.startswith("data: {") or line == "" for line in received)
            # leaving the block closes the connection mid-stream
        stats = wait_idle(live)
        assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats
        assert all(slot["pin_count"] == 0 for slot in stats["lora"]["slots"])
    # it really stopped early: far fewer tokens than two full requests
    assert stats["generated_tokens_total"] < 2 * max_tokens - 50
    # a non-streamed request whose client gives up is aborted too
    before = stats["generated_tokens_total"]
    body = {"model": "poet", "prompt": "Paris", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=0.5)
    except httpx.TimeoutException:
        pass
    stats = wait_idle(live)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["generated_tokens_total"] - before < max_tokens - 50
    with live.admin() as admin:
        assert admin.get("/admin/stats").json()["engine"]["kv_blocks_used"] == 0


def test_metrics_endpoint(serve, tiny_llama_dir, tmp_path):
    live = serve()
    key = new_tenant(live, "acme", requests_per_minute=4)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "a")
    with live.admin() as admin:
        admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                   files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")})
    usages = [client.completions.create(model=m, prompt="Paris is", max_tokens=5, extra_body={"ignore_eos": True}
                                        ).usage for m in ("tiny", "poet", "poet")]
    list(client.completions.create(model="tiny", prompt="Paris is", max_tokens=5, stream=True,
                                   extra_body={"ignore_eos": True}))
    try:
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
    except openai.RateLimitError:
        pass
    wait_idle(live)
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("loraplex_requests_total", endpoint="/v1/completions", status="200") == 4
    assert value("loraplex_requests_total", endpoint="/v1/completions", status="429") == 1
    assert value("loraplex_rate_limited_total") == 1
    assert value("loraplex_adapter_requests_total", adapter="acme/poet") == 2
    assert value("loraplex_adapter_requests_total", adapter="tiny") == 2
    assert value("loraplex_generation_tokens_total") == 20
    assert value("loraplex_prompt_tokens_total") == sum(u.prompt_tokens for u in usages) + usages[0].prompt_tokens
    assert value("loraplex_time_to_first_token_seconds_count") == 4
    assert value("loraplex_inter_token_latency_seconds_count") >= 4
    assert value("loraplex_request_latency_seconds_count", endpoint="completion") == 4
    assert value("loraplex_engine_kv_blocks_used") == 0
    assert value("loraplex_engine_kv_blocks_total") == 96
    assert value("loraplex_kv_cache_usage_ratio") == 0.0
    assert 0.0 <= value("loraplex_engine_prefix_hit_rate") <= 1.0
    assert value("loraplex_lora_slot_loads_total") >= 1
    assert value("loraplex_lora_slots") == 2
    assert value("loraplex_engine_generated_tokens_total") == 20
