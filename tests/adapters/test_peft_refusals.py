"""One test per refusal: the typed error and the message naming the field and value."""

from __future__ import annotations

import dataclasses

import json
import re

import pytest
import torch

from loraplex.adapters import (
    AdapterError,
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterUnsupportedError,
    BaseModelSpec,
    LoRASlotPool,
    inspect_peft_adapter,
    load_peft_adapter,
    validate_adapter_dir,
)
from loraplex.adapters.lora_request import LoRARequest

MAX_RANK = 16
Q0_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


DECLARED_ID = "ab" * 32


def register_declared(folder, spec, max_lora_rank):
    """Header-only registration: ``add_lora`` with a declared ``version_id`` reads no tensor data."""
    pool = LoRASlotPool(spec, 1, max_lora_rank, 1, torch.float32, "cpu")
    pool.add_lora(LoRARequest("declared", 1, str(folder), version_id=DECLARED_ID))
    return pool


def refused(folder, spec, error, message, max_lora_rank=MAX_RANK, *, needs_data=False):
    """Every entry point refuses with ``error`` whose message contains ``message`` verbatim:
    the loaders, and (unless the check ``needs_data``) the header-only inspection and
    declared-id registration."""
    entry_points = [load_peft_adapter, validate_adapter_dir]
    if not needs_data:
        entry_points += [inspect_peft_adapter, register_declared]
    for load in entry_points:
        with pytest.raises(error, match=re.escape(message)):
            load(folder, spec, max_lora_rank)


def test_every_refusal_is_a_value_error():
    for error in (AdapterFormatError, AdapterIncompatibleError, AdapterUnsupportedError):
        assert issubclass(error, AdapterError) and issubclass(error, ValueError)


# ---------------------------------------------------------------- files


def test_pickle_weights_refused(adapter_copy, spec):
    tensors = {"x": torch.zeros(1)}
    (adapter_copy / "adapter_model.safetensors").unlink()
    torch.save(tensors, adapter_copy / "adapter_model.bin")
    refused(
        adapter_copy,
        spec,
        AdapterUnsupportedError,
        "adapter_model.bin: pickle weights are refused; only safetensors is accepted",
    )


def test_pickle_refused_even_next_to_safetensors(adapter_copy, spec):
    torch.save({"x": torch.zeros(1)}, adapter_copy / "adapter_model.bin")
    refused(adapter_copy, spec, AdapterUnsupportedError, "adapter_model.bin: pickle weights are refused")


def test_missing_folder_refused(tmp_path, spec):
    refused(tmp_path / "nope", spec, AdapterFormatError, f"adapter folder '{tmp_path / 'nope'}' does not exist")


def test_missing_config_refused(adapter_copy, spec):
    (adapter_copy / "adapter_config.json").unlink()
    refused(adapter_copy, spec, AdapterFormatError, "adapter_config.json: missing in adapter folder")


def test_invalid_json_config_refused(adapter_copy, spec):
    (adapter_copy / "adapter_config.json").write_text('{"r": 4,')
    refused(adapter_copy, spec, AdapterFormatError, "adapter_config.json: not valid JSON")


def test_missing_safetensors_refused(adapter_copy, spec):
    (adapter_copy / "adapter_model.safetensors").unlink()
    refused(adapter_copy, spec, AdapterFormatError, "adapter_model.safetensors: missing in adapter folder")


