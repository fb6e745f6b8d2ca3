"""Load and validate a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

Everything is checked before any tensor is handed out, in this order: the folder,
pickle files (refused), the config (``peft_config``), ``layers_to_transform`` against
the model, the safetensors header (names, dtypes, shapes against ``BaseModelSpec``
and the config's ranks), then the tensor values (finite, and ``scaling * lora_B @ lora_A``
finite in the serving dtype). Tensor names are decided structurally (at most
``2 * num_layers * modules`` tensors, names of at most ``MAX_TENSOR_NAME_CHARS``, a layer
index of at most 6 digits below ``num_layers``, a module of the model) before any
user regex of the config runs on them. A refusal raises an
``AdapterError`` subclass naming the field / file / tensor and the value; nothing is
returned partially loaded.

``inspect_peft_adapter`` runs every check that needs no tensor data (all but the
finite-values one) from ``adapter_config.json`` and the safetensors header alone;
``load_peft_adapter`` runs the same checks, then reads the tensors.

Tensor names (PEFT ``get_peft_model_state_dict``):
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A[.{adapter}].weight``
``[r, in_features]`` and ``...lora_B[.{adapter}].weight`` ``[out_features, r]``; the
``base_model.model.`` prefix, the ``model.`` prefix and the adapter name are optional.
On the vocabulary-sized modules (``_plan_vocab``): ``model.embed_tokens.lora_embedding_{A,B}``,
``lm_head.lora_{A,B}.weight``, the ``base_layer.weight`` copy PEFT saves beside them, and
``modules_to_save`` copies ``model.embed_tokens.weight`` / ``lm_head.weight``.
DoRA adapters (``use_dora``) add ``...{module}.lora_magnitude_vector`` ``[out_features]`` per
targeted module (PEFT 0.21 writes no ``.weight`` suffix; one is accepted).
Compatibility is decided from these shapes and ``BaseModelSpec``, never from
``base_model_name_or_path``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from loraplex.adapters import tensor_file
from loraplex.adapters.adapter import AdapterInfo, LoRAAdapter, LoRAWeight, VocabWeights
from loraplex.adapters.errors import (
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterNotServedError,
    AdapterUnsupportedError,
)
from loraplex.adapters.identity import ContentStream
from loraplex.adapters.peft_config import (
    CONFIG_NAME,
    ModuleHyperparams,
    VOCAB_MODULES,
    PeftLoraConfig,
    read_adapter_config,
    vocab_module,
)
from loraplex.adapters.spec import LORA_MODULE_NAMES, MODULE_PARENT, BaseModelSpec
from loraplex.adapters.tensor_file import (
    SAFETENSORS_NAME,
    STORED_DTYPES,
    FileIdentity,
    Stacked,
    StoredTensor,
    TensorData,
    check_listed,
    check_same_file,
    check_same_header,
    file_identity,
    read_tensor_data,
    scatter_rows,
)

logger = logging.getLogger(__name__)

_PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "pytorch_model.bin")
_DTYPE_BYTES = {name: dtype.itemsize for name, dtype in STORED_DTYPES.items()}
_FLOAT_DTYPES = tuple(STORED_DTYPES)
_LORA_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>A|B)(?:\.(?P<adapter>[^.]+))?\.weight"
)
_MAGNITUDE_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<adapter>(?!weight$)[^.]+))?(?:\.weight)?"
)
_LAYER_MODULE = re.compile(r"(?:model\.)?layers\.(?P<layer>[0-9]+)\.(?P<parent>[A-Za-z0-9_]+)\.(?P<module>[A-Za-z0-9_]+)")
_LAYER_INDEX = re.compile(r"0|[1-9][0-9]{0,5}")  # a layer index as PEFT writes it: <= 6 digits, no leading zero
MAX_TENSOR_NAME_CHARS = 256
_NO_VOCAB = ("adapters on embed_tokens / lm_head are not served by this engine (its BaseModelSpec has no vocab_size: "
             "not implemented with tensor_parallel_size > 1)")
# Tensors of embed_tokens / lm_head as PEFT saves them: LoRA (lora_embedding_A/B on the embedding, lora_A/B on
# the head), the copy of the base module it saves beside LoRA there (``base_layer.weight``), or a
# ``modules_to_save`` copy (``<module>.weight``; ``.modules_to_save.<adapter>.weight`` unstripped).
_VOCAB_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?P<module>(?:model\.)?embed_tokens|lm_head)\."
    r"(?:(?P<lora>lora_embedding_A|lora_embedding_B|lora_A|lora_B)(?:\.(?P<adapter>[^.]+))??(?P<suffix>\.weight)?"
    r"|(?P<copy>base_layer\.weight|weight|modules_to_save\.[^.]+\.weight))"
)


@dataclass(frozen=True)
class _TensorRef:
    """One tensor of the file, as named in its header. ``layer``/``module`` are None when unmapped."""

    name: str
    module_key: str
    kind: str
    adapter_name: str | None
    dtype: str
    shape: tuple[int, ...]
    layer: int | None
    module: str | None


@dataclass(frozen=True)
class _ModulePlan:
    """A validated (layer, module) pair: which tensors hold its A and B (and its DoRA magnitude), and its
    hyperparameters."""

    layer: int
    module: str
    a_name: str
    b_name: str
    hyper: ModuleHyperparams
    magnitude_name: str | None = None


@dataclass(frozen=True)
class AdapterLayout:
    """A PEFT adapter checked from its config and safetensors header alone (no tensor data read).

    - ``path``: the adapter folder; ``config``: its parsed ``adapter_config.json``.
    - ``rank``: the largest module rank; ``target_modules``: modules present, in ``LORA_MODULE_NAMES`` order.
    - ``num_layers_targeted``: layers with at least one LoRA module.
    - ``size_bytes``: bytes of the tensors as stored in ``adapter_model.safetensors`` (from the header).
    """

    path: str
    config: PeftLoraConfig
    rank: int
    target_modules: tuple[str, ...]
    num_layers_targeted: int
    size_bytes: int
    modules: tuple[_ModulePlan, ...]
    vocab_lora: tuple[_ModulePlan, ...] = ()
    """LoRA on ``embed_tokens`` / ``lm_head`` (``layer`` -1; ``a_name``/``b_name``: lora_embedding_A/B of the
    embedding, lora_A/B of the head)."""
    full_modules: tuple[tuple[str, str], ...] = ()
    """``modules_to_save`` copies: (module, tensor name), each ``[vocab_size, hidden_size]``."""


# -- what a registration keeps between reads, quiet for the garbage collector ------------------------------
# A registered adapter keeps its layout (a _ModulePlan and a ModuleHyperparams per module) and its header's
# tensors (a StoredTensor each): ~270 class instances for a q/v adapter over 32 layers, which every full
# collection walks (2,000 registered adapters: one full collection 290 ms on an H200 host, RESULTS.md session
# 15). Kept as exact tuples of atoms instead: CPython's collector stops tracking those (``gc.is_tracked``).

def pack_layout(layout: AdapterLayout) -> tuple:
    """``layout`` as nested exact tuples of atoms (its ``config`` kept as is); :func:`unpack_layout` inverts it."""
    def plan(p: _ModulePlan) -> tuple:
        h = p.hyper
        return p.layer, p.module, p.a_name, p.b_name, (h.rank, h.alpha, h.scaling, h.rank_field), p.magnitude_name

    return (layout.path, layout.config, layout.rank, layout.target_modules, layout.num_layers_targeted,
            layout.size_bytes, tuple(map(plan, layout.modules)), tuple(map(plan, layout.vocab_lora)),
            layout.full_modules)


def unpack_layout(packed: tuple) -> AdapterLayout:
    """The :class:`AdapterLayout` that :func:`pack_layout` packed (equal to it)."""
    def plan(t: tuple) -> _ModulePlan:
        layer, module, a_name, b_name, hyper, magnitude_name = t
        return _ModulePlan(layer, module, a_name, b_name, ModuleHyperparams(*hyper), magnitude_name)

    path, config, rank, targets, layers, size, modules, vocab, full = packed
    return AdapterLayout(path, config, rank, targets, layers, size, tuple(map(plan, modules)),
                         tuple(map(plan, vocab)), full)


def pack_stored(stored: dict[str, StoredTensor]) -> tuple:
    """``stored`` as one exact tuple of ``(name, dtype, shape, offset_bytes, nbytes)`` tuples."""
    return tuple((name, t.dtype, t.shape, t.offset_bytes, t.nbytes) for name, t in stored.items())


def unpack_stored(packed: tuple) -> dict[str, StoredTensor]:
    """The ``{name: StoredTensor}`` that :func:`pack_stored` packed (equal to it, same order)."""
    return {name: StoredTensor(dtype, shape, offset_bytes, nbytes) for name, dtype, shape, offset_bytes, nbytes in packed}


def checked_shapes(layout: AdapterLayout, spec: BaseModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of ``layout`` (lora_A, lora_B and DoRA magnitude per module of ``layout.modules`` then
    ``layout.vocab_lora``, then the ``modules_to_save`` copies) with the shape its checks required, as
    ``(name, shape)`` for ``tensor_file.check_listed``."""
    expected: list[tuple[str, tuple[int, ...]]] = []
    for plan in layout.modules + layout.vocab_lora:
        in_features, out_features = _features(plan.module, spec)
        rank = plan.hyper.rank
        expected += [(plan.a_name, (rank, in_features)), (plan.b_name, (out_features, rank))]
        if plan.magnitude_name is not None:
            expected.append((plan.magnitude_name, (out_features,)))
    expected += [(name, (spec.vocab_size, spec.hidden_size)) for _, name in layout.full_modules]
    return expected


