"""Decode step per model family at Llama-2-7B-class shapes (issue 19): is a family slower per weight byte
than Llama?

Every family gets Llama-2-7B's shapes (hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000)
with its own features from a real-style config: Mistral's 4096-token sliding window, Qwen2's q/k/v biases,
Qwen3's q/k norms, Phi-3's fused checkpoint layout, Gemma 2's soft-caps / GeGLU / sandwich norms /
alternating windows, Gemma 3's q/k norms and local/global RoPE. Random bf16 weights, batch 32, prompt 128,
output 64, base model (no adapters). Reports the median decode step, the weight-bandwidth floor
(parameter bytes / measured copy bandwidth) and ms per GB of weights relative to Llama.

Usage (CUDA): ``python benchmarks/bench_family_decode.py --out family_decode.json``;
``--quick`` (2 layers, hidden 256; runs on CPU too) checks the script's logic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA2_7B, git_commit, make_model_dir, measure_copy_bandwidth, print_table  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402

_BASE = {k: v for k, v in LLAMA2_7B.items() if k not in ("architectures", "model_type", "rope_theta")}
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_parameters=_ROPE),
    "mistral (window 4096)": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096,
                                  rope_parameters=_ROPE),
    "qwen2 (qkv bias)": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_parameters=_ROPE),
    "qwen3 (q/k norm)": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=128,
                             rope_parameters=_ROPE),
    "phi3 (fused)": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], rope_parameters=_ROPE, pad_token_id=0),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=128,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=128, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_parameters=_ROPE,
                   tie_word_embeddings=True),
    "gemma3 text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=128,
                        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=128, sliding_window=1024,
                        sliding_window_pattern=6, tie_word_embeddings=True,
                        rope_parameters={"sliding_attention": dict(_ROPE),
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0}}),
}
QUICK = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64)


def family_config(name: str, quick: bool) -> dict:
    config = dict(_BASE, **FAMILIES[name])
    if quick:
        config.update({k: v for k, v in QUICK.items() if k in config or k == "num_key_value_heads"})
    return config


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, output_len: int, sync) -> float:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="final_only")
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", torch.randint(10, 31000, (prompt_len,), generator=gen).tolist(),
                           params, None)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        sync()
        steps.append(time.perf_counter() - t0)
    decode = steps[2:] or steps  # the first steps carry the prompts
    return 1e3 * statistics.median(decode)


def run(quick: bool) -> dict:
    """Every family, each in its own process (an engine does not give its device memory back in-process)."""
    rows = {}
    tmp = Path(tempfile.mkdtemp())
    for name in FAMILIES:
        out = tmp / f"{name.split()[0]}.json"
        subprocess.run([sys.executable, __file__, "--out", str(out), "--family", name] + (["--quick"] if quick else []),
                       check=True)
        part = json.loads(out.read_text())
        rows.update(part.pop("families"))
    llama = rows["llama"]["ms_per_GB"]
    for row in rows.values():
        row["ms_per_GB_vs_llama"] = row["ms_per_GB"] / llama
    return dict(part, families=rows)


def run_families(quick: bool, names: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch, prompt_len, output_len = (4, 16, 8) if quick else (32, 128, 64)
    bandwidth = measure_copy_bandwidth() if cuda else None
    tmp = Path(tempfile.mkdtemp())
    rows = {}
    for name in names:
        config = family_config(name, quick)
        folder = make_model_dir(tmp / name.split()[0], config)
        llm = LLM(model=str(folder), dummy_weights=True, dtype="bfloat16" if cuda else "float32",
                  max_model_len=512 if quick else 2048, gpu_memory_utilization=0.6, max_num_seqs=64,
                  **({} if cuda else {"num_kv_blocks": 256}))
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
        decode_step_ms(llm, min(batch, 4), prompt_len, 4, sync)  # warm-up: compile kernels, capture graphs
        step_ms = decode_step_ms(llm, batch, prompt_len, output_len, sync)
        floor_ms = 1e3 * weight_bytes / bandwidth if bandwidth else float("nan")
        rows[name] = {"weight_bytes": weight_bytes, "decode_step_ms_median": step_ms, "floor_ms": floor_ms,
                      "floor_fraction": floor_ms / step_ms, "ms_per_GB": step_ms / (weight_bytes / 1e9)}
        del llm
        if cuda:
            torch.cuda.empty_cache()
    return {"commit": git_commit(), "device": torch.cuda.get_device_name() if cuda else "cpu", "batch": batch,
            "prompt_len": prompt_len, "output_len": output_len,
            "copy_bandwidth_TBps": bandwidth / 1e12 if bandwidth else None, "families": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 256 (logic check; CPU works)")
    ap.add_argument("--family", choices=list(FAMILIES), help="measure this family only, in this process")
    args = ap.parse_args()
    if args.family:
        args.out.write_text(json.dumps(run_families(args.quick, [args.family]), indent=2))
        return
    result = run(args.quick)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(f"Decode step per family, Llama-2-7B-class shapes, batch {result['batch']}, bf16, "
                f"commit {result['commit']} ({result['device']})",
                ["family", "weights GB", "decode step ms", "floor ms", "floor/step", "ms/GB vs llama"],
                [[name, f"{r['weight_bytes'] / 1e9:.2f}", f"{r['decode_step_ms_median']:.2f}", f"{r['floor_ms']:.2f}",
                  f"{r['floor_fraction']:.2f}", f"{r['ms_per_GB_vs_llama']:.2f}"]
                 for name, r in result["families"].items()])


if __name__ == "__main__":
    main()
