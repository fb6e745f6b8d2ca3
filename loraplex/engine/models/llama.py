"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, SmolLM2) over a
flattened token batch with a paged KV cache.

Inputs are flattened across requests, as in vLLM: ``input_ids [T]``,
``positions [T]`` and an :class:`~loraplex.kernels.AttentionMetadata` holding
per-sequence offsets, the block tables and the slot mapping. q/k/v and
gate/up are fused into one matmul each at load time; LoRA is applied per
output slice through the batched SGMV ops (Punica, Chen et al. 2023).

Architecture reference: HF transformers ``modeling_llama.py`` / ``modeling_qwen2.py`` /
``modeling_qwen3.py`` (per-head q/k RMSNorm) / ``modeling_phi3.py`` (fused projections):
pre-norm, RMSNorm, RoPE, GQA, SwiGLU. What a checkpoint may ask for is decided by
:class:`~loraplex.adapters.model_spec.ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.adapters.model_spec import ModelSpec
from loraplex.engine.host_copy import host_to_device
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.dense_linear import dense_linear_config
from loraplex.kernels import fp8_linear
from loraplex.kernels.fp8_linear import ActivationSplit
from loraplex.kernels.lora_delta import LoRADelta
from loraplex.kernels.lora_expand import slot_rows_view
from loraplex.kernels.lora_linear import FOLD_MAX_TOKENS
from loraplex.kernels.lora_mapping import LoRAMapping, plan_segments
from loraplex.kernels.ops import Kernels
from loraplex.kernels.rotary import compute_cos_sin_cache, rope_inv_freq


def rope_cos_sin_cache(spec: ModelSpec, layer_type: str | None = None) -> torch.Tensor:
    """The RoPE table ``[max_position_embeddings, head_dim] fp32`` of ``spec`` (of ``layer_type``'s
    parameters for per-layer-type RoPE, Gemma 3), with HF's own inverse frequencies and attention scaling
    (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) for every rope type but the default one
    (:func:`~loraplex.kernels.rotary.rope_inv_freq`, the same formula).

    Raises ``ValueError`` for a spec without its HF config (RoPE parameters live there).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = spec.hf_config
    if config is None:
        raise ValueError("ModelSpec.hf_config is None: build the spec with ModelSpec.from_hf_config")
    rope = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, attention_scaling = rope_inv_freq(spec.head_dim, float(rope["rope_theta"])), 1.0
    elif layer_type is None:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    return compute_cos_sin_cache(inv_freq.float(), spec.max_position_embeddings, float(attention_scaling))


_FUSE_DECODE_LAYERS = True
# dense_linear's fusion of qkv_proj, o_proj, gate_up_proj and down_proj in DecoderLayer.forward_fused
_LAYER_FUSIONS = ("norm", "residual", "norm", "gated+residual")


def fuse_decode_layers(enabled: bool) -> bool:
    """Turn :meth:`LlamaForCausalLM.fuses_decode_layers` on or off (benchmarks' A/B; on by default); returns the
    previous setting. CUDA graphs keep the path they were captured with."""
    global _FUSE_DECODE_LAYERS
    previous, _FUSE_DECODE_LAYERS = _FUSE_DECODE_LAYERS, enabled
    return previous


@dataclass
class LoRABatch:
    """Per-step LoRA state handed to every layer: the SGMV mapping of tokens to
    adapter slots (built once per step).

    ``dora``: some token's slot holds a DoRA adapter; the LoRA'd linears then rescale their
    output rows by the slots' gains. ``gain_rows``: ``[T] int64`` (only with ``dora``), each
    token's row of the ``[S + 1, out]`` gain tables: its slot, or ``S`` (gains 1) for slot -1;
    device ops only, so the CUDA graphs capture it.
    """

    mapping: LoRAMapping
    dora: bool = False
    gain_rows: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.dora:
            self.gain_rows = self.mapping.token_slots.long().remainder(self.mapping.num_slots + 1)


@dataclass(frozen=True)
class VocabLoRA:
    """The adapter slots' parts on ``embed_tokens`` / ``lm_head`` (the pool's tensors; S slots, R rank,
    V vocab, H hidden, K full-module slots; see :mod:`loraplex.adapters.device_weights`).

    ``embed_a_t [S, V, R]``, ``embed_b [S, H, R]``, ``head_a [S, R, H]``, ``head_b [S, V, R]`` in the model
    dtype (the embedding's pair or the head's None when ``lora_target_modules`` leaves that module out);
    ``scaling [2, S] fp32`` (embedding, head); ``full [K, V, H]`` or None; ``full_index [2, S] int64``
    (the copy slot s uses for the embedding / the head, -1 = the base module) and its host mirror
    ``full_index_host`` (live lists, updated by the pool); ``lora_host [2][S]``: whether slot s holds LoRA on the
    embedding / the head (live lists: the head's SGMV runs only when a sampled row's slot has one).
    """

    embed_a_t: torch.Tensor | None
    embed_b: torch.Tensor | None
    head_a: torch.Tensor | None
    head_b: torch.Tensor | None
    scaling: torch.Tensor
    full: torch.Tensor | None
    full_index: torch.Tensor
    full_index_host: list[list[int]]
    lora_host: list[list[bool]]


FP8_FOLD_MAX_TOKENS = 64
"""Steps of more tokens take the SGMV pair in a folded FP8 linear. Measured on an H200 (Llama-2-7B, 32 adapters of
r=16 on every module, decode; RESULTS.md sessions 28-29): folded / SGMV step 3.57 / 3.93 ms at batch 1, 5.08 / 7.14
at 32, 6.90 / 8.26 at 48, 7.52 / 8.68 at 64, 10.62 / 10.55 at 96, 11.68 / 11.29 at 128 (the folded A tiles' bf16
GEMM over 96 or more tokens costs more than SGMV's)."""


class LinearWithLoRA(nn.Module):
    """``y = x @ W.T + b`` with W the concatenation of ``len(out_sizes)`` output
    slices, plus each slice's batched LoRA delta.

    Semantics: ``y[t, off_i:off_i+out_i] += scaling_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``, ``s = slot[t]``.
    DoRA steps (``LoRABatch.dora``), then: ``y[t] = gain[s] * (y[t] - bias) + bias`` (the bias added after
    the rescale; ``gain [S + 1, sum(out_i)]`` from ``LoRADeviceWeights.gain_columns``, 1 for non-DoRA slots).
    A folded linear (:meth:`fold_lora_a`) computes ``x @ A_i[s].T`` for every slot in its base GEMM at steps of up
    to ``FOLD_MAX_TOKENS`` tokens (an FP8 weight: up to ``FP8_FOLD_MAX_TOKENS``, in steps its GEMM takes with split
    activations, ``fp8_linear.default_activations``); its output ``y`` is then a row-strided view of that GEMM's
    output.
    """

    def __init__(self, in_features: int, out_sizes: list[int], module_names: list[str], bias: bool,
                 dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.weight_in_features = in_features
        self.out_sizes = out_sizes
        self.module_names = module_names
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(sum(out_sizes), dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.lora_a: list[torch.Tensor] = []
        self.lora_b: list[torch.Tensor] = []
        self.lora_scaling: list[torch.Tensor] = []
        self.lora_gain: torch.Tensor | None = None  # [S + 1, sum(out_sizes)] fp32 DoRA gains
        self.lora_ranks: torch.Tensor | None = None  # [S] int32 rank rows per slot
        self.lora_page_table: torch.Tensor | None = None  # [S, max_pages] int32 pages per slot
        # fold_lora_a(): [out + n·P·R, in], W's rows then each slice's A pages (weight and the pool's A are views)
        self.folded_weight: torch.Tensor | None = None
        self.folded_bias: torch.Tensor | None = None  # the bias, zeros under the A rows (when there is a bias)
        # fold_lora_a(): every slice's A pages [n·P·R, in] in the model dtype (folded_weight's rows past W, or for an
        # FP8 weight a tensor of their own, read by fp8_linear's split GEMM after the weight's column tiles)
        self.folded_a: torch.Tensor | None = None
        self.qweight: torch.Tensor | None = None  # FP8 weight [out, in] once quantize_fp8() ran
        self.weight_scale: torch.Tensor | None = None  # its per-output-channel scale [out] float32
        # Row-parallel (tensor parallelism): sums the ranks' partial outputs, LoRA delta included; the
        # bias is added once, after it. None: the layer's output is complete.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def quantize_fp8(self) -> None:
        """Replace the weight by its FP8 e4m3 form with per-output-channel scales
        (:mod:`loraplex.engine.models.quantization`); the bf16/fp32 weight is freed."""
        from loraplex.engine.models.quantization import quantize_fp8_per_channel

        self.qweight, self.weight_scale = quantize_fp8_per_channel(self.weight.data)
        self.weight = None  # frees the unquantized weight

    def use_fp8_storage(self) -> None:
        """Hold the weight as FP8 e4m3 ``qweight [out, in]`` with a float32 ``weight_scale [out]``
        (zeros / ones until an FP8 checkpoint is loaded into them); the unquantized weight is freed."""
        from loraplex.kernels.fp8_linear import FP8_DTYPE

        self.qweight = torch.zeros(self.weight.shape, dtype=FP8_DTYPE, device=self.weight.device)
        self.weight_scale = torch.ones(self.weight.shape[0], dtype=torch.float32, device=self.weight.device)
        self.weight = None

    def bind_lora(self, a: list[torch.Tensor], b: list[torch.Tensor], scaling: list[torch.Tensor],
                  gain: torch.Tensor | None = None, *, ranks: torch.Tensor | None = None,
                  page_table: torch.Tensor | None = None) -> None:
        """Point at the adapter weight pool (``loraplex.adapters.device_weights``): pages ``[N, P, in]`` and
        ``[N, out_i, P]`` per slice, scalings ``[S]``, DoRA gains ``[S + 1, sum(out_i)] fp32``, ``ranks [S] int32``
        and ``page_table [S, max_pages] int32`` (without a page table: slot rectangles ``[S, R, in]``,
        ``[S, out_i, R]``)."""
        self.lora_a, self.lora_b, self.lora_scaling = a, b, scaling
        self.lora_gain = gain
        self.lora_ranks, self.lora_page_table = ranks, page_table

    def fold_lora_a(self, lora_a: list[torch.Tensor]) -> list[torch.Tensor]:
        """Put the pool's A pages of every slice (``lora_a``: ``[P, R, in]`` each, P pages of R rank rows: one page per
        slot, or a paged pool's pages) under the base weight, in one tensor ``folded_weight [out + n·P·R, in]`` (W's
        rows, then slice 0's pages, slice 1's, ...), so that one GEMM gives a step's base output and every page's
        shrink (:meth:`forward`, steps of at most ``FOLD_MAX_TOKENS`` tokens; the expand then reads each token's own
        slot's pages of those columns through the page table). ``weight`` becomes a
        view of it. An FP8 weight (:meth:`can_fold_shrink`) keeps its e4m3 rows; the A pages, in the model dtype,
        go to ``folded_a [n·P·R, in]`` of their own, which ``fp8_linear``'s split GEMM reads after the weight's column
        tiles in the same launch. Returns the views of ``lora_a`` (contents copied) that the pool holds from now on
        (``LoRADeviceWeights.replace_a``).

        Raises ``ValueError`` for a linear that cannot fold (:meth:`can_fold_shrink`: a row-parallel linear under
        tensor parallelism, whose shrink would need its own all-reduce before the expand; an FP8 weight whose GEMM
        does not take split activations), a folded linear, or A of another dtype, device or width."""
        if not self.can_fold_shrink(lora_a[0].dtype) or self.folded_a is not None:
            raise ValueError("fold_lora_a: only an unfolded, complete (not row-parallel) linear, unquantized or FP8 "
                             f"with split activations, folds its shrink ({self.module_names})")
        w = self.weight.data if self.qweight is None else self.qweight
        dtype = w.dtype if self.qweight is None else lora_a[0].dtype
        if any(a.dim() != 3 or a.shape[2] != w.shape[1] or a.dtype != dtype or a.device != w.device or
               a.shape[:2] != lora_a[0].shape[:2] for a in lora_a):
            raise ValueError(f"fold_lora_a: A pages {[(tuple(a.shape), a.dtype) for a in lora_a]} do not fit weight "
                             f"{tuple(w.shape)} {w.dtype} of {self.module_names}")
        rows = [a.shape[0] * a.shape[1] for a in lora_a]
        base = 0 if self.qweight is not None else w.shape[0]
        folded = torch.empty(base + sum(rows), w.shape[1], dtype=dtype, device=w.device)
        folded[:base].copy_(w[:base])
        views, start = [], base
        for a, n in zip(lora_a, rows):
            views.append(folded[start:start + n].view(a.shape))
            views[-1].copy_(a)
            start += n
        self.folded_a = folded[base:]
        if self.qweight is not None:
            return views
        self.folded_weight = folded
        self.weight = nn.Parameter(folded[:base], requires_grad=False)
        if self.bias is not None:
            self.folded_bias = torch.cat([self.bias.data, self.bias.new_zeros(sum(rows))])
        return views

    def can_fold_shrink(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`fold_lora_a` applies to A pages of ``dtype``: a complete (not row-parallel) linear, with an
        unquantized weight or an FP8 one whose GEMM takes split activations for ``dtype`` (Triton kernels; bf16 on
        Hopper, ``fp8_linear.default_activations``)."""
        if self.all_reduce is not None:
            return False
        if self.qweight is None:
            return self.weight is not None
        return (self.kernels.backend == "triton"
                and fp8_linear.default_activations(dtype, self.qweight.device, 1) == "split")

    def weight_rows(self, module: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop`` of slice ``module``'s weight: ``[stop - start, in_features]`` in the model
        dtype, or float32 dequantized from FP8 (what the layer computes with). For DoRA's column norms."""
        i = self.module_names.index(module)
        offset = sum(self.out_sizes[:i])
        if self.qweight is not None:
            from loraplex.engine.models.quantization import dequantize_fp8

            rows = slice(offset + start, offset + stop)
            return dequantize_fp8(self.qweight[rows], self.weight_scale[rows])
        return self.weight[offset + start:offset + stop]

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        return self.forward_deferred(x, lora, defer=False)[0]

    def split_for(self, num_tokens: int, like: torch.Tensor) -> ActivationSplit | None:
        """Buffers for the activation split of this FP8 linear's input (``[num_tokens, in]`` of ``like``'s dtype and
        device) where ``fp8_linear`` takes its split path
        (:func:`~loraplex.kernels.fp8_linear.default_activations`), for the kernel that makes the input to fill
        (``rms_norm`` / ``silu_and_mul`` with ``split=``); None where the path does not apply (an unquantized
        linear, the reference kernels, fp32, long steps)."""
        if (self.qweight is None or self.kernels.backend != "triton"
                or fp8_linear.default_activations(like.dtype, like.device, num_tokens) != "split"):
            return None
        return ActivationSplit.empty(num_tokens, self.qweight.shape[1], like.device)

    def forward_base(self, x: torch.Tensor, *, norm: RMSNorm | None = None, activation: str | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
        """The base linear alone (no LoRA; a complete, unquantized weight) with the neighbours it absorbs
        (``dense_linear``): ``norm(x)`` or ``activation``'s ``act(gate) * up`` of x as its input, ``residual`` added
        to its output."""
        return self.kernels.dense_linear(x, self.weight, self.bias, norm_weight=None if norm is None else norm.weight,
                                         norm_eps=1e-6 if norm is None else norm.eps, activation=activation,
                                         residual=residual)

    def forward_deferred(self, x: torch.Tensor, lora: LoRABatch | None, defer: bool = True,
                         split: ActivationSplit | None = None) -> tuple[torch.Tensor, LoRADelta | None]:
        """``(y, delta)``: with ``defer`` and a folded step (folded linear, LoRA tokens, at most
        ``FOLD_MAX_TOKENS`` tokens, or for an FP8 weight ``FP8_FOLD_MAX_TOKENS`` in a step its GEMM takes with split
        activations; no DoRA), ``y`` is the base output and ``delta`` its expand for the kernel that
        reads ``y`` next (``rms_norm``, ``silu_and_mul``, ``gelu_tanh_and_mul`` take ``lora=delta``); otherwise
        ``(forward's y, None)``. ``split``: x's activation split (:meth:`split_for`, filled by the kernel that made
        x), read by an FP8 weight's GEMM instead of splitting x again."""
        reduce = self.all_reduce
        dora = lora is not None and lora.dora and self.lora_gain is not None
        bias = self.bias if reduce is None and not dora else None  # else added last
        with_lora = lora is not None and bool(self.lora_a) and lora.mapping.has_lora
        folds = with_lora and self.folded_a is not None and lora.mapping.num_tokens <= FOLD_MAX_TOKENS
        out = None  # a folded GEMM's output: the base columns, then every page's shrink
        if self.qweight is not None:
            folds = folds and lora.mapping.num_tokens <= FP8_FOLD_MAX_TOKENS and (
                split is not None or fp8_linear.default_activations(x.dtype, x.device, x.shape[0]) == "split")
            if folds:
                out = self.kernels.fp8_linear(x, self.qweight, self.weight_scale, bias, split=split,
                                              lora_a=self.folded_a)
            else:
                y = self.kernels.fp8_linear(x, self.qweight, self.weight_scale, bias, split=split)
        elif folds:
            out = self.kernels.dense_linear(x, self.folded_weight, self.folded_bias if bias is not None else None)
        else:
            y = self.kernels.dense_linear(x, self.weight, bias)
        if out is not None:
            # one GEMM: the base output (a row-strided view) and every page's shrink, read by the expand
            n = out.shape[1] - self.folded_a.shape[0]
            y = out[:, :n]
            v = slot_rows_view(out, n, len(self.lora_a), *self.lora_a[0].shape[:2])
            if defer and not dora:
                return y, LoRADelta(v, self.lora_b, self.lora_scaling, lora.mapping, page_table=self.lora_page_table,
                                    ranks=self.lora_ranks)
            self.kernels.lora_expand_slot_rows(v, self.lora_b, self.lora_scaling, y, lora.mapping,
                                               ranks=self.lora_ranks, page_table=self.lora_page_table)
            with_lora = False
        if with_lora:
            self.kernels.add_lora(x, self.lora_a, self.lora_b, self.lora_scaling, y, lora.mapping,
                                  ranks=self.lora_ranks, page_table=self.lora_page_table)
        if reduce is not None:
            y = reduce(y)
        if dora:
            y.mul_(self.lora_gain.index_select(0, lora.gain_rows))
        if self.bias is not None and bias is None:
            y = y + self.bias
        return y, None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, lora: LoRADelta | None = None,
                split: ActivationSplit | None = None):
        """``rms_norm``; ``lora``: the expand of the folded linear that made ``x``, added first; ``split``: filled
        with the output's activation split (for the FP8 linear that reads it)."""
        return self.kernels.rms_norm(x, self.weight, self.eps, residual, lora=lora, split=split)


class Attention(nn.Module):
    """Self-attention over the paged KV cache: fused qkv matmul (+ LoRA), optional per-head q/k
    RMSNorm (Qwen3, Gemma 3), RoPE and cache write (one ``rotary_and_cache`` launch), paged attention
    (limited to ``sliding_window`` tokens when set: Mistral, Phi-3, Qwen2/3 sliding layers), o_proj (+ LoRA).

    LoRA slices: ``q_proj``/``k_proj``/``v_proj`` on split families, one ``qkv_proj`` on fused
    ones (Phi-3, whose adapters target the fused module).
    """

    def __init__(self, spec: ModelSpec, sliding_window: int | None, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        d = spec.head_dim
        self.sliding_window = sliding_window
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_size, self.kv_size = spec.num_heads * d, spec.num_kv_heads * d
        self.scale = spec.attn_scale
        self.softcap = spec.attn_logit_softcapping
        if spec.fused_projections:
            sizes, names = [self.q_size + 2 * self.kv_size], ["qkv_proj"]
        else:
            sizes, names = [self.q_size, self.kv_size, self.kv_size], ["q_proj", "k_proj", "v_proj"]
        self.qkv_proj = LinearWithLoRA(spec.hidden_size, sizes, names, spec.qkv_bias, dtype, device, kernels)
        self.o_proj = LinearWithLoRA(self.q_size, [spec.hidden_size], ["o_proj"], spec.o_bias, dtype, device, kernels)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device, kernels) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device, kernels) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoRABatch | None, split: ActivationSplit | None = None) -> tuple[torch.Tensor, LoRADelta | None]:
        """``(o_proj's output, its deferred LoRA expand or None)``; ``split``: x's activation split for an FP8
        qkv_proj."""
        # A folded qkv linear's expand is added by the rotary kernel, unless a per-head norm comes first.
        qkv, delta = self.qkv_proj.forward_deferred(x, lora, defer=self.q_norm is None, split=split)
        return self.o_proj.forward_deferred(self.attend(qkv, positions, cos_sin, kv, meta, delta), lora)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
               kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               delta: LoRADelta | None = None) -> torch.Tensor:
        """From qkv_proj's output ``[T, q + 2 kv]`` (``delta``: its deferred LoRA expand) to o_proj's input
        ``[T, num_heads * head_dim]``: per-head norms, RoPE and the cache write, paged attention."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # row-strided views of qkv
        if self.q_norm is not None:  # RMSNorm over each head's D values, before RoPE (HF order)
            q = self.q_norm(q.contiguous().view(-1, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.contiguous().view(-1, self.head_dim)).view(t, self.kv_size)
        k_cache, v_cache = kv
        # One launch: q rotated in place (inside qkv), rotated k and v written to the cache slots.
        q = self.kernels.rotary_and_cache(positions, q, k, v, k_cache, v_cache, meta.slot_mapping, cos_sin, lora=delta)
        q = q.view(t, self.num_heads, self.head_dim)
        out = self.kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                                           softcap=self.softcap)
        return out.reshape(t, self.q_size)


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))`` or GeGLU (``gelu_tanh``, Gemma) with gate/up fused (LoRA
    slices ``gate_proj``/``up_proj``, or one ``gate_up_proj`` on fused families)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        i = spec.intermediate_size
        sizes, names = ([2 * i], ["gate_up_proj"]) if spec.fused_projections else ([i, i], ["gate_proj", "up_proj"])
        self.gate_up_proj = LinearWithLoRA(spec.hidden_size, sizes, names, spec.mlp_bias, dtype, device, kernels)
        self.down_proj = LinearWithLoRA(i, [spec.hidden_size], ["down_proj"], spec.mlp_bias, dtype, device, kernels)
        gelu = spec.activation == "gelu_pytorch_tanh"
        self.activation = "gelu_tanh" if gelu else "silu"  # dense_linear's name for it
        self.act_and_mul = kernels.gelu_tanh_and_mul if gelu else kernels.silu_and_mul

    def forward(self, x: torch.Tensor, lora: LoRABatch | None,
                split: ActivationSplit | None = None) -> tuple[torch.Tensor, LoRADelta | None]:
        """``(down_proj's output, its deferred LoRA expand or None)``; gate/up's expand, if deferred, is added by
        the activation kernel, which also writes an FP8 down_proj's activation split. ``split``: x's, for an FP8
        gate_up_proj."""
        gate_up, delta = self.gate_up_proj.forward_deferred(x, lora, split=split)
        down_split = self.down_proj.split_for(gate_up.shape[0], gate_up)
        act = self.act_and_mul(gate_up, lora=delta, split=down_split)
        return self.down_proj.forward_deferred(act, lora, split=down_split)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 kernels: Kernels) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype, device, kernels)
        self.self_attn = Attention(spec, spec.layer_windows[layer_idx], dtype, device, kernels)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, kernels)
        self.mlp = MLP(spec, dtype, device, kernels)
        self.sandwich = spec.gemma_norms
        if self.sandwich:  # Gemma 2: norms before and after the MLP too; post_attention_layernorm is an output norm
            self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, device, kernels)
            self.post_feedforward_layernorm = RMSNorm(h, eps, dtype, device, kernels)

    def forward(self, hidden, residual, positions, cos_sin, kv, meta, lora, pending=None):
        """Llama: ``(hidden, residual, pending)`` carried with the residual add fused into the next norm, and
        ``pending`` the LoRA expand of the down_proj that made ``hidden`` (folded linears, :class:`LoRADelta`), which
        that norm adds first. Sandwich (Gemma 2): ``h += post_attn_norm(attn(in_norm(h)));
        h += post_ff_norm(mlp(pre_ff_norm(h)))``, residual and pending stay None."""
        if self.sandwich:
            attn, delta = self.self_attn(self.input_layernorm(hidden), positions, cos_sin, kv, meta, lora)
            hidden = hidden + self.post_attention_layernorm(attn, lora=delta)
            mlp, delta = self.mlp(self.pre_feedforward_layernorm(hidden), lora)
            return hidden + self.post_feedforward_layernorm(mlp, lora=delta), None, None
        # FP8 linears: each norm writes its output's activation split for the GEMM after it (None otherwise)
        split = self.self_attn.qkv_proj.split_for(hidden.shape[0], hidden)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, split=split)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, lora=pending, split=split)
        hidden, delta = self.self_attn(hidden, positions, cos_sin, kv, meta, lora, split=split)
        split = self.mlp.gate_up_proj.split_for(hidden.shape[0], hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual, lora=delta, split=split)
        hidden, pending = self.mlp(hidden, lora, split=split)
        return hidden, residual, pending

    def forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """A Llama layer of a step without LoRA in four GEMMs, attention and RoPE + cache write (and the per-head q/k
        norms where the family has them), no other kernel:
        the input norm rides in qkv_proj, the residual adds in o_proj and down_proj, the post-attention norm in
        gate_up_proj and the activation in down_proj (``dense_linear``'s fusions). ``hidden`` is the residual stream
        ``[T, hidden]`` (the sum the unfused path carries as ``hidden + residual``); returns the next one."""
        attn, mlp = self.self_attn, self.mlp
        qkv = attn.qkv_proj.forward_base(hidden, norm=self.input_layernorm)
        hidden = attn.o_proj.forward_base(attn.attend(qkv, positions, cos_sin, kv, meta), residual=hidden)
        gate_up = mlp.gate_up_proj.forward_base(hidden, norm=self.post_attention_layernorm)
        return mlp.down_proj.forward_base(gate_up, activation=mlp.activation, residual=hidden)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches, meta, lora) -> hidden [T, hidden] dtype``;
    ``compute_logits(hidden [B, hidden]) -> [B, vocab] float32``.
    ``kv_caches[l] = (k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kernels: Kernels) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device, kernels) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, kernels)
        self.lm_head = (None if spec.tie_word_embeddings else
                        nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
                                     requires_grad=False))
        # One RoPE table per distinct parameter set (Gemma 3: local and global), shared by the layers using it.
        self.rope_keys = sorted(set(spec.layer_rope), key=str)
        for i, key in enumerate(self.rope_keys):
            self.register_buffer(f"cos_sin_cache_{i}", rope_cos_sin_cache(spec, key).to(device), persistent=False)
        self.layer_rope_index = [self.rope_keys.index(key) for key in spec.layer_rope]
        # HF Gemma: embeddings * tensor(sqrt(hidden_size)) cast to the weight dtype
        self.embed_scale = (None if spec.embed_scale is None else
                            torch.tensor(spec.embed_scale).to(dtype=dtype, device=device))
        self.kernels = kernels
        self.vocab_lora: VocabLoRA | None = None  # bound by bind_vocab_lora (adapters on embed_tokens / lm_head)

    def bind_vocab_lora(self, vocab_lora: VocabLoRA) -> None:
        """Point at the adapter slot pool's ``embed_tokens`` / ``lm_head`` tensors."""
        self.vocab_lora = vocab_lora

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoRABatch | None = None) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        if lora is not None and self.vocab_lora is not None:
            hidden = self._adapter_embeddings(input_ids, hidden, lora)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        caches = [getattr(self, f"cos_sin_cache_{i}") for i in range(len(self.rope_keys))]
        if self.fuses_decode_layers(input_ids.shape[0], lora):
            for layer, kv, rope in zip(self.layers, kv_caches, self.layer_rope_index):
                hidden = layer.forward_fused(hidden, positions, caches[rope], kv, meta)
            return self.norm(hidden)
        residual = pending = None
        for layer, kv, rope in zip(self.layers, kv_caches, self.layer_rope_index):
            hidden, residual, pending = layer(hidden, residual, positions, caches[rope], kv, meta, lora, pending)
        return self.norm(hidden, lora=pending) if residual is None else self.norm(hidden, residual, lora=pending)[0]

    def fuses_decode_layers(self, num_tokens: int, lora: LoRABatch | None) -> bool:
        """Whether a step of ``num_tokens`` tokens runs :meth:`DecoderLayer.forward_fused`: no token on an adapter,
        the kernels Triton's, Llama-order layers (not Gemma 2's sandwich norms) with complete unquantized linears (no
        FP8, no tensor-parallel all-reduce), and a measured fused ``dense_linear`` launch for all four linears at
        this token count (``dense_linear_config`` with their fusion: where the fused launch beat the plain one plus
        the separate kernel). Decided per step, so a CUDA graph keeps the path it was captured with."""
        if not _FUSE_DECODE_LAYERS or self.kernels.backend != "triton" or (lora is not None and lora.mapping.has_lora):
            return False
        layer = self.layers[0]
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if layer.sandwich or any(lin.weight is None or lin.all_reduce is not None for lin in linears):
            return False
        w = linears[0].weight
        return all(dense_linear_config(num_tokens, lin.weight.shape[0], lin.weight.shape[1], w.dtype, w.device, fusion)
                   is not None for lin, fusion in zip(linears, _LAYER_FUSIONS))

    def _adapter_embeddings(self, input_ids: torch.Tensor, hidden: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        """The adapters' embedding rows, before Gemma's scale (PEFT scales the LoRA delta and the copies too).

        Semantics, ``s = slot[t]``: ``e[t] = full[k][ids[t]]`` when ``k = full_index[0, s] >= 0`` (modules_to_save),
        then ``e[t] += scaling[0, s] * embed_a_t[s, ids[t]] @ embed_b[s].T``; nothing for ``s == -1``.
        Device ops only (a gather per token and one SGMV expand), so CUDA graphs capture it.
        """
        v = self.vocab_lora
        slots = lora.mapping.token_slots.long()
        safe = slots.clamp(min=0)
        if v.full is not None:
            index = torch.where(slots >= 0, v.full_index[0][safe], -1)  # [T]
            rows = v.full[index.clamp(min=0), input_ids]  # [T, H]
            hidden = torch.where((index >= 0)[:, None], rows, hidden)
        if lora.mapping.has_lora and v.embed_a_t is not None:  # None: embed_tokens LoRA not served
            a_rows = v.embed_a_t[safe, input_ids].float().unsqueeze(0).contiguous()  # [1, T, R]
            self.kernels.lora_expand(a_rows, [v.embed_b], [v.scaling[0]], hidden, lora.mapping)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, lora_slots: list[int] | None = None) -> torch.Tensor:
        """LM head (tied or not), then ``cap * tanh(logits / cap)`` with a final soft-cap (Gemma 2).

        ``lora_slots``: the adapter slot of each row of ``hidden`` (-1 = base model), or None (all base):
        rows of adapters with LoRA on ``lm_head`` get ``logits[t] += scaling[1, s] * (h[t] @ head_a[s].T) @
        head_b[s].T`` (batched SGMV shrink/expand), rows of adapters with a ``modules_to_save`` copy
        ``k = full_index[1, s] >= 0`` get ``h[t] @ full[k].T`` instead (one matmul per copy in the batch).
        """
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = self.kernels.dense_linear(hidden, head)
        if lora_slots is not None and self.vocab_lora is not None and max(lora_slots, default=-1) >= 0:
            self._adapter_logits(hidden, logits, lora_slots)
        cap = self.spec.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _adapter_logits(self, hidden: torch.Tensor, logits: torch.Tensor, lora_slots: list[int]) -> None:
        """``compute_logits``'s adapter rows, in place on ``logits [B, V]``."""
        v = self.vocab_lora
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(lora_slots):
            if slot >= 0 and v.full_index_host[1][slot] >= 0:
                groups.setdefault(v.full_index_host[1][slot], []).append(row)
        for index, rows in groups.items():
            at = host_to_device(rows, torch.int64, hidden.device)
            logits[at] = F.linear(hidden[at], v.full[index])
        if v.head_a is None or not any(slot >= 0 and v.lora_host[1][slot] for slot in lora_slots):
            return
        token_slots = host_to_device(lora_slots, torch.int32, hidden.device)
        mapping = plan_segments(token_slots, v.scaling.shape[1], has_lora=True)
        self.kernels.add_lora(hidden.contiguous(), [v.head_a], [v.head_b], [v.scaling[1]], logits, mapping)

    def num_lora_slots(self) -> int:
        """Adapter slots of the bound LoRA weights (S of the scalings ``[S]``), 0 when none are bound."""
        return next((lin.lora_scaling[0].shape[0] for _, lin in self.lora_linears() if lin.lora_a), 0)

    def base_weight_rows(self, layer: int, module: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop`` of the base weight of ``module`` in layer ``layer`` (``LinearWithLoRA.weight_rows``);
        the ``BaseWeightRows`` that DoRA installs read. Raises ``KeyError`` for a module the model lacks."""
        for idx, lin in self.lora_linears():
            if idx == layer and module in lin.module_names:
                return lin.weight_rows(module, start, stop)
        raise KeyError(f"layer {layer} has no LoRA-capable module {module!r}")

    def lora_linears(self) -> list[tuple[int, LinearWithLoRA]]:
        """Every LoRA-capable linear with its layer index."""
        out = []
        for idx, layer in enumerate(self.layers):
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                out.append((idx, lin))
        return out
