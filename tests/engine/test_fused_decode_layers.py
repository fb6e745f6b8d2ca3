"""Decode layers in four GEMMs (``LlamaForCausalLM.fuses_decode_layers``): the norms, the activation and the residual
adds inside ``dense_linear``'s launches give HF's greedy tokens and logprobs, on every family they apply to; steps
with adapter tokens, FP8 weights, Gemma 2's sandwich norms and shapes without a measured launch keep the separate
kernels."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.models import llama
from loraplex.kernels import dense_linear
from tiny_models import check_row, hf_greedy_ids, hf_last_logprobs, make_peft_adapter

TEXTS = ["The quick brown fox", "Paris is the capital of France. Berlin is", "def add(a, b):"]
MAX_NEW = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)


def every_shape(num_tokens, out_features, in_features, dtype, device, fusion=None):
    """A launch for every GEMM of at most 64 tokens, plain or fused (the measured tables hold H200 shapes only)."""
    if num_tokens > 64:
        return None
    return ("gemv", 1, 8, 32, 4, 1) if num_tokens == 1 else ("swap", 16, 32, 32, 4, 1)


@pytest.fixture
def triton_engine(monkeypatch):
    """The engine on the Triton kernels (the CPU interpreter) with a launch for every decode-sized GEMM."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the engine runs on the CPU here: Triton kernels need the interpreter (TRITON_INTERPRET=1)")
    from loraplex.engine import llm_engine

    monkeypatch.setattr(llm_engine, "default_backend", lambda device: "triton")
    monkeypatch.setattr(dense_linear, "dense_linear_config", every_shape)
    monkeypatch.setattr(llama, "dense_linear_config", every_shape)


def _count_fused(monkeypatch) -> list[int]:
    calls = [0]
    original = llama.DecoderLayer.forward_fused

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)

    monkeypatch.setattr(llama.DecoderLayer, "forward_fused", counted)
    return calls


def _references(path, prompts):
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    return [(hf_greedy_ids(model, p, MAX_NEW), hf_last_logprobs(model, p)) for p in prompts]


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_phi3_dir"])
def test_fused_layers_equal_hf(family, request, triton_engine, monkeypatch):
    """Prompt steps and decode steps (at most 64 tokens) run every layer fused and give HF's tokens and first
    logprobs: Llama (GQA), Qwen2 (q/k/v biases in the epilogue), Qwen3 (per-head q/k norms between the GEMMs),
    Phi-3 (fused gate/up halves)."""
    path = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [tok.encode(t) for t in TEXTS]
    calls = _count_fused(monkeypatch)
    llm = LLM(model=str(path), max_model_len=128, block_size=4, num_kv_blocks=256, device="cpu")
    assert llm.engine.model.kernels.backend == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    layers = len(llm.engine.model.layers)
    assert calls[0] >= layers * MAX_NEW and calls[0] % layers == 0, calls
    for out, ref in zip(outs, _references(path, prompts)):
        check_row(out, *ref)


@pytest.mark.interpreter
def test_adapter_steps_keep_the_separate_kernels(tiny_llama_dir, triton_engine, monkeypatch, tmp_path):
    """A step with an adapter token runs the unfused layers (its LoRA reads the normed input), a base step after it
    the fused ones; both as HF / PEFT."""
    from tiny_models import peft_model

    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "a", r=8, alpha=16,
                                targets=("q_proj", "o_proj", "up_proj", "down_proj"), seed=3)
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompt = tok.encode(TEXTS[1])
    calls = _count_fused(monkeypatch)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, block_size=4, num_kv_blocks=256, device="cpu",
              enable_lora=True, max_loras=1, max_lora_rank=8)
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))[0]
    assert calls[0] == 0
    peft = peft_model(tiny_llama_dir, str(adapter))
    check_row(out, hf_greedy_ids(peft, prompt, MAX_NEW), hf_last_logprobs(peft, prompt))
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    assert calls[0] > 0
    check_row(out, *_references(tiny_llama_dir, [prompt])[0])