def test_corrupt_safetensors_refused(adapter_copy, spec):
    (adapter_copy / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    refused(adapter_copy, spec, AdapterFormatError, "adapter_model.safetensors: corrupt or truncated")


def test_truncated_safetensors_refused(adapter_copy, spec):
    path = adapter_copy / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    refused(adapter_copy, spec, AdapterFormatError, "adapter_model.safetensors: corrupt or truncated")


# ---------------------------------------------------------------- config fields


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_qalora", True, "adapter_config.json: use_qalora=True is not supported (QALoRA)"),
        ("modules_to_save", ["lm_head", "score"],
         "adapter_config.json: modules_to_save=['lm_head', 'score'] names 'score': only full copies of embed_tokens"),
        ("bias", "lora_only", "adapter_config.json: bias='lora_only' is not supported; only 'none'"),
        ("bias", "all", "adapter_config.json: bias='all' is not supported; only 'none'"),
        ("peft_type", "IA3", "adapter_config.json: peft_type='IA3' is not supported; only 'LORA'"),
        ("lora_bias", True, "adapter_config.json: lora_bias=True is not supported"),
        ("alora_invocation_tokens", [1, 2], "adapter_config.json: alora_invocation_tokens=[1, 2] is not supported"),
        ("init_lora_weights", "pissa", "adapter_config.json: init_lora_weights='pissa' is not supported"),
    ],
)
def test_unsupported_config_refused(adapter_copy, spec, edit_config, field, value, message):
    edit_config(adapter_copy, **{field: value})
    refused(adapter_copy, spec, AdapterUnsupportedError, message)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("r", 0, "adapter_config.json: r=0 must be an integer >= 1"),
        ("r", "4", "adapter_config.json: r='4' must be an integer >= 1"),
        ("lora_alpha", None, "adapter_config.json: lora_alpha is missing"),
        ("use_rslora", "yes", "adapter_config.json: use_rslora='yes' must be true or false"),
        ("target_modules", None, "adapter_config.json: target_modules is missing"),
        ("target_modules", "q_proj(", "adapter_config.json: target_modules='q_proj(' is not a valid regular"),
        ("rank_pattern", {"v_proj": 0}, "adapter_config.json: rank_pattern['v_proj']=0 must be an integer >= 1"),
        ("layers_to_transform", ["0"], "adapter_config.json: layers_to_transform=['0'] must be an integer >= 0"),
    ],
)
def test_malformed_config_refused(adapter_copy, spec, edit_config, field, value, message):
    edit_config(adapter_copy, **{field: value})
    refused(adapter_copy, spec, AdapterFormatError, message)


def test_lm_head_lora_refused_for_a_spec_without_vocab_size(peft_adapter, spec):
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    no_vocab = dataclasses.replace(spec, vocab_size=None)
    refused(folder, no_vocab, AdapterUnsupportedError, "target_modules contains 'lm_head': adapters on embed_tokens / "
                                                       "lm_head are not served by this engine")


# ---------------------------------------------------------------- rank limit


def test_rank_above_max_lora_rank_refused(adapter_copy, spec):
    refused(adapter_copy, spec, AdapterIncompatibleError, "adapter_config.json: r=4 exceeds max_lora_rank=2", 2)


def test_rank_pattern_above_max_lora_rank_refused(peft_adapter, spec):
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 12})
    message = "adapter_config.json: rank_pattern['v_proj']=12 exceeds max_lora_rank=8"
    refused(folder, spec, AdapterIncompatibleError, message, 8)
    assert load_peft_adapter(folder, spec, 12).rank == 12


# ---------------------------------------------------------------- tensors vs. the base model


def test_wrong_hidden_size_refused(adapter_copy, tiny_llama_config):
    wide = BaseModelSpec.from_hf_config(tiny_llama_config(hidden_size=96))
    refused(
        adapter_copy,
        wide,
        AdapterIncompatibleError,
        f"tensor '{Q0_A}' has shape [4, 64]; expected [4, 96]: in_features=64 but the base model's q_proj has "
        "in_features=96 (hidden_size=96)",
    )


def test_wrong_kv_width_refused(adapter_copy, tiny_llama_config):
    more_kv = BaseModelSpec.from_hf_config(tiny_llama_config(num_key_value_heads=4))
    refused(
        adapter_copy,
        more_kv,
        AdapterIncompatibleError,
        "k_proj.lora_B.weight' has shape [32, 4]; expected [64, 4]: out_features=32 but the base model's k_proj "
        "has out_features=64",
    )


def test_layer_index_beyond_model_refused(adapter_copy, tiny_llama_config):
    one_layer = BaseModelSpec.from_hf_config(tiny_llama_config(num_hidden_layers=1))
    refused(
        adapter_copy,
        one_layer,
        AdapterIncompatibleError,
        "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight': layer index 1 is beyond the base model's "
        "num_layers=1",
    )


def test_layers_to_transform_beyond_model_refused(adapter_copy, spec, edit_config):
    edit_config(adapter_copy, layers_to_transform=[0, 5])
    refused(
        adapter_copy,
        spec,
        AdapterIncompatibleError,
        "adapter_config.json: layers_to_transform=[0, 5] has layer index 5, beyond the base model's num_layers=2",
    )


def test_no_tensor_maps_to_the_model_refused(adapter_copy, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {k.replace("model.layers", "vision_tower.blocks"): v for k, v in t.items()})
    refused(
        adapter_copy,
        spec,
        AdapterIncompatibleError,
        "adapter_model.safetensors: none of the 28 LoRA tensors maps to a layer of the base model (LlamaForCausalLM",
    )


