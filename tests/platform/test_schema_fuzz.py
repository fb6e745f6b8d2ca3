"""Fuzz every operation of the OpenAPI schema with schemathesis (a bounded number of
examples each): no 5xx, every error body follows the OpenAI error schema, and every
response conforms to the schema the app publishes (status codes it documents, content
types, and the JSON response models: ``response_schema_conformance``).

schemathesis 4's pytest plugin (``schemathesis.pytest.from_fixture``) fails under pytest
9.2 (it rewrites ``Node._nodeid``, which pytest 9.2 no longer has); so the test drives
schemathesis' Hypothesis strategies itself (``APIOperation.as_strategy``) and checks each
response with ``Case.validate_response``.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from platform_testlib import ADMIN_KEY, make_settings, new_tenant, run_server
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

CHECKS = [not_a_server_error, content_type_conformance, response_schema_conformance]


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


def _operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_lists_the_serving_operations(fuzz_server):
    labels = {op.label for op in _operations(fuzz_server.app)}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
            "GET /v1/models/{model_id}"} <= labels


def test_no_server_errors_and_responses_follow_the_schema(fuzz_server):
    failures = []
    for operation in _operations(fuzz_server.app):
        key = ADMIN_KEY if operation.path.startswith("/admin") else fuzz_server.tenant_key

        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                  database=None)
        def check(case):
            headers = {"Authorization": f"Bearer {key}"}
            response = case.call(base_url=fuzz_server.url, headers=headers, timeout=120)
            case.validate_response(response, checks=CHECKS, headers=headers)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        try:
            check()
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure, then report
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
