"""Ranks without padding in the engine: adapters of ranks 8, 16, 64 and 128 in one batch, each holding weight
pages for its own rank (``lora_page_rows``), every row equal to HF + PEFT (fp32, greedy tokens and logprobs),
also while adapters of other ranks churn through a pool too small to hold them all."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from tiny_models import check_row, make_peft_adapter, peft_references

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = {"r8": 8, "r16": 16, "r64": 64, "r128": 128}
PAGE = 8
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("ranked")
    out = {}
    for i, (name, r) in enumerate(RANKS.items()):
        targets = ALL if r != 16 else ("q_proj", "v_proj", "down_proj")
        path = make_peft_adapter(tiny_llama_dir, root / name, r=r, alpha=r, targets=targets, seed=40 + i,
                                 b_std=0.1 * (8 / r) ** 0.5)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok.encode(t) for t in ("The quick brown fox", "Paris is the capital", "def add(a, b):",
                                    "Colors: red, green", "Large language models serve")]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, prompts):
    return peft_references(tiny_llama_dir, adapters, prompts, MAX_NEW)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)



def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    kw.setdefault("max_lora_rank", 128)
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=512, enable_lora=True,
               lora_page_rows=PAGE, **kw)


@pytest.mark.parametrize(("max_lora_rank", "fold"), [(128, "off"), (256, "off"), (128, "on")])
def test_ranks_8_16_64_128_in_one_batch_equal_peft(tiny_llama_dir, adapters, prompts, references, max_lora_rank,
                                                   fold):
    """fold "on": the shrink in the base GEMM over every page; each token's expand reads its slot's pages of the
    GEMM's columns through the page table."""
    llm = make_llm(tiny_llama_dir, max_lora_rank=max_lora_rank, lora_fold_shrink=fold)
    assert all((lin.folded_weight is not None) == (fold == "on") for _, lin in llm.engine.model.lora_linears()
               if lin.lora_a)
    order = ["r8", "r16", None, "r64", "r128"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                        lora_request=[adapters[n] if n else None for n in order])
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    pool = llm.engine.lora_pool
    weights = pool.weights
    assert weights.page_rows == PAGE and weights.a[0]["q_proj"].shape[1:] == (PAGE, weights.spec.hidden_size)
    pages = {n: len(pool.slots.pages_of(pool.slot_of(adapters[n].lora_int_id))) for n in RANKS}
    assert pages == {"r8": 1, "r16": 2, "r64": 8, "r128": 16}  # memory in proportion to each adapter's rank
    assert weights.num_pages == 4 * max_lora_rank // PAGE


@pytest.mark.parametrize("fold", ["off", "on"])
def test_rank_churn_through_a_small_page_pool_stays_exact(tiny_llama_dir, adapters, prompts, references, fold):
    """max_lora_pages=18: the rank-128 adapter (16 pages) decodes for 40 steps while rank 8, 16 and 64 requests
    arrive; the rank-64 one (8 pages) waits until the rank-128 one finishes, the others run beside it (fold "on":
    in pages of the folded GEMM that other ranks held before)."""
    long_params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    expected = make_llm(tiny_llama_dir).generate({"prompt_token_ids": prompts[0]}, long_params,
                                                 lora_request=adapters["r128"])[0].outputs[0].token_ids
    engine = make_llm(tiny_llama_dir, max_lora_pages=18, lora_fold_shrink=fold).engine
    engine.add_request("long", prompts[0], long_params, adapters["r128"])
    engine.step()
    for k, name in enumerate(["r8", "r64", "r16", "r8", "r16"]):
        engine.add_request(f"short-{k}-{name}", prompts[2], PARAMS, adapters[name])
    finals, finished_order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                finished_order.append(out.request_id)
        pool = engine.lora_pool
        held = [p for s in range(pool.max_loras) for p in pool.slots.pages_of(s)]
        assert len(held) == len(set(held)) and len(held) <= 18
    assert finals["long"].outputs[0].token_ids == expected
    assert finished_order.index("short-1-r64") > finished_order.index("long")
    for rid, out in finals.items():
        if rid != "long":
            check_row(out, *references[(rid.rsplit("-", 1)[1], 2)])
