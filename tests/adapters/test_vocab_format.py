"""PEFT adapters on embed_tokens / lm_head: what is read (against the PEFT model's own parameters), what the
slot image holds, and what is refused."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters.errors import AdapterFormatError, AdapterIncompatibleError, AdapterUnsupportedError
from loraplex.adapters.peft_format import inspect_peft_adapter, load_peft_adapter
from loraplex.adapters.slot_image import read_slot_image, slot_image_from_adapter


def _randomized(peft_adapter, **kw):
    folder, model = peft_adapter(**kw)
    with torch.no_grad():  # PEFT starts lora_embedding_A at zero: make every factor non-zero
        for name, p in model.named_parameters():
            if "lora_embedding" in name or "modules_to_save" in name:
                p.copy_(torch.randn_like(p))
    model.save_pretrained(str(folder))
    return folder, model


def test_embedding_and_head_lora_read_as_peft_holds_them(peft_adapter, spec):
    folder, model = _randomized(peft_adapter, r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"],
                                rank_pattern={"lm_head": 2})
    adapter = load_peft_adapter(folder, spec, 8)
    base = model.base_model.model
    embed, head = base.model.embed_tokens, base.lm_head
    assert torch.equal(adapter.vocab.embed.a, embed.lora_embedding_A["default"])  # [r, V]
    assert torch.equal(adapter.vocab.embed.b, embed.lora_embedding_B["default"])  # [H, r]
    assert adapter.vocab.embed.scaling == embed.scaling["default"] == 2.0
    assert torch.equal(adapter.vocab.head.a, head.lora_A["default"].weight)  # [2, H] (rank_pattern)
    assert adapter.vocab.head.scaling == head.scaling["default"] == 4.0
    assert adapter.target_modules == ("q_proj", "embed_tokens", "lm_head") and adapter.vocab.full == {}
    info = adapter.info()
    assert info.target_modules == ("q_proj", "embed_tokens", "lm_head") and info.modules_to_save == ()
    layout = inspect_peft_adapter(folder, spec, 8)
    assert [plan.module for plan in layout.vocab_lora] == ["embed_tokens", "lm_head"] and layout.rank == 4
    # The slot image read from the file equals the one built from the loaded adapter; A is stored transposed.
    read = read_slot_image(layout, spec, 8, torch.float32, version_id="v", pin_memory=False)
    built = slot_image_from_adapter(adapter, spec, 8, torch.float32, pin_memory=False)
    for image in (read, built):
        vocab = image.vocab
        assert vocab.embed_a_t.shape == (spec.vocab_size, 8) and torch.equal(vocab.embed_a_t[:, :4], adapter.vocab.embed.a.T)
        assert not vocab.embed_a_t[:, 4:].any() and not vocab.head_b[:, 2:].any()
        assert torch.equal(vocab.head_b[:, :2], adapter.vocab.head.b) and vocab.scaling.tolist() == [2.0, 4.0]


def test_modules_to_save_copies_read_as_peft_holds_them(peft_adapter, spec):
    folder, model = _randomized(peft_adapter, r=4, lora_alpha=8, target_modules=["q_proj"],
                                modules_to_save=["lm_head", "embed_tokens"])
    adapter = load_peft_adapter(folder, spec, 8)
    base = model.base_model.model
    assert torch.equal(adapter.vocab.full["lm_head"], base.lm_head.modules_to_save["default"].weight)
    assert torch.equal(adapter.vocab.full["embed_tokens"], base.model.embed_tokens.modules_to_save["default"].weight)
    assert adapter.vocab.embed is None and adapter.vocab.head is None
    assert adapter.info().modules_to_save == ("embed_tokens", "lm_head")
    image = read_slot_image(inspect_peft_adapter(folder, spec, 8), spec, 8, torch.float32, version_id="v",
                            pin_memory=False)
    assert torch.equal(image.vocab.full["lm_head"], adapter.vocab.full["lm_head"])
    assert image.nbytes > 2 * spec.vocab_size * spec.hidden_size * 4


def _copy_with(folder, tmp_path, edit):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    tensors = edit(load_file(str(out / "adapter_model.safetensors")))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize(("kw", "edit", "error", "message"), [
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
     lambda t: {k: v for k, v in t.items() if not k.endswith("lm_head.weight")},
     AdapterFormatError, "lm_head: adapter_config.json modules_to_save=['lm_head'] but adapter_model.safetensors "
                         "holds no copy of it"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
     lambda t: t | {"base_model.model.lm_head.weight": torch.zeros(255, 64)},
     AdapterIncompatibleError, "tensor 'base_model.model.lm_head.weight' has shape [255, 64]; the base model's "
                               "lm_head is [256, 64]"),
    (dict(target_modules=["lm_head"]),
     lambda t: t | {"base_model.model.lm_head.lora_B.weight": torch.zeros(256, 3)},
     AdapterFormatError, "tensor 'base_model.model.lm_head.lora_B.weight' has shape [256, 3]; expected [256, 4]"),
    (dict(target_modules=["embed_tokens"]),
     lambda t: {k.replace("lora_embedding_A", "lora_A.weight"): v for k, v in t.items()},
     AdapterFormatError, "is not a LoRA weight of embed_tokens as PEFT saves it (expected lora_embedding_A"),
])
def test_bad_vocab_tensors_refused(peft_adapter, spec, tmp_path, kw, edit, error, message):
    folder, _ = peft_adapter(r=4, lora_alpha=8, **kw)
    edited = _copy_with(folder, tmp_path, edit)
    for load in (load_peft_adapter, inspect_peft_adapter):
        with pytest.raises(error, match=re.escape(message)):
            load(edited, spec, 8)


def test_lora_and_copy_of_one_module_refused(peft_adapter, spec, tmp_path, edit_config):
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    edited = _copy_with(folder, tmp_path, lambda t: t)
    edit_config(edited, target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterUnsupportedError, match="lm_head is both in modules_to_save and targeted by LoRA"):
        inspect_peft_adapter(edited, spec, 8)


def test_vocab_lora_rank_above_max_refused(peft_adapter, spec):
    folder, _ = peft_adapter(r=16, lora_alpha=8, target_modules=["lm_head"])
    with pytest.raises(AdapterIncompatibleError, match="r=16 exceeds max_lora_rank=8 \\(module 'lm_head'\\)"):
        inspect_peft_adapter(folder, spec, 8)


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_dora_on_embed_tokens_or_lm_head_refused(peft_adapter, spec, module):
    """PEFT puts DoRA on the embedding (``DoraEmbeddingLayer``, a gain per hidden channel) and on the head (a
    gain per logit); the engine's vocabulary LoRA path applies neither, so such an adapter is refused, naming it."""
    folder, model = peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj", module], use_dora=True)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert any(module in name and "lora_magnitude_vector" in name for name in saved)  # PEFT did put DoRA there
    message = f"use_dora=true with LoRA on {module} .*: DoRA on embed_tokens / lm_head is not served"
    for read in (inspect_peft_adapter, load_peft_adapter):
        with pytest.raises(AdapterUnsupportedError, match=message):
            read(folder, spec, 8)


def test_dora_with_modules_to_save_copies_served(peft_adapter, spec):
    """DoRA on the projections and a ``modules_to_save`` copy of lm_head: both parts read as PEFT holds them."""
    folder, model = _randomized(peft_adapter, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                modules_to_save=["lm_head"], use_dora=True)
    adapter = load_peft_adapter(folder, spec, 8)
    base = model.base_model.model
    assert adapter.use_dora and adapter.info().adapter_type == "dora"
    assert adapter.info().modules_to_save == ("lm_head",)
    assert torch.equal(adapter.vocab.full["lm_head"], base.lm_head.modules_to_save["default"].weight)
    q_proj = base.model.layers[0].self_attn.q_proj
    assert torch.equal(adapter.weights[(0, "q_proj")].magnitude, q_proj.lora_magnitude_vector["default"].weight)
    image = read_slot_image(inspect_peft_adapter(folder, spec, 8), spec, 8, torch.float32, version_id="v",
                            pin_memory=False)
    assert torch.equal(image.magnitude[(0, "q_proj")], adapter.weights[(0, "q_proj")].magnitude)
    assert torch.equal(image.vocab.full["lm_head"], adapter.vocab.full["lm_head"])
