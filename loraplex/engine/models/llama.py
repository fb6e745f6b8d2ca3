"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened
token batch with a paged KV cache.

Inputs are flattened across requests, as in vLLM: ``input_ids [T]``,
``positions [T]`` and an :class:`~loraplex.kernels.AttentionMetadata` holding
per-sequence offsets, the block tables and the slot mapping. q/k/v and
gate/up are fused into one matmul each at load time; LoRA is applied per
output slice through the batched SGMV ops (Punica, Chen et al. 2023).

Architecture reference: HF transformers ``modeling_llama.py`` /
``modeling_qwen2.py`` (pre-norm, RMSNorm, RoPE, GQA, SwiGLU).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.ops import Kernels
from loraplex.kernels.rotary import compute_cos_sin_cache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a Llama-family model, read once from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config_dict(cls, cfg: dict) -> "ModelSpec":
        """Raises ``ValueError`` for an unsupported architecture."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures={arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = cfg.get("rope_scaling") or _rope_scaling_from_parameters(cfg.get("rope_parameters"))
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, path: Path) -> "ModelSpec":
        return cls.from_config_dict(json.loads((Path(path) / "config.json").read_text()))

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """LoRA target module -> (in_features, out_features)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _rope_scaling_from_parameters(params: dict | None) -> dict | None:
    """transformers 5 stores rope scaling in ``rope_parameters``; default type means none."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return dict(params)


@dataclass
class LoRABatch:
    """Per-step LoRA state handed to every layer: the SGMV mapping of tokens to
    adapter slots (built once per step)."""

    mapping: LoRAMapping


class LinearWithLoRA(nn.Module):
    """``y = x @ W.T + b`` with W the concatenation of ``len(out_sizes)`` output
    slices, plus each slice's batched LoRA delta.

    Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``, ``s = slot[t]``.
    """

    def __init__(self, in_features: int, out_sizes: list[int], module_names: list[str], bias: bool,
                 dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.out_sizes = out_sizes
        self.module_names = module_names
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(sum(out_sizes), dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.lora_a: list[torch.Tensor] = []
        self.lora_b: list[torch.Tensor] = []
        self.lora_scaling: list[torch.Tensor] = []

    def bind_lora(self, a: list[torch.Tensor], b: list[torch.Tensor], scaling: list[torch.Tensor]) -> None:
        """Point at the adapter slot pool's stacked weights ([S,R,in], [S,out_i,R], [S])."""
        self.lora_a, self.lora_b, self.lora_scaling = a, b, scaling

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if lora is not None and self.lora_a and lora.mapping.has_lora:
            self.kernels.add_lora(x, self.lora_a, self.lora_b, self.lora_scaling, y, lora.mapping)
        return y


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        d = spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.scale = d ** -0.5
        self.qkv_proj = LinearWithLoRA(spec.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                       ["q_proj", "k_proj", "v_proj"], spec.attention_bias, dtype, device, kernels)
        self.o_proj = LinearWithLoRA(self.q_size, [spec.hidden_size], ["o_proj"], False, dtype, device, kernels)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, lora: LoRABatch | None):
        t = x.shape[0]
        qkv = self.qkv_proj(x, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.contiguous(), k.contiguous()
        self.kernels.rotary_embedding(positions, q, k, cos_sin, self.head_dim)
        k_cache, v_cache = kv
        self.kernels.reshape_and_cache(k.view(t, self.num_kv_heads, self.head_dim),
                                       v.reshape(t, self.num_kv_heads, self.head_dim), k_cache, v_cache,
                                       meta.slot_mapping)
        q = q.view(t, self.num_heads, self.head_dim)
        out = self.kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        i = spec.intermediate_size
        self.gate_up_proj = LinearWithLoRA(spec.hidden_size, [i, i], ["gate_proj", "up_proj"], False, dtype, device,
                                           kernels)
        self.down_proj = LinearWithLoRA(i, [spec.hidden_size], ["down_proj"], False, dtype, device, kernels)

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x, lora)), lora)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, kernels)
        self.self_attn = Attention(spec, dtype, device, kernels)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, kernels)
        self.mlp = MLP(spec, dtype, device, kernels)

    def forward(self, hidden, residual, positions, cos_sin, kv, meta, lora):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin, kv, meta, lora)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, lora), residual


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches, meta, lora) -> hidden [T, hidden] dtype``;
    ``compute_logits(hidden [B, hidden]) -> [B, vocab] float32``.
    ``kv_caches[l] = (k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    ``kernels``: the ops of the backend chosen for the model's device, used by every layer.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, device, kernels) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, kernels)
        self.lm_head = (None if spec.tie_word_embeddings else
                        nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
                                     requires_grad=False))
        self.register_buffer("cos_sin_cache", compute_cos_sin_cache(
            spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling).to(device),
            persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, kv, meta, lora)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()

    def lora_linears(self) -> list[tuple[int, LinearWithLoRA]]:
        """Every LoRA-capable linear with its layer index."""
        out = []
        for idx, layer in enumerate(self.layers):
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                out.append((idx, lin))
        return out
