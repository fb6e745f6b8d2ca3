"""Fixtures of the platform tests (helpers live in platform_testlib.py): apps over the
tiny random Llama served live on loopback, a private redis-server, and the PostgreSQL
URL from ``LORAPLEX_TEST_DATABASE_URL`` (skipped when unset, except with ``CI=true``
where a missing database fails the test)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from platform_testlib import LiveServer, RedisProcess, make_settings, reset_postgres, run_server, start_redis


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """``LORAPLEX_TEST_DATABASE_URL``; skip when unset unless ``CI=true`` (then fail loudly)."""
    url = os.environ.get("LORAPLEX_TEST_DATABASE_URL")
    if not url:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but LORAPLEX_TEST_DATABASE_URL is unset: PostgreSQL tests cannot run")
        pytest.skip("LORAPLEX_TEST_DATABASE_URL is unset (run scripts/ci_services.sh)")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> str | None:
    """None (the SQLite default under data_dir) or a freshly emptied PostgreSQL database."""
    if request.param == "sqlite":
        return None
    url = request.getfixturevalue("postgres_url")
    reset_postgres(url)
    return url


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    server = start_redis()
    yield server
    server.kill()


@pytest.fixture
def tiny_engine(tiny_llama_dir):
    """A fresh engine over the tiny Llama with LoRA on (2 slots, rank <= 8), small KV cache."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                  max_cpu_loras=4, num_kv_blocks=96, max_num_seqs=8, block_size=16))


@pytest.fixture
def serve(tmp_path, tiny_engine):
    """``serve(**settings_overrides)`` -> a started LiveServer over the tiny engine (stopped at teardown)."""
    from loraplex.platform.main import create_app

    servers: list[LiveServer] = []

    def start(engine=tiny_engine, **overrides) -> LiveServer:
        settings = make_settings(tmp_path, served_model_name="tiny", **overrides)
        live = run_server(create_app(settings, engine))
        servers.append(live)
        return live

    yield start
    for live in servers:
        live.stop()
