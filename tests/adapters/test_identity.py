"""version_id: same content -> same id wherever it lives; any change of config or weights -> new id."""

from __future__ import annotations

import hashlib
import json
import shutil

import torch

from loraplex.adapters import compute_version_id, load_peft_adapter

MAX_RANK = 16
Q0_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def version(folder, spec):
    return load_peft_adapter(folder, spec, MAX_RANK).version_id


def test_copy_elsewhere_keeps_id(base_adapter_dir, spec, tmp_path):
    copy = shutil.copytree(base_adapter_dir, tmp_path / "somewhere" / "else")
    assert version(copy, spec) == version(base_adapter_dir, spec)


def test_config_formatting_and_key_order_do_not_matter(adapter_copy, base_adapter_dir, spec):
    path = adapter_copy / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(config.items()))), indent=7))
    assert version(adapter_copy, spec) == version(base_adapter_dir, spec)


def test_changing_one_weight_changes_id(adapter_copy, base_adapter_dir, spec, edit_tensors):
    def nudge(tensors):
        tensors[Q0_B] = tensors[Q0_B].clone()
        tensors[Q0_B][0, 0] += 1e-3
        return tensors

    edit_tensors(adapter_copy, nudge)
    assert version(adapter_copy, spec) != version(base_adapter_dir, spec)


def test_changing_dtype_changes_id(adapter_copy, base_adapter_dir, spec, edit_tensors):
    edit_tensors(adapter_copy, lambda t: {k: v.to(torch.float64) for k, v in t.items()})
    assert version(adapter_copy, spec) != version(base_adapter_dir, spec)


def test_changing_config_changes_id(adapter_copy, base_adapter_dir, spec, edit_config):
    edit_config(adapter_copy, lora_alpha=9)
    assert version(adapter_copy, spec) != version(base_adapter_dir, spec)


def test_id_is_sha256_of_documented_stream():
    """Recompute the documented byte stream by hand for a two-tensor adapter."""
    config = {"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}
    tensors = {"b": torch.tensor([[3.0]]), "a": torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)}

    def framed(data: bytes) -> bytes:
        return len(data).to_bytes(8, "little") + data

    stream = b"loraplex-adapter-v1\0" + framed(b'{"lora_alpha":2,"r":1,"target_modules":["q_proj"]}')
    stream += framed(b'["a", "torch.bfloat16", [1, 2]]') + framed(bytes.fromhex("803f0040"))
    stream += framed(b'["b", "torch.float32", [1, 1]]') + framed(bytes.fromhex("00004040"))
    assert compute_version_id(config, tensors) == hashlib.sha256(stream).hexdigest()
