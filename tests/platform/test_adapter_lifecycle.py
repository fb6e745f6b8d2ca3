"""Adapters end to end: upload (zip, tar.gz, two files; admin and tenant APIs), the
adapter goes live and its output equals HF transformers + PEFT's, re-upload makes a
new version while in-flight requests finish on the old one, delete removes it at once."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from platform_testlib import (
    adapter_members,
    make_peft_adapter,
    new_tenant,
    peft_reference_greedy,
    stored_state,
    tar_gz_bytes,
    zip_bytes,
)
from transformers import AutoTokenizer

PROMPT = "Paris is the capital of"


@pytest.fixture(scope="module")
def adapter_v1(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("v1"), r=4, alpha=8, seed=1,
                             target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def adapter_v2(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("v2"), r=8, alpha=16, seed=2,
                             target_modules=("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"))


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(PROMPT)


def upload_zip(admin, tenant: str, name: str, adapter_dir, prefix: str = ""):
    data = zip_bytes(adapter_members(adapter_dir, prefix))
    return admin.post(f"/admin/tenants/{tenant}/adapters", data={"name": name},
                      files={"file": ("adapter.zip", data, "application/zip")})


def greedy_ids(client: openai.OpenAI, model: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Generated token ids, read back through logprobs (tokens are per-id there)."""
    response = client.completions.create(model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                         logprobs=0, extra_body={"ignore_eos": True})
    return response.choices[0].logprobs.tokens, response.choices[0].text


def ref_text(tiny_llama_dir, adapter_dir, prompt_ids, n):
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return tok.decode(peft_reference_greedy(tiny_llama_dir, adapter_dir, prompt_ids, n, ignore_eos=True),
                      skip_special_tokens=True)