def _features(module: str, spec: BaseModelSpec) -> tuple[int, int]:
    """``(in_features, out_features)`` of a LoRA'd module: a decoder projection's from ``spec.module_shapes``,
    ``embed_tokens`` ``(vocab_size, hidden_size)``, ``lm_head`` ``(hidden_size, vocab_size)``."""
    if module == "embed_tokens":
        return spec.vocab_size, spec.hidden_size
    if module == "lm_head":
        return spec.hidden_size, spec.vocab_size
    return spec.module_shapes[module]


def inspect_peft_adapter(path: str | os.PathLike[str], spec: BaseModelSpec, max_lora_rank: int) -> AdapterLayout:
    """Run every check of ``load_peft_adapter`` that needs no tensor data, reading only
    ``adapter_config.json`` and the safetensors header (names, dtypes, shapes).

    Not checked (no data read): that the tensor values are finite, and the ``version_id``.
    Raises what ``load_peft_adapter`` raises, except its NaN/Inf ``AdapterFormatError``.
    """
    return _inspect(path, spec, max_lora_rank)[0]


def inspect_peft_tensors(
    path: str | os.PathLike[str], spec: BaseModelSpec, max_lora_rank: int
) -> tuple[AdapterLayout, dict[str, StoredTensor], FileIdentity | None]:
    """``inspect_peft_adapter``, where every tensor of the file lies (``stored_tensors``), for reading them, and
    the weights file's identity (``file_identity``) taken before its header was read, for ``read_peft_tensors``.

    Raises what ``inspect_peft_adapter`` raises, and ``AdapterFormatError`` when the header parsed for the
    places does not list the tensors (names, dtypes, shapes) checked (the file was rewritten in between:
    ``check_same_header``).
    """
    identity = file_identity(Path(path) / SAFETENSORS_NAME)
    layout, header = _inspect(path, spec, max_lora_rank)
    stored = tensor_file.stored_tensors(Path(layout.path) / SAFETENSORS_NAME)
    check_same_header(stored, header)
    return layout, stored, identity


def read_peft_tensors(layout: AdapterLayout, stored: dict[str, StoredTensor], identity: FileIdentity | None, *,
                      into: tuple[int, torch.Tensor] | None = None) -> TensorData:
    """Every tensor of the adapter's file (``stored``, ``identity``: from ``inspect_peft_tensors``) in host memory,
    read in one ``pread`` per contiguous run (one for a file the safetensors library wrote); ``into``: as
    ``read_tensor_data``.

    The header and the data are read through two opens of the file: a file replaced or rewritten in between
    (``os.replace`` of a same-size file with its tensors in another order) would give tensors at the old
    header's offsets in the new file's bytes. So the file's identity after the read must be the one taken before
    its header was read (``check_same_file``). Raises ``AdapterFormatError`` (a byte count that does not match
    its shape: ``check_listed``; unreadable, truncated, changed while read)."""
    path = Path(layout.path) / SAFETENSORS_NAME
    check_listed(stored, ((name, None) for name in stored))
    data = read_tensor_data(path, stored, list(stored), into=into)
    check_same_file(path, identity)
    return data


