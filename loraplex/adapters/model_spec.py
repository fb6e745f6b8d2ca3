"""The base model loraplex serves, read once from its HF config: shapes, per-layer features, the
LoRA-able modules, and the refusal of every config field the engine does not implement.

One owner: the engine builds its model from :class:`ModelSpec`; adapters are checked against
:attr:`ModelSpec.adapter_spec` (:class:`~loraplex.adapters.spec.BaseModelSpec`). The config is
an HF ``PretrainedConfig`` (``transformers.AutoConfig.from_pretrained``), read by attribute, so
this package does not import transformers.

Field audit (kept true by ``tests/adapters/test_model_spec.py``, which walks every dataclass
field of each supported transformers config class): each field is either read into the spec,
checked against the values the engine implements (anything else raises
:class:`UnsupportedModelError` naming the field and value), or inert in inference (training-only,
token ids the tokenizer owns, bookkeeping). A config attribute that is no field of its class is
refused unless it is None/False (no effect), and ``quantization_config`` always is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.adapters.spec import BaseModelSpec


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something the engine does not implement; the message names the field."""


@dataclass(frozen=True)
class Family:
    """One supported HF model family (``model_type``) and how its config maps onto the engine.

    - ``qk_norm``: RMSNorm over each head of q and k before RoPE (Qwen3).
    - ``fused_projections``: the checkpoint stores ``qkv_proj`` / ``gate_up_proj`` (Phi-3), and
      adapters target those fused modules.
    - ``gemma``: Gemma 2 layout: RMSNorm weights stored as ``w - 1``, norms around attention and MLP
      ("sandwich"), embeddings scaled by sqrt(hidden_size), GeGLU, ``query_pre_attn_scalar``, soft-capping.
    - ``reads``: the config fields this family's parser reads or checks (besides :data:`INERT_FIELDS`).
    - ``ignored_extras``: attributes outside the class's fields that HF's modeling code ignores too.
    """

    model_type: str
    architecture: str
    reads: frozenset[str]
    qk_norm: bool = False
    fused_projections: bool = False
    gemma: bool = False
    ignored_extras: frozenset[str] = frozenset()


_COMMON = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "eos_token_id", "hidden_act",
})
_QWEN_WINDOWS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
_GEMMA = (_COMMON - {"hidden_act"}) | {
    "hidden_activation", "head_dim", "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (
        Family("llama", "LlamaForCausalLM", _COMMON | {"head_dim", "attention_bias", "mlp_bias"}),
        Family("mistral", "MistralForCausalLM", _COMMON | {"head_dim", "sliding_window"}),
        Family("qwen2", "Qwen2ForCausalLM", _COMMON | _QWEN_WINDOWS),
        Family("qwen3", "Qwen3ForCausalLM", _COMMON | _QWEN_WINDOWS | {"head_dim", "attention_bias"}, qk_norm=True),
        Family("phi3", "Phi3ForCausalLM", _COMMON | {"sliding_window", "original_max_position_embeddings"},
               fused_projections=True),
        Family("gemma2", "Gemma2ForCausalLM", _GEMMA, gemma=True,
               ignored_extras=frozenset({"hidden_act"})),  # Hub configs carry it; HF reads hidden_activation
        # Gemma 3 text (Gemma3ForCausalLM): Gemma 2 plus per-head q/k RMSNorm and a RoPE per layer type;
        # HF turns sliding_window_pattern into layer_types (read).
        Family("gemma3_text", "Gemma3ForCausalLM", _GEMMA, qk_norm=True, gemma=True,
               ignored_extras=frozenset({"hidden_act", "sliding_window_pattern", "_sliding_window_pattern"})),
    )
}

# Fields with no effect on eval-mode outputs: training (dropout, init), generation bookkeeping
# (cache use, pad/bos ids: the tokenizer owns them), and PretrainedConfig's own bookkeeping.
INERT_FIELDS = frozenset({
    "initializer_range", "use_cache", "attention_dropout", "resid_pdrop", "embd_pdrop", "pad_token_id",
    "bos_token_id", "pretraining_tp",  # pretraining_tp: transformers 5 no longer reads it
    "architectures", "chunk_size_feed_forward", "dtype", "id2label", "label2id", "is_encoder_decoder",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version",
})
# Attributes every loaded config carries besides its fields.
# cache_implementation: generation-only (HF moves it to generation_config); auto_map: the checkpoint's own
# modeling code for trust_remote_code (e.g. Phi-3), which loraplex, like HF without it, replaces by the
# built-in class of model_type.
# ``_model_name_or_path``: transformers 5 writes it into a saved config (e.g. the GGUF loader's folder).
_BOOKKEEPING_ATTRS = frozenset({"model_type", "output_attentions", "_name_or_path", "_model_name_or_path",
                                "cache_implementation", "auto_map"})

