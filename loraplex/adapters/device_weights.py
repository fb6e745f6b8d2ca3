"""The paged LoRA A/B weight pool on the device, its page table and its writes.

Adapters' weights live in pages of ``P`` rank rows (``page_rows``) from one pool per layer ``l`` and
module ``m`` (S = max_loras adapter slots, N = num_pages pages, R = max_lora_rank):

- ``a[l][m]``: ``[N, P, in_features]`` in ``dtype`` (rows of lora_A),
- ``b[l][m]``: ``[N, out_features, P]`` in ``dtype`` (columns of lora_B),
- ``page_table``: ``[S, ceil(R / P)] int32``: the pages of slot ``s``'s adapter in rank order (-1 past them);
  the same pages in every ``(l, m)``, so one table serves every layer; ``ranks``: ``[S] int32``, the rank
  rows slot ``s`` uses (its image rank, a multiple of ``P``; 0 for an empty or disabled slot),
- ``scaling[l][m]``: ``[S] fp32`` (0 where the slot's adapter does not target ``(l, m)``), views of
  one ``[L, M, S]`` table so that one copy writes a slot's scalings.

An adapter of rank ``r`` takes ``ceil(r / P)`` pages (S-LoRA, Sheng et al. 2023, "unified paging"; the
pool is sized beside the KV cache, not shared with it): memory proportional to its own rank, not to
``max_lora_rank``. With ``P = R`` and ``N = S`` (the defaults) every adapter takes one page: the padded
``[S, R, in]`` / ``[S, out, R]`` slot rectangles of a pool without paging.

Semantics: ``y[t] += scaling[l][m][s] * (x[t] @ A_s.T) @ B_s.T`` for ``s = slot(t)``, nothing when
``s == -1``, where ``A_s = concat_j a[l][m][page_table[s, j]]`` (``[ranks[s], in]``) and
``B_s = concat_j b[l][m][page_table[s, j]]`` along the rank (``[out, ranks[s]]``); zero rows past an
adapter's rank make the padded product equal the rank-r one.

Vocabulary-sized modules (when ``spec.vocab_size`` is set; V = vocab, H = hidden, K = full-module slots):

- ``embed_a_t [S, V, R]``, ``embed_b [S, H, R]``: LoRA on ``embed_tokens`` (None when ``spec.unserved_modules``
  holds it, as for ``head_a`` / ``head_b`` and ``lm_head``),
  ``e[t] += vocab_scaling[0, s] * embed_a_t[s, ids[t]] @ embed_b[s].T``;
- ``head_a [S, R, H]``, ``head_b [S, V, R]``: LoRA on ``lm_head``,
  ``logits[t] += vocab_scaling[1, s] * (h[t] @ head_a[s].T) @ head_b[s].T``;
- ``full [K, V, H]``: ``modules_to_save`` copies; ``full_index [2, S] int64`` (embedding, head) names the
  copy an adapter slot uses (-1: the base module), mirrored on the host in ``full_index_host``;
  ``vocab_lora_host [2][S]``: whether each slot holds LoRA on the embedding / the head (host only).

DoRA (Liu et al. 2024): ``gain[l][m]``: ``[S + 1, out_features] fp32``, column views of one
``[L, S + 1, sum(out)]`` table. Row ``s`` of a slot holding a DoRA adapter is
``g = m / ||W + scaling * B @ A||_row`` (``m`` its magnitude vector, ``W`` the base weight, the
L2 norm of each output row; PEFT ``DoraLinearLayer``), computed once at install in float32; every
other row is 1, and so is row ``S``, the row a token without an adapter (slot -1) reads after
``slot mod (S + 1)``. The model then rescales: ``y[t] = gain[l][m][s][:] * (y[t] - bias) + bias``
after the LoRA delta is added (PEFT's ``result + (g - 1) * (base - bias) + g * scaling * lora``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from loraplex.adapters.config import pages_per_adapter
from loraplex.adapters.errors import AdapterUnsupportedError
from loraplex.adapters.slot_image import ModuleKey, SlotImage
from loraplex.adapters.spec import BaseModelSpec

SLOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PerLayer = list[dict[str, torch.Tensor]]  # [layer][module] -> tensor
_FULL_ROWS = {"embed_tokens": 0, "lm_head": 1}  # row of full_index
# (layer, module, first row, end row) -> those rows of the base weight W [rows, in_features], any float dtype
BaseWeightRows = Callable[[int, str, int, int], torch.Tensor]
_NORM_CHUNK_ELEMENTS = 1 << 23  # rows of W + scaling * B @ A materialised at once (32 MiB in float32)
Write = tuple[int, SlotImage, tuple[int, ...]]  # (slot, image, its pages in rank order)


# A group of at least this many one-page images is scattered with two index_copy_ per (layer, module) rather than
# one torch._foreach_copy_ over a view per image and factor: building those views costs the host ~1.4 us each (0.2 ms
# per q/v Llama-2-7B image, 10 ms for the 51 installs of one prompt-carrying step; RESULTS.md session 14).
INDEX_COPY_MIN_IMAGES = 8


def page_runs(pages: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(first image page, first pool page, length)`` of each run of consecutive pool pages in ``pages``."""
    runs: list[tuple[int, int, int]] = []
    for j, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((j, page, 1))
    return runs


