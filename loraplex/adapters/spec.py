"""What an adapter must fit: the base model's layer count and LoRA-able module shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the annotation; the adapters package never imports transformers
    from transformers import PretrainedConfig

# The projections of Llama-style checkpoints, and the fused ones of Phi-3 checkpoints (whose adapters
# target the fused modules).
SPLIT_MODULE_NAMES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULE_NAMES: tuple[str, ...] = ("qkv_proj", "gate_up_proj")
# The projections loraplex can put LoRA on, in the order slot tensors are built.
LORA_MODULE_NAMES: tuple[str, ...] = SPLIT_MODULE_NAMES + FUSED_MODULE_NAMES

# Parent block of each projection in HF Llama-style models: model.layers.{i}.{parent}.{module}.
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "qkv_proj": "self_attn",
    "gate_up_proj": "mlp",
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
    - ``vocab_size``: rows of ``embed_tokens`` / ``lm_head`` (both ``[vocab_size, hidden_size]``);
      None: adapters on those modules (LoRA or ``modules_to_save``) are refused.

    Raises ``ValueError`` naming the field for non-positive sizes or unknown module names.
    """

    num_layers: int
    hidden_size: int
    module_shapes: dict[str, tuple[int, int]]
    architecture: str
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"BaseModelSpec.num_layers={self.num_layers!r}: must be >= 1")
        if self.hidden_size < 1:
            raise ValueError(f"BaseModelSpec.hidden_size={self.hidden_size!r}: must be >= 1")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"BaseModelSpec.vocab_size={self.vocab_size!r}: must be >= 1")
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
        """The adapter view of :class:`~loraplex.adapters.model_spec.ModelSpec` read from ``config``.

        Raises ``UnsupportedModelError`` (a ``ValueError``) naming the field the engine does not implement.
        """
        from loraplex.adapters.model_spec import ModelSpec  # model_spec builds on this module

        return ModelSpec.from_hf_config(config).adapter_spec

    def in_features(self, module: str) -> int:
        """Input width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][0]

    def out_features(self, module: str) -> int:
        """Output width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][1]
