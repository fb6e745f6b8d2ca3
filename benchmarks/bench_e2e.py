"""End-to-end GPU benchmark (issues 3 and 7): one command, one table.

- correctness: engine greedy tokens in bf16 vs HF transformers on a random
  mid-size Llama saved to disk (first divergence and its top-2 logit gap);
- offline throughput, Llama-2-7B shapes, random bf16 weights, prompt 128 /
  output 128: loraplex batch 1 and 32 vs HF ``generate`` on the same GPU;
- multi-LoRA, batch 32, r=16 on all 7 projections: (a) base only, (b) one
  adapter for all, (c) 32 distinct adapters, (d) HF + PEFT with the same 32
  adapters via ``adapter_names``; adapter load time disk -> slot;
- decode step latency against the weight-bandwidth floor.

Usage (on a CUDA machine): ``python benchmarks/bench_e2e.py [--quick]``.
Writes ``$OUT/e2e.json`` and prints markdown tables last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import (LLAMA2_7B, git_commit, make_model_dir, make_random_adapter, measure_copy_bandwidth,  # noqa: E402
                    out_dir, print_table)

from loraplex import LLM, LoRARequest, SamplingParams  # noqa: E402

RESULTS: dict = {"commit": os.environ.get("LORAPLEX_COMMIT") or git_commit(), "device": None}


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception as exc:  # keep the rest of the run going
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] {time.perf_counter() - t0:.1f} s: {RESULTS[name]}", flush=True)
            free_memory()
        return run
    return wrap


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


# -- correctness ------------------------------------------------------------
@section("correctness")
def correctness(tmp: Path, num_tokens: int = 64) -> dict:
    """Greedy tokens vs HF in float32 (must be equal) and bfloat16 (report the
    first divergence and HF's top-2 logit gap there: bf16 noise if small)."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp / "mid", "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
    prompts = [[5 + (7 * i + j) % 300 for j in range(10 + 13 * i)] for i in range(4)]
    return {dtype: _compare(path, prompts, num_tokens, dtype) for dtype in ("float32", "bfloat16")}


def _compare(path: Path, prompts: list[list[int]], num_tokens: int, dtype: str) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).cuda().eval()
    llm = LLM(model=str(path), dtype=dtype, max_model_len=512, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    report = []
    for p, mine in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=num_tokens,
                              min_new_tokens=num_tokens, do_sample=False)[0, len(p):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        gap = None
        if first is not None:
            with torch.no_grad():
                logits = hf(torch.tensor([p + ref[:first]], device="cuda")).logits[0, -1].float()
            top2 = logits.topk(2).values
            gap = float(top2[0] - top2[1])
        report.append({"prompt_len": len(p), "equal_tokens": first is None, "first_divergence": first,
                       "top2_logit_gap_at_divergence": gap})
    del llm, hf
    free_memory()
    return report


# -- throughput ---------------------------------------------------------------
def run_engine(llm: LLM, prompts: list[list[int]], output_len: int, loras=None) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    loras = loras or [None] * len(prompts)
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, lora)
    step_times, generated = [], 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        s0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - s0)
    total = time.perf_counter() - t0
    decode = step_times[2:] or step_times
    return {"total_s": total, "output_tokens_per_s": len(prompts) * output_len / total,
            "decode_step_ms_median": 1e3 * statistics.median(decode), "steps": len(step_times)}


@section("loraplex")
def loraplex_runs(model_dir: Path, adapters: list[LoRARequest], batch: int, in_len: int, out_len: int,
                  floor_ms: float) -> dict:
    llm = LLM(model=str(model_dir), dummy_weights=True, dtype="bfloat16", max_model_len=2048,
              gpu_memory_utilization=0.55, enable_lora=True, max_loras=len(adapters), max_lora_rank=16,
              max_cpu_loras=len(adapters) + 8, max_num_seqs=256, max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 31000, (in_len,), generator=gen).tolist() for _ in range(batch)]
    # Adapter load time: disk -> CPU cache -> GPU slot.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.engine.add_lora(adapters[0])
    t1 = time.perf_counter()
    llm.engine.lora_pool.pin(adapters[0].lora_int_id)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    llm.engine.lora_pool.unpin(adapters[0].lora_int_id)
    for a in adapters[1:]:
        llm.engine.add_lora(a)
    run_engine(llm, prompts[:4], 8)  # warm-up: compile kernels
    run_engine(llm, prompts, 8, loras=adapters[:batch])
    out = {"adapter_load_disk_to_cpu_ms": 1e3 * (t1 - t0), "adapter_load_cpu_to_slot_ms": 1e3 * (t2 - t1)}
    out["batch1_base"] = run_engine(llm, prompts[:1], out_len)
    out["a_base"] = run_engine(llm, prompts, out_len)
    out["b_one_adapter"] = run_engine(llm, prompts, out_len, loras=[adapters[0]] * batch)
    out["c_distinct_adapters"] = run_engine(llm, prompts, out_len, loras=adapters[:batch])
    for key in ("batch1_base", "a_base", "b_one_adapter", "c_distinct_adapters"):
        out[key]["floor_fraction"] = floor_ms / out[key]["decode_step_ms_median"]
    del llm
    return out


