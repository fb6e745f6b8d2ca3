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
- ``use_dora``: DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"); each
  targeted module also stores a ``lora_magnitude_vector`` (PEFT ``lora.dora.DoraLinearLayer``).

Bounded work: the file is at most ``MAX_CONFIG_BYTES`` and ``MAX_CONFIG_DEPTH`` levels deep;
user regexes (``target_modules``, ``exclude_modules``, ``rank_pattern``, ``alpha_pattern``)
are checked for syntax with ``re`` (as PEFT does) and matched with the ``regex`` package
(its ``re``-compatible V0 syntax) under a timeout: at most ``REGEX_MATCH_TIMEOUT_S`` per
match and ``REGEX_BUDGET_S`` for all matches of one config, else ``AdapterFormatError``.
Callers match them only against module keys already decided structurally (a layer index
below ``num_layers``, a module of the model), so their inputs are short.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from loraplex.adapters.errors import AdapterFormatError, AdapterUnsupportedError

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1 KB
MAX_CONFIG_DEPTH = 32  # nesting of JSON objects / arrays; PEFT writes 3
MAX_PATTERN_CHARS = 1024
REGEX_MATCH_TIMEOUT_S = 0.05
REGEX_BUDGET_S = 0.5
# The vocabulary-sized modules an adapter may change (LoRA, or a full copy in ``modules_to_save``),
# with their module keys as PEFT sees them in a ``*ForCausalLM`` (``model.embed_tokens``, ``lm_head``).
VOCAB_MODULES: dict[str, str] = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}

