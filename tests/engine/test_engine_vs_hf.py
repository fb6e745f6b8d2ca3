"""Greedy tokens and logits of the engine equal HF transformers' on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "def add(a, b):",
    "Numbers: 0 1 2 3",
    "你好，世界",
]


def hf_greedy(path, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF ``generate`` one prompt at a time (no padding), EOS masked as min_new_tokens does."""
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def engine_greedy(llm: LLM, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, min_tokens=max_new_tokens)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_bias_dir",
                                           "tiny_qwen3_window_dir"])
def test_greedy_tokens_equal_hf(model_fixture, request):
    path = request.getfixturevalue(model_fixture)
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    llm = LLM(model=str(path), max_model_len=256, block_size=4, num_kv_blocks=256)
    assert engine_greedy(llm, prompt_ids, 24) == hf_greedy(path, prompt_ids, 24)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7])  # whole prompt, or chunks of 7 across the window
def test_mistral_sliding_window_equals_hf(tiny_mistral_window_dir, max_num_batched_tokens):
    """Issue 19: window 16 was ignored, and greedy tokens differed from HF on a 50-token prompt."""
    tok = AutoTokenizer.from_pretrained(str(tiny_mistral_window_dir))
    gen = torch.Generator().manual_seed(19)
    prompt = torch.randint(3, len(tok), (50,), generator=gen).tolist()
    expected = hf_greedy(tiny_mistral_window_dir, [prompt], 24)
    llm = LLM(model=str(tiny_mistral_window_dir), max_model_len=256, block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=max_num_batched_tokens)
    assert llm.engine.spec.layer_windows == (16, 16)
    assert engine_greedy(llm, [prompt], 24) == expected
    # The window matters: the same weights with full causal attention continue differently.
    full = AutoModelForCausalLM.from_pretrained(str(tiny_mistral_window_dir), torch_dtype=torch.float32,
                                                sliding_window=None).eval()
    with torch.no_grad():
        unwindowed = full.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert unwindowed[0, 50:].tolist() != expected[0]


def test_prompt_logprobs_equal_hf_logits(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tok.encode("Large language models serve many LoRA adapters")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    # A small token budget forces the prompt through several chunks.
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=5)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3,
                                                                 logprobs=3))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        top = torch.topk(ref[pos - 1], 3).indices.tolist()
        assert set(top) <= set(entry)
    first = out.outputs[0].logprobs[0]
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())
    assert first[out.outputs[0].token_ids[0]] == pytest.approx(ref[-1].max().item(), abs=1e-4)


def test_prompt_logprobs_once_each_after_a_preemption_with_other_chunks(tiny_llama_dir):
    """Preempted (recompute) mid-prompt, then prefilled again in chunks that start elsewhere:
    every prompt token still gets exactly one logprob, equal to HF's."""
    import dataclasses

    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    ids = tok.encode("Large language models serve many LoRA adapters from one GPU.")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, block_size=4, num_kv_blocks=128,
                                    max_num_batched_tokens=5))
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    engine.step()  # prompt tokens 0..4: logprobs of tokens 1..5
    assert len(engine.groups["r"].prompt_logprobs) == 6
    engine.scheduler._preempt(engine.groups["r"].seqs[0])  # recompute from scratch
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=7)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        assert final.prompt_logprobs[pos][ids[pos]] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