@section("hf")
def hf_runs(config: dict, batch: int, in_len: int, out_len: int, peft_out_len: int, num_adapters: int) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 31000, (batch, in_len), generator=gen).cuda()

    def generate(m, x, n, **kw):
        with torch.no_grad():
            return m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, **kw)

    out = {}
    generate(model, ids[:1], 4)
    for name, x in (("batch1_base", ids[:1]), ("a_base", ids)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(model, x, out_len)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[name] = {"total_s": dt, "output_tokens_per_s": x.shape[0] * out_len / dt}
    lcfg = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], lora_dropout=0.0)
    peft = get_peft_model(model, lcfg, adapter_name="a0").eval()
    for i in range(1, num_adapters):
        peft.add_adapter(f"a{i}", lcfg)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    names = [f"a{i % num_adapters}" for i in range(batch)]
    generate(peft, ids[:2], 2, adapter_names=names[:2])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(peft, ids, peft_out_len, adapter_names=names)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out["d_peft_distinct_adapters"] = {"total_s": dt, "output_tokens_per_s": batch * peft_out_len / dt,
                                       "output_len": peft_out_len}
    del peft, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2-layer model, short sequences (smoke test)")
    args = ap.parse_args()
    RESULTS["device"] = torch.cuda.get_device_name()
    config = dict(LLAMA2_7B)
    batch, in_len, out_len, peft_len = 32, 128, 128, 32
    if args.quick:
        config.update(num_hidden_layers=2)
        out_len, peft_len = 16, 4
    tmp = Path(tempfile.mkdtemp())
    bw = measure_copy_bandwidth()
    weight_bytes = 2 * (config["vocab_size"] * config["hidden_size"] * 2 + config["num_hidden_layers"] * (
        4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"] * config["intermediate_size"]))
    floor_ms = 1e3 * weight_bytes / bw
    RESULTS["copy_bandwidth_TBps"] = bw / 1e12
    RESULTS["weight_bytes"] = weight_bytes
    RESULTS["floor_ms"] = floor_ms
    correctness(tmp)
    model_dir = make_model_dir(tmp / "llama2-7b", config)
    t0 = time.perf_counter()
    adapters = [LoRARequest(f"a{i}", i + 1, str(make_random_adapter(tmp / f"a{i}", config, 16, seed=i)))
                for i in range(batch)]
    print(f"wrote {batch} adapters in {time.perf_counter() - t0:.1f} s", flush=True)
    loraplex_runs(model_dir, adapters, batch, in_len, out_len, floor_ms)
    hf_runs(config, batch, in_len, out_len, peft_len, batch)
    (out_dir() / "e2e.json").write_text(json.dumps(RESULTS, indent=2))
    summarize(floor_ms)


def summarize(floor_ms: float) -> None:
    lp, hf = RESULTS.get("loraplex", {}), RESULTS.get("hf", {})
    rows = []
    for key, label in (("batch1_base", "batch 1, base"), ("a_base", "(a) batch 32, base"),
                       ("b_one_adapter", "(b) batch 32, 1 adapter"), ("c_distinct_adapters", "(c) batch 32, 32 adapters"),
                       ("d_peft_distinct_adapters", "(d) HF+PEFT, 32 adapters")):
        ours, ref = lp.get(key, {}), hf.get(key, {})
        rows.append([label, f"{ours.get('output_tokens_per_s', float('nan')):.0f}",
                     f"{ours.get('decode_step_ms_median', float('nan')):.2f}",
                     f"{ours.get('floor_fraction', float('nan')):.2f}",
                     f"{ref.get('output_tokens_per_s', float('nan')):.0f}"])
    print_table(f"Llama-2-7B shapes, bf16, prompt 128 / output 128 (floor {floor_ms:.2f} ms/step, "
                f"copy {RESULTS['copy_bandwidth_TBps']:.2f} TB/s), commit {RESULTS['commit']}",
                ["run", "loraplex tok/s", "decode step ms", "floor/step", "HF tok/s"], rows)
    print(json.dumps({k: v for k, v in RESULTS.items() if k in ("correctness",)}, indent=1))


if __name__ == "__main__":
    main()
