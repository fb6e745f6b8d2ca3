"""``adapter_config.json`` of a PEFT LoRA adapter: parse, refuse what loraplex does not serve,
and resolve per-module rank / alpha / scaling exactly as PEFT does.

Module keys are the module names of the base model as PEFT sees them, e.g.
``model.layers.3.self_attn.q_proj`` (the tensor name without ``base_model.model.``
and without ``.lora_A.weight``).

PEFT rules mirrored here (peft 0.13-0.21, ``tuners_utils.check_target_module_exists``,
``utils.other.get_pattern_key``, ``lora.layer.LoraLayer.update_layer``):

- ``target_modules`` as a list: a key is targeted if it equals an entry or ends with
  ``"." + entry``; ``layers_to_transform`` then restricts the layer index.
  As a string: ``re.fullmatch(target_modules, key)`` (``layers_to_transform`` is ignored,
  as in PEFT). ``"all-linear"`` targets every linear layer but ``lm_head``.
- ``exclude_modules``: string = ``re.fullmatch``; list = equal or ``"." + entry`` suffix.
- ``rank_pattern`` / ``alpha_pattern``: the first key ``p`` (in file order) with
  ``re.match(rf"(.*\\.)?({p})$", key)`` overrides ``r`` / ``lora_alpha`` for that module.
- ``scaling = alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``
  (Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.errors import AdapterFormatError, AdapterUnsupportedError

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")

# LoraConfig fields that select a LoRA variant whose forward pass (or saved tensors)
# differ from plain LoRA (PEFT marks them ``is_lora_variant``, plus QALoRA).
_VARIANT_FIELDS: dict[str, str] = {
    "use_dora": "DoRA",
    "alora_invocation_tokens": "Activated LoRA (aLoRA)",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA (BD-LoRA)",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "velora_config": "VeLoRA",
    "use_qalora": "QALoRA",
}

# Other LoraConfig fields that must be falsy, with the reason shown to the uploader.
_MUST_BE_OFF: dict[str, str] = {
    "modules_to_save": "full copies of base-model modules are not served, only LoRA A/B weights",
    "lora_bias": "a bias on lora_B is not served",
    "fan_in_fan_out": "transposed (Conv1D-style) LoRA weights are not served",
    "layer_replication": "layer replication is not served",
    "trainable_token_indices": "trainable token embeddings are not served",
    "target_parameters": "LoRA on raw parameters (MoE experts) is not served",
}

# init_lora_weights values that rewrite the base model's weights at initialisation: the saved
# adapter only works on that modified base unless PEFT converted it back to plain LoRA.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "mica")


@dataclass(frozen=True)
class ModuleHyperparams:
    """Rank, alpha and scaling of one module after ``rank_pattern`` / ``alpha_pattern``.

    ``rank_field`` names where the rank came from (``"r"`` or ``"rank_pattern['v_proj']"``),
    for error messages.
    """

    rank: int
    alpha: float
    scaling: float
    rank_field: str


@dataclass(frozen=True)
class PeftLoraConfig:
    """The fields of ``adapter_config.json`` that decide how the tensors are served.

    ``raw`` is the whole parsed JSON object (hashed into ``version_id``).
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: tuple[int, ...] | None
    exclude_modules: tuple[str, ...] | str | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PeftLoraConfig:
        """Validate a parsed ``adapter_config.json``.

        Raises ``AdapterUnsupportedError`` for PEFT features loraplex does not serve and
        ``AdapterFormatError`` for missing or ill-typed fields, each naming field and value.
        """
        _refuse_unsupported(raw)
        return cls(
            r=_positive_int(raw, "r"),
            lora_alpha=_positive_number(raw, "lora_alpha"),
            use_rslora=_bool(raw, "use_rslora"),
            target_modules=_target_modules(raw),
            rank_pattern={k: _pattern_int(k, v) for k, v in _pattern_dict(raw, "rank_pattern").items()},
            alpha_pattern={k: _pattern_number(k, v) for k, v in _pattern_dict(raw, "alpha_pattern").items()},
            layers_to_transform=_layers_to_transform(raw),
            exclude_modules=_exclude_modules(raw),
            raw=raw,
        )

    def targets(self, module_key: str, layer: int) -> bool:
        """Whether PEFT would put this adapter on ``module_key`` (in layer ``layer``)."""
        if self._excluded(module_key):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules == ALL_LINEAR:
                return True
            return re.fullmatch(self.target_modules, module_key) is not None
        found = _matches_list(self.target_modules, module_key)
        if found and self.layers_to_transform is not None:
            return layer in self.layers_to_transform
        return found

    def hyperparams(self, module_key: str) -> ModuleHyperparams:
        """Rank, alpha and scaling PEFT uses for ``module_key``."""
        rank_key = _pattern_key(self.rank_pattern, module_key)
        alpha_key = _pattern_key(self.alpha_pattern, module_key)
        rank = self.r if rank_key is None else self.rank_pattern[rank_key]
        alpha = self.lora_alpha if alpha_key is None else self.alpha_pattern[alpha_key]
        scaling = alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
        rank_field = "r" if rank_key is None else f"rank_pattern[{rank_key!r}]"
        return ModuleHyperparams(rank=rank, alpha=alpha, scaling=scaling, rank_field=rank_field)

    def describe_targets(self) -> str:
        """``target_modules=...`` (and ``layers_to_transform=...``) as written in the file."""
        text = f"target_modules={self.raw.get('target_modules')!r}"
        if self.layers_to_transform is not None:
            text += f", layers_to_transform={list(self.layers_to_transform)!r}"
        if self.exclude_modules:
            text += f", exclude_modules={self.raw.get('exclude_modules')!r}"
        return text

    def _excluded(self, module_key: str) -> bool:
        if self.exclude_modules is None:
            return False
        if isinstance(self.exclude_modules, str):
            return re.fullmatch(self.exclude_modules, module_key) is not None
        return _matches_list(self.exclude_modules, module_key)