def load_peft_adapter(
    path: str | os.PathLike[str],
    spec: BaseModelSpec,
    max_lora_rank: int,
    *,
    version_id: str | None = None,
    serving_dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Validate then load the PEFT LoRA adapter in folder ``path`` for the model ``spec``.

    Returns a ``LoRAAdapter`` whose ``weights`` hold ``a [r, in] fp32``, ``b [out, r] fp32``
    and the per-module ``scaling`` (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA).
    ``version_id``: the caller's known content id of these files (declared, or verified
    earlier): it is used as is and nothing is hashed; ``None`` computes it
    (``identity.compute_version_id``, a sha256 over config and tensors).
    ``serving_dtype``: the dtype the adapter will be served in (the slot dtype); every
    module's ``scaling * lora_B @ lora_A`` must be finite in it (bounded per factor:
    ``|scaling| * sum_k max_i |B[i, k]| * max_j |A[k, j]|``), and the scaling in float32.

    Raises ``AdapterFormatError``, ``AdapterIncompatibleError`` or ``AdapterUnsupportedError``
    (all ``AdapterError``, a ``ValueError``) naming the field and value.
    """
    layout, stored, identity = inspect_peft_tensors(path, spec, max_lora_rank)
    data = read_peft_tensors(layout, stored, identity)
    return _adapter_of(layout, check_tensor_data(layout, data, version_id=version_id, serving_dtype=serving_dtype),
                       data)


def validate_adapter_dir(
    path: str | os.PathLike[str],
    spec: BaseModelSpec,
    max_lora_rank: int,
    *,
    serving_dtype: torch.dtype = torch.float32,
) -> AdapterInfo:
    """Run every check of ``load_peft_adapter`` and return the summary; no tensors are kept.

    For the platform to call before storing an upload. Raises what ``load_peft_adapter`` raises.
    """
    return load_peft_adapter(path, spec, max_lora_rank, serving_dtype=serving_dtype).info()


FileSignature = tuple[tuple[int, int], tuple[int, int]]


def adapter_files_signature(path: str | os.PathLike[str]) -> FileSignature | None:
    """``((size_bytes, mtime_ns) of adapter_config.json, (size_bytes, mtime_ns) of the safetensors file)``.

    A cheap change detector (one ``stat`` per file, nothing read): equal signatures mean
    the files were not rewritten in between. ``None`` when a file cannot be stat'ed.
    """
    folder = Path(path)
    try:
        config, weights = (folder / CONFIG_NAME).stat(), (folder / SAFETENSORS_NAME).stat()
    except OSError:
        return None
    return (config.st_size, config.st_mtime_ns), (weights.st_size, weights.st_mtime_ns)


def _inspect(path: str | os.PathLike[str], spec: BaseModelSpec,
             max_lora_rank: int) -> tuple[AdapterLayout, dict[str, tuple[str, tuple[int, ...]]]]:
    """The checks of ``inspect_peft_adapter``: its layout, and the header they read (name -> (dtype, shape))."""
    folder, config = _checked_config(path, spec, max_lora_rank)
    with _open_weights(folder) as handle:
        header = _read_header(handle)
    return _layout(folder, config, header, spec, max_lora_rank), header


def _checked_config(
    path: str | os.PathLike[str], spec: BaseModelSpec, max_lora_rank: int
) -> tuple[Path, PeftLoraConfig]:
    """The folder and its parsed config, after the folder, pickle and config checks."""
    if max_lora_rank < 1:
        raise ValueError(f"max_lora_rank={max_lora_rank!r}: must be >= 1")
    folder = _adapter_folder(path)
    _refuse_pickle(folder)
    config = read_adapter_config(folder)
    _check_layers_to_transform(config, spec)
    _check_target_modules_exist(config, spec)
    return folder, config


def _layout(
    folder: Path,
    config: PeftLoraConfig,
    header: dict[str, tuple[str, tuple[int, ...]]],
    spec: BaseModelSpec,
    max_lora_rank: int,
) -> AdapterLayout:
    _check_tensor_count(header, config, spec)
    layer_header = {name: entry for name, entry in header.items() if _VOCAB_TENSOR.fullmatch(name) is None}
    vocab_lora, full_modules = _plan_vocab(header, config, spec, max_lora_rank)
    has_vocab = bool(vocab_lora or full_modules)
    plans = _plan_modules(layer_header, config, spec, max_lora_rank) if layer_header or not has_vocab else []
    present = {plan.module for plan in plans}
    ranks = [plan.hyper.rank for plan in plans + vocab_lora]
    if not ranks and not full_modules:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: holds no LoRA weight and no modules_to_save copy")
    return AdapterLayout(
        path=str(folder),
        config=config,
        rank=max(ranks, default=0),
        target_modules=tuple(module for module in LORA_MODULE_NAMES if module in present)
        + tuple(plan.module for plan in vocab_lora),
        num_layers_targeted=len({plan.layer for plan in plans}),
        size_bytes=sum(_DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in header.values()),
        modules=tuple(plans),
        vocab_lora=tuple(vocab_lora),
        full_modules=tuple(full_modules),
    )


def _plan_vocab(
    header: dict[str, tuple[str, tuple[int, ...]]],
    config: PeftLoraConfig,
    spec: BaseModelSpec,
    max_lora_rank: int,
) -> tuple[list[_ModulePlan], list[tuple[str, str]]]:
    """Check the ``embed_tokens`` / ``lm_head`` tensors of the header against the config and the model:
    (LoRA plans in ``VOCAB_MODULES`` order, ``modules_to_save`` copies as (module, tensor name)).

    PEFT's embedding LoRA stores ``lora_embedding_A [r, V]`` and ``lora_embedding_B [H, r]``
    (Semantics: ``e[t] += scaling * A.T[ids[t]] @ B.T``); the head's is a linear LoRA, ``lora_A [r, H]``,
    ``lora_B [V, r]``. The copy of the base module PEFT saves beside that LoRA (``base_layer.weight``,
    for resized vocabularies) must be ``[V, H]`` and is not served: the adapter runs on the server's base
    weights. A ``modules_to_save`` copy is ``[V, H]`` and replaces the module for the adapter's rows.

    DoRA (``use_dora``) on ``embed_tokens`` / ``lm_head`` is refused: PEFT rescales the embedding's hidden
    channels (``DoraEmbeddingLayer``, ``m [H]``) or the head's logits (``m [V]``) there, which the engine's
    vocabulary LoRA path does not apply. ``modules_to_save`` copies beside DoRA on the projections are served.
    """
    dora_vocab = [module for module in VOCAB_MODULES if config.use_dora and config.targets_vocab(module)]
    if dora_vocab:
        raise AdapterUnsupportedError(
            f"{CONFIG_NAME}: use_dora=true with LoRA on {' and '.join(dora_vocab)} ({config.describe_targets()}): "
            "DoRA on embed_tokens / lm_head is not served (DoRA is served on the decoder layers' projections; "
            "plain LoRA or a modules_to_save copy on embed_tokens / lm_head is served)"
        )
    parts: dict[str, dict[str, _TensorRef]] = {module: {} for module in VOCAB_MODULES}
    for name, (dtype, shape) in sorted(header.items()):
        match = _VOCAB_TENSOR.fullmatch(name)
        if match is None:
            continue
        module = vocab_module(match["module"])
        assert module is not None  # the regex names only these
        reason = spec.unserved_reason(module)
        if reason is not None:
            raise AdapterNotServedError(f"tensor {name!r}: {reason}")
        if spec.vocab_size is None:
            raise AdapterNotServedError(f"tensor {name!r}: {_NO_VOCAB}")
        if match["copy"] is not None:
            kind = "base_layer" if match["copy"] == "base_layer.weight" else "full"
        else:
            kind = match["lora"].removeprefix("lora_").removeprefix("embedding_")
            embedding_form = match["lora"].startswith("lora_embedding_") and match["suffix"] is None
            head_form = not match["lora"].startswith("lora_embedding_") and match["suffix"] is not None
            if not (embedding_form if module == "embed_tokens" else head_form):
                expected = ("lora_embedding_A / lora_embedding_B" if module == "embed_tokens"
                            else "lora_A.weight / lora_B.weight")
                raise AdapterFormatError(f"tensor {name!r} is not a LoRA weight of {module} as PEFT saves it "
                                         f"(expected {expected})")
        if kind in parts[module]:
            raise AdapterFormatError(f"tensors {parts[module][kind].name!r} and {name!r} both hold {kind} of {module}")
        parts[module][kind] = _TensorRef(name=name, module_key=VOCAB_MODULES[module], kind=kind, adapter_name=None,
                                         dtype=dtype, shape=shape, layer=-1, module=module)
    full_shape = (spec.vocab_size, spec.hidden_size)
    lora_plans: list[_ModulePlan] = []
    full: list[tuple[str, str]] = []
    for module, found in parts.items():
        saved = module in config.modules_to_save
        lora = "A" in found or "B" in found
        if saved and config.targets_vocab(module):
            raise AdapterUnsupportedError(
                f"{CONFIG_NAME}: {module} is both in modules_to_save and targeted by LoRA "
                f"({config.describe_targets()}); only one of the two is served"
            )
        for kind in ("base_layer", "full"):
            if kind in found:
                _check_full(found[kind], full_shape)
        if saved != ("full" in found):
            raise AdapterFormatError(
                f"{module}: adapter_config.json modules_to_save={list(config.modules_to_save)!r} but "
                + (f"{SAFETENSORS_NAME} holds no copy of it ('base_model.model.{VOCAB_MODULES[module]}.weight')"
                   if saved else f"{SAFETENSORS_NAME} holds a copy of it ({found['full'].name!r})")
            )
        if saved:
            full.append((module, found["full"].name))
        if "base_layer" in found and not lora:
            raise AdapterFormatError(f"tensor {found['base_layer'].name!r}: a base-layer copy of {module} without "
                                     f"LoRA on it")
        if not lora:
            continue
        for kind, other in (("A", "B"), ("B", "A")):
            if kind in found and other not in found:
                raise AdapterFormatError(f"tensor {found[kind].name!r} (lora_{kind}) has no matching lora_{other}")
        lora_plans.append(_plan_vocab_lora(found["A"], found["B"], config, spec, max_lora_rank))
    return lora_plans, full


def _targeted_hyperparams(a: _TensorRef, targeted: bool, config: PeftLoraConfig, max_lora_rank: int):
    """The config's rank/alpha for ``a``'s module; raises when the config does not target it
    (``AdapterFormatError``) or its rank exceeds ``max_lora_rank`` (``AdapterNotServedError``)."""
    if not targeted:
        raise AdapterFormatError(
            f"tensor {a.name!r}: module {a.module_key!r} is not targeted by {CONFIG_NAME} {config.describe_targets()}"
        )
    hyper = config.hyperparams(a.module_key)
    if hyper.rank > max_lora_rank:
        raise AdapterNotServedError(
            f"{CONFIG_NAME}: {hyper.rank_field}={hyper.rank} exceeds max_lora_rank={max_lora_rank} "
            f"(module {a.module_key!r})"
        )
    return hyper


def _plan_vocab_lora(
    a: _TensorRef, b: _TensorRef, config: PeftLoraConfig, spec: BaseModelSpec, max_lora_rank: int
) -> _ModulePlan:
    """A LoRA plan for ``embed_tokens`` (A ``[r, V]``, B ``[H, r]``) or ``lm_head`` (A ``[r, H]``, B ``[V, r]``)."""
    module = a.module
    assert module is not None and spec.vocab_size is not None
    hyper = _targeted_hyperparams(a, config.targets_vocab(module), config, max_lora_rank)
    in_features, out_features = _features(module, spec)
    _check_tensor(a, (hyper.rank, in_features), rank_dim=0, hyper=hyper, spec=spec)
    _check_tensor(b, (out_features, hyper.rank), rank_dim=1, hyper=hyper, spec=spec)
    return _ModulePlan(layer=-1, module=module, a_name=a.name, b_name=b.name, hyper=hyper)


def _check_full(ref: _TensorRef, shape: tuple[int, int]) -> None:
    """A full copy of ``embed_tokens`` / ``lm_head``: floating point, ``[vocab_size, hidden_size]``."""
    if ref.dtype not in _FLOAT_DTYPES:
        raise AdapterFormatError(
            f"tensor {ref.name!r}: dtype {ref.dtype} is not a floating-point type ({', '.join(_FLOAT_DTYPES)})"
        )
    if ref.shape != shape:
        raise AdapterIncompatibleError(
            f"tensor {ref.name!r} has shape {list(ref.shape)}; the base model's {ref.module} is {list(shape)} "
            "(vocab_size, hidden_size)"
        )


def _adapter_folder(path: str | os.PathLike[str]) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterFormatError(f"adapter folder '{folder}' does not exist or is not a directory")
    return folder


def _refuse_pickle(folder: Path) -> None:
    for name in _PICKLE_NAMES:
        if (folder / name).exists():
            raise AdapterUnsupportedError(
                f"{name}: pickle weights are refused; only safetensors is accepted ({SAFETENSORS_NAME})"
            )


def _check_layers_to_transform(config: PeftLoraConfig, spec: BaseModelSpec) -> None:
    for index in config.layers_to_transform or ():
        if index >= spec.num_layers:
            raise AdapterIncompatibleError(
                f"{CONFIG_NAME}: layers_to_transform={list(config.layers_to_transform or ())!r} has layer index "
                f"{index}, beyond the base model's num_layers={spec.num_layers}"
            )


def _check_target_modules_exist(config: PeftLoraConfig, spec: BaseModelSpec) -> None:
    """Every entry of a ``target_modules`` list must name a LoRA-able module of the model
    (equal to a module key such as ``model.layers.0.self_attn.q_proj``, or a ``.``-suffix of one)."""
    if not isinstance(config.target_modules, tuple):
        return
    names: set[str] = set()
    for layer in range(spec.num_layers):
        for module in spec.module_shapes:
            parts = ["model", "layers", str(layer), MODULE_PARENT[module], module]
            names.update(".".join(parts[i:]) for i in range(len(parts)))
    if spec.vocab_size is not None:
        names.update(("embed_tokens", "model.embed_tokens", "lm_head"))
    for entry in config.target_modules:
        reason = spec.unserved_reason(vocab_module(entry) or entry.rsplit(".", 1)[-1])
        if reason is not None:
            raise AdapterNotServedError(f"{CONFIG_NAME}: target_modules contains {entry[:100]!r}: {reason}")
        if spec.vocab_size is None and vocab_module(entry) is not None:
            raise AdapterNotServedError(f"{CONFIG_NAME}: target_modules contains {entry[:100]!r}: {_NO_VOCAB}")
        if entry not in names:
            raise AdapterIncompatibleError(
                f"{CONFIG_NAME}: target_modules contains {entry[:100]!r}, which the base model ({spec.architecture}) "
                f"does not have; its LoRA-able modules are {', '.join(spec.module_shapes)}"
            )


@contextmanager
def _open_weights(folder: Path) -> Iterator[Any]:
    path = folder / SAFETENSORS_NAME
    if not path.is_file():
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: missing in adapter folder '{folder}'")
    try:
        handle_cm = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: corrupt or truncated ({exc})") from exc
    with handle_cm as handle:
        yield handle


def _read_header(handle: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype string, shape), without reading tensor data."""
    try:
        return {
            name: (handle.get_slice(name).get_dtype(), tuple(handle.get_slice(name).get_shape()))
            for name in handle.keys()
        }
    except SafetensorError as exc:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: corrupt header ({exc})") from exc