def test_which_steps_fuse(tiny_llama_dir, tiny_gemma2_dir, monkeypatch):
    """The rule: Triton kernels, no adapter token, complete unquantized linears, Llama-order norms, a measured launch
    for all four shapes at the step's token count, and the switch on."""
    from loraplex.engine.models.llama import LoRABatch
    from loraplex.kernels.lora_mapping import plan_segments

    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64, device="cpu")
    model = llm.engine.model
    assert not model.fuses_decode_layers(1, None), "reference kernels (the CPU engine)"
    monkeypatch.setattr(model.kernels, "backend", "triton")
    assert not model.fuses_decode_layers(1, None), "no measured launch off CUDA"
    monkeypatch.setattr(llama, "dense_linear_config", every_shape)
    assert model.fuses_decode_layers(1, None) and model.fuses_decode_layers(64, None)
    assert not model.fuses_decode_layers(65, None)
    base = LoRABatch(plan_segments(torch.tensor([-1, -1], dtype=torch.int32), 2, has_lora=False))
    with_lora = LoRABatch(plan_segments(torch.tensor([-1, 0], dtype=torch.int32), 2, has_lora=True))
    assert model.fuses_decode_layers(2, base) and not model.fuses_decode_layers(2, with_lora)
    down = model.layers[0].mlp.down_proj
    monkeypatch.setattr(llama, "dense_linear_config",
                        lambda t, n, k, dtype, device, fusion=None: None if (n, k) == tuple(down.weight.shape)
                        else every_shape(t, n, k, dtype, device, fusion))
    assert not model.fuses_decode_layers(1, None), "one linear without a launch"
    monkeypatch.setattr(llama, "dense_linear_config", every_shape)
    previous = llama.fuse_decode_layers(False)
    try:
        assert not model.fuses_decode_layers(1, None)
    finally:
        llama.fuse_decode_layers(previous)
    monkeypatch.setattr(down, "all_reduce", lambda y: y)
    assert not model.fuses_decode_layers(1, None), "a row-parallel shard"
    monkeypatch.setattr(down, "all_reduce", None)
    fp8 = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64, device="cpu",
              quantization="fp8").engine.model
    monkeypatch.setattr(fp8.kernels, "backend", "triton")
    assert not fp8.fuses_decode_layers(1, None), "FP8 weights"
    gemma = LLM(model=str(tiny_gemma2_dir), max_model_len=64, block_size=4, num_kv_blocks=64,
                device="cpu").engine.model
    monkeypatch.setattr(gemma.kernels, "backend", "triton")
    assert not gemma.fuses_decode_layers(1, None), "sandwich norms"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_fused_layers_on_the_gpu_equal_the_separate_kernels(tiny_llama_dir, monkeypatch, graphs):
    """bf16 on the GPU (compiled kernels, eager and replayed from CUDA graphs; the one-sequence run replays the
    batch-1 graph, captured with programmatic dependent launches on Hopper): the fused layers' logprobs at every
    position equal the separate kernels' to bf16 rounding while their tokens agree (a tiny random model's flat
    logits can flip a greedy token; the CPU tests above compare tokens in fp32)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompts = [tok.encode(t) for t in TEXTS]
    kw = dict(model=str(tiny_llama_dir), max_model_len=128, block_size=16, dtype="bfloat16", enforce_eager=not graphs,
              num_kv_blocks=64, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    batches = ([{"prompt_token_ids": p} for p in prompts], [{"prompt_token_ids": prompts[1]}])

    def generate():
        llm = LLM(**kw)
        outs = [llm.generate(batch, params) for batch in batches]
        llm.engine.close()
        return [o for batch in outs for o in batch]

    previous = llama.fuse_decode_layers(False)
    try:
        separate = generate()
    finally:
        llama.fuse_decode_layers(previous)
    monkeypatch.setattr(dense_linear, "dense_linear_config", every_shape)
    monkeypatch.setattr(llama, "dense_linear_config", every_shape)
    calls = _count_fused(monkeypatch)
    fused = generate()
    assert calls[0] > 0
    compared = 0
    for a, b in zip(separate, fused):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for pos, (lp_a, lp_b) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            shared = set(lp_a) & set(lp_b)
            assert shared, (pos, lp_a, lp_b)
            for tid in shared:
                assert abs(lp_a[tid] - lp_b[tid]) < 0.05, (pos, tid, lp_a[tid], lp_b[tid])
            compared += 1
            if ta[pos] != tb[pos]:
                break  # the sequences diverge from here on
    assert compared >= len(separate)
