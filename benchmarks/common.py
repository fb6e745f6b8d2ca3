"""Shared pieces of the GPU benchmarks: model folders with real configs and
random weights, random PEFT adapters, timing helpers, result tables."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
                 intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
LLAMA3_8B = dict(LLAMA2_7B, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
                 max_position_embeddings=8192, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "/tmp/loraplex-bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def git_commit() -> str:
    """Short commit id: ``$LORAPLEX_COMMIT`` (set for runs from an exported tree), else git's."""
    if os.environ.get("LORAPLEX_COMMIT"):
        return os.environ["LORAPLEX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def make_model_dir(path: Path, config: dict) -> Path:
    """A folder with ``config.json`` and a word-level tokenizer covering the whole
    vocabulary ("t0".."tN"), for engines started with random (dummy) weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{config['eos_token_id']}")
    fast.save_pretrained(str(path))
    return path


def make_random_adapter(path: Path, config: dict, rank: int, seed: int, targets=ALL_TARGETS,
                        dtype=torch.bfloat16, *, use_dora: bool = False, vocab_lora: bool = False,
                        head_copy: bool = False) -> Path:
    """A PEFT-format LoRA adapter with random A and B for every layer and target; ``use_dora``: DoRA
    magnitude vectors too; ``vocab_lora``: LoRA on ``embed_tokens`` and ``lm_head`` as well (PEFT's embedding
    LoRA ``lora_embedding_A [r, V]`` / ``lora_embedding_B [H, r]``, linear LoRA on the head);
    ``head_copy``: an ``lm_head`` ``modules_to_save`` copy ``[V, H]``."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    shapes = {"q_proj": (h, config["num_attention_heads"] * d), "k_proj": (h, config["num_key_value_heads"] * d),
              "v_proj": (h, config["num_key_value_heads"] * d), "o_proj": (h, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for m in targets:
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{m}"
            fin, fout = shapes[m]
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) / fin ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * 0.01).to(dtype)
            if use_dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = 1.0 + 0.1 * torch.rand(fout, generator=gen)
    vocab = config["vocab_size"]
    cfg_targets = list(targets)
    if vocab_lora:
        emb, head = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
        tensors[f"{emb}.lora_embedding_A"] = torch.randn(rank, vocab, generator=gen).to(dtype)
        tensors[f"{emb}.lora_embedding_B"] = (torch.randn(h, rank, generator=gen) * 0.01).to(dtype)
        tensors[f"{head}.lora_A.weight"] = (torch.randn(rank, h, generator=gen) / h ** 0.5).to(dtype)
        tensors[f"{head}.lora_B.weight"] = (torch.randn(vocab, rank, generator=gen) * 0.01).to(dtype)
        cfg_targets += ["embed_tokens", "lm_head"]
    if head_copy:
        tensors["base_model.model.lm_head.weight"] = (torch.randn(vocab, h, generator=gen) * 0.02).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": cfg_targets,
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": "dummy"}
    if use_dora:
        adapter_config["use_dora"] = True
    if head_copy:
        adapter_config["modules_to_save"] = ["lm_head"]
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def cuda_time(fn, warmup: int = 1, repeat: int = 3) -> float:
    """Median wall seconds of ``fn()`` with the device synchronized around it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def capture_graph(calls: list):
    """A CUDA graph of ``calls`` (no-argument callables) in order, each run once eagerly first (Triton compiles,
    allocations outside the capture)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def graph_replay_ms(calls: list, replays: int = 10, warm_replays: int = 0) -> float:
    """Median ms of one replay of a CUDA graph that runs ``calls`` (no-arg callables) in order. Each distinct
    callable runs once eagerly first, on a side stream (Triton compiles, cuBLAS allocates its workspace), then
    ``warm_replays`` untimed replays; times are CUDA events around each of ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in dict.fromkeys(calls):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warm_replays):
        graph.replay()
    return replay_ms(graph, replays)


def replay_ms(graph, replays: int = 10) -> float:
    """Median ms of one replay of a captured CUDA graph over ``replays`` replays, CUDA events around each."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), warmup=3, repeat=10)
    return 2 * num_bytes / t


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [f"### {title}", "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def triton_variants() -> int:
    """Compiled variants of loraplex's Triton kernels so far on this process (a variant is
    compiled the first time a new constexpr / int-specialisation combination is launched)."""
    import importlib
    import pkgutil

    import loraplex.kernels as kernels
    total = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"loraplex.kernels.{info.name}")
        for obj in vars(module).values():
            for per_device in getattr(obj, "device_caches", {}).values():
                total += len(per_device[0]) if isinstance(per_device, tuple) else 0
    return total


def adapter_version_id(folder: Path) -> str:
    """The adapter's real content id (``loraplex.adapters.identity.compute_version_id`` over its
    config and stored tensors), declared as the platform declares its registry's content hash:
    registration then reads only the config and the safetensors header, and the engine checks
    the id at the first read (a made-up id is refused as a changed adapter)."""
    from safetensors.torch import load_file

    from loraplex.adapters.identity import compute_version_id

    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return compute_version_id(config, load_file(str(Path(folder) / "adapter_model.safetensors")))
