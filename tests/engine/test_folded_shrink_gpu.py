"""The LoRA shrink folded into the base GEMM on a GPU: with CUDA graphs (decode and mixed steps), each expand
applied by the kernel after its linear (rotary, norm, activation), a batch of LoRA and base rows gives the
unfolded engine's tokens and logprobs (the SGMV pair, checked against PEFT on the CPU in test_multi_lora.py),
in float32 and bfloat16. Adapters written by hand in PEFT's format (test_dora_gpu.write_adapter)."""

from __future__ import annotations

import pytest
import torch
from test_dora_gpu import PARENT, _run, mixed_batch, write_adapter
from tiny_models import make_tiny_model

from loraplex import LLM, LoRARequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("folded-gpu")
    base = make_tiny_model(root / "llama", "llama")
    specs = {"all": (8, 16, tuple(PARENT)), "qv": (4, 8, ("q_proj", "v_proj")),
             "mlp": (8, 32, ("k_proj", "o_proj", "up_proj", "down_proj"))}
    return base, {name: LoRARequest(name, i + 1, str(write_adapter(base, root / name, r=r, alpha=alpha, targets=t,
                                                                   dora=False, seed=70 + i)))
                  for i, (name, (r, alpha, t)) in enumerate(specs.items())}


@pytest.mark.parametrize("page_rows", [8, 2], ids=["one page per adapter", "2-row pages"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_folded_graphs_equal_the_unfolded_engine(setup, dtype, page_rows):
    """With 2-row pages (2 to 4 pages per adapter) the folded GEMM covers every page and each token's expand reads
    its slot's pages through the page table; the unfolded engine runs the paged SGMV kernels."""
    base, adapters = setup
    kw, prompts, params = mixed_batch(base, dtype, seed=11)
    kw["lora_page_rows"] = page_rows
    loras = [adapters[n] if n else None for n in ["all", "qv", None, "mlp", "all", None]]
    expected = _run(LLM(**kw, enforce_eager=True, lora_fold_shrink="off"), prompts, params, loras)
    llm = LLM(**kw, lora_fold_shrink="on")
    assert llm.engine.runner.graphs is not None
    assert all(lin.folded_weight is not None for _, lin in llm.engine.model.lora_linears() if lin.lora_a)
    got = _run(llm, prompts, params, loras)
    for (e_ids, e_cum), (g_ids, g_cum) in zip(expected, got):
        if dtype == "float32":
            assert g_ids == e_ids and g_cum == pytest.approx(e_cum, abs=1e-3)
        else:  # bf16 rounds the rank sums in another order: greedy ties may part later
            assert g_ids[:2] == e_ids[:2]
