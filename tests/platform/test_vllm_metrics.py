"""vLLM-named metrics (issue 18): ``vllm:lora_requests_info`` lists the adapters with running and
waiting requests by the name requests use, ``max_lora`` the slots; ``loraplex_lora_adapter_resident``
says which adapter versions sit in a device slot / in host memory; the engine gauges a
Kubernetes router reads come under vLLM's names too. Counts come from requests added and
scheduler steps taken here (2 slots: a third adapter waits while two run)."""

from __future__ import annotations

from platform_testlib import make_peft_adapter
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.async_engine import stats_to_dict
from loraplex.platform.lora_names import engine_lora_name, model_name_of, parse_engine_lora_name
from loraplex.platform.metrics import PlatformMetrics


class _Snapshot:
    """What the collector reads from an engine: ``stats_dict()``."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stats_dict(self):
        return stats_to_dict(self.engine.get_stats())


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _by_name(samples, name: str) -> dict[tuple, float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def test_lora_requests_info_and_residency_follow_the_scheduler(tiny_engine, tiny_llama_dir, tmp_path):
    folders = {name: make_peft_adapter(tiny_llama_dir, tmp_path / name, seed=i + 1)
               for i, name in enumerate(("support", "legal", "poet"))}
    # Tenant 1's "support" and "legal", tenant 2's "poet" (engine names carry tenant id and version).
    loras = {"support": LoRARequest(engine_lora_name(1, "support", 3), 1, str(folders["support"])),
             "legal": LoRARequest(engine_lora_name(1, "legal", 1), 2, str(folders["legal"])),
             "poet": LoRARequest(engine_lora_name(2, "poet", 1), 3, str(folders["poet"]))}
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    prompt = tiny_engine.tokenizer.encode("Paris is the capital of")
    metrics = PlatformMetrics(wall_clock=lambda: 1_700_000_000.5)
    metrics.bind_engine(_Snapshot(tiny_engine), model_name="tiny")

    tiny_engine.add_request("s1", prompt, params, loras["support"])
    tiny_engine.add_request("s2", prompt, params, loras["support"])
    tiny_engine.add_request("l1", prompt, params, loras["legal"])
    tiny_engine.add_request("b1", prompt, params)
    samples = _samples(metrics.render().decode())
    assert _by_name(samples, "vllm:lora_requests_info") == {
        (("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", "legal,support")): 1_700_000_000.5}
    assert samples[("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "tiny")))] == 4
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "tiny")))] == 0

    while tiny_engine.get_stats().num_waiting:  # two adapters fit the two slots: all four get admitted
        tiny_engine.step()
    tiny_engine.add_request("p1", prompt, params, loras["poet"])  # a third adapter: waits for a slot
    tiny_engine.step()
    stats = tiny_engine.get_stats()
    assert (stats.num_running, stats.num_waiting) == (4, 1)
    samples = _samples(metrics.render().decode())
    assert _by_name(samples, "vllm:lora_requests_info") == {
        (("max_lora", "2"), ("running_lora_adapters", "legal,support"), ("waiting_lora_adapters", "poet")):
            1_700_000_000.5}
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "tiny")))] == 4
    assert samples[("vllm:num_requests_waiting", (("engine", "0"), ("model_name", "tiny")))] == 1
    used, total = stats.kv_blocks_used, stats.kv_blocks_total
    assert samples[("vllm:kv_cache_usage_perc", (("engine", "0"), ("model_name", "tiny")))] == used / total > 0
    resident = _by_name(samples, "loraplex_lora_adapter_resident")
    gpu = {dict(labels)["adapter"] for labels, value in resident.items() if dict(labels)["level"] == "gpu"}
    assert gpu == {"1/support@3", "1/legal@1"}
    assert all(value == 1.0 for value in resident.values())
    cpu = {dict(labels)["adapter"] for labels, value in resident.items() if dict(labels)["level"] == "cpu"}
    assert {"1/support@3", "1/legal@1"} <= cpu  # slot images come through the host cache

    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    samples = _samples(metrics.render().decode())
    assert _by_name(samples, "vllm:lora_requests_info") == {
        (("max_lora", "2"), ("running_lora_adapters", ""), ("waiting_lora_adapters", "")): 1_700_000_000.5}


def test_engine_lora_names_round_trip():
    assert engine_lora_name(3, "support-v2", 12) == "3/support-v2@12"
    parts = parse_engine_lora_name("3/support-v2@12")
    assert (parts.tenant_id, parts.name, parts.version) == (3, "support-v2", 12)
    assert model_name_of("3/support-v2@12") == "support-v2"
    assert parse_engine_lora_name("french") is None and model_name_of("french") == "french"