def _plan_modules(
    header: dict[str, tuple[str, tuple[int, ...]]],
    config: PeftLoraConfig,
    spec: BaseModelSpec,
    max_lora_rank: int,
) -> list[_ModulePlan]:
    """Check every tensor of the header against the config and the model; one plan per module."""
    if not header:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: holds no tensors")
    _check_tensor_count(header, config, spec)
    refs = [_parse_name(name, dtype, shape, spec) for name, (dtype, shape) in sorted(header.items())]
    _check_adapter_names(refs)
    _check_mapped(refs, spec)
    pairs = _pair(refs)
    order = {name: i for i, name in enumerate(LORA_MODULE_NAMES)}
    keys = sorted(pairs, key=lambda key: (key[0], order[key[1]]))
    return [_plan_module(pairs[key]["A"], pairs[key]["B"], pairs[key].get("M"), config, spec, max_lora_rank)
            for key in keys]


def _check_tensor_count(header: dict[str, Any], config: PeftLoraConfig, spec: BaseModelSpec) -> None:
    """Bounds the work before any name is parsed; a few extra tensors get the precise refusal later."""
    per_module = 3 if config.use_dora else 2
    # the model's modules, served or not: an adapter on unserved ones gets the precise refusal that names the setting
    modules = len(spec.module_shapes) + sum(1 for m in spec.unserved_modules if m not in VOCAB_MODULES)
    most = per_module * spec.num_layers * modules
    if len(header) > 2 * most + 64 + 3 * len(VOCAB_MODULES):
        raise AdapterIncompatibleError(
            f"{SAFETENSORS_NAME}: holds {len(header)} tensors; an adapter of this base model has at most {most} "
            f"(lora_A and lora_B{' and lora_magnitude_vector' if config.use_dora else ''} of "
            f"{modules} modules in {spec.num_layers} layers)"
        )


