"""A registry (PostgreSQL) outage in the middle of serving (issue 14, item 3).

The app reaches the shared test database through a TCP proxy in this test that can cut
every connection and refuse new ones, then let them through again (the shared cluster is
never stopped). With the database cut: requests for an adapter already in the lookup cache
succeed, streaming and not, with no error after the chunks and no driver text, host or
port anywhere; a new upload gets 503 with a clean message; ``/health`` stays 200 and
``/health/ready`` says 503 (registry unavailable). Once it is back, the buffered usage is
written and the counted usage equals the requests made.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import httpx
import openai
import pytest
from platform_testlib import ADMIN_KEY, adapter_members, make_peft_adapter, new_tenant, reset_postgres, zip_bytes
from sqlalchemy.engine import make_url


class CuttableProxy:
    """Loopback TCP proxy to ``host:port``; :meth:`cut` closes every connection and makes new
    ones close at once (the database looks down), :meth:`restore` lets them through again."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.down = False
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if self.down:
                    client.close()
                    continue
                upstream = socket.create_connection(self.target)
                self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            self.down = True
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()

    def restore(self) -> None:
        with self.lock:
            self.down = False

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.listener.close()


@pytest.fixture
def proxied_postgres(postgres_url):
    reset_postgres(postgres_url)
    url = make_url(postgres_url)
    proxy = CuttableProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("outage"), r=4, alpha=8, seed=5)


def leaks(text: str, proxy: CuttableProxy) -> list[str]:
    """Driver, host or port text in a response body."""
    needles = ["psycopg", "OperationalError", "sqlalchemy", "127.0.0.1", "5432", str(proxy.port)]
    return [n for n in needles if n.lower() in text.lower()]


def test_registry_outage_serves_cached_adapters_and_writes_usage_after(serve, proxied_postgres, adapter_dir):
    proxy = proxied_postgres
    live = serve(database_url=proxy.url, cache_ttl_s=600)
    key = new_tenant(live, "acme")
    with live.admin() as admin:
        upload = admin.post("/admin/tenants/acme/adapters", data={"name": "support"},
                            files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")})
        assert upload.status_code == 201, upload.text
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=60)
    made = [client.completions.create(model="support", prompt="Hello there", max_tokens=4).usage]  # warms the cache
    assert httpx.get(live.url + "/health/ready").json()["registry"] == "ok"

    proxy.cut()
    for _ in range(3):
        response = client.completions.create(model="support", prompt="Hello there", max_tokens=4)
        assert response.usage.completion_tokens >= 1
        made.append(response.usage)
    body = {"model": "support", "prompt": "Hello there", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as stream:
        assert stream.status_code == 200
        text = stream.read().decode()
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text and leaks(text, proxy) == []
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usage_chunks = [c["usage"] for c in chunks if c.get("choices") == [] and c.get("usage")]
    assert len(usage_chunks) == 1, text
    made.append(openai.types.CompletionUsage(**usage_chunks[0]))

    upload = httpx.post(live.url + "/v1/adapters", headers={"Authorization": f"Bearer {key}"},
                        data={"name": "another"},
                        files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")},
                        timeout=60)
    assert upload.status_code == 503, upload.text
    assert upload.json()["error"]["code"] == "registry_unavailable" and leaks(upload.text, proxy) == []
    unknown = httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer lpx-not-cached"}, timeout=60)
    assert unknown.status_code == 503 and leaks(unknown.text, proxy) == []
    assert httpx.get(live.url + "/health").status_code == 200
    ready = httpx.get(live.url + "/health/ready")
    assert ready.status_code == 503 and ready.json() == {
        "status": "not_ready", "registry": "unavailable", "cache": "ok", "engine": "ok",
        "usage_pending": 1, "usage_lost_requests": 0}
    assert live.ctx.usage.pending() >= 1  # buffered, not lost
    assert live.ctx.usage.lost.requests == 0

    proxy.restore()
    assert live.ctx.usage.flush() is True
    assert httpx.get(live.url + "/health/ready").status_code == 200
    with live.admin() as admin:
        counted = admin.get("/admin/stats").json()["tenants"]
    assert len(made) == 5
    assert counted == [{"tenant": "acme", "requests": 5,
                        "prompt_tokens": sum(u.prompt_tokens for u in made),
                        "completion_tokens": sum(u.completion_tokens for u in made)}]
    assert live.ctx.usage.lost.requests == 0
    assert ADMIN_KEY not in text
