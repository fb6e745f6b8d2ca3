"""DoRA on a GPU (issue 19): captured CUDA graphs (decode and mixed steps, the DoRA variant) give the eager
engine's tokens and logprobs for a batch mixing DoRA, LoRA and base rows, and the gains computed on the GPU
equal the CPU engine's. The adapters are written by hand in PEFT's format (no PEFT needed on the GPU machine;
the CPU tests in test_dora.py check the format and the numbers against PEFT itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from loraplex import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(base_dir: Path, out: Path, *, r: int, alpha: float, targets: tuple[str, ...], dora: bool,
                  seed: int) -> Path:
    """A PEFT-format LoRA (or DoRA: magnitudes ``||W + s B A||_row * (1 + 0.1 N(0, 1))``) adapter of ``base_dir``."""
    weights = load_file(str(base_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    layers = 1 + max(int(name.split(".")[2]) for name in weights if name.startswith("model.layers."))
    for layer in range(layers):
        for module in targets:
            w = weights[f"model.layers.{layer}.{PARENT[module]}.{module}.weight"].float()
            a = torch.randn(r, w.shape[1], generator=generator) * 0.3
            b = torch.randn(w.shape[0], r, generator=generator) * 0.1
            prefix = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            if dora:
                norm = torch.linalg.vector_norm(w + (alpha / r) * b @ a, dim=1)
                noise = torch.randn(norm.shape, generator=generator)
                tensors[f"{prefix}.lora_magnitude_vector"] = norm * (1 + 0.1 * noise)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
              "use_dora": dora, "use_rslora": False, "lora_dropout": 0.0}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dora-gpu")
    base = make_tiny_model(root / "llama", "llama")
    specs = {"dora": (8, 16, tuple(PARENT), True), "lora": (4, 8, ("q_proj", "v_proj", "down_proj"), False),
             "dora2": (4, 32, ("k_proj", "o_proj", "up_proj"), True)}
    adapters = {name: LoRARequest(name, i + 1, str(write_adapter(base, root / name, r=r, alpha=alpha, targets=t,
                                                                 dora=d, seed=50 + i)))
                for i, (name, (r, alpha, t, d)) in enumerate(specs.items())}
    return base, adapters


def mixed_batch(base: Path, dtype: str, seed: int) -> tuple[dict, list[list[int]], SamplingParams]:
    """Engine keyword arguments (CUDA, 3 adapter slots of rank 8, 20-token steps: decode and mixed graphs), six
    random prompts of 3-14 tokens and greedy 12-token sampling: the batch the GPU engine tests compare."""
    kw = {"model": str(base), "device": "cuda", "dtype": dtype, "max_model_len": 64, "block_size": 4,
          "num_kv_blocks": 256, "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_num_seqs": 8,
          "max_num_batched_tokens": 20}
    rng = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=rng).tolist() for n in (5, 9, 3, 14, 7, 11)]
    return kw, prompts, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


def _run(llm: LLM, prompts, params, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_dora_graphs_equal_eager(setup, dtype):
    base, adapters = setup
    kw, prompts, params = mixed_batch(base, dtype, seed=9)
    order = ["dora", "lora", None, "dora2", "dora", None]
    loras = [adapters[n] if n else None for n in order]
    expected = _run(LLM(**kw, enforce_eager=True), prompts, params, loras)
    llm = LLM(**kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and {key[1:3] for key in graphs.graphs} == {(False, False), (True, False), (True, True)}
    calls = []
    run, run_mixed = graphs.run, graphs.run_mixed
    graphs.run = lambda *a, **k: calls.append(("decode", k.get("dora"))) or run(*a, **k)
    graphs.run_mixed = lambda *a, **k: calls.append(("mixed", k.get("dora"))) or run_mixed(*a, **k)
    got = _run(llm, prompts, params, loras)
    assert ("decode", True) in calls and ("mixed", True) in calls
    assert llm.engine.lora_pool.weights.dora_slots, "DoRA adapters are resident"
    for (e_ids, e_cum), (g_ids, g_cum) in zip(expected, got):
        assert g_ids == e_ids
        assert g_cum == pytest.approx(e_cum, abs=1e-3 if dtype == "float32" else 5e-2)
    # plain LoRA and base rows only: the plain graphs, no DoRA rescale
    calls.clear()
    only_lora = _run(llm, prompts[1:3], params, [adapters["lora"], None])
    assert calls and all(dora is False for _, dora in calls)
    if dtype == "float32":
        assert [ids for ids, _ in only_lora] == [ids for ids, _ in expected[1:3]]


def test_gpu_gains_equal_cpu_gains(setup):
    base, adapters = setup
    gains = []
    for device in ("cpu", "cuda"):
        llm = LLM(model=str(base), device=device, dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=64,
                  enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=True)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=1),
                     lora_request=adapters["dora"])
        weights = llm.engine.lora_pool.weights
        modules = list(weights.spec.module_shapes)
        gains.append(torch.stack([weights.gain_columns(layer, modules).cpu() for layer in range(len(weights.gain))]))
    torch.testing.assert_close(gains[1], gains[0], rtol=1e-5, atol=1e-5)
    assert float((gains[0][:, 0] - 1).abs().max()) > 0.05 and bool((gains[0][:, 1:] == 1).all())
