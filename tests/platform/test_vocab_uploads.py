"""Adapters on embed_tokens / lm_head through the platform: uploads accepted (and refused past
max_full_module_slots), the registry shows their targets and modules_to_save, and requests on them
equal HF + PEFT (the engine reads them header-first, with a declared version id)."""

from __future__ import annotations

import openai
import pytest
from platform_testlib import adapter_members, new_tenant, peft_reference_greedy, stored_state, zip_bytes
from tiny_models import make_vocab_adapter
from transformers import AutoTokenizer

PROMPT = "Paris is the capital"


@pytest.fixture(scope="module")
def vocab_adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {
        "lora": make_vocab_adapter(tiny_llama_dir, root / "lora", 1, r=4, lora_alpha=8,
                                   target_modules=["embed_tokens", "lm_head", "q_proj"]),
        "head-copy": make_vocab_adapter(tiny_llama_dir, root / "head", 2, r=4, lora_alpha=8, target_modules=["v_proj"],
                                        modules_to_save=["lm_head"]),
        "two-copies": make_vocab_adapter(tiny_llama_dir, root / "two", 3, r=4, lora_alpha=8,
                                         target_modules=["v_proj"], modules_to_save=["lm_head", "embed_tokens"]),
    }


def upload(admin, name, folder):
    return admin.post("/admin/tenants/acme/adapters", data={"name": name},
                      files={"file": ("a.zip", zip_bytes(adapter_members(folder)), "application/zip")})


def test_vocab_adapters_upload_list_and_serve_as_peft(serve, tiny_llama_dir, vocab_adapters):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    num_kv_blocks=96, max_num_seqs=8, block_size=16, max_full_module_slots=1))
    live = serve(engine=engine)
    key = new_tenant(live, "acme", max_upload_mb=5)
    with live.admin() as admin, live.tenant(key) as tenant:
        response = upload(admin, "lora", vocab_adapters["lora"])
        assert response.status_code == 201, response.text
        body = response.json()
        assert (body["target_modules"], body["modules_to_save"]) == (["q_proj", "embed_tokens", "lm_head"], [])
        response = upload(admin, "head-copy", vocab_adapters["head-copy"])
        assert response.status_code == 201, response.text
        assert response.json()["modules_to_save"] == ["lm_head"]
        listed = tenant.get("/v1/adapters/head-copy").json()
        assert (listed["target_modules"], listed["modules_to_save"]) == (["v_proj"], ["lm_head"])
        # Two copies need two full-module slots: refused, naming the setting; nothing stored.
        before = stored_state(live)
        response = upload(admin, "two-copies", vocab_adapters["two-copies"])
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "modules_to_save=['embed_tokens', 'lm_head'] needs 2 full-module slot(s)" in message
        assert "max_full_module_slots=1" in message and "--max-full-module-slots" in message
        assert stored_state(live) == before

    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompt_ids = tok.encode(PROMPT)
    texts = {}
    for name in ("tiny", "lora", "head-copy"):
        texts[name] = client.completions.create(model=name, prompt=prompt_ids, max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0].text
    for name in ("lora", "head-copy"):
        expected = tok.decode(peft_reference_greedy(tiny_llama_dir, vocab_adapters[name], prompt_ids, 8,
                                                    ignore_eos=True), skip_special_tokens=True)
        assert texts[name] == expected and texts[name] != texts["tiny"], name