# LoraConfig fields that select a LoRA variant whose forward pass (or saved tensors)
# differ from plain LoRA (PEFT marks them ``is_lora_variant``, plus QALoRA).
# DoRA (``use_dora``) is served: ``PeftLoraConfig.use_dora``.
_VARIANT_FIELDS: dict[str, str] = {
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

    ``raw`` is the whole parsed JSON object (hashed into ``version_id``). ``use_dora``: a DoRA
    adapter (every targeted module has a ``lora_magnitude_vector``).
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
    patterns: PatternMatcher = field(default_factory=lambda: PatternMatcher(), compare=False, repr=False)
    modules_to_save: tuple[str, ...] = ()
    """Modules of ``VOCAB_MODULES`` the adapter replaces by a full copy (PEFT ``modules_to_save``)."""
    use_dora: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PeftLoraConfig:
        """Validate a parsed ``adapter_config.json``.

        Raises ``AdapterUnsupportedError`` for PEFT features loraplex does not serve and
        ``AdapterFormatError`` for missing or ill-typed fields, each naming field and value.
        """
        _refuse_unsupported(raw)
        patterns = PatternMatcher()
        return cls(
            r=_positive_int(raw, "r"),
            lora_alpha=_positive_number(raw, "lora_alpha"),
            use_rslora=_bool(raw, "use_rslora"),
            target_modules=_target_modules(raw, patterns),
            rank_pattern={k: _pattern_int(k, v) for k, v in _pattern_dict(raw, "rank_pattern", patterns).items()},
            alpha_pattern={k: _pattern_number(k, v) for k, v in _pattern_dict(raw, "alpha_pattern", patterns).items()},
            layers_to_transform=_layers_to_transform(raw),
            exclude_modules=_exclude_modules(raw, patterns),
            raw=raw,
            patterns=patterns,
            modules_to_save=_modules_to_save(raw),
            use_dora=_bool_or_null(raw, "use_dora"),
        )

    def targets(self, module_key: str, layer: int) -> bool:
        """Whether PEFT would put this adapter on ``module_key`` (in layer ``layer``)."""
        if self._excluded(module_key):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules == ALL_LINEAR:
                return True
            return self.patterns.fullmatch(self.target_modules, module_key, "target_modules")
        if module_key in self.target_modules:  # named whole: PEFT skips the layer filter
            return True
        found = _matches_list(self.target_modules, module_key)
        if found and self.layers_to_transform is not None:
            return layer in self.layers_to_transform
        return found

    def targets_vocab(self, module: str) -> bool:
        """Whether PEFT would put LoRA on the vocabulary module ``module`` (a key of ``VOCAB_MODULES``):
        ``target_modules`` names it (``"all-linear"`` never does: PEFT leaves the output head out), it is
        not excluded, and no ``layers_to_transform`` is set (PEFT then targets layer modules only)."""
        module_key = VOCAB_MODULES[module]
        if self._excluded(module_key):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules == ALL_LINEAR:
                return False
            return self.patterns.fullmatch(self.target_modules, module_key, "target_modules")
        if module_key in self.target_modules:  # named whole: PEFT skips the layer filter
            return True
        return self.layers_to_transform is None and _matches_list(self.target_modules, module_key)

    def hyperparams(self, module_key: str) -> ModuleHyperparams:
        """Rank, alpha and scaling PEFT uses for ``module_key``."""
        rank_key = self._pattern_key(self.rank_pattern, module_key, "rank_pattern")
        alpha_key = self._pattern_key(self.alpha_pattern, module_key, "alpha_pattern")
        rank = self.r if rank_key is None else self.rank_pattern[rank_key]
        alpha = self.lora_alpha if alpha_key is None else self.alpha_pattern[alpha_key]
        scaling = alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
        rank_field = "r" if rank_key is None else f"rank_pattern[{_short(rank_key)}]"
        return ModuleHyperparams(rank=rank, alpha=alpha, scaling=scaling, rank_field=rank_field)

    def describe_targets(self) -> str:
        """``target_modules=...`` (and ``layers_to_transform=...``) as written in the file."""
        text = f"target_modules={_short(self.raw.get('target_modules'))}"
        if self.layers_to_transform is not None:
            text += f", layers_to_transform={_short(list(self.layers_to_transform))}"
        if self.exclude_modules:
            text += f", exclude_modules={_short(self.raw.get('exclude_modules'))}"
        return text

    def _excluded(self, module_key: str) -> bool:
        if self.exclude_modules is None:
            return False
        if isinstance(self.exclude_modules, str):
            return self.patterns.fullmatch(self.exclude_modules, module_key, "exclude_modules")
        return _matches_list(self.exclude_modules, module_key)

    def _pattern_key(self, patterns: dict[str, Any], module_key: str, name: str) -> str | None:
        """The first key ``p`` of ``patterns`` with ``re.match(rf"(.*\\.)?({p})$", module_key)`` (PEFT's rule)."""
        for key in patterns:
            if self.patterns.match(_pattern_regex(key), module_key, f"{name} key {_short(key)}"):
                return key
        return None


_POSIX_CLASS = re.compile(r"\[:\^?[A-Za-z]+:\]")
_BRACES = re.compile(r"\{([^{}]*)\}")
_REPEAT = re.compile(r"\d*(,\d*)?")


def regex_only_syntax(pattern: str) -> str | None:
    """The first part of ``pattern`` that the ``regex`` package (V0) reads other than Python's ``re``, else None:
    a POSIX class (``[[:alpha:]]``: ``re`` reads a set and a literal ``]``) or braces that are no repeat count
    (``{e<=1}`` is fuzzy matching to ``regex``, literal text to ``re``; so it is after an escaped backslash).
    Conservative: such text in a set, and escaped braces, are refused too (module names hold neither)."""
    posix = _POSIX_CLASS.search(pattern)
    if posix is not None:
        return posix.group(0)
    for braces in _BRACES.finditer(pattern):
        if not _REPEAT.fullmatch(braces.group(1)):
            return braces.group(0)
    return None


class PatternMatcher:
    """The user regexes of one config, compiled once and matched under a time bound.

    Each match may take at most ``REGEX_MATCH_TIMEOUT_S`` and all matches together
    ``REGEX_BUDGET_S``; past either, ``AdapterFormatError`` names the field. Not thread-safe
    (one config is checked by one thread).
    """

    def __init__(self, budget_s: float = REGEX_BUDGET_S) -> None:
        self.remaining_s = budget_s
        self._compiled: dict[str, Any] = {}

    def compile(self, pattern: str, field_text: str) -> None:
        """Raise ``AdapterFormatError`` naming ``field_text`` unless ``pattern`` is a valid regex
        (for Python's ``re``, as PEFT, and for the ``regex`` package that matches it) that means the
        same to both (:func:`regex_only_syntax`)."""
        if len(pattern) > MAX_PATTERN_CHARS:
            raise AdapterFormatError(
                f"{CONFIG_NAME}: {field_text[:80]}... is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS}"
            )
        try:
            re.compile(pattern)
            self._compiled[pattern] = regex.compile(pattern, flags=regex.V0)
        except (re.error, regex.error, RecursionError, OverflowError) as exc:
            raise AdapterFormatError(
                f"{CONFIG_NAME}: {field_text} is not a valid regular expression ({exc})"
            ) from None
        construct = regex_only_syntax(pattern)
        if construct is not None:
            raise AdapterFormatError(
                f"{CONFIG_NAME}: {field_text} contains {construct!r}, which Python's re (PEFT) reads as literal "
                "text but loraplex's regex matcher does not; write it another way"
            )

    def fullmatch(self, pattern: str, text: str, field_text: str) -> bool:
        """``re.fullmatch(pattern, text) is not None``, time-bounded."""
        return self._run(pattern, text, field_text, full=True)

    def match(self, pattern: str, text: str, field_text: str) -> bool:
        """``re.match(pattern, text) is not None``, time-bounded."""
        return self._run(pattern, text, field_text, full=False)

    def _run(self, pattern: str, text: str, field_text: str, *, full: bool) -> bool:
        if pattern not in self._compiled:
            self.compile(pattern, field_text)
        compiled = self._compiled[pattern]
        timeout_s = min(REGEX_MATCH_TIMEOUT_S, self.remaining_s)
        started = time.perf_counter()
        try:
            if timeout_s <= 0:
                raise TimeoutError
            found = (compiled.fullmatch if full else compiled.match)(text, timeout=timeout_s) is not None
        except TimeoutError:
            raise AdapterFormatError(
                f"{CONFIG_NAME}: {field_text} takes too long to match module names (e.g. {text!r}): "
                f"more than {REGEX_MATCH_TIMEOUT_S:g} s per name or {REGEX_BUDGET_S:g} s in all; "
                "simplify the regular expression (nested quantifiers?)"
            ) from None
        finally:
            self.remaining_s -= time.perf_counter() - started
        return found


def read_adapter_config(folder: Path) -> PeftLoraConfig:
    """Read and validate ``folder / adapter_config.json``.

    Raises ``AdapterFormatError`` if it is missing or not a JSON object, and whatever
    ``PeftLoraConfig.from_dict`` raises.
    """
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterFormatError(f"{CONFIG_NAME}: missing in adapter folder '{folder}'")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{CONFIG_NAME}: {size} bytes; at most {MAX_CONFIG_BYTES} bytes are accepted")
    raw = parse_config_json(path.read_bytes())
    return PeftLoraConfig.from_dict(raw)


def parse_config_json(data: bytes) -> dict[str, Any]:
    """``adapter_config.json``'s bytes as a JSON object nested at most ``MAX_CONFIG_DEPTH`` levels.

    Raises ``AdapterFormatError`` for invalid UTF-8 / JSON (numbers over Python's digit limit
    included), deeper nesting, or a top level that is not an object.
    """
    depth = _max_depth(data)
    if depth > MAX_CONFIG_DEPTH:
        raise AdapterFormatError(
            f"{CONFIG_NAME}: nested {depth} levels deep; at most {MAX_CONFIG_DEPTH} are accepted"
        )
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise AdapterFormatError(f"{CONFIG_NAME}: not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{CONFIG_NAME}: must be a JSON object, got {type(raw).__name__}")
    return raw


def _max_depth(data: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside JSON strings (an upper bound for invalid JSON),
    counted without recursion before anything is parsed."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def vocab_module(module_key: str) -> str | None:
    """``"embed_tokens"`` / ``"lm_head"`` when ``module_key`` names that module (``model.embed_tokens``,
    ``embed_tokens``, ``lm_head``), else None."""
    for module, key in VOCAB_MODULES.items():
        if module_key in (module, key):
            return module
    return None


def _modules_to_save(raw: dict[str, Any]) -> tuple[str, ...]:
    """``modules_to_save`` as module names of ``VOCAB_MODULES`` (PEFT matches its entries as suffixes
    of module keys); any other module is refused."""
    value = raw.get("modules_to_save")
    if not value:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterFormatError(f"{CONFIG_NAME}: modules_to_save={_short(value)} must be a list of module names")
    modules = []
    for entry in value:
        module = vocab_module(entry)
        if module is None:
            raise AdapterUnsupportedError(
                f"{CONFIG_NAME}: modules_to_save={_short(value)} names {_short(entry)}: only full copies of "
                f"{' and '.join(VOCAB_MODULES)} are served"
            )
        if module not in modules:
            modules.append(module)
    return tuple(module for module in VOCAB_MODULES if module in modules)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterUnsupportedError(f"{CONFIG_NAME}: peft_type={_short(peft_type)} is not supported; only 'LORA'")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterUnsupportedError(f"{CONFIG_NAME}: bias={_short(bias)} is not supported; only 'none'")
    for name, variant in _VARIANT_FIELDS.items():
        if raw.get(name):
            raise AdapterUnsupportedError(
                f"{CONFIG_NAME}: {name}={_short(raw[name])} is not supported ({variant}); only plain LoRA is served"
            )
    for name, reason in _MUST_BE_OFF.items():
        if raw.get(name):
            raise AdapterUnsupportedError(f"{CONFIG_NAME}: {name}={_short(raw[name])} is not supported: {reason}")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise AdapterUnsupportedError(
            f"{CONFIG_NAME}: init_lora_weights={_short(init)} is not supported: it modifies the base model's weights; "
            "convert it to plain LoRA first (PEFT save_pretrained(path_initial_model_for_weight_conversion=...))"
        )


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={_short(value)} must be an integer >= 1")
    return value


def _positive_number(raw: dict[str, Any], name: str) -> float:
    value = raw.get(name)
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: {name} is missing")
    if not _is_finite_positive(value):
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={_short(value)} must be a finite number > 0")
    return float(value)


def _is_finite_positive(value: Any) -> bool:
    """A JSON number > 0 that is finite as a Python float (a 400-digit integer is not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:
        return False


def _bool(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={_short(value)} must be true or false")
    return value


def _bool_or_null(raw: dict[str, Any], name: str) -> bool:
    """A boolean field that PEFT may write as ``null`` (read as false)."""
    return False if raw.get(name) is None else _bool(raw, name)


def _target_modules(raw: dict[str, Any], patterns: PatternMatcher) -> tuple[str, ...] | str:
    value = raw.get("target_modules")
    if value is None:
        raise AdapterFormatError(f"{CONFIG_NAME}: target_modules is missing")
    if isinstance(value, str) and value.lower() == ALL_LINEAR:  # PEFT compares it lower-cased
        return ALL_LINEAR
    if isinstance(value, str):
        patterns.compile(value, f"target_modules={_short(value)}")
        return value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise AdapterFormatError(
            f"{CONFIG_NAME}: target_modules={_short(value)} must be a regex string or a non-empty list of module names"
        )
    return tuple(value)


def _pattern_dict(raw: dict[str, Any], name: str, patterns: PatternMatcher) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{CONFIG_NAME}: {name}={_short(value)} must be an object of pattern -> value")
    for key in value:
        patterns.compile(_pattern_regex(key), f"{name} key {_short(key)}")
    return value


def _pattern_regex(key: str) -> str:
    """PEFT's ``get_pattern_key`` regex for a ``rank_pattern`` / ``alpha_pattern`` key."""
    return rf"(.*\.)?({key})$"


def _pattern_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterFormatError(f"{CONFIG_NAME}: rank_pattern[{_short(key)}]={_short(value)} must be an integer >= 1")
    return value


def _pattern_number(key: str, value: Any) -> float:
    if not _is_finite_positive(value):
        raise AdapterFormatError(f"{CONFIG_NAME}: alpha_pattern[{_short(key)}]={_short(value)} must be a finite number > 0")
    return float(value)


# the attribute holding the decoder layers in the HF keys of every served family (model.layers.<i>. ...)
LAYERS_ATTRIBUTE = "layers"


def _layers_to_transform(raw: dict[str, Any]) -> tuple[int, ...] | None:
    value = raw.get("layers_to_transform")
    pattern = raw.get("layers_pattern")  # PEFT reads the layer index after it; used only with layers_to_transform
    if value is None or value == []:
        if pattern:  # PEFT's LoraConfig refuses it
            raise AdapterFormatError(f"{CONFIG_NAME}: layers_pattern={_short(pattern)} needs layers_to_transform")
        return None
    names = [pattern] if isinstance(pattern, str) else pattern
    if pattern and (not isinstance(names, list) or LAYERS_ATTRIBUTE not in names):
        raise AdapterFormatError(
            f"{CONFIG_NAME}: layers_pattern={_short(pattern)} names no layer list of this model (its layers are "
            f"{LAYERS_ATTRIBUTE!r}): PEFT would find no module to adapt"
        )
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise AdapterFormatError(
            f"{CONFIG_NAME}: layers_to_transform={_short(value)} must be an integer >= 0 or a list of them"
        )
    return tuple(sorted(set(items)))


def _exclude_modules(raw: dict[str, Any], patterns: PatternMatcher) -> tuple[str, ...] | str | None:
    value = raw.get("exclude_modules")
    if not value:
        return None
    if isinstance(value, str):
        patterns.compile(value, f"exclude_modules={_short(value)}")
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AdapterFormatError(f"{CONFIG_NAME}: exclude_modules={_short(value)} must be a regex string or a list")
    return tuple(value)


def _matches_list(names: tuple[str, ...], module_key: str) -> bool:
    return module_key in names or any(module_key.endswith("." + name) for name in names)


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters (error messages quote user values)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