class LoRADeviceWeights:
    """A zeroed pool of ``num_pages`` weight pages of ``page_rows`` rank rows for ``num_slots`` adapters of
    rank <= ``max_lora_rank`` on model ``spec`` (module docstring). ``page_rows`` defaults to
    ``max_lora_rank`` and ``num_pages`` to ``num_slots * ceil(max_lora_rank / page_rows)`` (every slot can
    hold a max-rank adapter at once).

    Raises ``ValueError`` for a ``dtype`` other than fp16, bf16 or fp32, a ``page_rows`` that is neither
    ``max_lora_rank`` nor a power of two below it, or fewer pages than one max-rank adapter takes.
    """

    def __init__(self, spec: BaseModelSpec, num_slots: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str, max_full_module_slots: int = 0, *, page_rows: int | None = None,
                 num_pages: int | None = None) -> None:
        if dtype not in SLOT_DTYPES:
            raise ValueError(f"LoRASlotPool.dtype={dtype!r}: must be one of {list(SLOT_DTYPES)}")
        page_rows = page_rows or max_lora_rank
        if page_rows != max_lora_rank and (page_rows & (page_rows - 1) or not 1 <= page_rows <= max_lora_rank):
            raise ValueError(f"LoRADeviceWeights: page_rows={page_rows} must be a power of two in "
                             f"1..max_lora_rank={max_lora_rank} (or max_lora_rank itself: one page per adapter)")
        max_pages = pages_per_adapter(max_lora_rank, page_rows)
        num_pages = num_slots * max_pages if num_pages is None else num_pages
        if num_pages < max_pages:
            raise ValueError(f"LoRADeviceWeights: num_pages={num_pages} is fewer than the {max_pages} pages of one "
                             f"adapter of max_lora_rank={max_lora_rank}")
        self.spec = spec
        self.num_slots = num_slots
        self.max_lora_rank = max_lora_rank
        self.page_rows = page_rows
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        S, N, P = num_slots, num_pages, page_rows
        shapes = spec.module_shapes
        self._scaling_table = self._zeros(spec.num_layers, len(shapes), S, dtype=torch.float32)
        self.a: _PerLayer = [{m: self._zeros(N, P, i) for m, (i, _) in shapes.items()} for _ in range(spec.num_layers)]
        self.b: _PerLayer = [{m: self._zeros(N, o, P) for m, (_, o) in shapes.items()} for _ in range(spec.num_layers)]
        self.scaling: _PerLayer = [{m: self._scaling_table[layer, i] for i, m in enumerate(shapes)}
                                   for layer in range(spec.num_layers)]
        self.page_table = torch.full((S, max_pages), -1, dtype=torch.int32, device=self.device)
        self.ranks = self._zeros(S, dtype=torch.int32)
        self._slot_pages: list[tuple[int, ...]] = [()] * S  # host mirror of page_table (pages of the last write)
        self._written: list[frozenset[ModuleKey]] = [frozenset()] * N  # (layer, module)s non-zero per page
        columns = [0]
        for _, out in shapes.values():
            columns.append(columns[-1] + out)
        self._gain_table = torch.ones(spec.num_layers, S + 1, columns[-1], dtype=torch.float32, device=self.device)
        self.gain: _PerLayer = [{m: self._gain_table[layer, :, columns[i]:columns[i + 1]] for i, m in enumerate(shapes)}
                                for layer in range(spec.num_layers)]
        self._gain_columns = {m: (columns[i], columns[i + 1]) for i, m in enumerate(shapes)}
        self.dora_slots: set[int] = set()  # slots whose adapter is a DoRA one (gains not all 1)
        self._staging: torch.Tensor | None = None  # write_many's device staging buffer, kept between installs
        self._staging_view_cache: dict[tuple, list[torch.Tensor]] = {}
        # On CUDA the host-to-device copies of write_many run on a stream of their own, so that with async
        # scheduling an install for step N+1 overlaps step N's kernels (see _scatter); _staging_free marks
        # the compute stream's last read of the staging buffer.
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging_free: torch.cuda.Event | None = None
        self._base_weight: BaseWeightRows | None = None
        self._init_vocab(max_full_module_slots)

    def _init_vocab(self, max_full_module_slots: int) -> None:
        """The vocabulary-sized slot tensors (module docstring); None when ``spec.vocab_size`` is None."""
        S, R, V, H = self.num_slots, self.max_lora_rank, self.spec.vocab_size, self.spec.hidden_size
        if V is None and max_full_module_slots:
            raise ValueError("LoRADeviceWeights: max_full_module_slots needs a spec with vocab_size")
        self.has_vocab = V is not None
        embed = V is not None and "embed_tokens" not in self.spec.unserved_modules  # (lora_target_modules)
        head = V is not None and "lm_head" not in self.spec.unserved_modules
        self.embed_a_t = self._zeros(S, V, R) if embed else None
        self.embed_b = self._zeros(S, H, R) if embed else None
        self.head_a = self._zeros(S, R, H) if head else None
        self.head_b = self._zeros(S, V, R) if head else None
        self.vocab_scaling = self._zeros(2, S, dtype=torch.float32) if V else None
        self.max_full_module_slots = max_full_module_slots
        self.full = self._zeros(max_full_module_slots, V, H) if max_full_module_slots else None
        self.full_index = torch.full((2, S), -1, dtype=torch.int64, device=self.device)
        self.full_index_host = [[-1] * S, [-1] * S]
        self.vocab_lora_host = [[False] * S, [False] * S]

    def write_full(self, slot: int, module: str, index: int, weight: torch.Tensor) -> None:
        """Copy a ``modules_to_save`` matrix ``weight [V, H]`` into full-module slot ``index`` and make
        adapter slot ``slot`` use it for ``module`` (``"embed_tokens"`` or ``"lm_head"``); enqueued without
        waiting."""
        row = _FULL_ROWS[module]
        self.full[index].copy_(weight, non_blocking=True)
        self.full_index[row, slot] = index
        self.full_index_host[row][slot] = index

    def clear_full(self, slot: int) -> None:
        """Adapter slot ``slot`` uses the base ``embed_tokens`` / ``lm_head`` again (no device write when it
        already does)."""
        if all(row[slot] == -1 for row in self.full_index_host):
            return
        self.full_index[:, slot] = -1
        for row in self.full_index_host:
            row[slot] = -1

    def _write_vocab(self, slot: int, image: SlotImage) -> None:
        """The image's LoRA on ``embed_tokens`` / ``lm_head`` into ``slot`` (scalings 0 for parts it lacks).
        Raises ``ValueError`` for LoRA there when these slots hold none (the pool refuses such adapters)."""
        vocab = image.vocab
        if not self.has_vocab:
            if vocab is not None and (vocab.embed_a_t is not None or vocab.head_a is not None):
                raise ValueError("LoRADeviceWeights: these slots hold no embed_tokens/lm_head LoRA")
            return
        if vocab is None:
            self.vocab_scaling[:, slot] = 0.0
            self.vocab_lora_host[0][slot] = self.vocab_lora_host[1][slot] = False
            return
        for dest, source in ((self.embed_a_t, vocab.embed_a_t), (self.embed_b, vocab.embed_b),
                             (self.head_a, vocab.head_a), (self.head_b, vocab.head_b)):
            if source is not None:
                if dest is None:  # the module is not served (the adapter is refused before it gets here)
                    raise ValueError("LoRADeviceWeights: LoRA on a vocabulary module these slots do not serve")
                dest[slot].copy_(source, non_blocking=True)
        self.vocab_scaling[:, slot].copy_(vocab.scaling, non_blocking=True)
        self.vocab_lora_host[0][slot] = vocab.embed_a_t is not None
        self.vocab_lora_host[1][slot] = vocab.head_a is not None

    def bind_base_weights(self, rows: BaseWeightRows) -> None:
        """Where DoRA installs read the base weight: ``rows(layer, module, start, stop)`` -> rows
        ``start..stop`` of ``W [out_features, in_features]`` on this device (dequantized if stored in FP8)."""
        self._base_weight = rows

    def replace_a(self, layer: int, module: str, storage: torch.Tensor) -> None:
        """Hold the A pages of ``(layer, module)`` in ``storage`` from now on (``[num_pages, page_rows, in]``, the
        pool's dtype and device; e.g. a view into a linear's folded base weight, ``LinearWithLoRA.fold_lora_a``),
        the current pages copied into it.

        Raises ``ValueError`` for another shape, dtype or device."""
        current = self.a[layer][module]
        if storage.shape != current.shape or storage.dtype != current.dtype or storage.device != current.device:
            raise ValueError(f"LoRADeviceWeights.replace_a({layer}, {module!r}): storage {tuple(storage.shape)} "
                             f"{storage.dtype} on {storage.device}, expected {tuple(current.shape)} {current.dtype} "
                             f"on {current.device}")
        if storage.data_ptr() != current.data_ptr():
            storage.copy_(current)
        self.a[layer][module] = storage

    def check_dora(self, lora_name: str) -> None:
        """Raise ``AdapterUnsupportedError`` unless DoRA adapters can be installed here (base weights bound)."""
        if self._base_weight is None:
            raise AdapterUnsupportedError(
                f"adapter {lora_name!r} is a DoRA adapter (use_dora=true), but these adapter slots have no base "
                "model weights to compute its column norms from"
            )

    def gain_columns(self, layer: int, modules: list[str]) -> torch.Tensor:
        """``[S + 1, sum(out)] fp32``: the gains of ``modules`` (consecutive in ``spec.module_shapes``, as a
        fused projection's slices are) side by side, one view of the table.

        Raises ``ValueError`` if the modules are not consecutive."""
        spans = [self._gain_columns[m] for m in modules]
        if any(end != start for (_, end), (start, _) in zip(spans, spans[1:])):
            raise ValueError(f"gain_columns: modules {modules} are not consecutive in {list(self.spec.module_shapes)}")
        return self._gain_table[layer, :, spans[0][0]:spans[-1][1]]

    def pages_needed(self, image: SlotImage) -> int:
        """Pages ``image`` takes here. Raises ``ValueError`` if it was built for another page size."""
        if image.max_rank and image.page_rows != self.page_rows:
            raise ValueError(f"LoRADeviceWeights: image of {image.page_rows}-row pages, the pool's are "
                             f"{self.page_rows} rows")
        return image.num_pages

    def write(self, slot: int, image: SlotImage, pages: tuple[int, ...]) -> None:
        """Overwrite ``slot`` with ``image`` in ``pages`` (free pool pages, ``pages_needed(image)`` of them, in rank
        order): one copy per targeted module and run of consecutive pages from the image, zeros for modules an
        earlier holder of a page wrote and this adapter does not target, one copy for all scalings; enqueued
        without waiting. Nothing of a previous adapter survives. Raises ``ValueError`` for a wrong page count; if
        a copy raises, the slot is marked unknown (see ``invalidate``)."""
        self._check_pages(image, pages)
        self._slot_pages[slot] = pages
        try:
            self._zero_stale([(slot, image, pages)])
            keys = list(image.offsets)
            destinations: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            a_sources = [image.a(key).view(image.num_pages, self.page_rows, -1) for key in keys]
            b_sources = [image.b_pages(key) for key in keys]
            self._page_copies(keys, pages, a_sources + b_sources, destinations, sources)
            if keys:  # an adapter only on embed_tokens / lm_head has none
                torch._foreach_copy_(destinations, sources, non_blocking=True)  # one call, not 2 per module
            self._scaling_table[:, :, slot].copy_(image.scaling, non_blocking=True)
            self._set_page_tables([(slot, image, pages)])
            self._write_vocab(slot, image)
            self._gain_table[:, slot] = 1.0
            self._write_gains(slot, image)
        except Exception:
            self.invalidate(slot)
            raise
        self._mark_written([(slot, image, pages)])

    def write_many(self, writes: list[Write], *, staging_bytes: int) -> None:
        """Overwrite several slots at once (distinct slots and pages), as ``write`` would one by one, with
        one host-to-device copy per image and one device-side ``torch._foreach_copy_`` per group of
        up to ``staging_bytes`` of images sharing a layout (instead of two small host-to-device
        copies per module and image): the images are copied whole into a device staging buffer
        ``[n, numel]`` (kept between calls) and scattered from there into their pages; the scalings and page
        tables of a group take one copy each. Enqueued without waiting. Raises ``ValueError`` for a wrong page
        count; if a copy raises, every slot of ``writes`` is marked unknown (see ``invalidate``)."""
        for slot, image, pages in writes:
            self._check_pages(image, pages)
            self._slot_pages[slot] = pages
        groups: dict[tuple, list[Write]] = {}
        for write in writes:
            image = write[1]
            groups.setdefault(image.layout_key, []).append(write)
        try:
            self._zero_stale(writes)
            for members in groups.values():
                per_chunk = max(1, staging_bytes // max(1, members[0][1].nbytes))
                if self._staging is not None:  # fill the buffer there is (reserved, or grown) before growing it
                    per_chunk = max(1, min(per_chunk, self._staging.numel() // max(1, members[0][1].data.numel())))
                for start in range(0, len(members), per_chunk):
                    self._scatter(members[start : start + per_chunk])
            self._set_page_tables(writes)
            self._gain_table.index_fill_(1, self._to_device(torch.tensor([slot for slot, _, _ in writes])), 1.0)
            for slot, image, _ in writes:
                self._write_vocab(slot, image)
                self._write_gains(slot, image)
        except Exception:
            for slot, _, _ in writes:
                self.invalidate(slot)
            raise
        self._mark_written(writes)

    def _check_pages(self, image: SlotImage, pages: tuple[int, ...]) -> None:
        needed = self.pages_needed(image)
        if len(pages) != needed or any(not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"LoRADeviceWeights: adapter {image.version_id[:12]} needs {needed} pages of "
                             f"0..{self.num_pages - 1}, given {list(pages)}")

    def _zero_stale(self, writes: list[Write]) -> None:
        """Zero, in each page given to a write, the modules an earlier holder wrote and this image does not target
        (one multi-tensor call)."""
        stale: list[torch.Tensor] = []
        for _, image, pages in writes:
            for page in pages:
                for layer, module in self._written[page] - image.offsets.keys():
                    stale += [self.a[layer][module][page], self.b[layer][module][page]]
        if stale:
            torch._foreach_zero_(stale)

    def _mark_written(self, writes: list[Write]) -> None:
        for _, image, pages in writes:
            for page in pages:
                self._written[page] = frozenset(image.offsets)

    def _page_copies(self, keys: list[ModuleKey], pages: tuple[int, ...], sources: list[torch.Tensor],
                     destinations: list[torch.Tensor], source_views: list[torch.Tensor]) -> None:
        """Append the (destination, source) pairs that put an image's pages into ``pages``: ``sources`` are its A
        factors as ``[pages, P, in]`` then its B factors as ``[pages, out, P]``, in ``keys`` order; one pair per
        factor and run of consecutive pool pages."""
        runs = page_runs(pages)
        pools = [self.a[layer][module] for layer, module in keys] + [self.b[layer][module] for layer, module in keys]
        if len(runs) == 1:  # the common case: one contiguous run
            _, start, length = runs[0]
            destinations += [pool[start : start + length] for pool in pools]
            source_views += sources
            return
        for pool, source in zip(pools, sources):
            for first, start, length in runs:
                destinations.append(pool[start : start + length])
                source_views.append(source[first : first + length])

    def _set_page_tables(self, writes: list[Write]) -> None:
        """``page_table`` rows and ``ranks`` of the written slots (one host-to-device copy each)."""
        width = self.page_table.shape[1]
        rows = torch.tensor([list(pages) + [-1] * (width - len(pages)) for _, _, pages in writes], dtype=torch.int32)
        ranks = torch.tensor([image.max_rank for _, image, _ in writes], dtype=torch.int32)
        slots = self._to_device(torch.tensor([slot for slot, _, _ in writes], dtype=torch.int64))
        self.page_table.index_copy_(0, slots, self._to_device(rows))
        self.ranks.index_copy_(0, slots, self._to_device(ranks))

    def _scatter(self, members: list[Write]) -> None:
        """Images of one layout -> a staging buffer on the device (one host-to-device copy per image) -> their
        pages with one ``torch._foreach_copy_`` (a few multi-tensor kernels on CUDA, where two ``index_copy_``
        per (layer, module) cost ~900 launches per install). The staging buffer is kept between installs
        (allocated at the first, grown when a group needs more). Small per-call device tensors (slot ids,
        scalings) remain.

        On CUDA the host-to-device copies run on the copy stream: they wait only for the compute stream's
        last read of the staging buffer (the previous scatter), not for the kernels queued before this
        call, so with async scheduling they overlap the running step (S-LoRA's adapter prefetch on a
        separate stream, Sheng et al. 2023, sec. 5); the scatter into the pages stays on the compute stream
        after the copies (an event), in order with the steps that read those pages. The host images'
        reuse (host_arena's events, recorded on the compute stream) stays ordered after the copies."""
        first = members[0][1]
        numel = first.data.numel()
        staging = self._staging_rows(len(members), numel)
        with self._on_copy_stream():
            for row, (_, image, _) in enumerate(members):
                staging[row].copy_(image.data, non_blocking=True)
        keys = list(first.offsets)
        if keys and first.num_pages == 1 and len(members) >= INDEX_COPY_MIN_IMAGES:
            self._index_copy_pages(first, staging, [pages[0] for _, _, pages in members])
        elif keys:  # an adapter only on embed_tokens / lm_head has none
            destinations: list[torch.Tensor] = []
            sources: list[torch.Tensor] = []
            for row, (_, _, pages) in enumerate(members):
                self._page_copies(keys, pages, self._staging_views(first, row), destinations, sources)
            torch._foreach_copy_(destinations, sources, non_blocking=True)
        if self._copy_stream is not None:
            self._staging_free = torch.cuda.Event()
            self._staging_free.record(torch.cuda.current_stream(self.device))
        slots = self._to_device(torch.tensor([slot for slot, _, _ in members], dtype=torch.int64))
        scalings = torch.stack([image.scaling for _, image, _ in members], dim=-1)  # [L, M, n] fp32
        self._scaling_table.index_copy_(2, slots, self._to_device(scalings))

    def _index_copy_pages(self, layout: SlotImage, staging: torch.Tensor, pages: list[int]) -> None:
        """One-page images staged in rows of ``staging`` (``[n, numel]``, ``layout``'s layout) into pool pages
        ``pages`` (one each): two ``index_copy_`` per (layer, module), whatever the number of images."""
        index = self._to_device(torch.tensor(pages, dtype=torch.int64))
        n, P, shapes = len(pages), self.page_rows, self.spec.module_shapes
        for (layer, module), (a_off, b_off) in layout.offsets.items():
            in_features, out_features = shapes[module]
            a = staging[:, a_off:a_off + P * in_features].view(n, P, in_features)
            b = staging[:, b_off:b_off + out_features * P].view(n, out_features, P)
            self.a[layer][module].index_copy_(0, index, a)
            self.b[layer][module].index_copy_(0, index, b)

    def staging_bound(self, staging_bytes: int) -> int:
        """Elements of the install staging buffer that :meth:`write_many` with ``staging_bytes`` needs at most:
        one group holds at most ``staging_bytes`` of images (or one image, if larger) and at most one image per
        slot; the largest image targets every module of every layer at ``max_lora_rank`` rounded up to whole
        pages, with DoRA magnitude vectors. Vocabulary parts are not staged. (:meth:`write_many` also never puts
        more images in a group than the buffer holds, so only an image larger than it grows the buffer.)"""
        rows = pages_per_adapter(self.max_lora_rank, self.page_rows) * self.page_rows
        shapes = self.spec.module_shapes.values()
        # A, B and (DoRA, an image read verbatim from its file) the magnitude vectors between them
        largest = self.spec.num_layers * (rows * sum(i + o for i, o in shapes) + sum(o for _, o in shapes))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return max(largest, min(staging_bytes // itemsize, self.num_slots * largest))

    def reserve_staging(self, staging_bytes: int) -> int:
        """Allocate the install staging buffer now at :meth:`staging_bound` elements, so that no later install
        allocates device memory (the engine calls it before sizing the KV cache, which then leaves room for it);
        returns its bytes."""
        numel = self.staging_bound(staging_bytes)
        return self._staging_rows(1, numel).numel() * self._staging.element_size()

    @contextlib.contextmanager
    def _on_copy_stream(self) -> Iterator[None]:
        """Enqueue the body on the copy stream after the compute stream's last read of the staging buffer;
        the compute stream then waits for the body. Without a copy stream (CPU) the body runs as is."""
        if self._copy_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        if self._staging_free is not None:
            self._copy_stream.wait_event(self._staging_free)
        with torch.cuda.stream(self._copy_stream):
            yield
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        compute.wait_event(done)

    def _staging_rows(self, rows: int, numel: int) -> torch.Tensor:
        """``[rows, numel]`` view of the kept staging buffer, grown (and its cached views dropped) when too small."""
        if self._staging is None or self._staging.numel() < rows * numel:
            self._staging = torch.empty(rows * numel, dtype=self.dtype, device=self.device)
            self._staging_view_cache.clear()
            if self._copy_stream is not None:  # memory the compute stream may still be using: wait for its tail
                self._staging_free = torch.cuda.Event()
                self._staging_free.record(torch.cuda.current_stream(self.device))
        return self._staging[: rows * numel].view(rows, numel)

    def _staging_views(self, image: SlotImage, row: int) -> list[torch.Tensor]:
        """Views of staging row ``row`` (rows of ``image.data.numel()`` elements) shaped as ``image``'s A factors
        ``[pages, P, in]`` then B factors ``[pages, out, P]``, in ``image.offsets`` order; cached per layout and
        row."""
        numel = image.data.numel()
        key = (image.layout_key, row)
        views = self._staging_view_cache.get(key)
        if views is None:
            flat = self._staging[row * numel:(row + 1) * numel]
            R, n, P = image.max_rank, image.num_pages, self.page_rows
            shapes = self.spec.module_shapes
            views = ([flat[a_off:a_off + R * shapes[m][0]].view(n, P, shapes[m][0])
                      for (_, m), (a_off, _) in image.offsets.items()]
                     + [flat[b_off:b_off + shapes[m][1] * R].view(n, shapes[m][1], P)
                        for (_, m), (_, b_off) in image.offsets.items()])
            self._staging_view_cache[key] = views
        return views

    def slot_factors(self, slot: int, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [r, in], B [out, r])`` of ``slot``'s adapter for ``(layer, module)`` gathered from its pages
        (copies; ``r`` = its page count x ``page_rows``; for DoRA installs and tests)."""
        pages = list(self._slot_pages[slot])
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        a = self.a[layer][module].index_select(0, index).flatten(0, 1)
        b = self.b[layer][module].index_select(0, index).permute(1, 0, 2).flatten(1, 2)
        return a, b

    def _write_gains(self, slot: int, image: SlotImage) -> None:
        """DoRA: ``gain[l][m][slot] = m / ||W + scaling * B @ A||_row`` for each module of ``image.magnitude``,
        from the slot's (already written) A and B, in float32, ``_NORM_CHUNK_ELEMENTS`` at a time; the
        other gains of the slot must be 1 already. Plain LoRA: nothing (the slot leaves ``dora_slots``)."""
        self.dora_slots.discard(slot)
        if not image.magnitude:
            return
        if self._base_weight is None:
            raise AdapterUnsupportedError(
                f"adapter {image.version_id[:12]}: a DoRA adapter, but no base weights are bound")
        columns = list(self.spec.module_shapes)
        for (layer, module), magnitude in image.magnitude.items():
            in_features, out_features = self.spec.module_shapes[module]
            scaling = float(image.scaling[layer, columns.index(module)])
            a, b = self.slot_factors(slot, layer, module)
            a, b = a.float(), b.float()  # [r, in], [out, r]
            norm = torch.empty(out_features, dtype=torch.float32, device=self.device)
            rows = max(1, _NORM_CHUNK_ELEMENTS // in_features)
            for start in range(0, out_features, rows):
                stop = min(out_features, start + rows)
                adapted = self._base_weight(layer, module, start, stop).to(torch.float32, copy=True)
                adapted.addmm_(b[start:stop], a, alpha=scaling)  # W + scaling * B @ A, these rows
                norm[start:stop] = torch.linalg.vector_norm(adapted, dim=1)
            self.gain[layer][module][slot] = magnitude.to(self.device, torch.float32) / norm
        self.dora_slots.add(slot)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device without a stream sync (staged in pinned memory on CUDA)."""
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def disable(self, slot: int) -> None:
        """Zero ``slot``'s scalings and rank and set its DoRA gains to 1: tokens mapped to it get no LoRA delta
        and no rescale and read none of its pages (A/B left as they are; its pages may be given to another
        adapter), and its rows use the base ``embed_tokens`` / ``lm_head``."""
        self._scaling_table[:, :, slot] = 0.0
        self.ranks[slot] = 0
        self._gain_table[:, slot] = 1.0
        self.dora_slots.discard(slot)
        if self.vocab_scaling is not None:
            self.vocab_scaling[:, slot] = 0.0
        self.vocab_lora_host[0][slot] = self.vocab_lora_host[1][slot] = False
        self.clear_full(slot)

    def invalidate(self, slot: int) -> None:
        """``slot``'s contents are unknown (a write failed): scalings and rank zero, every module of its pages
        re-zeroed at their next write."""
        self.disable(slot)
        every = frozenset((layer, m) for layer in range(self.spec.num_layers) for m in self.spec.module_shapes)
        for page in self._slot_pages[slot]:
            self._written[page] = every

    def memory_bytes(self) -> int:
        """Device memory of the slot tensors, in bytes."""
        tensors = [t for group in (self.a, self.b, self.scaling) for per_layer in group for t in per_layer.values()]
        tensors += [self._gain_table, self.page_table, self.ranks]
        if self.has_vocab:
            vocab = (self.embed_a_t, self.embed_b, self.head_a, self.head_b, self.vocab_scaling, self.full, self.full_index)
            tensors += [t for t in vocab if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _zeros(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype or self.dtype, device=self.device)
