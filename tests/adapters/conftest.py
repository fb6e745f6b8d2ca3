"""Shared fixtures: real PEFT adapters on a tiny random Llama, and hand-written PEFT-format folders.

Helpers are handed out as fixtures (not imported) so the tests work under any pytest import mode.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import BaseModelSpec
from loraplex.adapters.spec import SPLIT_MODULE_NAMES

TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
ALL_PROJ = list(SPLIT_MODULE_NAMES)  # every LoRA-able module of a Llama


def make_tiny_llama_config(**overrides: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


@pytest.fixture(scope="session")
def tiny_llama_config() -> Callable[..., Any]:
    """Factory: ``tiny_llama_config(**overrides) -> LlamaConfig`` (hidden 64, 2 layers, 4 q / 2 kv heads)."""
    return make_tiny_llama_config


@pytest.fixture(scope="session")
def spec() -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(make_tiny_llama_config())


def build_peft_model(lora_kwargs: dict[str, Any], *, seed: int = 0, randomize_b: bool = True):
    """A PEFT LoRA model on a tiny random Llama; B set to non-zero random values unless told not to."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_tiny_llama_config())
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora_kwargs))
    if randomize_b:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0.0, 0.5)
    return peft_model.eval()


@pytest.fixture(scope="session")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Any]]:
    """Factory: ``peft_adapter(**LoraConfig kwargs) -> (saved folder, peft model)``, cached per kwargs."""
    cache: dict[str, tuple[Path, Any]] = {}

    def make(*, seed: int = 0, randomize_b: bool = True, **lora_kwargs: Any) -> tuple[Path, Any]:
        key = json.dumps([seed, randomize_b, lora_kwargs], sort_keys=True, default=str)
        if key not in cache:
            peft_model = build_peft_model(lora_kwargs, seed=seed, randomize_b=randomize_b)
            folder = tmp_path_factory.mktemp("peft")
            peft_model.save_pretrained(str(folder))
            cache[key] = (folder, peft_model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def base_adapter_dir(peft_adapter) -> Path:
    """A PEFT adapter on all seven projections, r=4, lora_alpha=8, random B."""
    folder, _ = peft_adapter(r=4, lora_alpha=8, target_modules=ALL_PROJ)
    return folder


@pytest.fixture
def adapter_copy(base_adapter_dir: Path, tmp_path: Path) -> Path:
    """A private, editable copy of ``base_adapter_dir``."""
    return Path(shutil.copytree(base_adapter_dir, tmp_path / "adapter"))


def _edit_config(folder: Path, **updates: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config, indent=2))


def _edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file(edit(tensors), str(path), metadata={"format": "pt"})


def _write_adapter(
    folder: Path,
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    lora_alpha: float,
    rank_pattern: dict[str, int] | None = None,
) -> None:
    """Write a PEFT-format folder by hand: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = sorted({module for _, module in weights})
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": lora_alpha,
        "target_modules": modules,
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": {},
        "bias": "none",
        "use_rslora": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for (layer, module), (a, b) in weights.items():
        parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def edit_config() -> Callable[..., None]:
    """``edit_config(folder, **fields)``: update fields of ``adapter_config.json``."""
    return _edit_config


@pytest.fixture(scope="session")
def edit_tensors() -> Callable[..., None]:
    """``edit_tensors(folder, fn)``: rewrite ``adapter_model.safetensors`` as ``fn(tensors)``."""
    return _edit_tensors


@pytest.fixture(scope="session")
def write_adapter() -> Callable[..., None]:
    """``write_adapter(folder, {(layer, module): (A, B)}, r=, lora_alpha=)``: a hand-written PEFT folder."""
    return _write_adapter
