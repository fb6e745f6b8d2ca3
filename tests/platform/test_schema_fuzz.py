"""Fuzz every operation of the OpenAPI schema with schemathesis (a bounded number of
examples each): no 5xx, and every error body follows the OpenAI error schema."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from platform_testlib import ADMIN_KEY, make_settings, new_tenant, run_server


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, tmp_path_factory):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.platform.main import create_app

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    num_kv_blocks=256, max_num_seqs=16, max_model_len=128))
    live = run_server(create_app(make_settings(tmp_path_factory.mktemp("fuzz"), served_model_name="tiny"), engine))
    live.tenant_key = new_tenant(live, "acme")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_server.app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server):
    key = ADMIN_KEY if case.path.startswith("/admin") else fuzz_server.tenant_key
    response = case.call(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
