"""Nothing under /ui accepts data before sign-in (issue 14, item 6), what the console
stores is bounded in size and lifetime, and console responses cannot be framed (item 17).

Gradio's upload endpoint ``/ui/gradio_api/upload`` (and its other data endpoints) answer 401
without a console session, which only ``POST /ui/session`` with a valid key opens (the
browser walkthrough in test_browser.py signs in and uploads through the page)."""

from __future__ import annotations

import socket

import httpx
import pytest
from ui_testlib import ADMIN_KEY, MODEL_ID, make_engine, run_server

from loraplex.ui.gate import COOKIE

SMALL_FILE = ("adapter_config.json", b'{"r": 8}', "application/json")


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama_dir):
    from loraplex.cli import mount_console_if_installed
    from loraplex.platform.main import create_app
    from loraplex.platform.settings import Settings

    settings = Settings(data_dir=tmp_path_factory.mktemp("gate"), admin_key=ADMIN_KEY, served_model_name=MODEL_ID,
                        gc_freeze=False, console_file_lifetime_s=600, max_upload_mb=1.0)
    app = create_app(settings, make_engine(tiny_llama_dir))
    mount_console_if_installed(app)
    server = run_server(app)
    yield server
    server.stop()


def new_tenant_key(live, name: str) -> str:
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
        assert admin.post("/admin/tenants", json={"name": name}).status_code == 201
        return admin.post(f"/admin/tenants/{name}/keys").json()["key"]


def test_gradio_data_endpoints_refuse_everything_before_sign_in(live):
    for path in ("/ui/gradio_api/upload", "/ui/gradio_api/process_recording", "/ui/gradio_api/run/predict",
                 "/ui/gradio_api/call/sign_in", "/ui/gradio_api/api/sign_in"):
        response = httpx.post(live.url + path, files={"files": SMALL_FILE})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=live.url, cookies={COOKIE: "made-up"}) as client:
        assert client.post("/ui/gradio_api/upload", files={"files": SMALL_FILE}).status_code == 401
    # A declared 200 MB upload is refused from the headers: the body is never waited for.
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /ui/gradio_api/upload HTTP/1.1\r\nHost: t\r\nContent-Type: multipart/form-data; "
                     b"boundary=x\r\nContent-Length: 200000000\r\n\r\n" + b"x" * 65536)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")


def test_a_console_session_opens_uploads_within_the_size_cap(live):
    assert httpx.post(live.url + "/ui/session", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with httpx.Client(base_url=live.url) as client:
        opened = client.post("/ui/session", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert opened.status_code == 204
        cookie = opened.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
        assert "Path=/ui" in cookie
        stored = client.post("/ui/gradio_api/upload", files={"files": SMALL_FILE})
        assert stored.status_code == 200 and len(stored.json()) == 1
        too_big = client.post("/ui/gradio_api/upload", files={"files": ("big.bin", b"x" * 1_100_000)})
        assert too_big.status_code == 413  # max_upload_mb=1 (plus 64 KiB of multipart overhead)
        assert client.delete("/ui/session").status_code == 204
        assert client.post("/ui/gradio_api/upload", files={"files": SMALL_FILE}, cookies={
            COOKIE: opened.cookies[COOKIE]}).status_code == 401  # closed on the server too


def test_a_revoked_tenant_key_closes_its_console_session(live):
    key = new_tenant_key(live, "acme")
    with httpx.Client(base_url=live.url) as client:
        assert client.post("/ui/session", headers={"Authorization": f"Bearer {key}"}).status_code == 204
        assert client.post("/ui/gradio_api/upload", files={"files": SMALL_FILE}).status_code == 200
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            key_id = admin.get("/admin/tenants/acme/keys").json()[0]["id"]
            assert admin.delete(f"/admin/tenants/acme/keys/{key_id}").status_code == 204
        assert client.post("/ui/gradio_api/upload", files={"files": SMALL_FILE}).status_code == 401


def test_stored_files_are_bounded_in_size_and_lifetime(live):
    from fastapi.routing import Mount

    mounted = next(r for r in live.app.routes if isinstance(r, Mount) and r.path == "/ui")
    blocks = mounted.app.get_blocks()
    assert blocks.delete_cache == (300, 600)  # checked every 300 s, deleted once older than 600 s
    assert blocks.max_file_size == 1_000_000


def test_console_pages_cannot_be_framed(live):
    for path in ("/ui/", "/ui/config"):
        response = httpx.get(live.url + path, follow_redirects=True)
        assert response.status_code == 200, path
        assert response.headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert response.headers["x-content-type-options"] == "nosniff"


def test_a_console_callback_shows_a_clean_message_when_the_registry_is_down():
    from sqlalchemy.exc import OperationalError

    from loraplex.ui.wiring import with_error_message

    def callback():
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError('connection to server at "db.internal" '
                                                                      "(10.0.0.5), port 5432 failed"))

    table, message = with_error_message(2, callback)
    assert "registry is unavailable" in message
    assert "5432" not in message and "db.internal" not in message and "psycopg" not in message.lower()
