"""Found by a hostile review (session 6), FP8 checkpoints (loraplex/adapters/model_spec.py ``_checkpoint_quantization``,
loraplex/engine/models/loader.py ``_copy_fp8``).

1. A compressed-tensors ``transform_config`` (online Hadamard rotations, llm-compressor's
   SpinQuant/QuIP: the stored weights are rotated and the runtime must rotate the activations too)
   was ignored: the checkpoint loaded and would be served without the rotations. A field the engine
   does not implement must be refused naming it.
2. The declared weight strategy was not checked against the stored scales: ``strategy: tensor``
   with one scale per output channel (or ``channel`` with a [2, out / 2] scale) loaded; HF's
   compressed-tensors loader refuses both (the parameter shapes differ).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fp8_quantization import FBGEMM, compressed_tensors, write_fp8_checkpoint  # noqa: E402

from loraplex import LLM  # noqa: E402
from loraplex.adapters.model_spec import UnsupportedModelError  # noqa: E402

SCALE = "model.layers.0.self_attn.k_proj.weight_scale"


def _with_config(folder: Path, quantization_config: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def _llm(folder: Path) -> LLM:
    return LLM(model=str(folder), max_model_len=64, block_size=4, num_kv_blocks=32)


def test_compressed_tensors_transform_config_is_refused_naming_the_field(tiny_llama_dir, tmp_path):
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path, compressed_tensors("channel", None), False)
    transform = {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_input"}]}}}
    _with_config(fp8_dir, {**compressed_tensors("channel", None), "transform_config": transform})
    with pytest.raises(UnsupportedModelError, match=r"\['transform_config'\]"):
        _llm(fp8_dir)


def test_per_tensor_strategy_with_per_channel_scales_is_refused(tiny_llama_dir, tmp_path):
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path, compressed_tensors("tensor", None), False)
    with pytest.raises(ValueError, match="weight_scale"):
        _llm(fp8_dir)  # every scale is [out, 1] but the config says one scale per tensor


def test_per_channel_scale_of_another_2d_shape_is_refused(tiny_llama_dir, tmp_path):
    fp8_dir, _ = write_fp8_checkpoint(tiny_llama_dir, tmp_path, FBGEMM, False)
    weights = load_file(str(fp8_dir / "model.safetensors"))
    weights[SCALE] = weights[SCALE].reshape(2, -1).contiguous()  # [32, 1] -> [2, 16]
    save_file(weights, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight_scale' has shape \(2, 16\)"):
        _llm(fp8_dir)
