"""Fixtures of the console tests: the platform app over the tiny random Llama, a real
PEFT adapter (non-zero B). Helpers live in ui_testlib.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import make_peft_adapter
from ui_testlib import PEFT_FILES, make_app


@pytest.fixture(scope="session")
def peft_adapter_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """A real PEFT LoRA adapter of the tiny Llama (rank 8, q/v/o, B ~ N(0, 0.5))."""
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("peft") / "shouty", r=8, alpha=16,
                             targets=("q_proj", "v_proj", "o_proj"), b_std=0.5, seed=3)


@pytest.fixture(scope="session")
def peft_files(peft_adapter_dir) -> list[str]:
    """The adapter's two files, as the console's file picker hands them over."""
    return [str(peft_adapter_dir / name) for name in PEFT_FILES]


@pytest.fixture
def app(tmp_path, tiny_llama_dir):
    """The platform app (console not mounted: the callbacks only need its context); its
    engine thread is not started."""
    app = make_app(tmp_path / "data", tiny_llama_dir, console=False)
    yield app
    app.state.ctx.db.dispose()


@pytest.fixture
def ctx(app):
    return app.state.ctx


@pytest.fixture
def running_ctx(ctx) -> Iterator:
    """``ctx`` with its engine thread running (chat, preloading, live stats)."""
    ctx.engine.start()
    yield ctx
    ctx.engine.shutdown()
