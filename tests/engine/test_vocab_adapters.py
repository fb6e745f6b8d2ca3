"""Adapters on embed_tokens / lm_head (PEFT embedding LoRA, LoRA on the head, modules_to_save copies): every
row equals HF + PEFT (greedy tokens and first-step logprobs, fp32), with untied and tied embeddings."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterUnsupportedError
from tiny_models import (check_row, hf_greedy_ids, hf_last_logprobs, make_peft_adapter, make_tiny_model,
                         make_vocab_adapter, peft_model)

MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
CASES = {  # name: LoraConfig keyword arguments
    "embed_lora": dict(target_modules=["embed_tokens"], r=4, lora_alpha=8),
    "head_lora": dict(target_modules=["lm_head", "v_proj"], r=8, lora_alpha=8),
    "save_head": dict(target_modules=["q_proj"], modules_to_save=["lm_head"], r=4, lora_alpha=8),
    "save_embed": dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"], r=4, lora_alpha=8),
    # DoRA on the projections (per-slot gains) with a full copy of the head (a full-module slot)
    "dora_save_head": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], use_dora=True, r=4,
                           lora_alpha=8),
}


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory):
    tied = request.param
    base_dir = make_tiny_model(tmp_path_factory.mktemp("base"), "llama", tie_word_embeddings=tied)
    root = tmp_path_factory.mktemp("vocab-adapters")
    adapters = {name: LoRARequest(name, i + 1, str(make_vocab_adapter(base_dir, root / name, 20 + i, **kw)))
                for i, (name, kw) in enumerate(CASES.items())}
    adapters["qv"] = LoRARequest("qv", 10, str(make_peft_adapter(base_dir, root / "qv", r=4, alpha=8, seed=3)))
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Paris is the capital", "def add(a, b):",
                                       "Colors: red, green")]
    refs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"base": AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32).eval()}
        models |= {name: peft_model(base_dir, req.lora_path) for name, req in adapters.items()}
    for name, model in models.items():
        for i, p in enumerate(prompts):
            refs[(name, i)] = (hf_greedy_ids(model, p, MAX_NEW), hf_last_logprobs(model, p))
    # The adapters really change the model (else the comparison proves nothing).
    for name in adapters:
        assert not torch.allclose(refs[(name, 0)][1], refs[("base", 0)][1], atol=1e-3), name
    return base_dir, adapters, prompts, refs


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    kw.setdefault("max_full_module_slots", 2)
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=256, enable_lora=True,
               max_lora_rank=8, **kw)



@pytest.mark.parametrize("name", list(CASES))
def test_each_vocab_adapter_equals_peft(setup, name):
    base_dir, adapters, prompts, refs = setup
    outs = make_llm(base_dir).generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                                       lora_request=adapters[name])
    for i, out in enumerate(outs):
        check_row(out, *refs[(name, i)])


def test_mixed_batch_rows_equal_peft(setup):
    """[embedding LoRA, base, head LoRA, q/v LoRA] in one batch, then copies of both modules and base, then a DoRA
    adapter with a copy of the head beside vocabulary LoRA and plain LoRA."""
    base_dir, adapters, prompts, refs = setup
    llm = make_llm(base_dir)
    for order in (["embed_lora", None, "head_lora", "qv"], ["save_head", "save_embed", None, "embed_lora"],
                  ["dora_save_head", "embed_lora", None, "qv"]):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                            lora_request=[adapters[n] if n else None for n in order])
        for i, (name, out) in enumerate(zip(order, outs)):
            check_row(out, *refs[(name or "base", i)])


def test_prompt_logprobs_use_the_adapters_head(setup):
    base_dir, adapters, prompts, refs = setup
    llm = make_llm(base_dir)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft_model(base_dir, adapters["save_head"].lora_path)
    prompt = prompts[1]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=adapters["save_head"])[0]
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]] == pytest.approx(float(logp[pos - 1, prompt[pos]]), abs=2e-4)


def test_full_module_slots_bound_what_is_served(setup):
    """max_full_module_slots=0 refuses a modules_to_save adapter, naming the setting; with 1 slot two such
    adapters take turns (one waits, base requests do not) and both stay exact."""
    base_dir, adapters, prompts, refs = setup
    with pytest.raises(AdapterUnsupportedError, match="max_full_module_slots=0"):
        make_llm(base_dir, max_full_module_slots=0).engine.add_lora(adapters["save_head"])
    llm = make_llm(base_dir, max_full_module_slots=1)
    order = ["save_head", "save_embed", None, "save_head"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *refs[(name or "base", i)])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_scaled_embeddings_and_soft_capped_head_equal_peft(arch, tmp_path):
    """Gemma scales the embeddings by sqrt(hidden) (the LoRA delta and a copy's rows too, as PEFT does) and
    Gemma 2 soft-caps the logits after the head (its LoRA included); tied embeddings."""
    base_dir = make_tiny_model(tmp_path / "base", arch, tie_word_embeddings=True, head_dim=16)
    cases = {"embed_lora": CASES["embed_lora"], "head_lora": CASES["head_lora"], "save_embed": CASES["save_embed"]}
    adapters = {name: LoRARequest(name, i + 1, str(make_vocab_adapter(base_dir, tmp_path / name, 40 + i, **kw)))
                for i, (name, kw) in enumerate(cases.items())}
    prompt = AutoTokenizer.from_pretrained(str(base_dir)).encode("Paris is the capital")
    llm = make_llm(base_dir)
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(adapters), PARAMS, lora_request=list(adapters.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for (name, req), out in zip(adapters.items(), outs):
            model = peft_model(base_dir, req.lora_path)
            check_row(out, hf_greedy_ids(model, prompt, MAX_NEW), hf_last_logprobs(model, prompt))


def test_engine_config_refuses_full_module_slots_it_cannot_serve():
    from loraplex.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="max_full_module_slots=1: is not implemented with tensor_parallel_size > 1"):
        EngineConfig.validate({"max_full_module_slots": 1, "tensor_parallel_size": 2, "enable_lora": True})
    with pytest.raises(ConfigError, match="max_full_module_slots=1: needs enable_lora"):
        EngineConfig.validate({"max_full_module_slots": 1})
    with pytest.raises(ConfigError, match="max_full_module_slots=-1: must be >= 0"):
        EngineConfig.validate({"max_full_module_slots": -1})


def test_tensor_parallel_refuses_vocab_adapters_and_serves_the_others(setup):
    """With tensor_parallel_size=2 adapters on embed_tokens / lm_head are refused when registered, naming the
    reason (the upload check uses the same spec); a plain adapter on the same engine still equals PEFT."""
    base_dir, adapters, prompts, refs = setup
    llm = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, max_num_seqs=4,
              tensor_parallel_size=2)
    try:
        assert llm.engine.adapter_spec.vocab_size is None
        for name in ("embed_lora", "head_lora", "save_head"):
            with pytest.raises(AdapterUnsupportedError, match="not implemented with tensor_parallel_size > 1"):
                llm.engine.add_lora(adapters[name])
        out = llm.generate({"prompt_token_ids": prompts[0]}, PARAMS, lora_request=adapters["qv"])[0]
        check_row(out, *refs[("qv", 0)])
    finally:
        llm.engine.close()
