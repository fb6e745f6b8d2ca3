"""The LoRA shrink folded into the base GEMM (``lora_fold_shrink``): PEFT-exact rows, installs into the folded
weight, the SGMV pair above FOLD_MAX_TOKENS, the auto rule and what is refused."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import ConfigError, EngineConfig
from loraplex.engine.models import llama
from loraplex.kernels.lora_linear import fold_shrink_pays
from tiny_models import check_row, make_peft_adapter, peft_references

ADAPTERS = {
    # name: (rank, alpha, targets, rslora)
    "a": (4, 8, ("q_proj", "v_proj"), False),
    "b": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "c": (16, 8, ("o_proj", "down_proj", "up_proj"), True),
    "d": (8, 32, ("k_proj", "gate_proj"), False),
}
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("folded-adapters")
    return {name: LoRARequest(name, i + 1, str(make_peft_adapter(tiny_llama_dir, root / name, r=r, alpha=alpha,
                                                                 targets=targets, use_rslora=rs, seed=40 + i)))
            for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok.encode(t) for t in ["The quick brown fox jumps", "Paris is the capital", "def add(a, b):",
                                    "Colors: red, green", "Large language models serve"]]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, prompts):
    return peft_references(tiny_llama_dir, adapters, prompts, MAX_NEW)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 3)
    kw.setdefault("max_lora_rank", 16)
    kw.setdefault("lora_fold_shrink", "on")
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=512, enable_lora=True, **kw)


def _bound(llm: LLM):
    return [(layer, lin) for layer, lin in llm.engine.model.lora_linears() if lin.lora_a]


def test_folded_pool_shares_the_base_weight_and_mixed_rows_equal_peft(tiny_llama_dir, adapters, prompts, references):
    """"on": every bound linear holds W and its pool's A pages in one tensor (the pool's A are its views, so
    installs land in the GEMM's rows); a mixed batch (three adapters and base rows) equals PEFT row by row, and a
    base batch after it the base model."""
    llm = make_llm(tiny_llama_dir)
    pool = llm.engine.lora_pool.weights
    for layer, lin in _bound(llm):
        folded = lin.folded_weight
        assert folded is not None and lin.weight.data_ptr() == folded.data_ptr()
        start = lin.weight.shape[0]
        for module in lin.module_names:
            a = pool.a[layer][module]
            assert a.data_ptr() == folded[start:].data_ptr()
            start += a.shape[0] * a.shape[1]
        assert start == folded.shape[0]
    order = ["a", "b", None, "c", "b"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    layer, lin = _bound(llm)[0]
    slot = llm.engine.lora_pool.slot_of(adapters["b"].lora_int_id)
    assert slot is not None and lin.folded_weight[lin.weight.shape[0]:].abs().sum() > 0, "installs reach the GEMM"
    for i, out in enumerate(llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)):
        check_row(out, *references[("base", i)])


@pytest.mark.parametrize("page_rows", [16, 8, 4])
def test_slot_churn_rewrites_the_folded_rows(tiny_llama_dir, adapters, prompts, references, page_rows):
    """Two slots, four adapters (ranks 4, 8, 16, 8) taking turns: every install and eviction rewrites A rows inside
    the folded weight (with 8- or 4-row pages, in pages other adapters held before, part of a page for rank 4);
    each row still equals PEFT."""
    llm = make_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=2, lora_page_rows=page_rows)
    for round_ in range(2):
        for k, name in enumerate(["a", "b", "c", "d"]):
            i = (k + round_) % len(prompts)
            out = llm.generate({"prompt_token_ids": prompts[i]}, PARAMS, lora_request=adapters[name])[0]
            check_row(out, *references[(name, i)])
    assert llm.engine.get_stats().lora.slot_evictions >= 4


@pytest.mark.parametrize("page_rows", [16, 4], ids=["one page per adapter", "4-row pages"])
def test_prompt_steps_above_the_fold_limit_take_the_sgmv_pair(tiny_llama_dir, adapters, prompts, references,
                                                              monkeypatch, page_rows):
    """A step of more than FOLD_MAX_TOKENS tokens runs the SGMV pair over the folded linear's base rows; decode
    steps the folded GEMM, each expand applied by the kernel after it (rotary, norm, activation): every path runs
    and the rows equal PEFT."""
    monkeypatch.setattr(llama, "FOLD_MAX_TOKENS", 4)
    llm = make_llm(tiny_llama_dir, lora_page_rows=page_rows)
    assert all(lin.lora_page_table.shape[1] == 16 // page_rows for _, lin in _bound(llm))
    kernels = llm.engine.model.norm.kernels
    calls = {"add_lora": 0, "rms_norm": 0, "silu_and_mul": 0, "rotary_and_cache": 0}
    for name in calls:
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if _name == "add_lora" or kwargs.get("lora") is not None:
                calls[_name] += 1  # the others: only when they apply a deferred expand
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernels, name, spy)
    for layer in llm.engine.model.layers:  # the MLP holds its activation op bound at construction
        monkeypatch.setattr(layer.mlp, "act_and_mul", kernels.silu_and_mul)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], PARAMS,
                        lora_request=[adapters["b"], adapters["a"]])
    for i, (name, out) in enumerate(zip(["b", "a"], outs)):
        check_row(out, *references[(name, i)])
    assert all(calls.values()), calls  # every folded linear's expand applied by the kernel after it


@pytest.mark.interpreter
@pytest.mark.parametrize("page_rows", [16, 4], ids=["one page per adapter", "4-row pages"])
def test_folded_rows_through_the_triton_kernels_equal_peft(tiny_llama_dir, adapters, prompts, references, monkeypatch,
                                                           page_rows):
    """The engine's Triton kernels (the CPU interpreter here): the expand reads the folded GEMM's columns (with
    4-row pages, adapter b's rank 8 in two of them)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU here: Triton kernels need the interpreter (TRITON_INTERPRET=1)")
    from loraplex.engine import llm_engine

    monkeypatch.setattr(llm_engine, "default_backend", lambda device: "triton")
    llm = make_llm(tiny_llama_dir, lora_page_rows=page_rows)
    assert llm.engine.model.norm.kernels.backend == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in (1, 2)], params,
                        lora_request=[adapters["b"], None])
    check_row(outs[0], references[("b", 1)][0][:3], references[("b", 1)][1])
    check_row(outs[1], references[("base", 2)][0][:3], references[("base", 2)][1])


