"""DoRA adapters in the engine (issue 19): every row equals HF + PEFT (``use_dora=True``), alone, batched
with plain LoRA adapters and base rows, across slot churn, and through the (emulated) CUDA-graph steps."""

from __future__ import annotations

import pytest
import torch
from test_fp8_quantization import dequantized_dir  # noqa: F401 (a fixture)
from test_step_fastpaths import _emulate_graphs, _run
from tiny_models import (
    FOLDS, check_row, fold_config, hf_greedy_ids, hf_last_logprobs, make_peft_adapter, peft_model, peft_references,
)
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterUnsupportedError

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name: (rank, alpha, targets, DoRA)
    "dora": (8, 16, ALL, True),
    "lora": (4, 8, ("q_proj", "v_proj", "down_proj"), False),
    "dora2": (4, 32, ("k_proj", "o_proj", "up_proj"), True),
}
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
TEXTS = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Colors: red, green"]


def _adapters(base_dir, root, names) -> dict[str, LoRARequest]:
    out = {}
    for i, name in enumerate(names):
        r, alpha, targets, dora = ADAPTERS[name]
        path = make_peft_adapter(base_dir, root / name, r=r, alpha=alpha, targets=targets, seed=30 + i,
                                 use_dora=dora)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    return _adapters(tiny_llama_dir, tmp_path_factory.mktemp("dora-llama"), list(ADAPTERS))


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok.encode(t) for t in TEXTS]


def _references(base_dir, adapters, prompts) -> dict:
    """(adapter name or "base", prompt index) -> (PEFT greedy tokens, PEFT first-step logprobs)."""
    return peft_references(base_dir, adapters, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def references(tiny_llama_dir, llama_adapters, prompts):
    return _references(tiny_llama_dir, llama_adapters, prompts)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=512, enable_lora=True,
               max_lora_rank=8, **kw)



def _max_gain_deviation(llm: LLM) -> float:
    """max |g - 1| over every slot and module (0 when no DoRA adapter is installed)."""
    weights = llm.engine.lora_pool.weights
    return max(float((g - 1).abs().max()) for per_layer in weights.gain for g in per_layer.values())


def test_dora_adapter_equals_peft_and_differs_from_plain_lora(tiny_llama_dir, llama_adapters, prompts, references):
    llm = make_llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=llama_adapters["dora"])
    for i, out in enumerate(outs):
        check_row(out, *references[("dora", i)])
    assert llm.engine.lora_pool.weights.dora_slots == {0}
    assert _max_gain_deviation(llm) > 0.05, "the magnitudes differ from the column norms: gains are not 1"
    # The same A, B and scaling without the rescale (gains forced to 1) give other logprobs: the gain matters.
    for per_layer in llm.engine.lora_pool.weights.gain:
        for gain in per_layer.values():
            gain.fill_(1.0)
    plain = llm.generate({"prompt_token_ids": prompts[0]}, PARAMS, lora_request=llama_adapters["dora"])[0]
    top5 = torch.topk(references[("dora", 0)][1], 5)
    plain_lp = plain.outputs[0].logprobs[0]
    assert any(abs(plain_lp.get(tid, float("-inf")) - lp) > 1e-2 for tid, lp in zip(top5.indices.tolist(),
                                                                                      top5.values.tolist()))


def test_qwen2_dora_with_biased_projections_equals_peft(tiny_qwen2_dir, prompts, tmp_path_factory):
    """Qwen2's q/k/v have a bias: DoRA rescales ``x W^T + delta`` and adds the bias after (PEFT subtracts it)."""
    adapters = _adapters(tiny_qwen2_dir, tmp_path_factory.mktemp("dora-qwen2"), ["dora"])
    refs = _references(tiny_qwen2_dir, adapters, prompts[:2])
    llm = make_llm(tiny_qwen2_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], PARAMS, lora_request=adapters["dora"])
    for i, out in enumerate(outs):
        check_row(out, *refs[("dora", i)])
    assert _max_gain_deviation(llm) > 0.05


