"""End to end: an ``alpha_pattern`` key valid for PEFT (``re``) that matches no module there, but that
the ``regex`` package reads as fuzzy matching (``{e<=1}``), makes the engine serve another scaling than PEFT:
different greedy tokens, no error (tests/adapters/test_regex_semantics.py); such a pattern is now refused."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterError
from tiny_models import check_row, hf_greedy_ids, hf_last_logprobs, make_peft_adapter, peft_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=5)


def test_fuzzy_alpha_pattern_key_is_served_as_peft_or_refused(tiny_llama_dir, tmp_path):
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "a", r=4, alpha=8, seed=5, b_std=0.3)
    config = json.loads((path / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"q_prox{e<=1}": 256}  # PEFT (re): matches nothing, alpha stays 8
    (path / "adapter_config.json").write_text(json.dumps(config))
    prompt = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode("Paris is the capital")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft_model(tiny_llama_dir, path)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 2.0
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64, enable_lora=True,
              max_lora_rank=8)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, PARAMS, lora_request=LoRARequest("a", 1, str(path)))[0]
    except AdapterError:
        return  # refused: fine
    check_row(out, hf_greedy_ids(model, prompt, 8), hf_last_logprobs(model, prompt))
