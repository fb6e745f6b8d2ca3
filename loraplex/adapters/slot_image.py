"""An adapter laid out in host memory exactly as a GPU adapter slot holds it.

The host-cache tier of ``LoRASlotPool`` keeps ``SlotImage``s, not ``LoRAAdapter``s:
one buffer per adapter in the slot dtype (a ``HostArena`` range in the pool, pinned when slots live on CUDA), with every
module's factors already padded to the image's rank ``R`` and laid out in weight pages of ``P`` rank rows
(``page_rows``), so that installing the adapter is one contiguous host-to-device copy of the whole image
and one multi-tensor device copy into its pages of the pool's per-module factors
(``LoRADeviceWeights.write_many``; S-LoRA, Sheng et al. 2023, "unified paging" of adapter weights).

``R`` is the adapter's own largest module rank rounded up to a multiple of ``P`` (the image takes
``R / P`` pages); built without ``page_rows`` (``P = R``) it is the pool's ``max_lora_rank``, one page.

Layout of ``SlotImage.data`` (1-D, slot dtype): for each targeted ``(layer, module)``
in (layer, ``LORA_MODULE_NAMES``) order, ``A`` padded to ``[R, in_features]`` (rows
``r..R`` zero; page ``j`` is rows ``jP..(j+1)P``) then ``B`` page by page, ``[R / P, out_features, P]``
(page ``j`` holds columns ``jP..(j+1)P`` of PEFT's ``[out_features, r]``, columns ``r..R`` zero). With one
page ``B`` is PEFT's ``[out_features, R]`` itself.

Semantics (per module): ``delta(x) = scaling * (x @ A.T) @ B.T``; the zero padding
makes the rank-R product equal the rank-r one. A DoRA adapter's magnitude vectors ride
beside ``data`` in float32 (``SlotImage.magnitude``); the gain they give needs the base
weight, so it is computed at install (``LoRADeviceWeights``).

An adapter with LoRA or ``modules_to_save`` copies on ``embed_tokens`` / ``lm_head`` also carries a
``VocabImage`` (separate host tensors, in the slot dtype, rank-padded like the rest).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loraplex.adapters import tensor_file
from loraplex.adapters.adapter import LoRAAdapter, LoRAWeight
from loraplex.adapters.errors import AdapterFormatError
from loraplex.adapters.peft_format import (
    AdapterLayout,
    ModuleGroup,
    check_tensor_data,
    checked_shapes,
    inspect_peft_tensors,
    module_groups,
    read_peft_tensors,
)
from loraplex.adapters.spec import BaseModelSpec
from loraplex.adapters.tensor_file import (
    SAFETENSORS_NAME,
    STORED_DTYPES,
    StoredTensor,
    TensorData,
    check_listed,
    read_tensor_data,
    scatter_rows,
)

ModuleKey = tuple[int, str]  # (layer index, module name)
Allocate = Callable[[int, torch.dtype], torch.Tensor]  # (numel, dtype) -> uninitialised [numel] host tensor


@dataclass(frozen=True)
class VocabImage:
    """An adapter's ``embed_tokens`` / ``lm_head`` parts in the slot dtype (V = vocab, H = hidden, R = pool rank).

    - ``embed_a_t``: ``[V, R]`` (``lora_embedding_A`` transposed, columns ``r..R`` zero: row ``v`` is what
      token id ``v`` gathers); ``embed_b``: ``[H, R]``. None when the embedding has no LoRA.
    - ``head_a``: ``[R, H]``; ``head_b``: ``[V, R]``. None when the head has no LoRA.
    - ``scaling``: ``[2] fp32``, (embedding, head); 0 for a part without LoRA.
    - ``full``: ``modules_to_save`` copies, module -> ``[V, H]``.

    Semantics: ``e[t] += scaling[0] * embed_a_t[ids[t]] @ embed_b.T``;
    ``logits[t] += scaling[1] * (h[t] @ head_a.T) @ head_b.T``.
    """

    embed_a_t: torch.Tensor | None
    embed_b: torch.Tensor | None
    head_a: torch.Tensor | None
    head_b: torch.Tensor | None
    scaling: torch.Tensor
    full: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [self.embed_a_t, self.embed_b, self.head_a, self.head_b, *self.full.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def vocab_image(embed: LoRAWeight | None, head: LoRAWeight | None, full: dict[str, torch.Tensor], max_rank: int,
                dtype: torch.dtype, *, pin_memory: bool) -> VocabImage:
    """The ``VocabImage`` of an adapter's vocabulary parts (``LoRAWeight`` factors as PEFT stores them:
    embedding ``a [r, V]``, ``b [H, r]``; head ``a [r, H]``, ``b [V, r]``), converted to ``dtype``.

    Raises ``AdapterFormatError`` if a value is NaN/Inf in ``dtype``.
    """
    def padded(source: torch.Tensor, rank_dim: int) -> torch.Tensor:
        shape = list(source.shape)
        shape[rank_dim] = max_rank
        out = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        out.narrow(rank_dim, 0, source.shape[rank_dim]).copy_(source)
        return out

    def copied(source: torch.Tensor) -> torch.Tensor:
        out = torch.empty(source.shape, dtype=dtype, pin_memory=pin_memory)
        return out.copy_(source)

    scaling = torch.zeros(2, dtype=torch.float32)
    parts: dict[str, torch.Tensor | None] = {"embed_a_t": None, "embed_b": None, "head_a": None, "head_b": None}
    if embed is not None:
        parts["embed_a_t"], parts["embed_b"] = padded(embed.a.T, 1), padded(embed.b, 1)
        scaling[0] = embed.scaling
    if head is not None:
        parts["head_a"], parts["head_b"] = padded(head.a, 0), padded(head.b, 1)
        scaling[1] = head.scaling
    image = VocabImage(**parts, scaling=scaling, full={m: copied(t) for m, t in full.items()})
    for name, tensor in list(parts.items()) + [(f"{m} (modules_to_save)", t) for m, t in image.full.items()]:
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            raise AdapterFormatError(f"{name} of the adapter contains NaN or Inf values (as {dtype})")
    return image


@dataclass(frozen=True)
class SlotImage:
    """One adapter ready to be copied into a GPU slot.

    - ``version_id``: the adapter's content id (as registered).
    - ``max_rank``: the image rank ``R`` every module is padded to (a multiple of ``page_rows``; 0 when the
      adapter has LoRA on ``embed_tokens`` / ``lm_head`` only).
    - ``data``: ``[numel]`` in the slot dtype; see the module docstring for the layout.
    - ``offsets``: ``(layer, module) -> (a_offset, b_offset)`` element offsets into ``data``
      for the targeted modules only.
    - ``scaling``: ``[num_layers, len(spec.module_shapes)] fp32``, module columns in
      ``spec.module_shapes`` order; 0 where the adapter does not target ``(layer, module)``.
    - ``module_shapes``: ``spec.module_shapes`` (``module -> (in_features, out_features)``).
    - ``vocab``: the ``embed_tokens`` / ``lm_head`` parts, or None.
    - ``magnitude``: DoRA only: ``(layer, module) -> m [out_features] fp32`` for every targeted
      module; empty for plain LoRA.
    - ``page_rows``: rank rows per weight page ``P`` (0: ``max_rank``, one page).
    """

    version_id: str
    max_rank: int
    data: torch.Tensor
    offsets: dict[ModuleKey, tuple[int, int]]
    scaling: torch.Tensor
    module_shapes: dict[str, tuple[int, int]]
    vocab: VocabImage | None = None
    magnitude: dict[ModuleKey, torch.Tensor] = field(default_factory=dict)
    page_rows: int = 0

    def __post_init__(self) -> None:
        if self.page_rows == 0:
            object.__setattr__(self, "page_rows", max(1, self.max_rank))
        if self.max_rank % self.page_rows:
            raise ValueError(f"SlotImage: max_rank={self.max_rank} is not a multiple of page_rows={self.page_rows}")

    @functools.cached_property
    def layout_key(self) -> tuple:
        """Equal for images whose ``data`` is laid out alike (numel, rank, page rows, module offsets in order):
        ``LoRADeviceWeights.write_many`` installs such images together through views built once."""
        return self.data.numel(), self.max_rank, self.page_rows, tuple(self.offsets.items())

    @property
    def num_pages(self) -> int:
        """Weight pages the image fills: ``max_rank / page_rows``."""
        return self.max_rank // self.page_rows

    @property
    def nbytes(self) -> int:
        """Host bytes of ``data`` and ``vocab`` (the scaling table is negligible)."""
        return self.data.numel() * self.data.element_size() + (self.vocab.nbytes if self.vocab is not None else 0)

    def a(self, key: ModuleKey) -> torch.Tensor:
        """``A`` of ``key`` padded to ``[R, in_features]`` (a view of ``data``). Raises ``KeyError`` if untargeted."""
        in_features, _ = self.module_shapes[key[1]]
        start = self.offsets[key][0]
        return self.data[start : start + self.max_rank * in_features].view(self.max_rank, in_features)

    def b_pages(self, key: ModuleKey) -> torch.Tensor:
        """``B`` of ``key`` as its pages, ``[R / P, out_features, P]`` (a view of ``data``). Raises ``KeyError``
        if untargeted."""
        _, out_features = self.module_shapes[key[1]]
        start = self.offsets[key][1]
        return self.data[start : start + out_features * self.max_rank].view(self.num_pages, out_features,
                                                                            self.page_rows)

    def b(self, key: ModuleKey) -> torch.Tensor:
        """``B`` of ``key`` padded to ``[out_features, R]``: a view of ``data`` with one page, a copy with several
        (write through :meth:`set_b`). Raises ``KeyError`` if untargeted."""
        pages = self.b_pages(key)
        if self.num_pages == 1:
            return pages[0]
        return pages.permute(1, 0, 2).reshape(pages.shape[1], self.max_rank)

    def set_b(self, key: ModuleKey, source: torch.Tensor) -> None:
        """Copy PEFT's ``lora_B`` ``source [out_features, r]`` (``r <= R``) into the first ``r`` columns of ``key``'s
        pages (converted to the image dtype); the other columns are left as they are."""
        pages, rank, step = self.b_pages(key), source.shape[1], self.page_rows
        for j in range(-(-rank // step)):
            width = min(step, rank - j * step)
            pages[j, :, :width].copy_(source[:, j * step : j * step + width])


def read_slot_image(
    layout: AdapterLayout,
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    *,
    version_id: str,
    pin_memory: bool,
    allocate: Allocate | None = None,
    check_finite: bool = True,
    page_rows: int | None = None,
    stored: dict[str, StoredTensor] | None = None,
) -> SlotImage:
    """Read the tensors of the adapter ``layout`` (checked by ``inspect_peft_adapter``)
    straight into a ``SlotImage`` of ``dtype``; nothing is hashed (``version_id`` is trusted).
    ``max_rank``: the pool's rank (``embed_tokens`` / ``lm_head`` parts are padded to it); ``page_rows``:
    the pool's weight-page rows, the projections padded to the adapter's own rank rounded up to a multiple of
    it (None: padded to ``max_rank``, one page).
    ``allocate`` gives the image's buffer (e.g. ``HostArena.empty``); default a new tensor,
    page-locked when ``pin_memory``. ``check_finite=False`` skips the NaN/Inf scan, for a re-read of
    content already hashed, matched and scanned as ``dtype`` (the loader's verified re-reads). ``stored``: the
    file's header (``stored_tensors``) when the caller parsed it already under an unchanged file signature.

    When every tensor is stored in ``dtype`` with rank R and R is one page, the image *is* the file's data
    section: one ``pread`` (the GIL released throughout) and the offsets taken from the header. Otherwise the
    tensors are read in one ``pread`` per contiguous run and laid out by ``_image_from_groups`` (a few torch and
    numpy calls per group of modules of one shape and dtype).

    Raises ``AdapterFormatError`` for unreadable or truncated tensor data, a file no longer
    matching ``layout``, or a NaN/Inf value (also one that appears only after the conversion
    to ``dtype``, e.g. fp32 70000 into float16).
    """
    path = Path(layout.path) / SAFETENSORS_NAME
    stored = stored if stored is not None else tensor_file.stored_tensors(path)
    expected = checked_shapes(layout, spec)
    check_listed(stored, expected)  # a header kept from an earlier read, or parsed again here
    target = _target(layout, spec, max_rank, dtype, allocate, pin_memory, page_rows)
    verbatim = _verbatim_buffer(layout, stored, target)
    data = read_tensor_data(path, stored, [name for name, _ in expected], into=verbatim)
    # A verbatim image needs no stacked copy of the factors (for a 16.8 MB adapter it took 2.4 of a 4.8 ms
    # re-read on a 2-core CPU), only of DoRA magnitudes when there are some.
    needs_groups = verbatim is None or any(plan.magnitude_name is not None for plan in layout.modules)
    modules = module_groups(layout.modules, data) if needs_groups else ()
    return _image(layout, modules, module_groups(layout.vocab_lora, data), data, target, version_id, verbatim,
                  check_finite=check_finite)


def read_new_slot_image(
    path: str | os.PathLike[str],
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    *,
    pin_memory: bool,
    allocate: Allocate | None = None,
    page_rows: int | None = None,
) -> tuple[SlotImage, dict[str, StoredTensor]]:
    """The first read of the adapter in folder ``path``: every check of ``load_peft_adapter`` (serving
    ``dtype``), its ``version_id`` computed (the image's), and its ``SlotImage`` (``max_rank``, ``page_rows``,
    ``allocate``: as ``read_slot_image``), all from one read of the file's data (into the image itself when
    it is the data verbatim). Returns the image and the file's header (``stored_tensors``), which later
    verified reads may reuse.

    The work is batched (``check_tensor_data``, ``_image_from_groups``): the calls that release the GIL (torch
    ops, large numpy ops, the hash), each a GIL hand-off on a loader thread while the engine thread runs Python,
    do not grow with the number of layers (``benchmarks/diag_first_read.py``).

    Raises what ``load_peft_adapter`` raises, and ``AdapterFormatError`` if a value is NaN/Inf in ``dtype`` (a DoRA
    magnitude: in float32).
    """
    layout, stored, identity = inspect_peft_tensors(path, spec, max_rank)
    target = _target(layout, spec, max_rank, dtype, allocate, pin_memory, page_rows)
    verbatim = _verbatim_buffer(layout, stored, target)
    data = read_peft_tensors(layout, stored, identity, into=verbatim)
    checked = check_tensor_data(layout, data, version_id=None, serving_dtype=dtype)
    image = _image(layout, checked.modules, checked.vocab, data, target, checked.version_id, verbatim,
                   check_finite=True)
    return image, stored


def image_rank(ranks: Iterable[int], max_rank: int, page_rows: int | None) -> int:
    """The rank an image pads its projections to: the largest of ``ranks`` rounded up to a multiple of
    ``page_rows`` (0 for none), or ``max_rank`` without ``page_rows``."""
    if page_rows is None:
        return max_rank
    return -(-max(ranks, default=0) // page_rows) * page_rows


def slot_image_from_adapter(
    adapter: LoRAAdapter, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype, *, pin_memory: bool,
    allocate: Allocate | None = None, page_rows: int | None = None,
) -> SlotImage:
    """The ``SlotImage`` of a loaded (validated, finite) ``adapter`` (buffer from ``allocate``; ``max_rank``
    and ``page_rows`` as in ``read_slot_image``). Module by module (torch ops per module): for tests and
    tools; the loader reads images with ``read_new_slot_image`` / ``read_slot_image``.

    Raises ``AdapterFormatError`` if a value overflows to Inf in ``dtype``.
    """
    ranks = {key: weight.rank for key, weight in adapter.weights.items()}
    rank = image_rank(ranks.values(), max_rank, page_rows)
    image = _empty_image(ranks, spec, rank, dtype, adapter.version_id, allocate or _new_tensor(pin_memory),
                         page_rows or rank)
    for key, weight in adapter.weights.items():
        _fill(image, key, weight.a, weight.b, weight.scaling, spec)
        if weight.magnitude is not None:
            image.magnitude[key] = weight.magnitude.float().clone()
    _check_finite(image, {key: (f"layer {key[0]} {key[1]} lora_A", f"layer {key[0]} {key[1]} lora_B")
                          for key in adapter.weights}, dtype)
    if adapter.vocab is not None:
        vocab = adapter.vocab
        image = dataclasses.replace(image, vocab=vocab_image(vocab.embed, vocab.head, vocab.full, max_rank, dtype,
                                                             pin_memory=pin_memory))
    return image


@dataclass(frozen=True)
class _Target:
    """What an image is built for: model shapes, image rank R, slot dtype, where its buffer comes from,
    rank rows per page, the pool's rank (vocabulary parts), whether vocabulary parts are page-locked."""

    spec: BaseModelSpec
    max_rank: int
    dtype: torch.dtype
    allocate: Allocate
    page_rows: int
    pool_rank: int
    pin_memory: bool


