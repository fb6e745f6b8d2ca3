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

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.adapters.adapter import LoRAAdapter, LoRAWeight
from loraplex.adapters.errors import AdapterFormatError
from loraplex.adapters.peft_format import SAFETENSORS_NAME, AdapterLayout, StoredTensor, stored_tensors
from loraplex.adapters.spec import BaseModelSpec

ModuleKey = tuple[int, str]  # (layer index, module name)
Allocate = Callable[[int, torch.dtype], torch.Tensor]  # (numel, dtype) -> uninitialised [numel] host tensor
_STORED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


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
    section: one ``pread`` (the GIL released throughout) and the offsets taken from the
    header. Otherwise a tensor stored in ``dtype`` whose image rows are contiguous (every
    ``lora_A``; a ``lora_B`` of rank R) is read directly into its place, and the others go
    through a temporary and a converting copy.

    Raises ``AdapterFormatError`` for unreadable or truncated tensor data, a file no longer
    matching ``layout``, or a NaN/Inf value (also one that appears only after the conversion
    to ``dtype``, e.g. fp32 70000 into float16).
    """
    path = Path(layout.path) / SAFETENSORS_NAME
    stored = stored if stored is not None else stored_tensors(path)
    names = {(plan.layer, plan.module): (plan.a_name, plan.b_name) for plan in layout.modules}
    fd = _open(path)
    try:
        rank = image_rank([plan.hyper.rank for plan in layout.modules], max_rank, page_rows)
        target = _Target(spec, rank, dtype, version_id, allocate or _new_tensor(pin_memory), page_rows or rank)
        read = _read_verbatim if _is_verbatim(layout, stored, target) else _read_per_tensor
        image = read(fd, layout, stored, target)
        _read_magnitudes(fd, layout, stored, image)
    finally:
        os.close(fd)
    _set_scalings(image, layout, spec)
    if check_finite:
        _check_finite(image, names, dtype)
    if layout.vocab_lora or layout.full_modules:
        image = dataclasses.replace(image, vocab=_read_vocab(path, layout, max_rank, dtype, pin_memory))
    return image


def _read_vocab(path: Path, layout: AdapterLayout, max_rank: int, dtype: torch.dtype, pin_memory: bool) -> VocabImage:
    """The ``embed_tokens`` / ``lm_head`` tensors of ``layout`` (checked) as a ``VocabImage``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            lora = {plan.module: LoRAWeight(a=handle.get_tensor(plan.a_name), b=handle.get_tensor(plan.b_name),
                                            scaling=plan.hyper.scaling) for plan in layout.vocab_lora}
            full = {module: handle.get_tensor(name) for module, name in layout.full_modules}
    except (SafetensorError, OSError) as exc:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: unreadable embed_tokens/lm_head tensors ({exc})") from exc
    return vocab_image(lora.get("embed_tokens"), lora.get("lm_head"), full, max_rank, dtype, pin_memory=pin_memory)


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
    and ``page_rows`` as in ``read_slot_image``).

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
        name in stored and _STORED_DTYPES.get(stored[name].dtype) == dtype
        and stored[name].offset_bytes % dtype.itemsize == 0
        for name in names
    )


@dataclass(frozen=True)
class _Target:
    """What an image is built for: model shapes, image rank R, slot dtype, id, where its buffer comes from,
    rank rows per page."""

    spec: BaseModelSpec
    max_rank: int
    dtype: torch.dtype
    version_id: str
    allocate: Allocate
    page_rows: int


def _new_tensor(pin_memory: bool) -> Allocate:
    return lambda numel, dtype: torch.empty(numel, dtype=dtype, pin_memory=pin_memory)


