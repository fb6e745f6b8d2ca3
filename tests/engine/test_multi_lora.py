"""Multi-LoRA in the engine: every request in a mixed batch equals HF + PEFT."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterConflictError
from tiny_models import FOLDS, check_row, fold_config, make_peft_adapter, peft_references, step_to_end

ADAPTERS = {
    # name: (rank, alpha, targets, rslora)
    "a": (4, 8, ("q_proj", "v_proj"), False),
    "b": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "c": (16, 8, ("o_proj", "down_proj", "up_proj"), True),
    "d": (8, 32, ("k_proj", "gate_proj"), False),
}
MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        path = make_peft_adapter(tiny_llama_dir, root / name, r=r, alpha=alpha, targets=targets, use_rslora=rs,
                                 seed=10 + i)
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    texts = ["The quick brown fox", "Paris is the capital", "def add(a, b):", "Colors: red, green",
             "Large language models serve"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters, prompts) -> dict[tuple[str, int], tuple[list[int], torch.Tensor]]:
    """(adapter name or "base", prompt index) -> (PEFT greedy tokens, PEFT last-position logprobs)."""
    return peft_references(tiny_llama_dir, adapters, prompts, MAX_NEW)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("max_loras", 4)
    return LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=512, enable_lora=True,
               max_lora_rank=16, **kw)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)



@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_equals_peft(tiny_llama_dir, adapters, prompts, references, name):
    llm = make_llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=adapters[name])
    for i, out in enumerate(outs):
        check_row(out, *references[(name, i)])


@pytest.mark.parametrize("fold", FOLDS)  # the SGMV kernels, the shrink in the base GEMM, over 4-row pages too
def test_mixed_batch_rows_equal_peft_and_base_unaffected(tiny_llama_dir, adapters, prompts, references, fold):
    llm = make_llm(tiny_llama_dir, max_loras=3, **fold_config(fold))
    order = ["a", "b", None, "a", "c"]
    loras = [adapters[n] if n else None for n in order]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=loras)
    for i, (name, out) in enumerate(zip(order, outs)):
        check_row(out, *references[(name or "base", i)])
    # A batch that follows (all base) is unaffected by the adapters before it.
    base_outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    for i, out in enumerate(base_outs):
        check_row(out, *references[("base", i)])


def test_slot_churn_keeps_long_decodes_exact(tiny_llama_dir, adapters, prompts, references):
    """max_loras=2, max_cpu_loras=3: A decodes for 60 steps in one slot while B, C
    and D take turns in the other slot (loaded and evicted repeatedly, and
    evicted from the 3-entry CPU cache too)."""
    long_params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)
    short_params = SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3)
    quiet = make_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=3)
    expected = quiet.generate({"prompt_token_ids": prompts[0]}, long_params, lora_request=adapters["a"])[0]
    engine = make_llm(tiny_llama_dir, max_loras=2, max_cpu_loras=3).engine
    engine.add_request("A", prompts[0], long_params, adapters["a"])
    finals, cycle, k = {}, ["b", "c", "d"], 0
    while engine.has_unfinished_requests():
        if k < 12 and not any(r.startswith("short") for r in engine.groups):
            name = cycle[k % 3]
            engine.add_request(f"short-{k}-{name}", prompts[2], short_params, adapters[name])
            k += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["A"].outputs[0].token_ids == expected.outputs[0].token_ids
    shorts = [r for r in finals if r.startswith("short")]
    assert len(shorts) == 12
    for rid in shorts:
        name = rid.rsplit("-", 1)[1]
        assert finals[rid].outputs[0].token_ids == references[(name, 2)][0][:3]
    stats = engine.get_stats().lora
    assert stats.slot_loads >= 12 and stats.slot_evictions >= 10
    assert stats.cpu_evictions >= 1
    assert all(s.pin_count == 0 for s in stats.slots)


def test_remove_lora_lets_the_requests_it_accepted_finish_then_drops_it(tiny_llama_dir, adapters, prompts,
                                                                         references):
    """remove_lora while one request on the adapter runs and another waits (a 4-token step budget: one prompt
    chunk per step), a third is a 2-sequence fork: all three finish on the adapter, PEFT-exact; the adapter refuses
    new requests at once and is dropped when the last one ends; the engine serves on."""
    engine = make_llm(tiny_llama_dir, max_loras=2, max_num_seqs=4, max_num_batched_tokens=4).engine
    a = adapters["a"]
    engine.add_request("run", prompts[0], PARAMS, a)
    engine.add_request("wait", prompts[1], PARAMS, a)
    engine.add_request("fork", prompts[3], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW,
                                                          logprobs=5, n=2), a)
    engine.add_request("base", prompts[2], PARAMS)
    engine.step()
    assert [s.group.request_id for s in engine.scheduler.running] == ["run"]
    assert engine.remove_lora(a.lora_int_id) and not engine.remove_lora(a.lora_int_id)
    assert a.lora_int_id not in engine.list_loras()
    with pytest.raises(AdapterConflictError, match="being removed"):
        engine.add_request("late", prompts[4], PARAMS, a)
    finals = step_to_end(engine)
    assert sorted(finals) == ["base", "fork", "run", "wait"]
    for request_id, index in (("run", 0), ("wait", 1), ("fork", 3)):
        for completion in finals[request_id].outputs:
            assert completion.finish_reason == "length" and finals[request_id].error is None
            assert completion.token_ids == references[("a", index)][0]
    assert len(finals["fork"].outputs) == 2
    check_row(finals["base"], *references[("base", 2)])
    pool = engine.lora_pool
    assert pool.registry.get(a.lora_int_id) is None and pool.stats().pending_removal == []
    assert all(info.lora_int_id is None for info in pool.stats().slots)
    check_row(generate_base(engine, prompts[2]), *references[("base", 2)])


def test_remove_lora_held_only_by_a_waiting_request_completes_at_its_abort(tiny_llama_dir, adapters, prompts):
    engine = make_llm(tiny_llama_dir, max_loras=2).engine
    b = adapters["b"]
    engine.add_request("queued", prompts[0], PARAMS, b)
    assert engine.remove_lora(b.lora_int_id)
    assert engine.lora_pool.stats().pending_removal == ["b"]
    engine.abort_request("queued")
    assert engine.lora_pool.registry.get(b.lora_int_id) is None and not engine.has_unfinished_requests()
    engine.add_lora(b)  # the id can be registered again once dropped
    assert b.lora_int_id in engine.list_loras()


def generate_base(engine, prompt):
    engine.add_request("after", prompt, PARAMS)
    return step_to_end(engine)["after"]