def _parse_name(name: str, dtype: str, shape: tuple[int, ...], spec: BaseModelSpec) -> _TensorRef:
    if len(name) > MAX_TENSOR_NAME_CHARS:
        raise AdapterFormatError(
            f"tensor name {name[:60]!r}... is {len(name)} characters long; at most {MAX_TENSOR_NAME_CHARS}"
        )
    if any(vocab_module(part) for part in name.split(".")):
        raise AdapterFormatError(
            f"tensor {name!r}: not a tensor of embed_tokens/lm_head as PEFT saves it (lora_embedding_A/B of "
            "embed_tokens, lora_A/B.weight of lm_head, base_layer.weight, or a modules_to_save copy '<module>.weight')"
        )
    match = _LORA_TENSOR.fullmatch(name) or _MAGNITUDE_TENSOR.fullmatch(name)
    if match is None:
        raise AdapterFormatError(
            f"tensor {name!r} is not a LoRA weight (expected '<module>.lora_A.weight', '<module>.lora_B.weight' "
            "or, for DoRA, '<module>.lora_magnitude_vector')"
        )
    module_key = match["module"]
    layer, module = _map_module(module_key, spec)
    return _TensorRef(
        name=name,
        module_key=module_key,
        kind=match.groupdict().get("kind") or "M",
        adapter_name=match["adapter"],
        dtype=dtype,
        shape=shape,
        layer=layer,
        module=module,
    )


