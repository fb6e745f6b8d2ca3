"""``/v1/completions`` with ``echo`` and the vLLM extra ``prompt_logprobs`` (issue 23), with the
official ``openai`` client against a live server over the tiny random Llama, on the base
model and on an adapter. Reference: log-softmax of HF transformers (+ PEFT) logits, fp32."""

from __future__ import annotations

import openai
import pytest
import torch
from platform_testlib import adapter_members, make_peft_adapter, new_tenant, zip_bytes
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["The quick brown fox", "你好，世界！ Paris is"]


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("echo-adapter"), seed=5)


@pytest.fixture
def client(serve, adapter_dir) -> openai.OpenAI:
    live = serve()
    key = new_tenant(live, "acme")
    with live.admin() as admin:
        response = admin.post("/admin/tenants/acme/adapters", data={"name": "style"},
                              files={"file": ("a.zip", zip_bytes(adapter_members(adapter_dir)), "application/zip")})
        assert response.status_code == 201, response.text
    return openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _hf_logprobs(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` log-softmax of the logits at each position (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("model", ["tiny", "style"])
def test_echo_logprobs_cover_prompt_and_completion(client, tokenizer, tiny_llama_dir, adapter_dir, model):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    response = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, logprobs=3,
                                         echo=True)
    assert len(response.choices) == 2
    for choice, prompt_ids, text in zip(sorted(response.choices, key=lambda c: c.index), ids, PROMPTS):
        lp = choice.logprobs
        assert choice.text.startswith(text)
        assert len(lp.tokens) == len(prompt_ids) + 2
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        reference = _hf_logprobs(tiny_llama_dir, adapter_dir if model == "style" else None, prompt_ids)
        expected = [reference[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]
        assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
        for i in range(1, len(prompt_ids)):
            top = torch.topk(reference[i - 1], 3).values.tolist()
            assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-4)
        # the generated tokens follow: greedy, first one predicted from the last prompt position
        assert lp.token_logprobs[len(prompt_ids)] == pytest.approx(reference[-1].max().item(), abs=1e-4)


def test_echo_string_prompts_streamed_equal_non_streamed(client):
    kwargs = dict(model="style", prompt=PROMPTS, max_tokens=4, temperature=0, logprobs=1, echo=True)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        streamed = [(t, lp, o) for c in mine if c.logprobs for t, lp, o in
                    zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset)]
        assert streamed == list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                    choice.logprobs.text_offset))
        assert choice.text.startswith(PROMPTS[choice.index])


def test_echo_without_logprobs_and_logprobs_zero(client, tokenizer):
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    zero = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True,
                                     logprobs=0)
    lp = zero.choices[0].logprobs
    assert len(lp.tokens) == len(tokenizer.encode(PROMPTS[0])) + 1
    assert lp.top_logprobs[0] is None and all(top == {} for top in lp.top_logprobs[1:])


def test_echo_logprobs_20_is_the_top_20_and_21_is_a_400(client, tokenizer, tiny_llama_dir):
    ids = tokenizer.encode(PROMPTS[1])
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True,
                                         logprobs=20)
    lp = response.choices[0].logprobs
    reference = _hf_logprobs(tiny_llama_dir, None, ids)
    for i in range(1, len(ids)):
        assert len(lp.top_logprobs[i]) == 20
        top = torch.topk(reference[i - 1], 20).values.tolist()
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=21)
    assert info.value.body["param"] == "logprobs"


def test_prompt_logprobs_extra_field_on_both_endpoints(client, tokenizer, tiny_llama_dir):
    ids = tokenizer.encode(PROMPTS[0])
    reference = _hf_logprobs(tiny_llama_dir, None, ids)
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 2})
    plps = response.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for i in range(1, len(ids)):
        entry = plps[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(reference[i - 1, ids[i]].item(), abs=1e-4)
        top = torch.topk(reference[i - 1], 2)
        for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[str(token_id)]["rank"] == rank
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat_ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": 21})
    assert info.value.param == "prompt_logprobs"


def test_prompt_logprobs_with_a_cached_prefix(client, tokenizer, tiny_llama_dir):
    """The second request's prefix is in the prefix cache: its prompt logprobs are recomputed, equal."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    first = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0)
    assert first.choices[0].text is not None  # fills the prefix cache
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    reference = _hf_logprobs(tiny_llama_dir, None, ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert again.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
