"""The registry's content hash is the engine's ``version_id``: the platform declares it in
its ``LoRARequest``s, so the engine registers uploads from their header alone."""

from __future__ import annotations

import json

import openai
from platform_testlib import adapter_members, make_peft_adapter, new_tenant, peft_reference_greedy, zip_bytes
from safetensors.torch import load_file
from transformers import AutoTokenizer

from loraplex.adapters import compute_version_id, load_peft_adapter
from loraplex.platform import crud
from loraplex.platform.services.adapters import lora_request, resolve_adapter


def test_registry_content_hash_is_the_declared_engine_version_id(serve, tiny_llama_dir, tmp_path):
    adapter_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "src", r=4, alpha=8, seed=3,
                                    target_modules=("q_proj", "v_proj"))
    live = serve()
    key = new_tenant(live, "acme")
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "poet"},
                              files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")})
    assert response.status_code == 201, response.text
    content_hash = response.json()["version_id"]
    ctx = live.ctx
    stored = ctx.settings.adapters_dir / content_hash

    # The engine's own computation over the stored files gives the registry's hash.
    config = json.loads((stored / "adapter_config.json").read_text())
    assert compute_version_id(config, load_file(str(stored / "adapter_model.safetensors"))) == content_hash
    assert load_peft_adapter(stored, ctx.base_spec, ctx.max_lora_rank).version_id == content_hash

    with ctx.sessions() as session:
        tenant_id = crud.get_tenant(session=session, name="acme").id
    request = lora_request(resolve_adapter(ctx=ctx, tenant_id=tenant_id, name="poet"))
    assert request.version_id == content_hash and request.lora_path == str(stored.resolve())

    prompt_ids = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode("Paris is the capital of")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    completion = client.completions.create(model="poet", prompt=prompt_ids, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    expected = tok.decode(peft_reference_greedy(tiny_llama_dir, adapter_dir, prompt_ids, 5, ignore_eos=True),
                          skip_special_tokens=True)
    assert completion.choices[0].text == expected

    pool = ctx.engine.engine.lora_pool
    version, loads = ctx.engine.run_on_engine_thread(
        lambda: (pool.version_id(request.lora_int_id), pool.stats().disk_loads)).result(timeout=30)
    assert version == content_hash
    assert loads == 1  # registered from the header (no read, no hash), read once at first use