# RoPE types whose tables are position-independent within max_position_embeddings; the engine
# builds them with transformers.modeling_rope_utils. "longrope" switches factor sets with the
# sequence length (per batch in HF), so it is refused.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class CheckpointQuantization:
    """An FP8 checkpoint's ``quantization_config``, as the engine serves it.

    Weights are float8_e4m3fn with one float32 scale per output channel (``weight_strategy``
    ``"channel"``) or per tensor (``"tensor"``), ``W = Wq * scale``; the engine computes
    ``x @ W.T`` in the model dtype (W8A16, :data:`~loraplex.kernels.fp8_linear.FP8_LINEAR`).
    ``dynamic_activations``: the checkpoint also asks for activations quantized per token at
    run time (W8A8 dynamic); the engine keeps activations in the model dtype instead (as vLLM
    does on GPUs without FP8 tensor cores) and logs it. ``method``: ``"fbgemm_fp8"`` or
    ``"compressed-tensors"`` (format ``float-quantized``). ``unquantized``: module names left
    in the model dtype (``lm_head`` and the embeddings always are).
    """

    method: str
    weight_strategy: str
    dynamic_activations: bool
    unquantized: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only base model as the engine implements it.

    Shapes: ``head_dim`` D, ``num_heads`` Hq, ``num_kv_heads`` Hkv, ``intermediate_size`` I.
    ``layer_windows[l]``: the sliding-window size in tokens of layer l (a query at position p
    attends to keys at positions ``> p - window``), or None for full causal attention.
    ``activation``: the gate activation of the MLP, ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
    ``attn_scale``: softmax scale (``head_dim ** -0.5``, or ``query_pre_attn_scalar ** -0.5`` for Gemma).
    ``attn_logit_softcapping`` / ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on attention scores /
    LM-head logits, or None. ``embed_scale``: factor on the embeddings (Gemma: sqrt(hidden_size)), or None.
    ``gemma_norms``: RMSNorm weights are stored as ``w - 1`` and layers have sandwich norms.
    ``layer_rope``: per layer, the key of its RoPE parameters in ``hf_config.rope_parameters`` (Gemma 3:
    ``"sliding_attention"`` / ``"full_attention"``), or None where one set serves every layer.
    ``hf_config``: the HF config the spec was read from (RoPE tables are built from it); None for
    specs built by hand in tests. ``checkpoint_quantization``: how the checkpoint's linear weights
    are stored when they are FP8 (:class:`CheckpointQuantization`), else None.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    fused_projections: bool
    activation: str
    attn_scale: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    embed_scale: float | None
    gemma_norms: bool
    layer_windows: tuple[int | None, ...]
    layer_rope: tuple[str | None, ...]
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(default=None, compare=False, repr=False)
    checkpoint_quantization: CheckpointQuantization | None = None

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """Read and check an HF ``PretrainedConfig`` (transformers 5).

        Raises:
            UnsupportedModelError: unsupported ``model_type``, or a field with a value the engine
                does not implement (the message names the field and the value).
        """
        model_type = getattr(config, "model_type", None)
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"config.model_type={model_type!r}: unsupported; supported are {', '.join(sorted(FAMILIES))}")
        quantization = _check_extra_attributes(config, family)
        activation_field = "hidden_activation" if family.gemma else "hidden_act"
        _require(config, activation_field, ("gelu_pytorch_tanh",) if family.gemma else ("silu",))
        _require(config, "use_bidirectional_attention", (None, False))
        _check_rope(config)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
        scalar = getattr(config, "query_pre_attn_scalar", None) if family.gemma else None
        num_layers = int(config.num_hidden_layers)
        eos = getattr(config, "eos_token_id", None)
        bias = bool(getattr(config, "attention_bias", False))
        return cls(
            architecture=family.architecture,
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family.qk_norm,
            fused_projections=family.fused_projections,
            activation=getattr(config, activation_field),
            attn_scale=float(scalar) ** -0.5 if scalar is not None else head_dim ** -0.5,
            attn_logit_softcapping=_positive_or_none(config, "attn_logit_softcapping"),
            final_logit_softcapping=_positive_or_none(config, "final_logit_softcapping"),
            embed_scale=float(config.hidden_size) ** 0.5 if family.gemma else None,
            gemma_norms=family.gemma,
            layer_windows=_layer_windows(config, model_type, num_layers),
            layer_rope=_layer_rope(config, num_layers),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ()),
            hf_config=config,
            checkpoint_quantization=quantization,
        )

    @property
    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """LoRA module name -> ``(in_features, out_features)``, the same in every layer.

        Split families: q_proj ``H -> Hq*D``, k_proj/v_proj ``H -> Hkv*D``, o_proj ``Hq*D -> H``,
        gate_proj/up_proj ``H -> I``, down_proj ``I -> H``. Fused (Phi-3): qkv_proj
        ``H -> (Hq + 2 Hkv) * D``, gate_up_proj ``H -> 2 I``.
        """
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        if self.fused_projections:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def lora_linear_groups(self) -> tuple[tuple[str, ...], ...]:
        """The LoRA modules of each linear the engine computes fused, in layer order: split families
        ``(q_proj, k_proj, v_proj), (o_proj,), (gate_proj, up_proj), (down_proj,)``; fused (Phi-3)
        ``(qkv_proj,), (o_proj,), (gate_up_proj,), (down_proj,)``."""
        if self.fused_projections:
            return ("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)
        return ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)

    @property
    def adapter_spec(self) -> BaseModelSpec:
        """What an adapter must fit (layer count and LoRA-able module shapes)."""
        return BaseModelSpec(num_layers=self.num_layers, hidden_size=self.hidden_size,
                             module_shapes=self.module_shapes, architecture=self.architecture,
                             vocab_size=self.vocab_size)

    def served_adapter_spec(self, target_modules: tuple[str, ...] | None, *, vocab: bool = True) -> BaseModelSpec:
        """:attr:`adapter_spec` as a server with LoRA on ``target_modules`` (None: every module) checks adapters
        (:meth:`BaseModelSpec.serving_only` over :attr:`lora_linear_groups`); ``vocab=False``: no LoRA on
        ``embed_tokens`` / ``lm_head`` at all (``vocab_size`` None; tensor parallelism).

        Raises ``ValueError`` naming a module of ``target_modules`` this model has no LoRA for."""
        spec = self.adapter_spec
        if not vocab:
            named = [m for m in ("embed_tokens", "lm_head") if m in (target_modules or ())]
            if named:
                raise ValueError(f"names {', '.join(named)}: adapters on embed_tokens / lm_head are not implemented "
                                 "with tensor_parallel_size > 1")
            spec = dataclasses.replace(spec, vocab_size=None)
        return spec if target_modules is None else spec.serving_only(target_modules, self.lora_linear_groups)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def _require(config: Any, name: str, allowed: tuple[Any, ...]) -> None:
    value = getattr(config, name, allowed[0])
    if value not in allowed:
        raise UnsupportedModelError(
            f"config.{name}={value!r} ({type(config).__name__}): not implemented; loraplex supports "
            f"{' or '.join(repr(a) for a in allowed)}")


