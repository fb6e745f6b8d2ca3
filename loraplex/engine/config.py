"""Engine configuration: one validated dataclass, as vLLM's ``EngineArgs``.

Every knob is checked once in ``__post_init__``; a bad value raises
``ValueError`` naming the field and the value. Derived values (the resolved
device and dtype) are computed once by :meth:`EngineConfig.resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loraplex.adapters.config import LoRAConfig

DTypeName = Literal["auto", "float32", "float16", "bfloat16"]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    """All engine knobs (names as in vLLM).

    Attributes:
        model: local HF folder (``config.json`` + safetensors + tokenizer) or a
            demo model name such as ``"smollm2-135m-instruct"``.
        download_dir: where demo models are prepared (``None``: ~/.cache/loraplex).
        dtype: weight/activation dtype; ``"auto"`` is bfloat16 on CUDA and
            float32 on CPU (so CPU results match HF transformers exactly).
        device: ``"auto"`` picks CUDA when available.
        seed: seed of the default random generator (unseeded requests).
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of GPU memory the engine may use in
            total (weights + activations + KV cache).
        kv_cache_memory_bytes: explicit KV cache size; required sizing on CPU
            (default there: enough for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, capped at 2 GiB).
        num_kv_blocks: explicit number of KV blocks (overrides both sizes; for tests).
        max_model_len: maximum prompt + output tokens of one sequence
            (``None``: the model's ``max_position_embeddings``).
        max_num_seqs: maximum sequences running at once.
        max_num_batched_tokens: token budget of one step (prompt chunks and
            decode tokens together); longer prompts are chunked.
        swap_space: GiB of host memory for swapped-out KV blocks; 0 means
            preemption recomputes instead of swapping.
        enable_prefix_caching: share and keep KV blocks of identical prefixes.
        enable_lora: serve LoRA adapters.
        max_loras: adapter slots on the device (distinct adapters in one step).
        max_lora_rank: largest adapter rank accepted; slots are padded to it.
        max_cpu_loras: adapters kept in the host-memory LRU cache.
        enforce_eager: disable CUDA graphs.
        max_adapter_wait_steps: aging bound of adapter admission, in scheduler steps: once a
            request that needs an adapter slot (all ``max_loras`` taken) has waited this long,
            one running adapter admits nothing new until its slot drains and the waiting
            adapter takes it. Its first token then comes within about this many steps plus
            one request duration.
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"fair"`` (Virtual Token Counter
            across tenants, Sheng et al. OSDI 2024: the least-served backlogged tenant's
            request is admitted first; see ``loraplex.engine.fairness``).
        fair_prompt_token_weight: service weight of one computed prompt token (VTC's w_p).
        fair_output_token_weight: service weight of one generated token (VTC's w_q).
        async_scheduling: schedule and launch step N+1 while step N runs on the device
            (``LLMEngine.step``); off by default (not yet measured on a GPU).
    """

    model: str
    download_dir: str | None = None
    dtype: DTypeName = "auto"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    swap_space: float = 0.0
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enforce_eager: bool = False
    max_adapter_wait_steps: int = 32
    scheduling_policy: Literal["fcfs", "fair"] = "fcfs"
    fair_prompt_token_weight: float = 1.0
    fair_output_token_weight: float = 2.0
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        checks = [
            (bool(self.model), "model", "must not be empty"),
            (self.dtype in ("auto", *_DTYPES), "dtype", f"must be one of auto, {', '.join(_DTYPES)}"),
            (self.device in ("auto", "cuda", "cpu"), "device", "must be auto, cuda or cpu"),
            (self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", "must be a power of two <= 128"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
             "must be > 0"),
            (self.num_kv_blocks is None or self.num_kv_blocks > 0, "num_kv_blocks", "must be > 0"),
            (self.max_model_len is None or self.max_model_len > 0, "max_model_len", "must be > 0"),
            (self.max_num_seqs > 0, "max_num_seqs", "must be > 0"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens", "must be > 0"),
            (self.swap_space >= 0, "swap_space", "must be >= 0"),
            (self.max_loras > 0, "max_loras", "must be > 0"),
            (self.max_lora_rank in (1, 2, 4, 8, 16, 32, 64, 128, 256), "max_lora_rank",
             "must be a power of two <= 256"),
            (self.max_adapter_wait_steps >= 0, "max_adapter_wait_steps", "must be >= 0"),
            (self.scheduling_policy in ("fcfs", "fair"), "scheduling_policy", "must be fcfs or fair"),
            (self.fair_prompt_token_weight >= 0, "fair_prompt_token_weight", "must be >= 0"),
            (self.fair_output_token_weight >= 0, "fair_output_token_weight", "must be >= 0"),
            (self.fair_prompt_token_weight + self.fair_output_token_weight > 0, "fair_output_token_weight",
             "the two token weights must not both be 0"),
            (self.max_cpu_loras >= self.max_loras, "max_cpu_loras", f"must be >= max_loras={self.max_loras}"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: {rule}")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * (1 << 30))

    def resolve_device(self) -> torch.device:
        """The device to run on; raises ``ValueError`` if CUDA is asked for but absent."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device='cuda': no CUDA device is available")
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def lora_config(self, device: torch.device) -> LoRAConfig:
        """The adapter tiers' knobs. Adapter reads run on loader threads on CUDA (disk reads stay
        out of the GPU step) and inline on CPU (deterministic tests)."""
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, background_loads=device.type == "cuda")

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """The compute dtype: ``dtype``, or bfloat16 on CUDA / float32 on CPU for ``"auto"``."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
