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


@pytest.mark.parametrize("content", ["Say something in Chinese: 你好", "Translate to Chinese: good morning"])
def test_chat_logprobs_bytes_rebuild_chinese_text(smol_server, content):
    """Issue 15.1 on the demo model: no U+FFFD stand-ins; the tokens' own bytes join to the text."""
    key = new_tenant(smol_server, f"zh-{len(content)}")
    client = openai.OpenAI(api_key=key, base_url=smol_server.url + "/v1", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=12, logprobs=True,
                  top_logprobs=2, temperature=0)
    answer = client.chat.completions.create(**kwargs)
    text = answer.choices[0].message.content
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    assert "".join(e.token for e in entries) == text
    assert any(e.token == "" and e.bytes for e in entries)  # a character split over tokens (the case)
    if "\ufffd" not in text:
        assert all(e.bytes != [239, 191, 189] for e in entries)
        assert all(alt.bytes != [239, 191, 189] for e in entries for alt in e.top_logprobs)
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # Same tokens, bytes and alternatives; the logprob values may differ in the last float32 digits because the
    # second request reuses the first one's prefix-cached KV (a different but equally exact compute path).
    def shape(e):
        return (e.token, e.bytes, [(a.token, a.bytes) for a in e.top_logprobs])

    assert [shape(e) for e in streamed] == [shape(e) for e in entries]
    for s, e in zip(streamed, entries):
        assert s.logprob == pytest.approx(e.logprob, abs=1e-3)
        assert [a.logprob for a in s.top_logprobs] == pytest.approx([a.logprob for a in e.top_logprobs], abs=1e-3)