def _target(layout: AdapterLayout, spec: BaseModelSpec, max_rank: int, dtype: torch.dtype,
            allocate: Allocate | None, pin_memory: bool, page_rows: int | None) -> _Target:
    rank = image_rank([plan.hyper.rank for plan in layout.modules], max_rank, page_rows)
    return _Target(spec, rank, dtype, allocate or _new_tensor(pin_memory), page_rows or rank, max_rank, pin_memory)


def _new_tensor(pin_memory: bool) -> Allocate:
    return lambda numel, dtype: torch.empty(numel, dtype=dtype, pin_memory=pin_memory)


def _is_verbatim(layout: AdapterLayout, stored: dict[str, StoredTensor], target: _Target) -> bool:
    """The image is one page, every module has rank R and every tensor is stored in ``dtype`` at an aligned offset (DoRA magnitudes
    included: the data section read may span them, and the image's finite-value scan reads it as ``dtype``), and
    no ``embed_tokens`` / ``lm_head`` tensor lies in the file's data, which the one read would copy."""
    max_rank, dtype = target.max_rank, target.dtype
    if layout.vocab_lora or layout.full_modules or target.page_rows != max_rank:
        return False
    if any(plan.hyper.rank != max_rank for plan in layout.modules):
        return False
    names = [name for plan in layout.modules for name in (plan.a_name, plan.b_name, plan.magnitude_name) if name]
    return all(
        name in stored and STORED_DTYPES.get(stored[name].dtype) == dtype
        and stored[name].offset_bytes % dtype.itemsize == 0
        for name in names
    )


