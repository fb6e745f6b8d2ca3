"""What an unauthenticated client or another tenant can reach (issue 14, items 4, 5, 17):
``/metrics`` needs the admin key or the metrics key and no tenant-facing route shows another
tenant's adapter names; bodies are refused from the headers before one byte is read (401
unauthenticated, 413 over the per-route cap); every response carries anti-framing headers."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from platform_testlib import (
    ADMIN_KEY,
    LiveServer,
    adapter_members,
    make_peft_adapter,
    make_settings,
    new_tenant,
    run_server,
    zip_bytes,
)

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("exposure"), r=4, alpha=8, seed=7)


def upload(live, tenant: str, name: str, adapter_dir) -> None:
    with live.admin() as admin:
        response = admin.post(f"/admin/tenants/{tenant}/adapters", data={"name": name},
                              files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")})
        assert response.status_code == 201, response.text


# -- item 4 ------------------------------------------------------------------------------------------
def test_metrics_need_the_admin_or_metrics_key_and_tenants_never_see_other_tenants_names(serve, adapter_dir):
    live = serve(metrics_key="metrics-reader-key")
    acme, globex = new_tenant(live, "acme"), new_tenant(live, "globex")
    upload(live, "acme", "acme-secret-adapter", adapter_dir)
    openai.OpenAI(api_key=acme, base_url=live.url + "/v1", max_retries=0).completions.create(
        model="acme-secret-adapter", prompt="hi", max_tokens=1)

    for headers in ({}, {"Authorization": f"Bearer {globex}"}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(live.url + "/metrics", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert "acme-secret-adapter" not in refused.text
    for key in (ADMIN_KEY, "metrics-reader-key"):
        text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
        assert 'loraplex_adapter_requests_total{adapter="acme/acme-secret-adapter"} 1.0' in text
    assert httpx.get(live.url + "/admin/stats",
                     headers={"Authorization": "Bearer metrics-reader-key"}).status_code == 401

    # Every tenant-facing GET route, as globex: none names acme's adapter.
    seen = []
    with live.tenant(globex) as client:
        for path, operations in live.app.openapi()["paths"].items():
            if "get" in operations and not path.startswith("/admin"):
                response = client.get(path.replace("{name}", "acme-secret-adapter"))
                seen.append((path, response.status_code))
                if "{name}" in path:  # the caller's own input echoed: the same body as for a name never used
                    never = client.get(path.replace("{name}", "never-used-name"))
                    assert (response.status_code, response.text.replace("acme-secret-adapter", "X")) == (
                        never.status_code, never.text.replace("never-used-name", "X")), path
                else:
                    assert "acme-secret-adapter" not in response.text, path
        assert client.get("/admin/stats").status_code == 401
        other = client.post("/v1/completions", json={"model": "acme-secret-adapter", "prompt": "hi", "max_tokens": 1})
        missing = client.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "hi", "max_tokens": 1})
        assert other.status_code == missing.status_code == 404
        assert other.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"
    assert ("/v1/models", 200) in seen and ("/v1/adapters/{name}", 404) in seen


# -- item 5 ------------------------------------------------------------------------------------------
class CountingApp:
    """ASGI wrapper counting the request-body bytes the app pulled through ``receive``."""

    def __init__(self, app) -> None:
        self.app = app
        self.state = app.state
        self.body_bytes = 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.body_bytes += len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


@pytest.fixture
def counted(tmp_path, tiny_engine):
    from loraplex.platform.main import create_app

    wrapper = CountingApp(create_app(make_settings(tmp_path, served_model_name="tiny", max_json_body_mb=0.5),
                                     tiny_engine))
    live = run_server(wrapper)
    live.counter = wrapper
    yield live
    live.stop()


def raw_request(live: LiveServer, head: str, body: bytes) -> tuple[int, str]:
    """Send ``head`` and (part of) a body on a raw socket; (status, response text)."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    text = data.decode("latin-1")
    return int(text.split(" ", 2)[1]), text


def head(path: str, *, length: int | None, key: str | None = None, chunked: bool = False,
         content_type: str = "application/json") -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Type: {content_type}"]
    if key:
        lines.append(f"Authorization: Bearer {key}")
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return "\r\n".join(lines) + "\r\n\r\n"


def test_unauthenticated_200_mb_bodies_are_refused_without_being_read(counted):
    for path, content_type in (("/v1/completions", "application/json"), ("/v1/chat/completions", "application/json"),
                               ("/v1/adapters", "multipart/form-data; boundary=x"), ("/admin/tenants", "application/json"),
                               ("/admin/tenants/acme/adapters", "multipart/form-data; boundary=x")):
        status, text = raw_request(counted, head(path, length=200_000_000, content_type=content_type),
                                   b"x" * 65536)
        assert status == 401 and '"type":"authentication_error"' in text.replace(" ", ""), (path, text)
    assert counted.counter.body_bytes == 0


def test_authenticated_oversized_json_gets_413_in_openai_format(counted):
    key = new_tenant(counted, "acme")
    before = counted.counter.body_bytes
    status, text = raw_request(counted, head("/v1/completions", length=200_000_000, key=key), b"{" * 65536)
    assert status == 413 and '"code":"payload_too_large"' in text.replace(" ", "")
    assert "500000 bytes" in text
    assert counted.counter.body_bytes == before  # refused from Content-Length: nothing read
    # A chunked body (no declared length) is refused once past the 500,000-byte cap: its last
    # chunk is never sent, so a server that waited for the whole body would never answer.
    chunk = b"{" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(9))  # 589,824 bytes, unterminated
    status, text = raw_request(counted, head("/v1/completions", length=None, key=key, chunked=True), body)
    assert status == 413 and "more than 500000 bytes" in text
    # Under the cap the body reaches the route as before.
    with counted.tenant(key) as client:
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


# -- item 17 -----------------------------------------------------------------------------------------
def test_responses_carry_anti_framing_headers(serve):
    live = serve()
    for path in ("/health", "/docs", "/v1/models", "/metrics"):
        response = httpx.get(live.url + path)
        assert response.headers["x-frame-options"] == "DENY", path
        assert response.headers["content-security-policy"] == "frame-ancestors 'none'", path
        assert response.headers["x-content-type-options"] == "nosniff", path
