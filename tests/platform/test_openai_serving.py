"""The official ``openai`` client against a live server on loopback (tiny random Llama).

References: HF transformers greedy generation and log-softmax (independent of
the engine), the tokenizer for usage counts, and the non-streamed response for
the streamed one (same seed).
"""

from __future__ import annotations

import openai
import pytest
import torch
from platform_testlib import display, new_tenant, peft_reference_greedy, raw_token_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The quick brown fox"


@pytest.fixture
def live(serve):
    return serve()


@pytest.fixture
def client(live) -> openai.OpenAI:
    key = new_tenant(live, "acme")
    return openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _text_of(tokenizer, ids: list[int]) -> str:
    eos = tokenizer.eos_token_id
    return tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)


def test_completion_greedy_matches_transformers(client, tokenizer, tiny_llama_dir):
    prompt_ids = tokenizer.encode(PROMPT)
    reference = peft_reference_greedy(tiny_llama_dir, None, prompt_ids, 10)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    choice = response.choices[0]
    assert choice.text == _text_of(tokenizer, reference)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reference)
    assert response.usage.total_tokens == len(prompt_ids) + len(reference)
    assert choice.finish_reason == ("stop" if reference[-1] == tokenizer.eos_token_id else "length")
    assert response.object == "text_completion" and response.model == "tiny"


def test_token_id_prompt_equals_text_prompt(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_greedy_matches_transformers(client, tokenizer, tiny_llama_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    prompt_ids = _chat_ids(tokenizer, messages)
    reference = peft_reference_greedy(tiny_llama_dir, None, prompt_ids, 8)
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == _text_of(tokenizer, reference)
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reference)


def test_streamed_completion_joins_to_the_non_streamed_text(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1  # really streamed, not one blob
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_streamed_chat_joins_to_the_non_streamed_text(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=16,
                  temperature=0.8, seed=7)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    without_usage = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.usage is None for c in without_usage)


def test_n_and_several_prompts_number_choices_and_count_usage(client, tokenizer):
    prompts = ["Paris is", "Numbers: 1 2"]
    response = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=3,
                                         logprobs=0)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)


def test_stop_string_and_max_tokens(client):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length" and base.usage.completion_tokens == 12
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_logprobs_match_transformers(client, tokenizer, tiny_llama_dir):
    prompt_ids = tokenizer.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, -1].float(), dim=-1)
    top = torch.topk(logprobs, 3)
    response = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert lp.token_logprobs[0] == pytest.approx(top.values[0].item(), abs=1e-3)
    # the chosen token shows as the text it produced, the others as their own text or bytes
    expected = {lp.tokens[0] if int(i) == top.indices[0] else display(raw_token_bytes(tokenizer, int(i))): v.item()
                for i, v in zip(top.indices, top.values)}
    assert lp.tokens[0] == response.choices[0].text
    assert lp.top_logprobs[0] == pytest.approx(expected, abs=1e-3)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_top_k_one_is_greedy_and_penalties_are_accepted(client):
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    top1 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    penalised = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0)
    assert penalised.usage.completion_tokens >= 1


def test_prompt_over_max_model_len_is_a_400_stating_the_limit(client, live):
    max_len = next(m for m in client.models.list().data if m.id == "tiny").model_extra["max_model_len"]
    assert max_len == live.ctx.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * max_len, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert f"maximum context length is {max_len} tokens" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[5] * (max_len - 2), max_tokens=4)


def test_bad_values_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, suffix="x")
    assert info.value.param == "suffix"


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.code == "model_not_found"
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}


def test_missing_or_wrong_key_is_401(live):
    bad = openai.OpenAI(api_key="lpx-wrong", base_url=live.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
