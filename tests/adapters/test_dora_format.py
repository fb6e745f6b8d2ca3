"""DoRA adapters (PEFT ``use_dora=True``, issue 19): the magnitude vectors are read and checked like A and B,
and the slot gains computed at install equal PEFT's ``magnitude / ||W + scaling * B @ A||_row``."""

from __future__ import annotations

import re

import pytest
import torch

from loraplex.adapters import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterUnsupportedError,
    LoRASlotPool,
    inspect_peft_adapter,
    load_peft_adapter,
    validate_adapter_dir,
)
from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.slot_image import read_slot_image, slot_image_from_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 8
Q0_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.fixture(scope="module")
def dora(peft_adapter):
    """(folder, PEFT model) of a DoRA adapter on every projection, magnitudes moved off their initial norms."""
    folder, model = peft_adapter(r=4, lora_alpha=8, target_modules=ALL, use_dora=True, seed=3)
    return folder, model


@pytest.fixture
def dora_copy(dora, tmp_path):
    import shutil

    return shutil.copytree(dora[0], tmp_path / "dora")


def _peft_layer(model, layer: int, module: str):
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return getattr(getattr(model.base_model.model.model.layers[layer], parent), module)


def _peft_gain(model, layer: int, module: str) -> torch.Tensor:
    """PEFT's ``mag_norm_scale`` (``DoraLinearLayer.forward``) of one module, float32."""
    lin = _peft_layer(model, layer, module)
    dora_layer = lin.lora_magnitude_vector["default"]
    lora_weight = lin.lora_B["default"].weight @ lin.lora_A["default"].weight
    with torch.no_grad():
        norm = dora_layer.get_weight_norm(lin.base_layer.weight, lora_weight, lin.scaling["default"])
        return (dora_layer.weight / norm).float()


def test_dora_adapter_loads_with_its_magnitudes(dora, spec):
    folder, model = dora
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    assert adapter.use_dora and adapter.info().adapter_type == "dora"
    assert validate_adapter_dir(folder, spec, MAX_RANK).adapter_type == "dora"
    assert len(adapter.weights) == 2 * len(ALL)
    for (layer, module), weight in adapter.weights.items():
        expected = _peft_layer(model, layer, module).lora_magnitude_vector["default"].weight
        assert torch.equal(weight.magnitude, expected.detach().float())
    # The same image from the file (header offsets) and from the loaded adapter.
    layout = inspect_peft_adapter(folder, spec, MAX_RANK)
    assert layout.config.use_dora and all(plan.magnitude_name for plan in layout.modules)
    read = read_slot_image(layout, spec, MAX_RANK, torch.float32, version_id="x", pin_memory=False)
    built = slot_image_from_adapter(adapter, spec, MAX_RANK, torch.float32, pin_memory=False)
    assert read.magnitude.keys() == built.magnitude.keys() == adapter.weights.keys()
    for key in read.magnitude:
        assert torch.equal(read.magnitude[key], built.magnitude[key])


def test_weight_suffix_accepted(dora_copy, spec, edit_tensors):
    edit_tensors(dora_copy, lambda t: {(k + ".weight" if k.endswith("magnitude_vector") else k): v
                                       for k, v in t.items()})
    adapter = load_peft_adapter(dora_copy, spec, MAX_RANK)
    assert all(weight.magnitude is not None for weight in adapter.weights.values())


def _refused(folder, spec, error, message, *, needs_data=False):
    entry_points = [load_peft_adapter, validate_adapter_dir]
    if not needs_data:
        entry_points.append(inspect_peft_adapter)
    for load in entry_points:
        with pytest.raises(error, match=re.escape(message)):
            load(folder, spec, MAX_RANK)


def test_use_dora_without_magnitudes_refused(dora_copy, spec, edit_tensors):
    edit_tensors(dora_copy, lambda t: {k: v for k, v in t.items() if "magnitude" not in k})
    _refused(dora_copy, spec, AdapterFormatError, "has use_dora=true but module 'model.layers.0.self_attn.q_proj' "
             "has no lora_magnitude_vector")


def test_magnitudes_without_use_dora_refused(dora_copy, spec, edit_config):
    edit_config(dora_copy, use_dora=False)
    _refused(dora_copy, spec, AdapterFormatError, "a DoRA magnitude vector, but adapter_config.json has use_dora=false")


def test_magnitude_of_wrong_width_refused(dora_copy, spec, edit_tensors):
    edit_tensors(dora_copy, lambda t: {**t, Q0_M: t[Q0_M][:32].contiguous()})
    _refused(dora_copy, spec, AdapterIncompatibleError, f"tensor {Q0_M!r} has shape [32]; expected [64]")


def test_magnitude_without_lora_a_refused(dora_copy, spec, edit_tensors):
    edit_tensors(dora_copy, lambda t: {k: v for k, v in t.items() if "q_proj.lora_A" not in k or ".layers.0." not in k})
    _refused(dora_copy, spec, AdapterFormatError, "has no matching lora_A")