@pytest.mark.parametrize("fold", FOLDS)  # the SGMV kernels, the shrink in the base GEMM, over 4-row pages too
def test_mixed_batch_dora_lora_base_dora2_rows_equal_peft(tiny_llama_dir, llama_adapters, prompts, references, fold):
    llm = make_llm(tiny_llama_dir, max_loras=3, **fold_config(fold))
    order = ["dora", "lora", None, "dora2"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[llama_adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    weights = llm.engine.lora_pool.weights
    assert len(weights.dora_slots) == 2
    # Base rows afterwards: no rescale left behind.
    for i, out in enumerate(llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)):
        check_row(out, *references[("base", i)])


def test_dora_slot_churn_stays_exact(tiny_llama_dir, llama_adapters, prompts, references):
    """One slot, max_cpu_loras=1: DoRA, LoRA, DoRA2, DoRA again take turns, each evicting the previous one
    from the slot and from the host cache (so the DoRA adapters are read and their gains computed again)."""
    llm = make_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=1)
    for name in ("dora", "lora", "dora2", "dora"):
        out = llm.generate({"prompt_token_ids": prompts[1]}, PARAMS, lora_request=llama_adapters[name])[0]
        check_row(out, *references[(name, 1)])
        assert llm.engine.lora_pool.weights.dora_slots == ({0} if ADAPTERS[name][3] else set())
    stats = llm.engine.get_stats().lora
    assert stats.slot_evictions == 3 and stats.cpu_evictions >= 2


def test_graph_steps_with_dora_equal_eager_steps(tiny_llama_dir, llama_adapters, prompts, references):
    """Decode steps replay the (emulated) graph variant of their batch: with the DoRA rescale while a DoRA
    adapter's row runs, the plain LoRA graph otherwise; every row still equals PEFT."""
    llm = make_llm(tiny_llama_dir, max_loras=3, max_num_seqs=8)
    replays = _emulate_graphs(llm)
    order = ["dora", "lora", None, "dora2"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[llama_adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    assert sum(r.replays for r in replays if r.with_dora) >= MAX_NEW - 1
    lora_only = [llama_adapters["lora"], None]
    before = sum(r.replays for r in replays if r.with_dora)
    outs = _run(llm, [{"prompt_token_ids": p} for p in prompts[:2]], [PARAMS, PARAMS], lora_only)
    assert sum(r.replays for r in replays if r.with_dora) == before, "no DoRA slot in the batch: no rescale"
    assert sum(r.replays for r in replays if r.with_lora and not r.with_dora) >= MAX_NEW - 1
    assert outs[0][0][0] == references[("lora", 0)][0] and outs[1][0][0] == references[("base", 1)][0]


def test_dora_steps_run_eagerly_without_dora_graphs(tiny_llama_dir, llama_adapters, prompts, references):
    """Graphs captured without the DoRA variants (tensor parallelism): steps holding a DoRA slot run eagerly."""
    llm = make_llm(tiny_llama_dir, max_loras=3, max_num_seqs=8)
    replays = _emulate_graphs(llm)
    graphs = llm.engine.runner.graphs
    graphs.dora = False
    graphs.graphs = {key: graph for key, graph in graphs.graphs.items() if not key[2]}
    order = ["dora", None]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], PARAMS,
                        lora_request=[llama_adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    assert sum(r.replays for r in replays) == 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], PARAMS,
                        lora_request=[llama_adapters["lora"], None])
    assert sum(r.replays for r in replays) >= MAX_NEW - 1
    check_row(outs[0], *references[("lora", 0)])


def test_fp8_dora_norms_use_the_dequantized_weights(tiny_llama_dir, dequantized_dir, llama_adapters,  # noqa: F811
                                                     prompts):
    """With FP8 base weights the column norms are those of the weights the layers compute with: HF + PEFT over
    the dequantized checkpoint is the reference."""
    llm = make_llm(tiny_llama_dir, quantization="fp8")
    adapter = llama_adapters["dora"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], PARAMS, lora_request=adapter)
    reference = peft_model(dequantized_dir, adapter.lora_path)
    for p, out in zip(prompts, outs):
        check_row(out, hf_greedy_ids(reference, p, MAX_NEW), hf_last_logprobs(reference, p))


def test_dora_refused_with_tensor_parallelism(tiny_llama_dir, llama_adapters):
    """With tensor parallelism (two CPU ranks) a DoRA adapter is refused at registration, naming the setting;
    plain LoRA adapters are still served."""
    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
              max_num_seqs=4, tensor_parallel_size=2)
    try:
        with pytest.raises(AdapterUnsupportedError, match="DoRA is not served with tensor_parallel_size=2 > 1"):
            llm.engine.add_lora(llama_adapters["dora"])
        assert llm.engine.add_lora(llama_adapters["lora"])
        assert llm.engine.list_loras() == {llama_adapters["lora"].lora_int_id}
    finally:
        llm.engine.close()
