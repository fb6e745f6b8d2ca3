"""The official ``openai`` client against SmolLM2-135M-Instruct served live (skipped when
the demo model is not prepared; CI prepares it)."""

from __future__ import annotations

import openai
import pytest
from platform_testlib import make_settings, new_tenant, run_server
from transformers import AutoTokenizer

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


@pytest.fixture(scope="module")
def smol_server(smollm2_dir, tmp_path_factory):
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.platform.main import create_app

    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), enable_lora=True, max_loras=2, max_lora_rank=8,
                                    max_model_len=512, max_num_seqs=4))
    live = run_server(create_app(make_settings(tmp_path_factory.mktemp("smol")), engine))
    yield live
    live.stop()


def test_chat_answers_and_streams_the_same_text(smol_server, smollm2_dir):
    key = new_tenant(smol_server, "acme")
    client = openai.OpenAI(api_key=key, base_url=smol_server.url + "/v1", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    assert model == smollm2_dir.name
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        answer.choices[0].message.content
