"""A client that disconnects aborts its request (KV blocks and slot pin freed), and
``/metrics`` reports requests, tokens, latencies, KV usage and adapter slots."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import openai
from platform_testlib import ADMIN_KEY, adapter_members, make_peft_adapter, new_tenant, zip_bytes
from prometheus_client.parser import text_string_to_metric_families


class ErrorRecords(logging.Handler):
    """The ERROR records of a logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_idle(live, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    from loraplex.platform.async_engine import stats_to_dict

    while True:
        # a fresh snapshot taken on the engine thread (the published one can predate the request)
        stats = stats_to_dict(live.ctx.engine._submit(live.ctx.engine.engine.get_stats).result(timeout_s))
        if stats and stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class StepGate:
    """Holds the engine after ``steps`` steps until the server has aborted every request.

    Makes the disconnect tests independent of machine speed: no request can finish (or run
    on) while its client goes away; ``reached`` tells the test when to leave. Wraps the
    engine's ``step`` (engine thread); while holding, it runs the commands the server
    submits (an abort is one) on the engine thread, as the engine loop would between steps.
    """

    def __init__(self, async_engine, steps: int) -> None:
        self.async_engine = async_engine
        self.llm_engine = async_engine.engine
        self.steps = steps
        self.taken = 0
        self.reached = threading.Event()
        self.aborted = threading.Event()
        self._submitted = threading.Event()
        self._step = self.llm_engine.step
        self._submit = async_engine._submit
        self.llm_engine.step = self.step
        async_engine._submit = self.submit

    def step(self):
        if self.taken == self.steps:
            self.reached.set()
            while self.llm_engine.has_unfinished_requests():
                assert self._submitted.wait(60), "the server never aborted the request"
                self._submitted.clear()
                self.async_engine._run_commands()
            self.aborted.set()
        self.taken += 1
        return self._step()

    def submit(self, fn):
        future = self._submit(fn)
        self._submitted.set()
        return future

    def close(self) -> None:
        self.llm_engine.step = self._step
        self.async_engine._submit = self._submit


def http_request(live, key: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    host = live.url.removeprefix("http://")
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload


def test_disconnect_mid_stream_frees_blocks_and_slot_pins(serve, tiny_llama_dir, tmp_path):
    live = serve()
    key = new_tenant(live, "acme")
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "a")
    with live.admin() as admin:
        assert admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                          files={"file": ("a.zip", zip_bytes(adapter_members(adapter)), "application/zip")}
                          ).status_code == 201
    max_tokens, gate_steps = 400, 8
    before = wait_idle(live)["generated_tokens_total"]
    for model in ("tiny", "poet"):
        body = {"model": model, "prompt": "The quick brown fox " * 4, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        gate = StepGate(live.ctx.engine, gate_steps)
        try:
            with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
                with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    lines = response.iter_lines()
                    received = [next(lines) for _ in range(4)]
                    assert all(line.startswith("data: {") or line == "" for line in received)
                    assert gate.reached.wait(60)
                # leaving the block closes the connection mid-stream
            assert gate.aborted.wait(60)
        finally:
            gate.close()
        stats = wait_idle(live)
        assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats
        assert all(slot["pin_count"] == 0 for slot in stats["lora"]["slots"])
        # it stopped where the client left: at most one step after the gate (+1 for the prefill's token)
        assert stats["generated_tokens_total"] - before <= gate_steps + 2
        before = stats["generated_tokens_total"]
    # a non-streamed request whose client gives up is aborted too, an ordinary end: no "Exception in ASGI
    # application" traceback in the server log
    body = {"model": "poet", "prompt": "Paris", "max_tokens": max_tokens, "ignore_eos": True}
    gate = StepGate(live.ctx.engine, gate_steps)
    errors = ErrorRecords()
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        with socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(http_request(live, key, body))
            assert gate.reached.wait(60)
        assert gate.aborted.wait(60)
        stats = wait_idle(live)
        live.stop()  # a sync point: the server ends once the request's handler has ended (and logged)
    finally:
        gate.close()
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert [r.getMessage() for r in errors.records] == []
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert stats["generated_tokens_total"] - before <= gate_steps + 2


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
    # vLLM's names (issue 18): idle engine, both adapters' requests done; acme (tenant 1)'s poet v1 in a slot.
    assert value("vllm:num_requests_running", model_name="tiny", engine="0") == 0
    assert value("vllm:lora_requests_info", max_lora="2", running_lora_adapters="", waiting_lora_adapters="") > 0
    assert value("loraplex_lora_adapter_resident", adapter="1/poet@1", level="gpu") == 1
