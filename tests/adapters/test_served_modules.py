"""A server that serves LoRA on some modules only (EngineConfig.lora_target_modules): the spec it checks adapters
against (ModelSpec.served_adapter_spec), and the refusal of adapters on the other modules, naming the setting."""

from __future__ import annotations

import json
import re

import pytest
import torch

from loraplex.adapters import (
    AdapterNotServedError,
    LoRASlotPool,
    inspect_peft_adapter,
    load_peft_adapter,
    validate_adapter_dir,
)
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.model_spec import ModelSpec

MAX_RANK = 16


@pytest.fixture(scope="module")
def model_spec(tiny_llama_config) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_llama_config())


def test_fused_linears_are_served_whole_and_the_rest_listed(model_spec):
    served = model_spec.served_adapter_spec(("q_proj", "v_proj"))
    assert list(served.module_shapes) == ["q_proj", "k_proj", "v_proj"]
    assert served.module_shapes["k_proj"] == model_spec.module_shapes["k_proj"] == (64, 32)
    assert served.unserved_modules == ("o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
    assert served.vocab_size is None  # neither vocabulary module named: nothing of the vocab pool is allocated

    mlp = model_spec.served_adapter_spec(("up_proj", "lm_head"))
    assert list(mlp.module_shapes) == ["gate_proj", "up_proj"]
    assert mlp.vocab_size == 256
    assert mlp.unserved_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "embed_tokens")

    assert model_spec.served_adapter_spec(None) == model_spec.adapter_spec


def test_fused_family_groups():
    from transformers import Phi3Config

    phi3 = ModelSpec.from_hf_config(Phi3Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                               pad_token_id=0, eos_token_id=1))
    served = phi3.served_adapter_spec(("qkv_proj",))
    assert list(served.module_shapes) == ["qkv_proj"]
    with pytest.raises(ValueError, match="'q_proj' is not a module this model serves LoRA on; its modules are "
                                         "qkv_proj, o_proj, gate_up_proj, down_proj, embed_tokens, lm_head"):
        phi3.served_adapter_spec(("q_proj",))


def test_names_the_model_lacks_are_refused(model_spec):
    with pytest.raises(ValueError, match="'qkv_proj' is not a module this model serves LoRA on"):
        model_spec.served_adapter_spec(("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="names no decoder-layer module"):
        model_spec.served_adapter_spec(("lm_head",))
    with pytest.raises(ValueError, match="names lm_head: adapters on embed_tokens / lm_head are not implemented with "
                                         "tensor_parallel_size > 1"):
        model_spec.served_adapter_spec(("q_proj", "lm_head"), vocab=False)


def _refused(folder, spec, message, *, needs_data=False):
    entry_points = [load_peft_adapter, validate_adapter_dir]
    if not needs_data:
        entry_points += [inspect_peft_adapter]
    for load in entry_points:
        with pytest.raises(AdapterNotServedError, match=re.escape(message)):
            load(folder, spec, MAX_RANK)


def test_adapter_on_an_unserved_module_is_refused_naming_the_setting(peft_adapter, model_spec):
    served = model_spec.served_adapter_spec(("q_proj", "v_proj"))
    reason = ("LoRA on o_proj is not served by this server: its lora_target_modules setting serves q_proj, k_proj, "
              "v_proj only (a server started with o_proj in lora_target_modules serves it)")
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])
    _refused(folder, served, f"target_modules contains 'o_proj': {reason}")
    # A regex target (PEFT's all-linear and the like) is checked tensor by tensor.
    regex, _ = peft_adapter(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|o_proj)")
    _refused(regex, served, f"module 'model.layers.0.self_attn.o_proj': {reason}")
    # The whole qkv linear is served: k_proj is accepted though only q_proj and v_proj were named.
    kv, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])
    assert load_peft_adapter(kv, served, MAX_RANK).info().target_modules == ("k_proj", "v_proj")


def test_vocabulary_adapters_on_an_unserved_module_are_refused(peft_adapter, model_spec):
    served = model_spec.served_adapter_spec(("q_proj", "embed_tokens"))
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    _refused(folder, served, "target_modules contains 'lm_head': adapters on lm_head (LoRA or a modules_to_save copy) "
                             "are not served by this server: its lora_target_modules setting serves q_proj, k_proj, "
                             "v_proj, embed_tokens only")
    saved, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    _refused(saved, served, "adapters on lm_head (LoRA or a modules_to_save copy) are not served by this server")
    none_vocab = model_spec.served_adapter_spec(("q_proj",))
    embed, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    _refused(embed, none_vocab, "target_modules contains 'embed_tokens': adapters on embed_tokens (LoRA or a "
                                "modules_to_save copy) are not served by this server: its lora_target_modules "
                                "setting serves q_proj, k_proj, v_proj only")


def test_pool_holds_only_the_served_modules_and_installs_peft_exact_weights(peft_adapter, model_spec):
    served = model_spec.served_adapter_spec(("q_proj", "v_proj"))
    pool = LoRASlotPool(served, 2, MAX_RANK, 2, torch.float32, "cpu")
    assert set(pool.weights.a[0]) == set(pool.weights.b[1]) == {"q_proj", "k_proj", "v_proj"}
    assert pool.weights.embed_a_t is None and pool.weights.head_b is None
    folder, peft_model = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    pool.add_lora(LoRARequest("qv", 1, str(folder)))
    assert pool.ensure_ready(1)
    slot = pool.pin(1)
    layer = peft_model.base_model.model.model.layers[1].self_attn.v_proj
    page = int(pool.weights.page_table[slot, 0])
    torch.testing.assert_close(pool.weights.a[1]["v_proj"][page, :4], layer.lora_A["default"].weight, rtol=0, atol=0)
    torch.testing.assert_close(pool.weights.b[1]["v_proj"][page, :, :4], layer.lora_B["default"].weight,
                               rtol=0, atol=0)
    assert float(pool.weights.scaling[1]["v_proj"][slot]) == 2.0
    assert float(pool.weights.scaling[1]["k_proj"][slot]) == 0.0


def test_an_adapter_on_every_linear_is_refused_for_the_unserved_module_not_for_its_tensor_count(tmp_path,
                                                                                             tiny_llama_config):
    """The tensor-count bound is the model's (every module, served or not): a DoRA adapter on all linears of a
    12-layer model (252 tensors) against a server serving o_proj only is refused naming the setting."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(num_hidden_layers=12)
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                use_dora=True, lora_dropout=0.0))
    model.save_pretrained(str(tmp_path / "all"))
    config_path = tmp_path / "all" / "adapter_config.json"  # a regex target: checked tensor by tensor
    saved = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(saved | {"target_modules": r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|"
                                                                 r"down_proj)"}))
    served = ModelSpec.from_hf_config(config).served_adapter_spec(("o_proj",))
    with pytest.raises(AdapterNotServedError, match="LoRA on [a-z_]+ is not served by this server: its "
                                                    "lora_target_modules setting serves o_proj only"):
        inspect_peft_adapter(tmp_path / "all", served, MAX_RANK)


def test_not_served_errors_cross_processes_with_their_reason():
    """The engine process and replicas send refusals to the gateway pickled: type and tenant-facing reason kept."""
    import pickle

    from loraplex.adapters import AdapterIncompatibleError, AdapterUnsupportedError

    error = AdapterNotServedError("adapter 'tenant-3/a@7': DoRA is not served", "DoRA is not served")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is AdapterNotServedError and isinstance(copy, AdapterIncompatibleError | AdapterUnsupportedError)
    assert (str(copy), copy.reason) == ("adapter 'tenant-3/a@7': DoRA is not served", "DoRA is not served")