def _verbatim_buffer(layout: AdapterLayout, stored: dict[str, StoredTensor],
                     target: _Target) -> tuple[int, torch.Tensor] | None:
    """When the image is the file's data verbatim (``_is_verbatim``): (file offset, the image's buffer) of the
    span of the modules' lora_A / lora_B tensors, for the read to fill (``read_tensor_data``'s ``into``)."""
    if not layout.modules or not _is_verbatim(layout, stored, target):
        return None
    refs = [stored[name] for plan in layout.modules for name in (plan.a_name, plan.b_name)]
    start = min(ref.offset_bytes for ref in refs)
    end = max(ref.offset_bytes + ref.nbytes for ref in refs)
    return start, target.allocate((end - start) // target.dtype.itemsize, target.dtype)


def _image(layout: AdapterLayout, modules: tuple[ModuleGroup, ...], vocab: tuple[ModuleGroup, ...], data: TensorData,
           target: _Target, version_id: str, verbatim: tuple[int, torch.Tensor] | None, *,
           check_finite: bool) -> SlotImage:
    """The image of ``layout`` from its tensors read into ``data`` (``verbatim``: the data span that is the
    image) and stacked (``modules``, ``vocab``): lora_A / lora_B laid out, DoRA magnitudes, scalings, and the
    vocabulary parts. Raises ``AdapterFormatError`` for a NaN/Inf in ``dtype`` (``check_finite``) or in a DoRA
    magnitude as float32."""
    spec, dtype = target.spec, target.dtype
    scaling = _scaling_table(layout, spec)
    if verbatim is not None:
        image = _verbatim_image(layout, data.stored, verbatim, target, version_id, scaling)
    else:
        image = _image_from_groups(layout, modules, target, version_id, scaling)
    _set_magnitudes(image, layout, modules)
    if check_finite:
        _check_finite(image, {(plan.layer, plan.module): (plan.a_name, plan.b_name) for plan in layout.modules},
                      dtype)
    if layout.vocab_lora or layout.full_modules:
        lora = {}
        for group in vocab:
            a, b = _as_loaded(group.a.tensor()), _as_loaded(group.b.tensor())
            lora.update({plan.module: LoRAWeight(a=a[k], b=b[k], scaling=plan.hyper.scaling)
                         for k, plan in enumerate(group.plans)})
        full = {module: _as_loaded(data.tensor(name)) for module, name in layout.full_modules}
        image = dataclasses.replace(image, vocab=vocab_image(lora.get("embed_tokens"), lora.get("lm_head"), full,
                                                             target.pool_rank, dtype, pin_memory=target.pin_memory))
    return image


def _as_loaded(tensor: torch.Tensor) -> torch.Tensor:
    """A factor as it is converted to the slot dtype: through float32, as ``LoRAAdapter`` holds it (only a
    float64 one changes), so that every read of an adapter gives the same bytes."""
    return tensor.float() if tensor.dtype == torch.float64 else tensor


def _scaling_table(layout: AdapterLayout, spec: BaseModelSpec) -> torch.Tensor:
    """``[num_layers, len(spec.module_shapes)] fp32``: each module's scaling, 0 where untargeted (one op)."""
    columns = {module: i for i, module in enumerate(spec.module_shapes)}
    table = [[0.0] * len(columns) for _ in range(spec.num_layers)]
    for plan in layout.modules:
        table[plan.layer][columns[plan.module]] = plan.hyper.scaling
    return torch.tensor(table, dtype=torch.float32)


def _verbatim_image(layout: AdapterLayout, stored: dict[str, StoredTensor], verbatim: tuple[int, torch.Tensor],
                    target: _Target, version_id: str, scaling: torch.Tensor) -> SlotImage:
    """The image whose buffer holds the file's bytes from offset ``verbatim[0]`` on; module offsets from the
    header ``stored``. Raises nothing: every lora_A / lora_B of ``stored`` is ``[R, in]`` / ``[out, R]``
    (``check_listed`` against ``checked_shapes``, or ``check_same_header`` on a first read; every rank is R:
    ``_is_verbatim``), stored in the slot dtype (``_is_verbatim``) with a byte count that matches its shape
    (``check_listed``)."""
    spec, max_rank, dtype = target.spec, target.max_rank, target.dtype
    start, data = verbatim
    offsets = {}
    for plan in layout.modules:
        a, b = stored[plan.a_name], stored[plan.b_name]
        offsets[(plan.layer, plan.module)] = ((a.offset_bytes - start) // dtype.itemsize,
                                              (b.offset_bytes - start) // dtype.itemsize)
    return SlotImage(version_id, max_rank, data, offsets, scaling, dict(spec.module_shapes),
                     page_rows=target.page_rows)


def _image_from_groups(layout: AdapterLayout, groups: tuple[ModuleGroup, ...], target: _Target, version_id: str,
                       scaling: torch.Tensor) -> SlotImage:
    """The image laid out from stacked modules: per group of K modules (rank r, stored dtype), ``A`` padded to
    ``[K, R, in]`` and ``B`` to its pages ``[K, R / P, out, P]`` in the slot dtype (zeros past r; none of it when
    the stack already is that), then each module's two regions copied to their places in the buffer by two numpy
    calls per group (no tensor per module)."""
    spec, max_rank, dtype, step = target.spec, target.max_rank, target.dtype, target.page_rows
    offsets, numel = _padded_offsets([(plan.layer, plan.module) for plan in layout.modules], spec, max_rank)
    data = target.allocate(numel, dtype)
    image_bytes = data.view(torch.uint8).numpy() if groups else None
    for group in groups:
        in_features, out_features = group.a.shape[1], group.b.shape[0]
        rank, count = group.a.shape[0], len(group.plans)
        as_stored = STORED_DTYPES[group.a.dtype] == dtype, STORED_DTYPES[group.b.dtype] == dtype
        if rank == max_rank and as_stored[0]:
            a_rows = group.a.rows  # already [R, in] in the slot dtype
        else:
            a_image = (torch.empty if rank == max_rank else torch.zeros)(count, max_rank, in_features, dtype=dtype)
            a_image[:, :rank] = _as_loaded(group.a.tensor())
            a_rows = a_image.view(torch.uint8).numpy().reshape(count, -1)
        if rank == max_rank == step and as_stored[1]:
            b_rows = group.b.rows  # one page: PEFT's [out, R] itself
        else:
            b = _as_loaded(group.b.tensor())  # [K, out, r]
            b_pages = (torch.empty if rank == max_rank else torch.zeros)(count, max_rank // step, out_features, step,
                                                                          dtype=dtype)
            for j in range(-(-rank // step)):
                width = min(step, rank - j * step)
                b_pages[:, j, :, :width] = b[:, :, j * step : j * step + width]
            b_rows = b_pages.view(torch.uint8).numpy().reshape(count, -1)
        for index, rows in enumerate((a_rows, b_rows)):
            scatter_rows(image_bytes, [offsets[(p.layer, p.module)][index] * dtype.itemsize for p in group.plans], rows)
    return SlotImage(version_id, max_rank, data, offsets, scaling, dict(spec.module_shapes), page_rows=step)


def _set_magnitudes(image: SlotImage, layout: AdapterLayout, groups: tuple[ModuleGroup, ...]) -> None:
    """DoRA: each module's ``lora_magnitude_vector`` into ``image.magnitude`` as float32 (views of one tensor
    per group), which must be finite. Raises ``AdapterFormatError`` naming the first module's tensor that is not."""
    finite = True
    for group in groups:
        if group.magnitude is None:
            continue
        # [K, out], a copy (a view could outlive the image buffer it lies in), converted holding the GIL
        magnitude = torch.asarray(group.magnitude.tensor(), dtype=torch.float32, copy=True)
        finite = finite and bool(np.isfinite(magnitude.numpy()).all())
        for k, plan in enumerate(group.plans):
            image.magnitude[(plan.layer, plan.module)] = magnitude[k]
    if not finite:
        for plan in layout.modules:
            key = (plan.layer, plan.module)
            if key in image.magnitude and not bool(torch.isfinite(image.magnitude[key]).all()):
                raise AdapterFormatError(f"tensor {plan.magnitude_name!r} contains NaN or Inf values")


def _empty_image(
    ranks: dict[ModuleKey, int],
    spec: BaseModelSpec,
    max_rank: int,
    dtype: torch.dtype,
    version_id: str,
    allocate: Allocate,
    page_rows: int,
) -> SlotImage:
    """An image of rank ``max_rank`` (pages of ``page_rows``) for the modules in ``ranks``; zero-filled only if
    some module needs rank padding."""
    offsets, numel = _padded_offsets(ranks, spec, max_rank)
    data = allocate(numel, dtype)
    if any(rank != max_rank for rank in ranks.values()):
        data.zero_()
    scaling = torch.zeros(spec.num_layers, len(spec.module_shapes), dtype=torch.float32)
    return SlotImage(version_id, max_rank, data, offsets, scaling, dict(spec.module_shapes), page_rows=page_rows)


def _padded_offsets(keys: Iterable[ModuleKey], spec: BaseModelSpec,
                    max_rank: int) -> tuple[dict[ModuleKey, tuple[int, int]], int]:
    """The layout of an image padded to rank ``max_rank`` for the modules ``keys``: per module (by layer, then
    module order) the element offsets of its ``[R, in]`` A and its B pages, back to back; and the total numel."""
    offsets: dict[ModuleKey, tuple[int, int]] = {}
    numel = 0
    for key in _ordered(keys, spec.module_shapes):
        in_features, out_features = spec.module_shapes[key[1]]
        offsets[key] = (numel, numel + max_rank * in_features)
        numel += max_rank * (in_features + out_features)
    return offsets, numel


def _ordered(keys: Iterable[ModuleKey], module_order: Iterable[str]) -> list[ModuleKey]:
    """``keys`` by layer, then by the position of the module in ``module_order``."""
    column = {module: i for i, module in enumerate(module_order)}
    return sorted(keys, key=lambda key: (key[0], column[key[1]]))


def _fill(
    image: SlotImage, key: ModuleKey, a: torch.Tensor, b: torch.Tensor, scaling: float, spec: BaseModelSpec
) -> None:
    rank = a.shape[0]
    image.a(key)[:rank].copy_(a)
    image.set_b(key, b)
    image.scaling[key[0], list(spec.module_shapes).index(key[1])] = scaling


def _check_finite(image: SlotImage, names: dict[ModuleKey, tuple[str, str]], dtype: torch.dtype) -> None:
    """One pass over the whole buffer; only on failure is the offending tensor looked up."""
    if image.data.numel() == 0:
        return
    low, high = (value.tolist() for value in torch.aminmax(image.data))  # one op; tolist keeps the GIL
    if math.isfinite(low) and math.isfinite(high):
        return
    for key in _ordered(image.offsets, image.module_shapes):
        for name, tensor in zip(names[key], (image.a(key), image.b(key))):
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterFormatError(f"tensor {name!r} contains NaN or Inf values (as {dtype})")
    raise AdapterFormatError(f"adapter {image.version_id[:12]} contains NaN or Inf values (as {dtype})")

