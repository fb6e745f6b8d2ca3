"""Issue 22.4: prompts are validated once, by the engine's input processing; each typed error is a
400 in OpenAI's format, checked through the official ``openai`` client (message, param, code)."""

from __future__ import annotations

import openai
import pytest
from platform_testlib import new_tenant
from transformers import AutoTokenizer

from loraplex.engine.input_processor import (
    ContextLengthExceededError,
    EmptyPromptError,
    PromptTooLongError,
    TokenIdOutOfVocabError,
)
from loraplex.engine.sampling_params import SamplingParams


@pytest.fixture
def live(serve):
    return serve()


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(api_key=new_tenant(live, "acme"), base_url=live.url + "/v1", max_retries=0, timeout=60)


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
    return info.value


def test_each_prompt_error_is_a_400_with_its_message(client, live):
    max_len, vocab = live.ctx.engine.max_model_len, live.ctx.engine.engine.spec.vocab_size
    cases = [
        (lambda: client.completions.create(model="tiny", prompt=[5] * max_len, max_tokens=4),
         f"This model's maximum context length is {max_len} tokens (max_model_len). However, you requested "
         f"{max_len + 4} tokens ({max_len} in the prompt, 4 in the completion). Please reduce the length of the "
         "prompt or the completion.", "prompt", "context_length_exceeded"),
        (lambda: client.completions.create(model="tiny", prompt=[5] * (max_len - 2), max_tokens=4),
         f"This model's maximum context length is {max_len} tokens (max_model_len). However, you requested "
         f"{max_len + 2} tokens ({max_len - 2} in the prompt, 4 in the completion). Please reduce the length of "
         "the prompt or the completion.", "prompt", "context_length_exceeded"),
        (lambda: client.completions.create(model="tiny", prompt=[], max_tokens=4),
         "The prompt is empty (0 tokens after tokenization).", "prompt", "empty_prompt"),
        (lambda: client.completions.create(model="tiny", prompt=[[1, 2], [3, vocab]], max_tokens=4),
         f"Token id {vocab} in the prompt is outside the vocabulary [0, {vocab}).", "prompt", "invalid_token_id"),
        (lambda: client.completions.create(model="tiny", prompt=[-1], max_tokens=4),
         f"Token id -1 in the prompt is outside the vocabulary [0, {vocab}).", "prompt", "invalid_token_id"),
        (lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * max_len}],
                                                max_tokens=4),
         None, "messages", "context_length_exceeded"),
    ]
    for call, message, param, code in cases:
        error = refused(call)
        assert (error.param, error.code) == (param, code)
        if message is not None:
            assert error.body["message"] == message
    assert live.ctx.engine.engine.get_stats().num_waiting == 0  # refused before queueing
    ok = client.completions.create(model="tiny", prompt=[5] * (max_len - 4), max_tokens=4, temperature=0)
    assert ok.usage.prompt_tokens == max_len - 4  # exactly at the limit is accepted


def test_chat_over_the_context_names_the_messages_and_the_numbers(client, live, tiny_llama_dir):
    max_len = live.ctx.engine.max_model_len
    messages = [{"role": "user", "content": "hi " * (max_len // 4)}]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    n = len(out["input_ids"] if hasattr(out, "keys") else out)
    assert n < max_len
    error = refused(lambda: client.chat.completions.create(model="tiny", messages=messages,
                                                           max_completion_tokens=max_len))
    assert error.body["message"] == (
        f"This model's maximum context length is {max_len} tokens (max_model_len). However, you requested "
        f"{n + max_len} tokens ({n} in the prompt, {max_len} in the completion). Please reduce the length of the "
        "prompt or the completion.")
    assert (error.param, error.code) == ("messages", "context_length_exceeded")


def test_the_offline_engine_raises_the_same_typed_errors(tiny_engine):
    processor, greedy = tiny_engine.input_processor, SamplingParams(temperature=0.0, max_tokens=4)
    max_len, vocab = tiny_engine.max_model_len, tiny_engine.spec.vocab_size
    with pytest.raises(PromptTooLongError) as too_long:
        tiny_engine.add_request("a", [5] * max_len, greedy)
    assert (too_long.value.num_prompt_tokens, too_long.value.max_model_len) == (max_len, max_len)
    with pytest.raises(ContextLengthExceededError) as beyond:
        tiny_engine.add_request("b", [5] * (max_len - 3), greedy)
    assert type(beyond.value) is ContextLengthExceededError and beyond.value.max_tokens == 4
    with pytest.raises(EmptyPromptError):
        tiny_engine.add_request("c", [], greedy)
    with pytest.raises(TokenIdOutOfVocabError) as bad:
        tiny_engine.add_request("d", [1, vocab + 7], greedy)
    assert (bad.value.token_id, bad.value.vocab_size) == (vocab + 7, vocab)
    assert not tiny_engine.has_unfinished_requests()
    processed = processor.process([5] * (max_len - 4), greedy)
    assert processed.max_tokens == 4 and processor.process(processed, greedy) is processed
    assert processor.process([5, 6], SamplingParams(max_tokens=None)).max_tokens == max_len - 2  # no max_tokens: what fits
