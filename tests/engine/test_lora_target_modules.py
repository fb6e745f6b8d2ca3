"""lora_target_modules in the engine: only the served linears launch LoRA kernels, adapters on them stay PEFT-exact
in mixed batches, adapters on other modules are refused naming the setting, and bad values are refused at start."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterUnsupportedError
from loraplex.engine.config import ConfigError, EngineConfig
from tiny_models import check_row, make_peft_adapter, peft_references

ADAPTERS = {"qv": ("q_proj", "v_proj"), "k": ("k_proj",), "qo": ("q_proj", "o_proj")}
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("target_modules")
    adapters = {name: LoRARequest(name, i + 1, str(make_peft_adapter(tiny_llama_dir, root / name, r=8, alpha=16,
                                                                     targets=targets, seed=30 + i)))
                for i, (name, targets) in enumerate(ADAPTERS.items())}
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Paris is the capital", "def add(a, b):")]
    refs = peft_references(tiny_llama_dir, {n: adapters[n] for n in ("qv", "k")}, prompts, MAX_NEW)
    return tiny_llama_dir, adapters, prompts, refs


def make_llm(path, **kw) -> LLM:
    # Shrinks not folded into the base GEMMs: every served linear then launches add_lora (counted below).
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=256, enable_lora=True, max_loras=2,
               max_lora_rank=8, lora_fold_shrink="off", **kw)


def count_lora_launches(llm: LLM) -> list[tuple[int, ...]]:
    """Wrap the model's ``add_lora``: each call's output width is recorded (the linear it serves)."""
    widths: list[tuple[int, ...]] = []
    kernels = llm.engine.model.layers[0].self_attn.qkv_proj.kernels
    add_lora = kernels.add_lora

    def counted(x, a, b, scaling, y, mapping, **kw):
        widths.append(tuple(t.shape[1] for t in b))
        return add_lora(x, a, b, scaling, y, mapping, **kw)

    for _, lin in llm.engine.model.lora_linears():
        assert lin.kernels is kernels
    kernels.add_lora = counted
    return widths


def test_only_served_linears_launch_and_mixed_batches_equal_peft(setup):
    """q_proj,v_proj: the qkv linear of each layer is the only one that launches LoRA (k served with it: an
    adapter on k_proj alone is exact too); the o, gate_up and down linears launch nothing."""
    base_dir, adapters, prompts, refs = setup
    llm = make_llm(base_dir, lora_target_modules="q_proj, v_proj")
    num_layers = len(llm.engine.model.layers)
    assert set(llm.engine.lora_pool.weights.a[0]) == {"q_proj", "k_proj", "v_proj"}
    widths = count_lora_launches(llm)
    order = ["qv", None, "k"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *refs[(name or "base", i)])
    spec = llm.engine.spec
    qkv = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim)
    assert set(widths) == {qkv}
    assert len(widths) % num_layers == 0 and len(widths) >= num_layers * MAX_NEW

    every = make_llm(base_dir)  # the default serves every module: four linears per layer launch
    all_widths = count_lora_launches(every)
    every.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=1),
                   lora_request=adapters["qv"])
    h, i = spec.hidden_size, spec.intermediate_size
    assert all_widths == [qkv, (h,), (i, i), (h,)] * num_layers


def test_adapter_on_an_unserved_module_is_refused(setup):
    base_dir, adapters, prompts, refs = setup
    llm = make_llm(base_dir, lora_target_modules="q_proj,v_proj")
    with pytest.raises(AdapterUnsupportedError, match="LoRA on o_proj is not served by this server: its "
                                                      "lora_target_modules setting serves q_proj, k_proj, v_proj only"):
        llm.engine.add_lora(adapters["qo"])
    out = llm.generate({"prompt_token_ids": prompts[0]}, PARAMS, lora_request=adapters["qv"])[0]
    check_row(out, *refs[("qv", 0)])


def test_bad_values_are_refused_naming_the_field(setup):
    base_dir = setup[0]
    with pytest.raises(ConfigError, match="lora_target_modules='q_proj': needs enable_lora"):
        EngineConfig.validate({"lora_target_modules": "q_proj"})
    with pytest.raises(ConfigError, match="lora_target_modules='q_proj;v_proj': must be module names separated by "
                                          "commas"):
        EngineConfig.validate({"lora_target_modules": "q_proj;v_proj", "enable_lora": True})
    with pytest.raises(ConfigError, match="lora_target_modules='q_proj,qkv_proj': 'qkv_proj' is not a module this "
                                          "model serves LoRA on; its modules are q_proj, k_proj, v_proj, o_proj, "
                                          "gate_proj, up_proj, down_proj, embed_tokens, lm_head"):
        make_llm(base_dir, lora_target_modules="q_proj,qkv_proj")


def test_a_vocabulary_module_left_out_gets_no_pool_tensors_and_the_other_serves_exactly(setup, tmp_path):
    """lora_target_modules=q_proj,lm_head: the embedding's LoRA tensors are not allocated (and its expand is not
    launched), an adapter with LoRA on lm_head equals PEFT, and one on embed_tokens is refused naming the setting;
    max_full_module_slots without either vocabulary module is refused at start."""
    from tiny_models import hf_greedy_ids, hf_last_logprobs, make_vocab_adapter, peft_model

    base_dir, _, prompts, _ = setup
    head = LoRARequest("head", 11, str(make_vocab_adapter(base_dir, tmp_path / "head", 50, r=4, lora_alpha=8,
                                                          target_modules=["q_proj", "lm_head"])))
    embed = LoRARequest("embed", 12, str(make_vocab_adapter(base_dir, tmp_path / "embed", 51, r=4, lora_alpha=8,
                                                            target_modules=["q_proj", "embed_tokens"])))
    llm = make_llm(base_dir, lora_target_modules="q_proj,lm_head")
    weights = llm.engine.lora_pool.weights
    assert weights.embed_a_t is None and weights.embed_b is None and weights.head_a is not None
    out = llm.generate({"prompt_token_ids": prompts[0]}, PARAMS, lora_request=head)[0]
    model = peft_model(base_dir, head.lora_path)
    check_row(out, hf_greedy_ids(model, prompts[0], MAX_NEW), hf_last_logprobs(model, prompts[0]))
    with pytest.raises(AdapterUnsupportedError, match="adapters on embed_tokens \\(LoRA or a modules_to_save copy\\) "
                                                      "are not served by this server"):
        llm.engine.add_lora(embed)
    with pytest.raises(ConfigError, match="max_full_module_slots=1: needs embed_tokens or lm_head in "
                                          "lora_target_modules"):
        make_llm(base_dir, lora_target_modules="q_proj", max_full_module_slots=1)
