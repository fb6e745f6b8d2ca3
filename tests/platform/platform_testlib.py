"""Helpers of the platform tests (used by conftest.py and the test modules): a live
uvicorn server on loopback, tenants, PEFT adapters made with ``peft`` and their HF
reference outputs, archives, a private redis-server, and PostgreSQL resets."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from upload_checks import ISSUE_NAME, ISSUE_REGEX, crashing_check, gil_holding_check, memory_hungry_check  # noqa: F401

ADMIN_KEY = "test-admin-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- database ----------------------------------------------------------------------------------------
def reset_postgres(url: str) -> None:
    """Drop everything in the public schema (each test starts from an empty database)."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA public CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()


# -- redis -------------------------------------------------------------------------------------------
@dataclass
class RedisProcess:
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_redis() -> RedisProcess:
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return RedisProcess(port, process)
        time.sleep(0.05)
    process.kill()
    pytest.fail("redis-server did not start")


# -- engine and apps ---------------------------------------------------------------------------------
def make_settings(tmp_path: Path, **overrides):
    from loraplex.platform.settings import Settings

    # gc_freeze off: a full collection at each of the suite's many server starts (test_gc_freeze.py checks it on)
    values = dict(data_dir=tmp_path / "data", admin_key=ADMIN_KEY, stats_interval_s=0.2, gc_freeze=False)
    values.update(overrides)
    return Settings(**values)


@dataclass
class LiveServer:
    """A uvicorn server in a thread; ``url`` like http://127.0.0.1:PORT."""

    app: object
    url: str
    server: object
    thread: threading.Thread

    @property
    def ctx(self):
        return self.app.state.ctx

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)

    def tenant(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def run_server(app) -> LiveServer:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return LiveServer(app, f"http://127.0.0.1:{port}", server, thread)


def new_tenant(live: LiveServer, name: str, **limits) -> str:
    """Create a tenant and return a fresh API key of it."""
    with live.admin() as admin:
        assert admin.post("/admin/tenants", json={"name": name, **limits}).status_code == 201
        response = admin.post(f"/admin/tenants/{name}/keys")
        assert response.status_code == 201, response.text
        return response.json()["key"]


# -- adapters ----------------------------------------------------------------------------------------
def make_peft_adapter(model_dir: Path, out: Path, *, r: int = 4, alpha: int = 8, seed: int = 1,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj"), b_std: float = 0.5,
                      **config_overrides) -> Path:
    """A PEFT LoRA adapter of the HF model in ``model_dir`` with random, non-zero B, saved
    as adapter_config.json + adapter_model.safetensors in ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM", **config_overrides)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_reference_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_tokens: int,
                          ignore_eos: bool = False) -> list[int]:
    """Greedy token ids from HF transformers (+ PEFT when ``adapter_dir``): the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        if ignore_eos:
            model.generation_config.eos_token_id = None
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


def tar_gz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def adapter_members(adapter_dir: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + n: (adapter_dir / n).read_bytes()
            for n in ("adapter_config.json", "adapter_model.safetensors")}


def stored_state(live: LiveServer) -> tuple[int, int, list[str]]:
    """(adapter rows, version rows, stored adapter folders): what an upload leaves behind."""
    from loraplex.platform.models import Adapter, AdapterVersion

    ctx = live.ctx
    with ctx.sessions() as session:
        adapters = session.scalar(sa.select(sa.func.count(Adapter.id)))
        versions = session.scalar(sa.select(sa.func.count(AdapterVersion.id)))
    root = ctx.settings.adapters_dir
    folders = sorted(p.name for p in root.iterdir()) if root.exists() else []
    tmp = ctx.settings.uploads_tmp_dir
    leftovers = sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []
    assert leftovers == [], f"staging folders left behind: {leftovers}"
    return adapters, versions, folders


# -- upload checks -----------------------------------------------------------------------------------


def streamed_chunks(live: LiveServer, key: str, model: str, stop: threading.Event, pending: threading.Event,
                    counts: dict[str, int]) -> None:
    """Stream completions of ``model`` back to back until ``stop``; count chunks with text in
    ``counts["total"]`` and, of those, the ones received while ``pending`` is set in ``counts["pending"]``."""
    import json

    with live.tenant(key) as client:
        while not stop.is_set():
            body = {"model": model, "prompt": "Paris is", "max_tokens": 48, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if json.loads(line[6:])["choices"][0]["text"]:
                        counts["total"] += 1
                        counts["pending"] += pending.is_set()


# -- token bytes (reference for logprobs) ------------------------------------------------------------
def raw_token_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's own bytes, from GPT-2's byte alphabet (transformers' copy)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    if token_id in added:
        return added[token_id].encode()
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def display(raw: bytes) -> str:
    """OpenAI's token text: the text, or ``bytes:\\xNN...`` when not valid UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