def _positive_or_none(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModelError(f"config.{name}={value!r}: expected None or a number > 0")
    return float(value)


def _check_extra_attributes(config: Any, family: Family) -> CheckpointQuantization | None:
    """Refuse attributes that are no field of the config class (HF keeps unknown config.json keys);
    return the checkpoint's FP8 quantization, if it has a ``quantization_config`` the engine serves."""
    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    skip = fields | _BOOKKEEPING_ATTRS | family.ignored_extras
    extras = {k: v for k, v in config.to_dict().items() if k not in skip}
    quantization = None
    if "quantization_config" in extras:
        quantization = _checkpoint_quantization(extras.pop("quantization_config"))
    for name, value in extras.items():
        if value not in (None, False):
            raise UnsupportedModelError(
                f"config.{name}={value!r}: not a field of {type(config).__name__}; loraplex does not implement it")
    return quantization


_SERVED_QUANTIZATION = ("fbgemm_fp8 (per-channel FP8 weights) or compressed-tensors float-quantized FP8 weights "
                        "per channel or per tensor")


def _refuse_quantization(field_name: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"config.quantization_config{field_name}={value!r}: {why}; loraplex serves "
                                 f"{_SERVED_QUANTIZATION}")


def _checkpoint_quantization(qc: Any) -> CheckpointQuantization:
    """Parse an FP8 ``quantization_config`` (fbgemm_fp8; compressed-tensors float-quantized with one
    config group of 8-bit float weights, per channel or per tensor, static; activations absent or
    dynamic). Anything else raises :class:`UnsupportedModelError` naming the field."""
    if not isinstance(qc, dict):
        raise _refuse_quantization("", qc, "not a mapping")
    method = qc.get("quant_method")
    if method == "fbgemm_fp8":
        skipped = _unquantized(qc.get("modules_to_not_convert"), "['modules_to_not_convert']")
        return CheckpointQuantization("fbgemm_fp8", "channel", True, skipped)
    if method != "compressed-tensors":
        raise _refuse_quantization("['quant_method']", method, "this quantization method is not implemented")
    if qc.get("format") != "float-quantized":
        raise _refuse_quantization("['format']", qc.get("format"), "only float-quantized (FP8) weights are implemented")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse_quantization("['kv_cache_scheme']", qc["kv_cache_scheme"], "a quantized KV cache is not "
                                   "implemented")
    if qc.get("transform_config") is not None:  # rotated weights: the runtime would have to rotate activations
        raise _refuse_quantization("['transform_config']", qc["transform_config"], "online weight/activation "
                                   "transforms are not implemented")
    sparsity = qc.get("sparsity_config")
    if sparsity is not None and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        raise _refuse_quantization("['sparsity_config']", sparsity, "only dense-stored weights are implemented")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse_quantization("['config_groups']", sorted(groups), "exactly one config group is implemented")
    [(group_name, group)] = groups.items()
    where = f"['config_groups'][{group_name!r}]"
    if list(group.get("targets") or []) != ["Linear"]:
        raise _refuse_quantization(f"{where}['targets']", group.get("targets"), "only targets ['Linear'] is "
                                   "implemented")
    weights = group.get("weights") or {}
    expected = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    for key, value in expected.items():
        if weights.get(key, value) != value:
            raise _refuse_quantization(f"{where}['weights'][{key!r}]", weights.get(key), f"expected {value!r}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise _refuse_quantization(f"{where}['weights']['strategy']", strategy, "only per-channel or per-tensor "
                                   "weight scales are implemented")
    activations = group.get("input_activations")
    if activations is not None and not activations.get("dynamic", False):
        raise _refuse_quantization(f"{where}['input_activations']['dynamic']", activations.get("dynamic"),
                                   "static activation scales are not implemented")
    if group.get("output_activations") is not None:
        raise _refuse_quantization(f"{where}['output_activations']", group["output_activations"],
                                   "quantized outputs are not implemented")
    return CheckpointQuantization("compressed-tensors", strategy, activations is not None,
                                  _unquantized(qc.get("ignore"), "['ignore']"))


# Modules an FP8 checkpoint may leave unquantized: the engine never quantizes these anyway.
_NEVER_QUANTIZED = ("lm_head", "re:.*lm_head", "model.embed_tokens", "embed_tokens", "re:.*embed_tokens")


def _unquantized(names: Any, where: str) -> tuple[str, ...]:
    names = tuple(names or ())
    for name in names:
        if name not in _NEVER_QUANTIZED:
            raise _refuse_quantization(where, list(names), f"{name!r} left unquantized is not implemented (only "
                                       "lm_head and the embeddings may be)")
    return names


def _rope_sets(config: Any) -> dict[str | None, dict]:
    """``{None: rope_parameters}``, or ``{layer_type: parameters}`` for per-layer-type RoPE (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return dict(rope)
    return {None: rope}


def _layer_rope(config: Any, num_layers: int) -> tuple[str | None, ...]:
    sets = _rope_sets(config)
    if None in sets:
        return (None,) * num_layers
    types = list(getattr(config, "layer_types", None) or [])
    for i, t in enumerate(types):
        if t not in sets:
            raise UnsupportedModelError(f"config.layer_types[{i}]={t!r}: no rope_parameters[{t!r}]")
    return tuple(types)


def _check_rope(config: Any) -> None:
    for key, rope in _rope_sets(config).items():
        _check_rope_set(rope, "" if key is None else f"[{key!r}]")


def _check_rope_set(rope: dict, where: str) -> None:
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.rope_parameters{where}['rope_type']={rope_type!r}: not implemented; supported are "
            f"{', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(
            f"config.rope_parameters{where}['partial_rotary_factor']={partial!r}: partial rotary embeddings are not "
            "implemented")


def _layer_windows(config: Any, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window: every layer for Mistral / Phi-3 (``sliding_window``); the layers HF
    marks ``"sliding_attention"`` in ``layer_types`` for Qwen2/3 (HF's own rule: ``use_sliding_window``
    and ``max_window_layers``) and Gemma 2/3 (alternating / every ``sliding_window_pattern``-th global). Raises for a window that is not a positive int or an unknown layer type."""
    window = getattr(config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
        for i, t in enumerate(types):
            if t not in ("full_attention", "sliding_attention"):
                raise UnsupportedModelError(f"config.layer_types[{i}]={t!r}: not implemented")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        windows = (window,) * num_layers
    for w in windows:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise UnsupportedModelError(f"config.sliding_window={w!r}: expected a positive number of tokens")
    return windows