def _map_module(module_key: str, spec: BaseModelSpec) -> tuple[int | None, str | None]:
    """(layer index, module name) if ``module_key`` is a LoRA-able projection of the model, else (None, None)."""
    match = _LAYER_MODULE.fullmatch(module_key)
    if match is None:
        return None, None
    if _LAYER_INDEX.fullmatch(match["layer"]) is None:
        raise AdapterIncompatibleError(
            f"module {module_key!r}: layer index {match['layer']!r} is not a decimal of at most 6 digits "
            "without leading zeros"
        )
    module = match["module"]
    reason = spec.unserved_reason(module)
    if reason is not None and MODULE_PARENT[module] == match["parent"]:
        raise AdapterNotServedError(f"module {module_key!r}: {reason}")
    if module not in spec.module_shapes or MODULE_PARENT[module] != match["parent"]:
        return None, None
    return int(match["layer"]), module


def _check_adapter_names(refs: list[_TensorRef]) -> None:
    names = sorted({ref.adapter_name or "" for ref in refs})
    if len(names) > 1:
        raise AdapterFormatError(
            f"{SAFETENSORS_NAME}: tensor names carry several adapter names {names!r} ('' = none); expected one adapter"
        )


def _check_mapped(refs: list[_TensorRef], spec: BaseModelSpec) -> None:
    unmapped = [ref for ref in refs if ref.layer is None]
    if len(unmapped) == len(refs):
        raise AdapterIncompatibleError(
            f"{SAFETENSORS_NAME}: none of the {len(refs)} LoRA tensors maps to a layer of the base model "
            f"({spec.architecture}: model.layers.<i>.<self_attn|mlp>.<{'|'.join(spec.module_shapes)}>); "
            f"first tensor: {refs[0].name!r}"
        )
    if unmapped:
        raise AdapterIncompatibleError(
            f"tensor {unmapped[0].name!r}: module {unmapped[0].module_key!r} is not one of the base model's "
            f"LoRA-able modules ({', '.join(spec.module_shapes)})"
        )
    for ref in refs:
        if ref.layer is not None and ref.layer >= spec.num_layers:
            raise AdapterIncompatibleError(
                f"tensor {ref.name!r}: layer index {ref.layer} is beyond the base model's num_layers={spec.num_layers}"
            )


def _pair(refs: list[_TensorRef]) -> dict[tuple[int, str], dict[str, _TensorRef]]:
    """Group tensors by (layer, module); every module must have exactly one A and one B."""
    pairs: dict[tuple[int, str], dict[str, _TensorRef]] = {}
    for ref in refs:
        assert ref.layer is not None and ref.module is not None  # _check_mapped ran
        slot = pairs.setdefault((ref.layer, ref.module), {})
        if ref.kind in slot:
            raise AdapterFormatError(
                f"tensors {slot[ref.kind].name!r} and {ref.name!r} both hold {_KIND_NAMES[ref.kind]} "
                f"of layer {ref.layer} {ref.module}"
            )
        slot[ref.kind] = ref
    for slot in pairs.values():
        for kind, other in (("A", "B"), ("B", "A"), ("M", "A")):
            if kind in slot and other not in slot:
                raise AdapterFormatError(
                    f"tensor {slot[kind].name!r} ({_KIND_NAMES[kind]}) has no matching {_KIND_NAMES[other]}"
                )
    return pairs


_KIND_NAMES = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}


def _plan_module(
    a: _TensorRef, b: _TensorRef, magnitude: _TensorRef | None, config: PeftLoraConfig, spec: BaseModelSpec,
    max_lora_rank: int,
) -> _ModulePlan:
    assert a.layer is not None and a.module is not None  # _check_mapped ran
    hyper = _targeted_hyperparams(a, config.targets(a.module_key, a.layer), config, max_lora_rank)
    in_features, out_features = _features(a.module, spec)
    _check_tensor(a, (hyper.rank, in_features), rank_dim=0, hyper=hyper, spec=spec)
    _check_tensor(b, (out_features, hyper.rank), rank_dim=1, hyper=hyper, spec=spec)
    _check_magnitude(a, magnitude, config, out_features)
    return _ModulePlan(layer=a.layer, module=a.module, a_name=a.name, b_name=b.name, hyper=hyper,
                       magnitude_name=None if magnitude is None else magnitude.name)


def _check_magnitude(a: _TensorRef, magnitude: _TensorRef | None, config: PeftLoraConfig, out_features: int) -> None:
    """DoRA (``use_dora``): every module has a float ``lora_magnitude_vector [out_features]``; plain LoRA none."""
    if magnitude is None:
        if config.use_dora:
            raise AdapterFormatError(
                f"tensor {a.name!r}: {CONFIG_NAME} has use_dora=true but module {a.module_key!r} has no "
                "lora_magnitude_vector"
            )
        return
    if not config.use_dora:
        raise AdapterFormatError(
            f"tensor {magnitude.name!r}: a DoRA magnitude vector, but {CONFIG_NAME} has use_dora=false"
        )
    if magnitude.dtype not in _FLOAT_DTYPES:
        raise AdapterFormatError(
            f"tensor {magnitude.name!r}: dtype {magnitude.dtype} is not a floating-point type "
            f"({', '.join(_FLOAT_DTYPES)})"
        )
    if magnitude.shape != (out_features,):
        raise AdapterIncompatibleError(
            f"tensor {magnitude.name!r} has shape {list(magnitude.shape)}; expected [{out_features}] "
            f"(out_features of the base model's {magnitude.module})"
        )


def _check_tensor(
    ref: _TensorRef, expected: tuple[int, int], *, rank_dim: int, hyper: ModuleHyperparams, spec: BaseModelSpec
) -> None:
    """lora_A must be ``[r, in_features]`` (rank_dim 0) and lora_B ``[out_features, r]`` (rank_dim 1), float."""
    feature_dim = 1 - rank_dim
    feature_name = "in_features" if feature_dim == 1 else "out_features"
    if ref.dtype not in _FLOAT_DTYPES:
        raise AdapterFormatError(
            f"tensor {ref.name!r}: dtype {ref.dtype} is not a floating-point type ({', '.join(_FLOAT_DTYPES)})"
        )
    if len(ref.shape) != 2:
        raise AdapterFormatError(f"tensor {ref.name!r} has shape {list(ref.shape)}; expected 2-D {list(expected)}")
    if ref.shape[rank_dim] != hyper.rank:
        raise AdapterFormatError(
            f"tensor {ref.name!r} has shape {list(ref.shape)}; expected {list(expected)} "
            f"(rank {ref.shape[rank_dim]} != {CONFIG_NAME} {hyper.rank_field}={hyper.rank})"
        )
    if ref.shape[feature_dim] != expected[feature_dim]:
        raise AdapterIncompatibleError(
            f"tensor {ref.name!r} has shape {list(ref.shape)}; expected {list(expected)}: {feature_name}="
            f"{ref.shape[feature_dim]} but the base model's {ref.module} has {feature_name}={expected[feature_dim]} "
            f"(hidden_size={spec.hidden_size})"
        )


