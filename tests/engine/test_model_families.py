"""Each model family beyond Llama, end to end on a tiny random checkpoint: greedy tokens equal HF
transformers, PEFT adapters (on the family's own module names) equal PEFT in a mixed batch, and
chunked prefill / prefix caching change nothing."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from tiny_models import FOLDS, check_row, fold_config, hf_greedy_ids, hf_last_logprobs, make_peft_adapter, peft_model

# family fixture -> (adapter a targets, adapter b targets), in the family's module names
FAMILIES = {
    "tiny_qwen3_dir": (("q_proj", "v_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "tiny_phi3_dir": (("qkv_proj",), ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "tiny_mistral_window_dir": (("q_proj", "v_proj"), ("k_proj", "o_proj", "gate_proj", "down_proj")),  # window 16
    "tiny_gemma2_dir": (("q_proj", "v_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "tiny_gemma3_dir": (("q_proj", "k_proj"), ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}
# The last two prompts (42 and 39 tokens) outgrow a 16-token sliding window.
TEXTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):",
         "Paris is the capital of France. Berlin is the capital of Germany. The quick brown fox jumps over the lazy dog.",
         "Large language models serve many LoRA adapters from one GPU. Numbers: 0 1 2 3 4 5 6 7 8 9 10"]
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(model dir, prompts, {name: LoRARequest}, {(name, prompt index): (tokens, last logprobs)})."""
    path = request.getfixturevalue(request.param)
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [tok.encode(t) for t in TEXTS]
    root = tmp_path_factory.mktemp("family-adapters")
    adapters = {}
    for i, (name, targets) in enumerate(zip("ab", FAMILIES[request.param])):
        adapter = make_peft_adapter(path, root / name, r=8, alpha=16, targets=targets, seed=20 + i)
        adapters[name] = LoRARequest(name, i + 1, str(adapter))
    models = {"base": AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()}
    models |= {name: peft_model(path, req.lora_path) for name, req in adapters.items()}
    refs = {(name, i): (hf_greedy_ids(m, p, MAX_NEW), hf_last_logprobs(m, p))
            for name, m in models.items() for i, p in enumerate(prompts)}
    return path, prompts, adapters, refs


def make_llm(path, **kw) -> LLM:
    # On the CPU (the fp32 reference path; the Triton variant below runs in the interpreter): on a
    # GPU, Triton's fp32 dots use TF32 and tiny random models' near-flat logits flip tokens.
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=512, enable_lora=True,
               max_lora_rank=8, max_loras=2, device="cpu", **kw)



@pytest.mark.parametrize("fold", FOLDS)  # the SGMV kernels, the shrink in the base GEMM, over 4-row pages too
def test_mixed_batch_equals_hf_and_peft(family, fold):
    path, prompts, adapters, refs = family
    order = ["a", None, "b", "a", None]
    outs = make_llm(path, **fold_config(fold)).generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *refs[(name or "base", i)])
    for name in adapters:  # the adapters are not no-ops: they change some greedy continuation
        assert any(refs[(name, i)][0] != refs[("base", i)][0] for i in range(len(prompts)))


def test_chunked_prefill_and_prefix_caching_change_nothing(family):
    """A 5-token budget splits every prompt into chunks while others decode; a second pass over
    the same prompts reads their prefix from the cache."""
    path, prompts, adapters, refs = family
    order = ["b", "a", None, "b", "a"]
    loras = [adapters[n] if n else None for n in order]
    llm = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3, enable_prefix_caching=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
        for i, (name, out) in enumerate(zip(order, outs)):
            check_row(out, *refs[(name or "base", i)])
    assert all(o.num_cached_tokens > 0 for o, p in zip(outs, prompts) if len(p) > 4)


@pytest.mark.slow
@pytest.mark.interpreter
def test_triton_kernels_equal_hf_and_peft(family, monkeypatch):
    """One adapter row over a prompt longer than any window, through the Triton kernels (the CPU interpreter
    here, the GPU path there): q/k norms, fused projections, sliding windows, soft-caps, GeGLU, SGMV."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU here: Triton kernels need the interpreter (TRITON_INTERPRET=1)")
    from loraplex.engine import llm_engine

    monkeypatch.setattr(llm_engine, "default_backend", lambda device: "triton")  # the engine's kernel choice
    path, prompts, adapters, refs = family
    llm = make_llm(path)
    assert llm.engine.model.norm.kernels.backend == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3, logprobs=5)
    out = llm.generate({"prompt_token_ids": prompts[4]}, params, lora_request=adapters["b"])[0]
    ref_tokens, ref_lp = refs[("b", 4)]
    check_row(out, ref_tokens[:3], ref_lp)
