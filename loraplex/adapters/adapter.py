"""Plain dataclasses for a loaded LoRA adapter and the summary the platform stores.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
adds to a frozen linear layer ``y = x @ W.T`` the low-rank term

Semantics: ``y += scaling * (x @ A.T) @ B.T`` with ``A [r, in]`` (shrink) and ``B [out, r]`` (expand).

DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"; PEFT ``use_dora``) also
rescales each output channel by its magnitude over the column norm of the adapted weight:

Semantics (DoRA): ``y = g * (x @ W.T + scaling * (x @ A.T) @ B.T) + bias`` with
``g = m / ||W + scaling * B @ A||_row`` (``m [out]``, the L2 norm of each output row, held constant).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRAWeight:
    """The LoRA factors of one module in one layer.

    - ``a``: ``[r, in_features] fp32`` (lora_A, shrink).
    - ``b``: ``[out_features, r] fp32`` (lora_B, expand).
    - ``scaling``: ``alpha / r`` (or ``alpha / sqrt(r)`` with rsLoRA) for this module.
    - ``magnitude``: DoRA's ``[out_features] fp32`` magnitude vector ``m``; None for plain LoRA.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    magnitude: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """The rank r of this module (rows of ``a``)."""
        return int(self.a.shape[0])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """Reference LoRA output for ``x [T, in_features]`` -> ``[T, out_features]`` fp32.

        Semantics: ``delta = scaling * (x @ A.T) @ B.T``.
        """
        return (x.float() @ self.a.T @ self.b.T) * self.scaling


@dataclass(frozen=True)
class VocabWeights:
    """What an adapter changes on the vocabulary-sized modules (V = vocab_size, H = hidden_size).

    - ``embed``: LoRA on ``embed_tokens`` (PEFT ``lora.Embedding``): ``a = lora_embedding_A [r, V]``,
      ``b = lora_embedding_B [H, r]`` fp32. Semantics: ``e[t] += scaling * A.T[ids[t]] @ B.T``.
    - ``head``: LoRA on ``lm_head`` (a linear LoRA): ``a [r, H]``, ``b [V, r]`` fp32.
      Semantics: ``logits[t] += scaling * (h[t] @ A.T) @ B.T``.
    - ``full``: ``modules_to_save`` copies, module name -> ``[V, H] fp32``: the adapter's rows use it
      instead of the base's ``embed_tokens`` / ``lm_head`` (and not its LoRA, which PEFT never combines).

    With tied embeddings each part changes only its own module, as PEFT does.
    """

    embed: LoRAWeight | None = None
    head: LoRAWeight | None = None
    full: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def modules(self) -> tuple[str, ...]:
        """``"embed_tokens"`` / ``"lm_head"`` with a LoRA part, in that order."""
        return tuple(m for m, part in (("embed_tokens", self.embed), ("lm_head", self.head)) if part is not None)


@dataclass(frozen=True)
class LoRAAdapter:
    """A validated PEFT LoRA adapter held in host memory.

    - ``version_id``: sha256 hex of the canonical config and the tensors
      (see ``loraplex.adapters.identity``); equal content gives an equal id.
    - ``rank``: the largest rank over all modules (``rank_pattern`` may lower some).
    - ``alpha``: ``lora_alpha`` of the config (``alpha_pattern`` may override per module;
      the per-module value is folded into ``LoRAWeight.scaling``).
    - ``use_rslora``: scaling is ``alpha / sqrt(r)`` instead of ``alpha / r``.
    - ``target_modules``: module names present, in ``LORA_MODULE_NAMES`` order.
    - ``weights``: ``(layer_index, module_name) -> LoRAWeight``.
    - ``size_bytes``: bytes of the tensors as stored in ``adapter_model.safetensors``.
    - ``warnings``: human-readable warnings (e.g. all-zero lora_B matrices).
    - ``path``: the folder it was read from (not part of its identity).
    - ``vocab``: LoRA or full copies on ``embed_tokens`` / ``lm_head``, or None (see ``VocabWeights``).
    - ``use_dora``: a DoRA adapter (every ``LoRAWeight`` has a ``magnitude``).
    """

    version_id: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], LoRAWeight]
    size_bytes: int
    warnings: tuple[str, ...] = ()
    path: str = ""
    vocab: VocabWeights | None = None
    use_dora: bool = False

    @property
    def layers(self) -> tuple[int, ...]:
        """Sorted indices of the layers that have at least one LoRA module."""
        return tuple(sorted({layer for layer, _ in self.weights}))

    def info(self) -> AdapterInfo:
        """The tensor-free summary of this adapter."""
        return AdapterInfo(
            version_id=self.version_id,
            rank=self.rank,
            alpha=self.alpha,
            use_rslora=self.use_rslora,
            target_modules=self.target_modules,
            num_layers_targeted=len(self.layers),
            size_bytes=self.size_bytes,
            warnings=self.warnings,
            modules_to_save=tuple(self.vocab.full) if self.vocab is not None else (),
            use_dora=self.use_dora,
        )


@dataclass(frozen=True)
class AdapterInfo:
    """What the platform records about an uploaded adapter (no tensors).

    Fields as in ``LoRAAdapter``; ``num_layers_targeted`` counts layers with at least one LoRA module;
    ``target_modules`` lists ``embed_tokens`` / ``lm_head`` after the projections when they carry LoRA;
    ``modules_to_save``: the modules the adapter replaces by a full copy.
    ``adapter_type``: ``"dora"`` or ``"lora"``.
    """

    version_id: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    num_layers_targeted: int
    size_bytes: int
    warnings: tuple[str, ...] = field(default_factory=tuple)
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False

    @property
    def adapter_type(self) -> str:
        """``"dora"`` for a DoRA adapter, else ``"lora"``."""
        return "dora" if self.use_dora else "lora"