# -- tensor values: checked in batches ---------------------------------------------------------------------
# A first read runs on a loader thread while the engine thread runs Python: every call that releases the GIL
# there (a torch op, a tensor's deallocation, a large numpy op or hash update) waits up to the switch interval
# to take it back. The checks below stack the modules whose factors share dtypes and shapes (``module_groups``,
# one numpy gather each), reduce each stack with two numpy calls (``Stacked.abs_max``) and loop in Python over
# ``tolist()`` results: a handful of such calls per group, however many layers the adapter has.

_FP32_ZERO = 2.0**-150  # |x| <= this rounds to 0 in float32 (round to nearest even); larger does not


@dataclass(frozen=True)
class ModuleGroup:
    """Modules whose tensors share stored dtypes and shapes (``plans``, K of them, in plan order), stacked as
    stored (``TensorData.stack``): ``a`` (lora_A, ``S = [r, in]``), ``b`` (lora_B, ``[out, r]``), DoRA's
    ``magnitude`` (``[out]``) or None."""

    plans: tuple[_ModulePlan, ...]
    a: Stacked
    b: Stacked
    magnitude: Stacked | None = None


def module_groups(plans: tuple[_ModulePlan, ...], data: TensorData) -> tuple[ModuleGroup, ...]:
    """``plans`` grouped by the stored dtypes and shapes of their tensors (groups in order of first
    appearance), each stacked: one numpy call per stacked factor, however many modules."""
    grouped: dict[tuple, list[_ModulePlan]] = {}
    for plan in plans:
        names = (plan.a_name, plan.b_name, plan.magnitude_name)
        key = tuple(None if name is None else (data.stored[name].dtype, data.stored[name].shape) for name in names)
        grouped.setdefault(key, []).append(plan)
    return tuple(
        ModuleGroup(tuple(group), data.stack([p.a_name for p in group]), data.stack([p.b_name for p in group]),
                    None if group[0].magnitude_name is None else data.stack([str(p.magnitude_name) for p in group]))
        for group in grouped.values()
    )


@dataclass(frozen=True)
class CheckedTensors:
    """An adapter's tensors after ``check_tensor_data``: its ``version_id`` (computed or given), the
    ``warnings`` (logged), and its LoRA factors stacked in their stored dtype: ``modules`` (the decoder layers'
    projections, ``layout.modules``) and ``vocab`` (``layout.vocab_lora``)."""

    version_id: str
    warnings: tuple[str, ...]
    modules: tuple[ModuleGroup, ...]
    vocab: tuple[ModuleGroup, ...]


def check_tensor_data(layout: AdapterLayout, data: TensorData, *, version_id: str | None,
                      serving_dtype: torch.dtype) -> CheckedTensors:
    """The value checks of ``load_peft_adapter`` on the tensors of ``layout`` read into ``data`` (every tensor
    of the file, ``read_peft_tensors``), then the ``version_id`` (``version_id``, or the hash of ``data``).

    In order: every tensor finite (in name order), every DoRA magnitude finite in float32 (its ``max |value|`` at most
    float32's largest finite value), then per module (``layout.modules``, then
    ``layout.vocab_lora``) the scaling finite in float32 and ``|scaling| * sum_k max_i |B[i, k]| * max_j |A[k, j]|``
    (float64) and every ``|A|``, ``|B|`` at most the largest finite value of ``serving_dtype``, then every
    ``modules_to_save`` copy's ``max |value|``; then an all-zero lora_B (as float32) is a warning.

    Raises ``AdapterFormatError`` naming the first tensor (in name order) with a NaN or Inf value, or the first
    DoRA magnitude (in module order) out of float32's range, or ``AdapterIncompatibleError`` naming the module or
    tensor out of ``serving_dtype``'s range.
    """
    modules, vocab = module_groups(layout.modules, data), module_groups(layout.vocab_lora, data)
    rank_max = _check_values(layout, modules + vocab, data, serving_dtype)
    warnings = _zero_b_warnings(layout, rank_max)
    for message in warnings:
        logger.warning("adapter '%s': %s", layout.path, message)
    if version_id is None:
        version_id = _content_hash(layout.config.raw, data, modules + vocab)
    return CheckedTensors(version_id, warnings, modules, vocab)


def _content_hash(config: dict[str, Any], data: TensorData, groups: tuple[ModuleGroup, ...]) -> str:
    """``identity.compute_version_id`` of ``config`` and every tensor held in ``data``: the stream laid out,
    the tensors' bytes copied in (the stacked ones from ``groups``, one numpy call per stack; the others by
    ``TensorData.copy_into``), one hash update."""
    stream = ContentStream(config, [(name, data.dtype(name), ref.shape, ref.nbytes)
                                    for name, ref in data.stored.items()])
    copied: set[str] = set()
    for group in groups:
        for stacked, names in ((group.a, [p.a_name for p in group.plans]), (group.b, [p.b_name for p in group.plans]),
                               (group.magnitude, [str(p.magnitude_name) for p in group.plans])):
            if stacked is not None:
                scatter_rows(stream.buffer, [stream.offsets[name] for name in names], stacked.rows)
                copied.update(names)
    rest = [name for name in data.stored if name not in copied]
    data.copy_into(rest, stream.buffer, [stream.offsets[name] for name in rest])
    return stream.hexdigest()