def test_upload_goes_live_and_matches_peft(serve, adapter_v1, tiny_llama_dir, prompt_ids):
    live = serve()
    key = new_tenant(live, "acme")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    with live.admin() as admin:
        response = upload_zip(admin, "acme", "poet", adapter_v1)
    assert response.status_code == 201, response.text
    body = response.json()
    config = json.loads((adapter_v1 / "adapter_config.json").read_text())
    assert (body["name"], body["version"], body["status"]) == ("poet", 1, "ready")
    assert body["rank"] == config["r"] and body["alpha"] == config["lora_alpha"]
    assert sorted(body["target_modules"]) == sorted(config["target_modules"])
    assert len(body["version_id"]) == 64
    assert stored_state(live) == (1, 1, [body["version_id"]])

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "poet"} and models["poet"].model_extra["parent"] == "tiny"

    base_text = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    _, lora_text = greedy_ids(client, "poet", prompt_ids, 12)
    assert lora_text != base_text
    assert lora_text == ref_text(tiny_llama_dir, adapter_v1, prompt_ids, 12)
    chat = client.chat.completions.create(model="poet", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens >= 1


@pytest.mark.parametrize("packing", ["tar.gz", "files", "tenant-api"])
def test_other_upload_forms(serve, adapter_v1, packing):
    live = serve()
    key = new_tenant(live, "acme")
    members = adapter_members(adapter_v1)
    with live.admin() as admin, live.tenant(key) as tenant:
        if packing == "tar.gz":
            data = tar_gz_bytes(adapter_members(adapter_v1, "my-adapter/"))
            response = admin.post("/admin/tenants/acme/adapters", data={"name": "a"},
                                  files={"file": ("a.tar.gz", data, "application/gzip")})
        elif packing == "files":
            response = admin.post("/admin/tenants/acme/adapters", data={"name": "a"}, files=[
                ("files", ("adapter_config.json", members["adapter_config.json"], "application/json")),
                ("files", ("adapter_model.safetensors", members["adapter_model.safetensors"],
                           "application/octet-stream"))])
        else:
            response = tenant.post("/v1/adapters", data={"name": "a"},
                                   files={"file": ("a.zip", zip_bytes(members), "application/zip")})
        assert response.status_code == 201, response.text
        assert tenant.get("/v1/adapters/a").json()["version_id"] == response.json()["version_id"]
        assert [a["name"] for a in tenant.get("/v1/adapters").json()] == ["a"]
        assert [a["name"] for a in admin.get("/admin/tenants/acme/adapters").json()] == ["a"]


def test_reupload_is_a_new_version_and_in_flight_requests_finish_on_the_old(
        serve, adapter_v1, adapter_v2, tiny_llama_dir, prompt_ids):
    live = serve()
    key = new_tenant(live, "acme")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    long_tokens = 200
    engine = live.ctx.engine
    with live.admin() as admin:
        first = upload_zip(admin, "acme", "poet", adapter_v1).json()
        stream = client.completions.create(model="poet", prompt=prompt_ids, max_tokens=long_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        pieces = [next(chunks).choices[0].text]
        # Hold the engine between two steps while v2 is uploaded, so the request is surely in flight.
        gate = threading.Event()
        paused = engine.run_on_engine_thread(lambda: gate.wait(60))
        try:
            second = upload_zip(admin, "acme", "poet", adapter_v2)
            in_flight = engine.run_on_engine_thread(lambda: engine.engine.has_unfinished_requests())
        finally:
            gate.set()
        paused.result(10)
        assert in_flight.result(10) is True
        assert second.status_code == 201, second.text
        pieces += [c.choices[0].text for c in chunks]
    assert second.json()["version"] == 2 and second.json()["rank"] == 8 and first["version"] == 1
    assert "".join(pieces) == ref_text(tiny_llama_dir, adapter_v1, prompt_ids, long_tokens)
    _, new_text = greedy_ids(client, "poet", prompt_ids, 12)
    assert new_text == ref_text(tiny_llama_dir, adapter_v2, prompt_ids, 12)
    # The superseded version's folder goes once no request uses it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stored_state(live)[2] != [second.json()["version_id"]]:
        time.sleep(0.05)
    assert stored_state(live) == (1, 2, [second.json()["version_id"]])


def test_delete_removes_the_adapter_at_once(serve, adapter_v1, prompt_ids):
    live = serve()
    key = new_tenant(live, "acme")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    with live.admin() as admin, live.tenant(key) as tenant:
        assert upload_zip(admin, "acme", "poet", adapter_v1).status_code == 201
        client.completions.create(model="poet", prompt=prompt_ids, max_tokens=2)  # warm the caches
        assert "poet" in [m.id for m in client.models.list().data]
        assert tenant.delete("/v1/adapters/poet").status_code == 204
        assert [m.id for m in client.models.list().data] == ["tiny"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="poet", prompt=prompt_ids, max_tokens=2)
        assert tenant.get("/v1/adapters/poet").status_code == 404
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and stored_state(live) != (0, 0, []):
            time.sleep(0.05)
        assert stored_state(live) == (0, 0, [])
        assert live.ctx.engine.stats_dict() is not None
        # upload again under the same name, via the admin API, then delete there
        assert upload_zip(admin, "acme", "poet", adapter_v1).json()["version"] == 1
        assert admin.delete("/admin/tenants/acme/adapters/poet").status_code == 204
        assert admin.get("/admin/tenants/acme/adapters/poet").status_code == 404


def test_max_adapters_quota(serve, adapter_v1):
    live = serve()
    new_tenant(live, "acme", max_adapters=1)
    with live.admin() as admin:
        assert upload_zip(admin, "acme", "one", adapter_v1).status_code == 201
        assert upload_zip(admin, "acme", "one", adapter_v1).status_code == 201  # a new version is no new adapter
        refused = upload_zip(admin, "acme", "two", adapter_v1)
    assert refused.status_code == 403 and "max_adapters=1" in refused.json()["error"]["message"]
    assert stored_state(live)[:2] == (1, 2)


def test_max_adapters_holds_when_an_upload_finishes_while_another_is_checked(serve, adapter_v1, database_url,
                                                                              monkeypatch):
    """The last place goes to one upload only: B runs start to end while A is between its early
    quota check and its record (the window of two concurrent uploads); A is refused, not stored."""
    from loraplex.platform.services import adapters as adapter_service

    live = serve(database_url=database_url) if database_url else serve()
    new_tenant(live, "acme", max_adapters=1)
    real_validate = adapter_service._validate
    nested: list[int] = []

    def validate_with_a_concurrent_upload(*args, **kwargs):
        if not nested:
            nested.append(0)
            with live.admin() as other:
                nested[0] = upload_zip(other, "acme", "two", adapter_v1).status_code
        return real_validate(*args, **kwargs)

    monkeypatch.setattr(adapter_service, "_validate", validate_with_a_concurrent_upload)
    with live.admin() as admin:
        refused = upload_zip(admin, "acme", "one", adapter_v1)
        names = [a["name"] for a in admin.get("/admin/tenants/acme/adapters").json()]
    assert nested == [201]
    assert refused.status_code == 403 and "max_adapters=1" in refused.json()["error"]["message"]
    assert names == ["two"]
    assert stored_state(live)[:2] == (1, 1)


def test_name_of_the_base_model_is_refused(serve, adapter_v1):
    live = serve()
    new_tenant(live, "acme")
    with live.admin() as admin:
        response = upload_zip(admin, "acme", "tiny", adapter_v1)
    assert response.status_code == 400 and response.json()["error"]["param"] == "name"
    assert stored_state(live) == (0, 0, [])