def read_adapter_config(folder: Path) -> PeftLoraConfig:
    """Read and validate ``folder / adapter_config.json``.

    Raises ``AdapterFormatError`` if it is missing or not a JSON object, and whatever
    ``PeftLoraConfig.from_dict`` raises.
    """
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterFormatError(f"{CONFIG_NAME}: missing in adapter folder '{folder}'")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"{CONFIG_NAME}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{CONFIG_NAME}: must be a JSON object, got {type(raw).__name__}")
    return PeftLoraConfig.from_dict(raw)


def is_unsupported_target(module_key: str) -> bool:
    """Whether ``module_key`` is an embedding / output head (LoRA there is refused)."""
    return module_key.rsplit(".", 1)[-1] in _UNSUPPORTED_TARGETS


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterUnsupportedError(f"{CONFIG_NAME}: peft_type={peft_type!r} is not supported; only 'LORA'")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterUnsupportedError(f"{CONFIG_NAME}: bias={bias!r} is not supported; only 'none'")
    for name, variant in _VARIANT_FIELDS.items():
        if raw.get(name):
            raise AdapterUnsupportedError(
                f"{CONFIG_NAME}: {name}={raw[name]!r} is not supported ({variant}); only plain LoRA is served"
            )
    for name, reason in _MUST_BE_OFF.items():
        if raw.get(name):
            raise AdapterUnsupportedError(f"{CONFIG_NAME}: {name}={raw[name]!r} is not supported: {reason}")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise AdapterUnsupportedError(
            f"{CONFIG_NAME}: init_lora_weights={init!r} is not supported: it modifies the base model's weights; "
            "convert it to plain LoRA first (PEFT save_pretrained(path_initial_model_for_weight_conversion=...))"
        )


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={value!r} must be an integer >= 1")
    return value


def _positive_number(raw: dict[str, Any], name: str) -> float:
    value = raw.get(name)
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={value!r} must be a finite number > 0")
    return float(value)


def _bool(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={value!r} must be true or false")
    return value


def _target_modules(raw: dict[str, Any]) -> tuple[str, ...] | str:
    value = raw.get("target_modules")
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: target_modules is missing")
    if value == ALL_LINEAR:
        return value
    if isinstance(value, str):
        _compile(value, f"target_modules={value!r}")
        for name in ("lm_head", "embed_tokens", "model.embed_tokens"):
            if re.fullmatch(value, name):
                raise AdapterUnsupportedError(
                    f"{CONFIG_NAME}: target_modules={value!r} matches {name!r}: "
                    "LoRA on embed_tokens/lm_head is not supported"
                )
        return value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise AdapterFormatError(
            f"{CONFIG_NAME}: target_modules={value!r} must be a regex string or a non-empty list of module names"
        )
    for name in value:
        if is_unsupported_target(name):
            raise AdapterUnsupportedError(
                f"{CONFIG_NAME}: target_modules contains {name!r}: LoRA on embed_tokens/lm_head is not supported"
            )
    return tuple(value)


def _pattern_dict(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={value!r} must be an object of pattern -> value")
    for key in value:
        _compile(rf"(.*\.)?({key})$", f"{name} key {key!r}")
    return value


def _pattern_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{CONFIG_NAME}: rank_pattern[{key!r}]={value!r} must be an integer >= 1")
    return value


def _pattern_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AdapterFormatError(f"{CONFIG_NAME}: alpha_pattern[{key!r}]={value!r} must be a finite number > 0")
    return float(value)


def _layers_to_transform(raw: dict[str, Any]) -> tuple[int, ...] | None:
    value = raw.get("layers_to_transform")
    if value is None or value == []:
        return None
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise AdapterFormatError(
            f"{CONFIG_NAME}: layers_to_transform={value!r} must be an integer >= 0 or a list of them"
        )
    return tuple(items)


def _exclude_modules(raw: dict[str, Any]) -> tuple[str, ...] | str | None:
    value = raw.get("exclude_modules")
    if not value:
        return None
    if isinstance(value, str):
        _compile(value, f"exclude_modules={value!r}")
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterFormatError(f"{CONFIG_NAME}: exclude_modules={value!r} must be a regex string or a list")
    return tuple(value)


def _compile(pattern: str, field_text: str) -> None:
    """Raise ``AdapterFormatError`` naming ``field_text`` if ``pattern`` is not a valid regex."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterFormatError(f"{CONFIG_NAME}: {field_text} is not a valid regular expression ({exc})") from exc


def _matches_list(names: tuple[str, ...], module_key: str) -> bool:
    return module_key in names or any(module_key.endswith("." + name) for name in names)


def _pattern_key(patterns: dict[str, Any], module_key: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None