def _check_values(layout: AdapterLayout, groups: tuple[ModuleGroup, ...], data: TensorData,
                  dtype: torch.dtype) -> dict[str, list[float]]:
    """The checks of ``check_tensor_data`` but the warnings; returns, per LoRA factor, ``max |value|`` per rank
    index (lora_A's rows, lora_B's columns). ``max |value|`` is exact in any float dtype and NaN survives it, so
    one reduction (``Stacked.abs_max``, numpy on the bits) serves the finiteness check and the bound."""
    rank_max: dict[str, list[float]] = {}
    sums: dict[str, float] = {}  # lora_A name -> sum_k max|A[k, :]| * max|B[:, k]| (float64, summed by torch)
    whole_max: dict[str, float] = {}  # other tensors -> max |value| (NaN if one is NaN)
    for group in groups:
        a_max, b_max = group.a.abs_max(1), group.b.abs_max(0)  # [K, r] float64
        # Inf * 0 (refused below as Inf) and float64 overflow (refused as out of range) are no numpy warnings
        with np.errstate(over="ignore", invalid="ignore"):
            products = a_max * b_max
        # torch sums [K, r] rows as it sums one [r] vector, bit for bit (the bound as first defined)
        totals = torch.sum(torch.from_numpy(products), dim=1).tolist()
        for plan, a_row, b_row, total in zip(group.plans, a_max.tolist(), b_max.tolist(), totals):
            rank_max[plan.a_name], rank_max[plan.b_name], sums[plan.a_name] = a_row, b_row, total
        if group.magnitude is not None:
            for plan, value in zip(group.plans, group.magnitude.abs_max(None).tolist()):
                whole_max[str(plan.magnitude_name)] = value
    for name in data.stored:
        if name not in rank_max and name not in whole_max:  # modules_to_save and base_layer copies: [V, H]
            whole_max[name] = data.stack([name]).abs_max(None).tolist()[0]  # a view: no [V, H] copy
    for name in sorted(data.stored):
        values = rank_max.get(name)
        if not (all(map(math.isfinite, values)) if values is not None else math.isfinite(whole_max[name])):
            raise AdapterFormatError(f"tensor {name!r} contains NaN or Inf values")
    fp32_max = torch.finfo(torch.float32).max
    for plan in layout.modules:  # DoRA magnitudes are served in float32 (``SlotImage.magnitude``)
        if plan.magnitude_name is not None and not whole_max[plan.magnitude_name] <= fp32_max:
            raise AdapterFormatError(f"tensor {plan.magnitude_name!r} contains NaN or Inf values (as float32)")
    limit = torch.finfo(dtype).max
    for plan in layout.modules + layout.vocab_lora:
        where = f"layer {plan.layer} {plan.module}" if plan.layer >= 0 else plan.module
        scaling = plan.hyper.scaling
        if not abs(scaling) <= fp32_max:
            raise AdapterIncompatibleError(
                f"{CONFIG_NAME}: {where}: scaling {scaling:.4g} (lora_alpha={plan.hyper.alpha:.4g}, "
                f"{plan.hyper.rank_field}={plan.hyper.rank}) is not finite in float32"
            )
        bound = abs(scaling) * sums[plan.a_name]
        largest = max(max(rank_max[plan.a_name]), max(rank_max[plan.b_name]))
        if not (bound <= limit and largest <= limit):
            raise AdapterIncompatibleError(
                f"{where}: scaling * lora_B @ lora_A is not finite in {str(dtype).removeprefix('torch.')} "
                f"(scaling {scaling:.4g}, |lora_A| and |lora_B| up to {largest:.4g}: entries up to {bound:.4g}, "
                f"largest finite value {limit:.4g})"
            )
    for module, name in layout.full_modules:
        largest = whole_max[name]
        if not largest <= limit:
            raise AdapterIncompatibleError(
                f"tensor {name!r} ({module} copy of modules_to_save) has values up to {largest:.4g}, not finite in "
                f"{str(dtype).removeprefix('torch.')} (largest finite value {limit:.4g})"
            )
    return rank_max


def _zero_b_warnings(layout: AdapterLayout, rank_max: dict[str, list[float]]) -> tuple[str, ...]:
    """A warning when lora_B of some ``layout.modules`` is all zero as float32 (as ``LoRAWeight.b``)."""
    zero = [(plan.layer, plan.module) for plan in layout.modules if max(rank_max[plan.b_name]) <= _FP32_ZERO]
    if not zero:
        return ()
    total = len(layout.modules)
    if len(zero) == total:
        return (f"all {total} lora_B matrices are zero: the adapter does not change the model (untrained?)",)
    layer, module = zero[0]
    return (
        f"{len(zero)} of {total} lora_B matrices are zero (first: layer {layer} {module}): "
        "those modules do not change the model",
    )


def _adapter_of(layout: AdapterLayout, checked: CheckedTensors, data: TensorData) -> LoRAAdapter:
    """The ``LoRAAdapter`` of checked tensors: float32 factors (views of each group converted once)."""
    weights: dict[tuple[int, str], LoRAWeight] = {}
    for group in checked.modules:
        a, b = _float32(group.a), _float32(group.b)
        magnitude = None if group.magnitude is None else _float32(group.magnitude)
        for k, plan in enumerate(group.plans):
            weights[(plan.layer, plan.module)] = LoRAWeight(a=a[k], b=b[k], scaling=plan.hyper.scaling,
                                                            magnitude=None if magnitude is None else magnitude[k])
    return LoRAAdapter(
        version_id=checked.version_id,
        rank=layout.rank,
        alpha=layout.config.lora_alpha,
        use_rslora=layout.config.use_rslora,
        target_modules=layout.target_modules,
        weights={(plan.layer, plan.module): weights[(plan.layer, plan.module)] for plan in layout.modules},
        use_dora=layout.config.use_dora,
        size_bytes=layout.size_bytes,
        warnings=checked.warnings,
        path=layout.path,
        vocab=_vocab_weights(layout, checked, data),
    )


def _vocab_weights(layout: AdapterLayout, checked: CheckedTensors, data: TensorData) -> VocabWeights | None:
    """The ``embed_tokens`` / ``lm_head`` parts of a checked adapter (fp32), or None when it has none."""
    if not layout.vocab_lora and not layout.full_modules:
        return None
    lora = {}
    for group in checked.vocab:
        a, b = _float32(group.a), _float32(group.b)
        lora.update({plan.module: LoRAWeight(a=a[k], b=b[k], scaling=plan.hyper.scaling)
                     for k, plan in enumerate(group.plans)})
    return VocabWeights(embed=lora.get("embed_tokens"), head=lora.get("lm_head"),
                        full={module: data.tensor(name).to(torch.float32, copy=True)
                              for module, name in layout.full_modules})


def _float32(stacked: Stacked) -> torch.Tensor:
    """``[K, *S] fp32``, a copy (a one-tensor stack is a view of the whole file's data, not to be kept)."""
    return stacked.tensor().to(torch.float32, copy=True)
