"""Tenant isolation: B cannot list, use, read, delete or learn of A's adapters; the 404
body for A's adapter is byte-for-byte the body for a name that never existed."""

from __future__ import annotations

import openai
import pytest
from platform_testlib import adapter_members, make_peft_adapter, new_tenant, zip_bytes


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    return (make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("a"), seed=11),
            make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("b"), seed=12))


def upload(admin, tenant, name, folder):
    response = admin.post(f"/admin/tenants/{tenant}/adapters", data={"name": name},
                          files={"file": ("a.zip", zip_bytes(adapter_members(folder)), "application/zip")})
    assert response.status_code == 201, response.text


def probe(client, name: str) -> dict[str, tuple[int, bytes]]:
    """Everything tenant-facing that could reveal adapter ``name``: (status, raw body)."""
    out = {}
    for label, method, path, body in [
        ("get", "GET", f"/v1/adapters/{name}", None),
        ("model", "GET", f"/v1/models/{name}", None),
        ("delete", "DELETE", f"/v1/adapters/{name}", None),
        ("completion", "POST", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}),
        ("chat", "POST", "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = client.request(method, path, json=body)
        out[label] = (response.status_code, response.content)
    return out


def test_other_tenants_adapters_are_invisible(serve, adapters):
    live = serve()
    key_a, key_b = new_tenant(live, "alpha"), new_tenant(live, "beta")
    with live.admin() as admin, live.tenant(key_a) as a, live.tenant(key_b) as b:
        before = probe(b, "secret")  # "secret" does not exist anywhere yet
        upload(admin, "alpha", "secret", adapters[0])
        after = probe(b, "secret")  # now it is alpha's
        assert after == before
        assert all(status == 404 for status, _ in after.values())
        assert b"alpha" not in b"".join(body for _, body in after.values())
        assert [m["id"] for m in b.get("/v1/models").json()["data"]] == ["tiny"]
        assert b.get("/v1/adapters").json() == []
        # alpha still has it, untouched by beta's delete attempt
        assert [m["id"] for m in a.get("/v1/models").json()["data"]] == ["tiny", "secret"]
        assert a.get("/v1/adapters/secret").status_code == 200


def test_same_name_in_two_tenants_serves_each_its_own(serve, adapters):
    live = serve()
    key_a, key_b = new_tenant(live, "alpha"), new_tenant(live, "beta")
    with live.admin() as admin:
        upload(admin, "alpha", "shared", adapters[0])
        upload(admin, "beta", "shared", adapters[1])
    a = openai.OpenAI(api_key=key_a, base_url=live.url + "/v1", max_retries=0)
    b = openai.OpenAI(api_key=key_b, base_url=live.url + "/v1", max_retries=0)
    kwargs = dict(model="shared", prompt="The quick brown", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    text_a, text_b = a.completions.create(**kwargs).choices[0].text, b.completions.create(**kwargs).choices[0].text
    assert text_a != text_b
    # Deleting beta's does not touch alpha's.
    with live.tenant(key_b) as client_b:
        assert client_b.delete("/v1/adapters/shared").status_code == 204
    assert a.completions.create(**kwargs).choices[0].text == text_a
    with pytest.raises(openai.NotFoundError):
        b.completions.create(**kwargs)


def test_admin_routes_refuse_tenant_keys(serve):
    live = serve()
    key = new_tenant(live, "alpha")
    with live.tenant(key) as client:
        for method, path in [("GET", "/admin/tenants"), ("GET", "/admin/stats"), ("POST", "/admin/tenants/alpha/keys"),
                             ("GET", "/admin/tenants/alpha/adapters")]:
            response = client.request(method, path)
            assert response.status_code == 401, path
            assert response.json()["error"]["type"] == "authentication_error"
