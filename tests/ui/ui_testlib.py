"""Helpers of the console tests: the platform app over the tiny random Llama with the
console mounted, and a live uvicorn server on loopback."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ADMIN_KEY = "ui-test-admin-key"
MODEL_ID = "tiny"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def make_engine(model_dir: Path):
    """The tiny Llama with LoRA on: 2 GPU slots, rank <= 8, 4 in the CPU cache, small KV cache."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                  max_cpu_loras=4, num_kv_blocks=96, max_num_seqs=8, block_size=16))


def make_app(data_dir: Path, model_dir: Path, *, console: bool = True):
    """``create_app`` over a fresh engine and database; ``console``: mounted at /ui, as
    ``loraplex serve`` does (through the CLI's ``mount_console_if_installed`` hook)."""
    from loraplex.cli import mount_console_if_installed
    from loraplex.platform.main import create_app
    from loraplex.platform.settings import Settings

    settings = Settings(data_dir=data_dir, admin_key=ADMIN_KEY, served_model_name=MODEL_ID, gc_freeze=False,
                        stats_interval_s=0.2)
    app = create_app(settings, make_engine(model_dir))
    if console:
        mount_console_if_installed(app)
    if console and not any(getattr(route, "path", None) == "/ui" for route in app.routes):
        raise RuntimeError("mount_console_if_installed did not mount the console at /ui")
    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    """uvicorn serving ``app`` in a thread; ``url`` like http://127.0.0.1:PORT."""

    app: object
    url: str
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_server(app) -> LiveServer:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return LiveServer(app, f"http://127.0.0.1:{port}", server, thread)
