"""What an adapter must fit: the base model's layer count and LoRA-able module shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for the annotation; the adapters package never imports transformers
    from transformers import PretrainedConfig

# The projections loraplex can put LoRA on, in the order slot tensors are built.
LORA_MODULE_NAMES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# Parent block of each projection in HF Llama-style models: model.layers.{i}.{parent}.{module}.
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

# HF ``model_type`` values whose decoder layers have exactly the shapes computed below.
_SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True)
class BaseModelSpec:
    """Shapes of the base model that an adapter is checked against.

    - ``num_layers``: decoder layers; LoRA layer indices must be in ``[0, num_layers)``.
    - ``hidden_size``: model width (for error messages and the platform).
    - ``module_shapes``: module name (a subset of ``LORA_MODULE_NAMES``) ->
      ``(in_features, out_features)`` of that linear layer, the same in every layer.
      An adapter targeting a module not listed here is refused.
    - ``architecture``: e.g. ``"LlamaForCausalLM"`` (informational).

    Raises ``ValueError`` naming the field for non-positive sizes or unknown module names.
    """

    num_layers: int
    hidden_size: int
    module_shapes: dict[str, tuple[int, int]]
    architecture: str

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"BaseModelSpec.num_layers={self.num_layers!r}: must be >= 1")
        if self.hidden_size < 1:
            raise ValueError(f"BaseModelSpec.hidden_size={self.hidden_size!r}: must be >= 1")
        if not self.module_shapes:
            raise ValueError("BaseModelSpec.module_shapes: must name at least one module")
        for name, shape in self.module_shapes.items():
            if name not in LORA_MODULE_NAMES:
                raise ValueError(
                    f"BaseModelSpec.module_shapes: unknown module {name!r}; expected one of {list(LORA_MODULE_NAMES)}"
                )
            if len(shape) != 2 or min(shape) < 1:
                raise ValueError(
                    f"BaseModelSpec.module_shapes[{name!r}]={shape!r}: must be (in_features, out_features) >= 1"
                )

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> BaseModelSpec:
        """Compute the module shapes of a Llama / Mistral / Qwen2 ``config``.

        With D = ``config.head_dim`` (else hidden_size // num_attention_heads),
        Hq = num_attention_heads, Hkv = num_key_value_heads (else Hq),
        I = intermediate_size: q_proj hidden -> Hq*D, k_proj/v_proj hidden -> Hkv*D,
        o_proj Hq*D -> hidden, gate_proj/up_proj hidden -> I, down_proj I -> hidden.

        Raises ``ValueError`` naming ``config.model_type`` for other architectures.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.model_type={model_type!r}: unsupported; expected one of {sorted(_SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(config.hidden_size)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(_attr_or(config, "num_key_value_heads", num_heads))
        head_dim = int(_attr_or(config, "head_dim", hidden // num_heads))
        intermediate = int(config.intermediate_size)
        architectures = getattr(config, "architectures", None) or [_SUPPORTED_MODEL_TYPES[model_type]]
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=hidden,
            module_shapes={
                "q_proj": (hidden, num_heads * head_dim),
                "k_proj": (hidden, num_kv_heads * head_dim),
                "v_proj": (hidden, num_kv_heads * head_dim),
                "o_proj": (num_heads * head_dim, hidden),
                "gate_proj": (hidden, intermediate),
                "up_proj": (hidden, intermediate),
                "down_proj": (intermediate, hidden),
            },
            architecture=str(architectures[0]),
        )

    def in_features(self, module: str) -> int:
        """Input width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][0]

    def out_features(self, module: str) -> int:
        """Output width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][1]


def _attr_or(config: Any, name: str, default: int) -> int:
    """``config.name`` unless it is missing or None (HF configs use None for 'derive it')."""
    value = getattr(config, name, None)
    return default if value is None else value