def test_unknown_module_refused(adapter_copy, spec, edit_tensors):
    def add_fc1(tensors):
        tensors["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = torch.ones(4, 64)
        tensors["base_model.model.model.layers.0.mlp.fc1.lora_B.weight"] = torch.ones(64, 4)
        return tensors

    edit_tensors(adapter_copy, add_fc1)
    refused(
        adapter_copy,
        spec,
        AdapterIncompatibleError,
        "tensor 'base_model.model.model.layers.0.mlp.fc1.lora_A.weight': module 'model.layers.0.mlp.fc1' is not one "
        "of the base model's LoRA-able modules",
    )


def test_module_missing_from_spec_refused(adapter_copy, spec):
    no_mlp = BaseModelSpec(
        num_layers=2,
        hidden_size=64,
        module_shapes={m: spec.module_shapes[m] for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
        architecture="AttentionOnlyLoRA",
    )
    # target_modules names MLP modules, which this model lacks: refused from the config already
    refused(adapter_copy, no_mlp, AdapterIncompatibleError,
            "which the base model (AttentionOnlyLoRA) does not have; its LoRA-able modules are q_proj, k_proj, v_proj, o_proj")
    _edit_config_targets(adapter_copy, ["q_proj", "k_proj", "v_proj", "o_proj"])
    refused(adapter_copy, no_mlp, AdapterIncompatibleError, "module 'model.layers.0.mlp.down_proj' is not one of")


def _edit_config_targets(folder, targets):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = targets
    path.write_text(json.dumps(config))


def test_lora_tensor_on_lm_head_refused(adapter_copy, spec, edit_tensors):
    def add_head(tensors):
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.ones(4, 64)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.ones(256, 4)
        return tensors

    edit_tensors(adapter_copy, add_head)
    refused(
        adapter_copy,
        spec,
        AdapterFormatError,
        "tensor 'base_model.model.lm_head.lora_A.weight': module 'lm_head' is not targeted by adapter_config.json",
    )


# ---------------------------------------------------------------- tensors vs. the config / each other


def test_a_without_b_refused(adapter_copy, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {k: v for k, v in t.items() if k != Q0_B})
    refused(adapter_copy, spec, AdapterFormatError, f"tensor '{Q0_A}' (lora_A) has no matching lora_B")


def test_b_without_a_refused(adapter_copy, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {k: v for k, v in t.items() if k != Q0_A})
    refused(adapter_copy, spec, AdapterFormatError, f"tensor '{Q0_B}' (lora_B) has no matching lora_A")


def test_rank_disagreeing_with_config_refused(adapter_copy, spec, edit_config):
    edit_config(adapter_copy, r=8)
    refused(
        adapter_copy,
        spec,
        AdapterFormatError,
        f"tensor '{Q0_A}' has shape [4, 64]; expected [8, 64] (rank 4 != adapter_config.json r=8)",
    )


def test_tensor_not_targeted_by_config_refused(adapter_copy, spec, edit_config):
    edit_config(adapter_copy, target_modules=["q_proj", "v_proj"])
    refused(
        adapter_copy,
        spec,
        AdapterFormatError,
        "module 'model.layers.0.self_attn.k_proj' is not targeted by adapter_config.json "
        "target_modules=['q_proj', 'v_proj']",
    )


def test_non_lora_tensor_refused(adapter_copy, spec, edit_tensors):
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_E"  # an AdaLoRA tensor
    edit_tensors(adapter_copy, lambda t: {**t, name: torch.ones(64)})
    refused(adapter_copy, spec, AdapterFormatError, f"tensor '{name}' is not a LoRA weight")


def test_integer_tensor_refused(adapter_copy, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {**t, Q0_A: torch.ones(4, 64, dtype=torch.int32)})
    refused(adapter_copy, spec, AdapterFormatError, f"tensor '{Q0_A}': dtype I32 is not a floating-point type")


def test_nan_weight_refused(adapter_copy, spec, edit_tensors):
    def poison(tensors):
        tensors[Q0_B] = tensors[Q0_B].clone()
        tensors[Q0_B][3, 1] = float("nan")
        return tensors

    edit_tensors(adapter_copy, poison)
    message = f"tensor '{Q0_B}' contains NaN or Inf values"
    refused(adapter_copy, spec, AdapterFormatError, message, needs_data=True)
    # Values are not read at a declared-id registration: the refusal comes at first use.
    inspect_peft_adapter(adapter_copy, spec, MAX_RANK)
    pool = register_declared(adapter_copy, spec, MAX_RANK)
    with pytest.raises(AdapterFormatError, match=re.escape(message)):
        pool.pin(1)
    stats = pool.stats()
    assert (stats.load_failures, stats.disk_loads, stats.slot_loads) == (1, 0, 0)


def test_two_adapter_names_refused(adapter_copy, spec, edit_tensors):
    edit_tensors(
        adapter_copy,
        lambda t: {(k.replace(".weight", ".other.weight") if "layers.1" in k else k): v for k, v in t.items()},
    )
    refused(adapter_copy, spec, AdapterFormatError, "tensor names carry several adapter names ['', 'other']")


def test_duplicate_module_refused(adapter_copy, spec, edit_tensors):
    short = Q0_A.removeprefix("base_model.model.")
    edit_tensors(adapter_copy, lambda t: {**t, short: t[Q0_A].clone()})
    refused(adapter_copy, spec, AdapterFormatError, "both hold lora_A of layer 0 q_proj")


# ---------------------------------------------------------------- issue 14: hostile uploads are bounded


LAYER_26_ZEROS = "base_model.model.model.layers." + "0" * 26 + ".self_attn.q_proj"


def test_nested_quantifier_regex_on_zero_run_layer_index_is_refused_structurally(adapter_copy, spec, edit_config,
                                                                                 edit_tensors):
    """Issue 14 item 1: this regex took 11.6 s against these names with Python's ``re``; the
    layer index is refused before any user pattern runs."""
    edit_config(adapter_copy, target_modules=r"model\.layers\.(\d+)+\.self_attn\.q_projX")

    def zero_run(tensors):
        return {LAYER_26_ZEROS + ".lora_A.weight": torch.ones(4, 64), LAYER_26_ZEROS + ".lora_B.weight": torch.ones(64, 4)}

    edit_tensors(adapter_copy, zero_run)
    refused(adapter_copy, spec, AdapterIncompatibleError,
            f"layer index '{'0' * 26}' is not a decimal of at most 6 digits without leading zeros")


@pytest.mark.parametrize("layer_text", ["00", "01", "1234567", "\u0661"])
def test_non_canonical_layer_indices_refused(adapter_copy, spec, edit_tensors, layer_text):
    layer_text = layer_text.encode().decode("unicode_escape")
    prefix = f"base_model.model.model.layers.{layer_text}.self_attn.q_proj"
    edit_tensors(adapter_copy, lambda t: {**t, prefix + ".lora_A.weight": torch.ones(4, 64),
                                          prefix + ".lora_B.weight": torch.ones(64, 4)})
    with pytest.raises(AdapterError):
        validate_adapter_dir(adapter_copy, spec, MAX_RANK)


def test_same_regex_on_well_formed_names_matches_quickly(adapter_copy, spec, edit_config):
    """The issue's pattern itself is harmless once names are structural (short, canonical):
    it matches nothing (the X), so the q_proj tensors are reported as untargeted."""
    edit_config(adapter_copy, target_modules=r"model\.layers\.(\d+)+\.self_attn\.q_projX")
    refused(adapter_copy, spec, AdapterFormatError, "is not targeted by adapter_config.json")


def test_regex_timeout_is_a_refusal(adapter_copy, spec, edit_config, monkeypatch):
    """A pattern that exceeds the per-match bound is refused naming the field (the bound is
    lowered to zero here so the test needs no slow pattern)."""
    from loraplex.adapters import peft_config

    monkeypatch.setattr(peft_config, "REGEX_MATCH_TIMEOUT_S", 0.0)
    edit_config(adapter_copy, target_modules=r".*\.(q|k|v|o|gate|up|down)_proj")
    refused(adapter_copy, spec, AdapterFormatError, "target_modules takes too long to match module names")


def test_too_long_pattern_refused(adapter_copy, spec, edit_config):
    edit_config(adapter_copy, rank_pattern={"a" * 2000: 4})
    refused(adapter_copy, spec, AdapterFormatError, "characters long; at most 1024")


def test_config_nested_100000_levels_refused(adapter_copy, spec):
    """Issue 14 item 14: this config made the upload answer 500 (RecursionError)."""
    (adapter_copy / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(adapter_copy, spec, AdapterFormatError, "adapter_config.json: nested 100000 levels deep; at most 32")


@pytest.mark.parametrize("text", ['{"r": 1' + "0" * 5000 + "}", '{"r": 4, "lora_alpha": 1' + "0" * 400 + "}",
                                  '{"r": 4, "x": "\\ud800"}' + "\xff"])
def test_config_numbers_and_bytes_beyond_python_limits_refused(adapter_copy, spec, text):
    (adapter_copy / "adapter_config.json").write_bytes(text.encode("utf-8", "surrogatepass"))
    with pytest.raises(AdapterFormatError, match="adapter_config.json"):
        validate_adapter_dir(adapter_copy, spec, MAX_RANK)


def test_target_module_the_model_lacks_refused(adapter_copy, spec, edit_config):
    """Issue 14 item 13: ["q_proj", "foo_proj"] was accepted silently as ["q_proj"]."""
    edit_config(adapter_copy, target_modules=["q_proj", "foo_proj"])
    refused(adapter_copy, spec, AdapterIncompatibleError,
            "target_modules contains 'foo_proj', which the base model (LlamaForCausalLM) does not have")


def test_target_modules_as_module_path_suffixes_accepted(adapter_copy, spec, edit_config):
    edit_config(adapter_copy, target_modules=["self_attn.q_proj", "k_proj", "model.layers.0.self_attn.v_proj",
                                              "layers.1.self_attn.v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"])
    assert validate_adapter_dir(adapter_copy, spec, MAX_RANK).rank == 4


def test_lora_alpha_1e308_refused(adapter_copy, spec, edit_config):
    """Issue 14 item 12: lora_alpha 1e308 uploaded fine, then every request failed."""
    edit_config(adapter_copy, lora_alpha=1e308)
    refused(adapter_copy, spec, AdapterIncompatibleError, "scaling 2.5e+307 (lora_alpha=1e+308, r=4) is not finite "
            "in float32", needs_data=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_f64_weights_of_1e300_refused_in_every_serving_dtype(adapter_copy, spec, edit_tensors, dtype):
    """Issue 14 item 12: F64 weights of 1e300 are finite as stored but not as served."""
    edit_tensors(adapter_copy, lambda t: {n: (torch.full_like(v, 1e300, dtype=torch.float64) if ".q_proj.lora_B" in n
                                               else v) for n, v in t.items()})
    with pytest.raises(AdapterIncompatibleError, match=rf"layer 0 q_proj: scaling \* lora_B @ lora_A is not finite "
                                                       rf"in {str(dtype).removeprefix('torch.')}"):
        validate_adapter_dir(adapter_copy, spec, MAX_RANK, serving_dtype=dtype)


def test_scaled_product_beyond_float16_refused_only_there(adapter_copy, spec, edit_tensors):
    """A and B finite in float16 whose scaled product is not (entries reach 4 * 2 * 300 * 300 = 720000);
    the bound is checked against the exact product: it is reached."""
    def big(tensors):
        out = dict(tensors)
        out[Q0_A] = torch.full((4, 64), 300.0)
        out[Q0_B] = torch.full((64, 4), 300.0)
        return out

    edit_tensors(adapter_copy, big)
    exact = 2.0 * (torch.full((64, 4), 300.0, dtype=torch.float64) @ torch.full((4, 64), 300.0, dtype=torch.float64))
    assert float(exact.abs().max()) == 720000.0 > torch.finfo(torch.float16).max
    with pytest.raises(AdapterIncompatibleError, match="entries up to 7.2e\\+05"):
        validate_adapter_dir(adapter_copy, spec, MAX_RANK, serving_dtype=torch.float16)
    assert validate_adapter_dir(adapter_copy, spec, MAX_RANK, serving_dtype=torch.bfloat16).rank == 4


@pytest.mark.parametrize("name, index, value", [(Q0_A, (2, 40), float("inf")), (Q0_A, (0, 0), float("-inf")),
                                                (Q0_A, (3, 63), float("nan")), (Q0_B, (0, 0), float("-inf"))])
def test_non_finite_value_anywhere_in_a_factor_refused(adapter_copy, spec, edit_tensors, name, index, value):
    """One NaN or Inf anywhere in lora_A or lora_B (checked through its per-rank abs-max: max keeps NaN and
    Inf) refuses the adapter, naming the first such tensor in name order."""
    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][index] = value
        return tensors

    edit_tensors(adapter_copy, poison)
    refused(adapter_copy, spec, AdapterFormatError, f"tensor '{name}' contains NaN or Inf values", needs_data=True)