def _auto_decisions_follow_the_rule(path, rank: int, page_rows: int, slot_counts: tuple[int, ...]) -> set[bool]:
    """Under auto, each bound linear of pools of ``slot_counts`` slots folds exactly when fold_shrink_pays(its base
    rows, its pool's A rows over every page, ``page_rows``); returns the decisions seen."""
    seen = set()
    for max_loras in slot_counts:
        llm = make_llm(path, max_loras=max_loras, max_cpu_loras=8, max_lora_rank=rank, lora_page_rows=page_rows,
                       lora_fold_shrink="auto")
        decisions = [(lin.folded_weight is not None,
                      fold_shrink_pays(sum(lin.out_sizes), sum(max_loras * rank for _ in lin.module_names), page_rows))
                     for _, lin in _bound(llm)]
        assert decisions and all(folded == pays for folded, pays in decisions), decisions
        seen |= {pays for _, pays in decisions}
    return seen


def test_auto_folds_the_linears_whose_pool_rows_are_small_and_off_folds_none(tiny_llama_dir):
    """auto: a linear folds exactly when fold_shrink_pays(its base rows, its pool's A rows, its page rows); not in a
    pool of 32-row pages; a paged pool by the same rule over all its pages; off: none."""
    assert _auto_decisions_follow_the_rule(tiny_llama_dir, 16, 16, (2, 4, 8)) == {True, False}
    assert _auto_decisions_follow_the_rule(tiny_llama_dir, 32, 8, (1, 2, 4)) == {True, False}, "paged pools"
    llm = make_llm(tiny_llama_dir, lora_fold_shrink="off")
    assert all(lin.folded_weight is None for _, lin in _bound(llm))
    llm = make_llm(tiny_llama_dir, max_loras=1, max_lora_rank=32, lora_page_rows=32, lora_fold_shrink="auto")
    assert all(lin.folded_weight is None for _, lin in _bound(llm)), "pages above 16 rows were not measured folded"


@pytest.mark.parametrize("fields, fragment", [
    ({"enable_lora": True, "lora_fold_shrink": "sometimes"}, "lora_fold_shrink"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 1"),
    ({"enable_lora": False}, "needs enable_lora"),
])
def test_fold_on_where_it_cannot_run_is_refused(fields, fragment):
    values = {"enable_lora": True, "lora_fold_shrink": "on"} | fields
    with pytest.raises(ConfigError, match=fragment):
        EngineConfig(model="x", **values)


def test_a_folded_linear_refuses_a_second_fold_and_foreign_pages():
    lin = llama.LinearWithLoRA(8, [6, 2], ["q_proj", "k_proj"], False, torch.float32, torch.device("cpu"),
                               kernels=None)
    with pytest.raises(ValueError, match="do not fit"):
        lin.fold_lora_a([torch.zeros(2, 4, 8), torch.zeros(2, 4, 8, dtype=torch.float16)])
    w = torch.randn(8, 8)
    lin.weight.data.copy_(w)
    views = lin.fold_lora_a([torch.ones(2, 4, 8), torch.full((2, 4, 8), 2.0)])
    assert torch.equal(lin.weight, w) and lin.folded_weight.shape == (8 + 16, 8)
    assert torch.equal(views[1], torch.full((2, 4, 8), 2.0)) and views[1].data_ptr() == lin.folded_weight[16:].data_ptr()
    with pytest.raises(ValueError, match="unfolded"):
        lin.fold_lora_a(views)


def test_the_auto_rule_counts_an_fp8_weights_rows_as_half_an_a_row():
    """fold_shrink_pays over bytes: an e4m3 weight row holds half the bytes of a 16-bit A row, so an FP8 linear
    folds up to half as many A rows as a 16-bit one of the same shape."""
    assert fold_shrink_pays(1024, 1024, 16) and not fold_shrink_pays(1024, 1025, 16)
    assert fold_shrink_pays(1024, 512, 16, fp8=True) and not fold_shrink_pays(1024, 513, 16, fp8=True)
    assert not fold_shrink_pays(1024, 16, 32, fp8=True)