def _read_verbatim(fd: int, layout: AdapterLayout, stored: dict[str, StoredTensor], target: _Target) -> SlotImage:
    """The file's data section as the image (one read); module offsets from the header."""
    spec, max_rank, dtype = target.spec, target.max_rank, target.dtype
    refs = [stored[name] for plan in layout.modules for name in (plan.a_name, plan.b_name)]
    start = min(ref.offset_bytes for ref in refs)
    end = max(ref.offset_bytes + ref.nbytes for ref in refs)
    data = target.allocate((end - start) // dtype.itemsize, dtype)
    _pread_exact(fd, data, start, f"{layout.modules[0].a_name} .. {layout.modules[-1].b_name}")
    offsets = {}
    for plan in layout.modules:
        a, b = stored[plan.a_name], stored[plan.b_name]
        in_features, out_features = spec.module_shapes[plan.module]
        expected = max_rank * in_features * dtype.itemsize, out_features * max_rank * dtype.itemsize
        if (a.shape, b.shape) != ((max_rank, in_features), (out_features, max_rank)) or (a.nbytes, b.nbytes) != expected:
            raise AdapterFormatError(f"tensor {plan.a_name!r}: {SAFETENSORS_NAME} changed since it was checked")
        offsets[(plan.layer, plan.module)] = ((a.offset_bytes - start) // dtype.itemsize,
                                              (b.offset_bytes - start) // dtype.itemsize)
    scaling = torch.zeros(spec.num_layers, len(spec.module_shapes), dtype=torch.float32)
    return SlotImage(target.version_id, max_rank, data, offsets, scaling, dict(spec.module_shapes),
                     page_rows=target.page_rows)


def _read_per_tensor(fd: int, layout: AdapterLayout, stored: dict[str, StoredTensor], target: _Target) -> SlotImage:
    """A padded image filled tensor by tensor (direct reads where the layout allows)."""
    ranks = {(plan.layer, plan.module): plan.hyper.rank for plan in layout.modules}
    image = _empty_image(ranks, target.spec, target.max_rank, target.dtype, target.version_id,
                         target.allocate, target.page_rows)
    for plan in layout.modules:
        key, rank = (plan.layer, plan.module), plan.hyper.rank
        _read_into(fd, plan.a_name, stored, image.a(key)[:rank])
        if image.num_pages == 1:
            _read_into(fd, plan.b_name, stored, image.b(key)[:, :rank])
        else:  # PEFT's [out, r] spread over the pages
            b = torch.empty(image.module_shapes[plan.module][1], rank, dtype=image.data.dtype)
            _read_into(fd, plan.b_name, stored, b)
            image.set_b(key, b)
    return image


def _read_magnitudes(fd: int, layout: AdapterLayout, stored: dict[str, StoredTensor], image: SlotImage) -> None:
    """DoRA: each module's ``lora_magnitude_vector`` into ``image.magnitude`` as float32 (must be finite)."""
    for plan in layout.modules:
        if plan.magnitude_name is None:
            continue
        magnitude = torch.empty(image.module_shapes[plan.module][1], dtype=torch.float32)
        _read_into(fd, plan.magnitude_name, stored, magnitude)
        if not bool(torch.isfinite(magnitude).all()):
            raise AdapterFormatError(f"tensor {plan.magnitude_name!r} contains NaN or Inf values")
        image.magnitude[(plan.layer, plan.module)] = magnitude


def _set_scalings(image: SlotImage, layout: AdapterLayout, spec: BaseModelSpec) -> None:
    columns = list(spec.module_shapes)
    for plan in layout.modules:
        image.scaling[plan.layer, columns.index(plan.module)] = plan.hyper.scaling


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise AdapterFormatError(f"{SAFETENSORS_NAME}: cannot be opened ({exc})") from exc


def _read_into(fd: int, name: str, stored: dict[str, StoredTensor], dest: torch.Tensor) -> None:
    """Fill ``dest`` with tensor ``name`` of the open file ``fd`` (converted to ``dest.dtype``)."""
    ref = stored.get(name)
    if ref is None or ref.dtype not in _STORED_DTYPES or ref.shape != tuple(dest.shape):
        raise AdapterFormatError(f"tensor {name!r}: {SAFETENSORS_NAME} changed since it was checked")
    source_dtype = _STORED_DTYPES[ref.dtype]
    if ref.nbytes != dest.numel() * source_dtype.itemsize:
        raise AdapterFormatError(f"tensor {name!r}: {ref.nbytes} bytes stored for shape {list(ref.shape)}")
    if source_dtype == dest.dtype and dest.is_contiguous():
        _pread_exact(fd, dest, ref.offset_bytes, name)
        return
    staging = torch.empty(ref.shape, dtype=source_dtype)
    _pread_exact(fd, staging, ref.offset_bytes, name)
    dest.copy_(staging)


# A read of at least PARALLEL_READ_MIN_BYTES is split into PARALLEL_READ_PARTS parts read side by side (os.preadv
# releases the GIL): one thread copies files from the page cache at ~5 GB/s (an H200 host: a 16.8 MB adapter's
# pread took 3.2 ms of its 6.9 ms disk -> slot; benchmarks/diag_disk_to_slot.py, RESULTS.md session 14).
PARALLEL_READ_MIN_BYTES = 4 << 20
PARALLEL_READ_PARTS = 4
PARALLEL_READ_ALIGN_BYTES = 4096  # parts start on page boundaries of the destination
_read_pool: concurrent.futures.ThreadPoolExecutor | None = None
_read_pool_lock = threading.Lock()


def _pread_exact(fd: int, dest: torch.Tensor, offset_bytes: int, name: str) -> None:
    """Read ``dest.nbytes`` bytes at ``offset_bytes`` into the contiguous CPU tensor ``dest`` (in
    ``PARALLEL_READ_PARTS`` parts on as many threads from ``PARALLEL_READ_MIN_BYTES`` on).
    Raises ``AdapterFormatError`` if the file ends first."""
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    if len(view) < PARALLEL_READ_MIN_BYTES or PARALLEL_READ_PARTS < 2:
        _pread_part(fd, view, offset_bytes, name)
        return
    per_part = -(-len(view) // PARALLEL_READ_PARTS)
    step = -(-per_part // PARALLEL_READ_ALIGN_BYTES) * PARALLEL_READ_ALIGN_BYTES
    parts = [(start, min(start + step, len(view))) for start in range(0, len(view), step)]
    futures = []
    try:
        try:
            pool = _parallel_read_pool()
            for start, end in parts[1:]:
                futures.append(pool.submit(_pread_part, fd, view[start:end], offset_bytes + start, name))
        except RuntimeError:  # the interpreter is shutting down (no new threads): the rest on this thread
            for start, end in parts[1 + len(futures):]:
                _pread_part(fd, view[start:end], offset_bytes + start, name)
        _pread_part(fd, view[parts[0][0]:parts[0][1]], offset_bytes, name)
    finally:
        # every part has ended before the caller closes fd or reuses dest, whichever part failed
        concurrent.futures.wait(futures)
    for future in futures:
        future.result()  # a later part's error (truncated file)


def _pread_part(fd: int, view: memoryview, offset_bytes: int, name: str) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset_bytes + done)
        if count <= 0:
            raise AdapterFormatError(f"tensor {name!r}: {SAFETENSORS_NAME} is truncated")
        done += count


def _parallel_read_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _read_pool
    with _read_pool_lock:
        if _read_pool is None:
            _read_pool = concurrent.futures.ThreadPoolExecutor(PARALLEL_READ_PARTS - 1,
                                                               thread_name_prefix="loraplex-pread")
        return _read_pool


def _forget_read_pool_in_child() -> None:
    """After ``fork`` the parent's pool has no threads in the child: the child starts its own."""
    global _read_pool, _read_pool_lock
    _read_pool, _read_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_read_pool_in_child)


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
    offsets: dict[ModuleKey, tuple[int, int]] = {}
    numel = 0
    for key in _ordered(ranks, spec.module_shapes):
        in_features, out_features = spec.module_shapes[key[1]]
        offsets[key] = (numel, numel + max_rank * in_features)
        numel += max_rank * (in_features + out_features)
    data = allocate(numel, dtype)
    if any(rank != max_rank for rank in ranks.values()):
        data.zero_()
    scaling = torch.zeros(spec.num_layers, len(spec.module_shapes), dtype=torch.float32)
    return SlotImage(version_id, max_rank, data, offsets, scaling, dict(spec.module_shapes), page_rows=page_rows)


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
    low, high = torch.aminmax(image.data)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return
    for key in _ordered(image.offsets, image.module_shapes):
        for name, tensor in zip(names[key], (image.a(key), image.b(key))):
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterFormatError(f"tensor {name!r} contains NaN or Inf values (as {dtype})")
    raise AdapterFormatError(f"adapter {image.version_id[:12]} contains NaN or Inf values (as {dtype})")