def test_nan_magnitude_refused(dora_copy, spec, edit_tensors):
    def poison(t):
        m = t[Q0_M].clone()
        m[3] = float("nan")
        return {**t, Q0_M: m}

    edit_tensors(dora_copy, poison)
    _refused(dora_copy, spec, AdapterFormatError, f"tensor {Q0_M!r} contains NaN or Inf values", needs_data=True)
    layout = inspect_peft_adapter(dora_copy, spec, MAX_RANK)
    with pytest.raises(AdapterFormatError, match=re.escape(f"tensor {Q0_M!r} contains NaN or Inf values")):
        read_slot_image(layout, spec, MAX_RANK, torch.float32, version_id="x", pin_memory=False)


def _bound_weights(spec, model, num_slots: int = 3) -> LoRADeviceWeights:
    weights = LoRADeviceWeights(spec, num_slots, MAX_RANK, torch.float32, "cpu")
    weights.bind_base_weights(lambda layer, module, start, stop:
                              _peft_layer(model, layer, module).base_layer.weight[start:stop].detach())
    return weights


@pytest.mark.parametrize("batched", [False, True], ids=["write", "write_many"])
def test_install_gains_equal_peft(dora, peft_adapter, spec, batched):
    folder, model = dora
    adapter = load_peft_adapter(folder, spec, MAX_RANK)
    image = slot_image_from_adapter(adapter, spec, MAX_RANK, torch.float32, pin_memory=False)
    lora_folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=ALL, seed=3)
    plain = slot_image_from_adapter(load_peft_adapter(lora_folder, spec, MAX_RANK), spec, MAX_RANK, torch.float32,
                                    pin_memory=False)
    weights = _bound_weights(spec, model)
    for table in weights.gain:  # poison: every written row must be rewritten
        for gain in table.values():
            gain[:2].fill_(float("nan"))
    if batched:
        weights.write_many([(1, image, (1,)), (0, plain, (0,))], staging_bytes=1 << 20)
    else:
        weights.write(1, image, (1,))
        weights.write(0, plain, (0,))
    assert weights.dora_slots == {1}
    for layer in range(spec.num_layers):
        for module in ALL:
            gain = weights.gain[layer][module]
            torch.testing.assert_close(gain[1], _peft_gain(model, layer, module), rtol=1e-6, atol=1e-6)
            assert float((gain[1] - 1).abs().max()) > 1e-3
            assert torch.equal(gain[0], torch.ones_like(gain[0])) and torch.equal(gain[3], torch.ones_like(gain[3]))
    # The fused view a q/k/v linear binds: the three slices side by side.
    fused = weights.gain_columns(0, ["q_proj", "k_proj", "v_proj"])
    assert torch.equal(fused[1], torch.cat([weights.gain[0][m][1] for m in ("q_proj", "k_proj", "v_proj")]))
    with pytest.raises(ValueError, match="not consecutive"):
        weights.gain_columns(0, ["q_proj", "v_proj"])
    # A plain adapter over the DoRA slot, and disabling: gains back to 1.
    weights.write(1, plain, (1,))
    assert weights.dora_slots == set() and all(torch.equal(g[1], torch.ones_like(g[1]))
                                               for t in weights.gain for g in t.values())
    weights.write(2, image, (2,))
    weights.disable(2)
    assert weights.dora_slots == set() and all(torch.equal(g[2], torch.ones_like(g[2]))
                                               for t in weights.gain for g in t.values())


def test_pool_without_base_weights_refuses_dora(dora, spec):
    """Slots with no base weights bound cannot compute the gains: registration refuses (declared or not)."""
    folder, _ = dora
    pool = LoRASlotPool(spec, 1, MAX_RANK, 1, torch.float32, "cpu")
    for request in (LoRARequest("d", 1, str(folder)), LoRARequest("d", 2, str(folder), version_id="ab" * 32)):
        with pytest.raises(AdapterUnsupportedError, match="is a DoRA adapter .* no base model weights"):
            pool.add_lora(request)
    assert pool.list_loras() == []


@pytest.mark.parametrize("magnitude_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bf16_image_read_verbatim_or_not_equals_the_loaded_adapter(dora_copy, spec, edit_tensors, magnitude_dtype):
    """A/B stored in the slot dtype at rank R: the image is read from the file's data section, with the
    magnitudes (bf16: between the factors; float32: safetensors writes them first) read on their own;
    both equal the loaded adapter's image."""
    edit_tensors(dora_copy, lambda t: {k: v.to(magnitude_dtype if "magnitude" in k else torch.bfloat16)
                                       for k, v in t.items()})
    adapter = load_peft_adapter(dora_copy, spec, 4)
    layout = inspect_peft_adapter(dora_copy, spec, 4)
    read = read_slot_image(layout, spec, 4, torch.bfloat16, version_id="x", pin_memory=False)
    built = slot_image_from_adapter(adapter, spec, 4, torch.bfloat16, pin_memory=False)
    for key in adapter.weights:
        assert torch.equal(read.a(key), built.a(key)) and torch.equal(read.b(key), built.b(key))
        assert torch.equal(read.magnitude[key], built.magnitude[key])
