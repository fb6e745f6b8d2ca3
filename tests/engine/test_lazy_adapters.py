"""Lazy adapter registration and background loads in the engine, against HF + PEFT.

Adapters registered with a declared ``version_id`` are read at first use and give the
same greedy tokens as PEFT and as eager registration; N > max_cpu_loras adapters are
registered with no disk read and served with one read each; an adapter whose files
cannot be read fails only its own requests (``finish_reason="error"``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_models import hf_greedy_ids, make_peft_adapter, peft_model, step_to_end
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters import compute_version_id

ADAPTERS = {  # name: (rank, alpha, targets)
    "a": (4, 8, ("q_proj", "v_proj")),
    "b": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "c": (16, 8, ("o_proj", "down_proj", "up_proj")),
    "d": (8, 32, ("k_proj", "gate_proj")),
    "e": (2, 4, ("v_proj", "up_proj")),
    "f": (4, 4, ("q_proj", "down_proj")),
}
MAX_NEW = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def content_id(folder: Path) -> str:
    """The adapter's content id computed from the files directly (the platform's content_hash)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return compute_version_id(config, load_file(str(folder / "adapter_model.safetensors")))


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lazy-adapters")
    return {name: make_peft_adapter(tiny_llama_dir, root / name, r=r, alpha=alpha, targets=targets, seed=20 + i)
            for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok.encode(t) for t in ("The quick brown fox", "Paris is the capital", "def add(a, b):")]


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapter_dirs, prompts) -> dict[tuple[str, int], list[int]]:
    """(adapter name or "base", prompt index) -> PEFT greedy tokens."""
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    models = {"base": base} | {n: peft_model(tiny_llama_dir, d) for n, d in adapter_dirs.items()}
    return {(name, i): hf_greedy_ids(model, p, MAX_NEW) for name, model in models.items()
            for i, p in enumerate(prompts)}


def requests(adapter_dirs, *, declare: bool) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(folder), version_id=content_id(folder) if declare else None)
            for i, (name, folder) in enumerate(adapter_dirs.items())}


def make_llm(path, *, background: bool = False, **kw) -> LLM:
    kw.setdefault("max_loras", 2)
    kw.setdefault("max_cpu_loras", 2)
    llm = LLM(model=str(path), max_model_len=64, block_size=4, num_kv_blocks=256, enable_lora=True,
              max_lora_rank=16, **kw)
    llm.engine.lora_pool.background_loads = background
    return llm


def run_all(engine, jobs: dict[str, tuple[list[int], LoRARequest | None]]) -> dict:
    """Queue every job at once, step to completion; request id -> final RequestOutput."""
    for request_id, (prompt, lora) in jobs.items():
        engine.add_request(request_id, prompt, PARAMS, lora)
    return step_to_end(engine)


def test_lazy_first_use_equals_peft_and_eager_registration(tiny_llama_dir, adapter_dirs, prompts, references):
    lazy, eager = make_llm(tiny_llama_dir), make_llm(tiny_llama_dir)
    declared, undeclared = requests(adapter_dirs, declare=True), requests(adapter_dirs, declare=False)
    for name in ("a", "b", "c"):
        assert lazy.engine.add_lora(declared[name]) is True
        assert eager.engine.add_lora(undeclared[name]) is True
    assert lazy.engine.get_stats().lora.disk_loads == 0
    assert eager.engine.get_stats().lora.disk_loads == 3
    for name in ("a", "b", "c"):  # the declared id is the id the engine computes itself
        assert lazy.engine.lora_pool.version_id(declared[name].lora_int_id) == \
            eager.engine.lora_pool.version_id(undeclared[name].lora_int_id)
    order = ["a", None, "b", "c", "a", "b"]
    batch = [{"prompt_token_ids": prompts[i % 3]} for i in range(len(order))]
    lazy_outs = lazy.generate(batch, PARAMS, lora_request=[declared[n] if n else None for n in order])
    eager_outs = eager.generate(batch, PARAMS, lora_request=[undeclared[n] if n else None for n in order])
    for i, name in enumerate(order):
        expected = references[(name or "base", i % 3)]
        assert lazy_outs[i].outputs[0].token_ids == expected, (i, name)
        assert eager_outs[i].outputs[0].token_ids == expected, (i, name)
    assert lazy.engine.get_stats().lora.disk_loads == 3  # each adapter read once, at first use


@pytest.mark.parametrize("background", [False, True])
def test_more_adapters_than_host_cache_one_read_each(tiny_llama_dir, adapter_dirs, prompts, references, background):
    """6 adapters, host cache of 2, 2 slots, all requests queued at once: registration reads
    nothing, the scheduler groups requests by adapter and prefetches no further ahead than
    the host cache holds, so each adapter is read exactly once."""
    llm = make_llm(tiny_llama_dir, background=background)
    declared = requests(adapter_dirs, declare=True)
    jobs = {}
    for name in ADAPTERS:
        for i in range(2):
            jobs[f"{name}-{i}"] = (prompts[i], declared[name])
    jobs["base-0"] = (prompts[0], None)
    for lora in declared.values():
        llm.engine.add_lora(lora)
    assert llm.engine.get_stats().lora.disk_loads == 0
    finals = run_all(llm.engine, jobs)
    for request_id, out in finals.items():
        name, i = request_id.split("-")
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == references[(name, int(i))], request_id
    stats = llm.engine.get_stats().lora
    assert (stats.disk_loads, stats.load_failures, stats.loads_in_flight) == (6, 0, 0)
    assert all(s.pin_count == 0 for s in stats.slots)
    llm.engine.lora_pool.close()


@pytest.mark.parametrize("background", [False, True])
def test_unreadable_adapter_fails_only_its_requests(tiny_llama_dir, adapter_dirs, prompts, references, background,
                                                    tmp_path):
    broken_dir = Path(shutil.copytree(adapter_dirs["b"], tmp_path / "b"))
    declared = requests(adapter_dirs, declare=True)
    broken = LoRARequest("b", 2, str(broken_dir), version_id=declared["b"].version_id)
    llm = make_llm(tiny_llama_dir, background=background)
    llm.engine.add_lora(broken)  # header read: fine
    hidden = broken_dir.with_name("b-hidden")
    broken_dir.rename(hidden)  # the files vanish before first use
    jobs = {"bad-0": (prompts[0], broken), "a-1": (prompts[1], declared["a"]), "base-2": (prompts[2], None),
            "bad-1": (prompts[1], broken)}
    finals = run_all(llm.engine, jobs)
    assert set(finals) == set(jobs)
    for request_id in ("bad-0", "bad-1"):
        out = finals[request_id]
        assert out.finished and out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert out.error == (f"adapter 'b' (lora_int_id=2) could not be loaded: adapter folder '{broken_dir}' "
                             "does not exist or is not a directory")
    assert finals["a-1"].outputs[0].token_ids == references[("a", 1)] and finals["a-1"].error is None
    assert finals["base-2"].outputs[0].token_ids == references[("base", 2)]
    assert llm.engine.get_stats().lora.load_failures == 1
    assert llm.engine.get_stats().num_waiting == 0 and llm.engine.get_stats().kv_blocks_used == 0
    hidden.rename(broken_dir)  # files back: the next request on the adapter is served
    finals = run_all(llm.engine, {"b-0": (prompts[0], broken)})
    assert finals["b-0"].outputs[0].token_ids == references[("b", 0)]
    llm.engine.lora_pool.close()
