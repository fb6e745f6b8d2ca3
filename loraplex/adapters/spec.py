"""What an adapter must fit: the base model's layer count and LoRA-able module shapes."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    - ``unserved_modules``: modules of the model (LoRA-able projections, ``embed_tokens``, ``lm_head``) that the
      server does not put LoRA on (the engine's ``lora_target_modules``; :meth:`serving_only`): left out of
      ``module_shapes`` (and ``vocab_size`` None when both vocabulary modules are), and an adapter on one of
      them is refused with the setting named rather than as a module the model lacks.

    Raises ``ValueError`` naming the field for non-positive sizes or unknown module names.
    """

    num_layers: int
    hidden_size: int
    module_shapes: dict[str, tuple[int, int]]
    architecture: str
    vocab_size: int | None = None
    unserved_modules: tuple[str, ...] = ()

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

    def serving_only(self, modules: tuple[str, ...], groups: tuple[tuple[str, ...], ...]) -> BaseModelSpec:
        """This spec with LoRA served on ``modules`` only: each group of ``groups`` (the modules one linear
        computes fused, e.g. ``("q_proj", "k_proj", "v_proj")``) that holds one of them is served whole; the
        other groups, and ``embed_tokens`` / ``lm_head`` unless named, go to ``unserved_modules``.

        Raises ``ValueError`` naming a module that is neither in ``module_shapes`` nor a vocabulary module of a
        spec with ``vocab_size``, or a module of ``module_shapes`` outside every group."""
        vocab = ("embed_tokens", "lm_head") if self.vocab_size is not None else ()
        known = tuple(self.module_shapes) + vocab
        for module in modules:
            if module not in known:
                raise ValueError(f"{module!r} is not a module this model serves LoRA on; its modules are "
                                 f"{', '.join(known)}")
        grouped = [m for group in groups for m in group]
        if sorted(grouped) != sorted(self.module_shapes):
            raise ValueError(f"groups {groups} do not partition the model's modules {list(self.module_shapes)}")
        served = {m for group in groups if set(group) & set(modules) for m in group}
        shapes = {m: shape for m, shape in self.module_shapes.items() if m in served}
        if not shapes:  # the pool's per-layer tensors need a module; vocabulary-only serving is not implemented
            raise ValueError(f"names no decoder-layer module (one of {', '.join(self.module_shapes)}) besides "
                             "embed_tokens / lm_head")
        served_vocab = tuple(m for m in vocab if m in modules)
        unserved = tuple(m for m in known if m not in served and m not in served_vocab)
        return replace(self, module_shapes=shapes, vocab_size=self.vocab_size if served_vocab else None,
                       unserved_modules=self.unserved_modules + unserved)

    def unserved_reason(self, module: str) -> str | None:
        """Why an adapter on ``module`` is refused by this server when it is one of ``unserved_modules``,
        else None."""
        if module not in self.unserved_modules:
            return None
        served = [m for m in self.module_shapes] + (
            [m for m in ("embed_tokens", "lm_head") if m not in self.unserved_modules] if self.vocab_size else [])
        what = (f"adapters on {module} (LoRA or a modules_to_save copy) are" if module in ("embed_tokens", "lm_head")
                else f"LoRA on {module} is")
        return (f"{what} not served by this server: its lora_target_modules setting serves "
                f"{', '.join(served)} only (a server started with {module} in lora_target_modules serves it)")

    def in_features(self, module: str) -> int:
        """Input width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][0]

    def out_features(self, module: str) -> int:
        """Output width of ``module`` (raises ``KeyError`` if the model has no such module)."""
        return self.module_shapes[module][1]
