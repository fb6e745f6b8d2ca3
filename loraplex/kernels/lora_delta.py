"""A folded linear's LoRA expand, left to the kernel that consumes the linear's output.

Semantics: ``delta[t, off_i + c] = scaling_i[s] * sum_{r < ranks[s]} v[i, t, p(r), r % PAGE] * B_i[p(r), c, r % PAGE]``,
``s = slot[t]``, ``p(r) = page_table[s, r // PAGE]`` (``p = s`` and every rank row without a table); 0 where
``s == -1`` or ``scaling_i[s] == 0``.

A linear that folds its shrink into its base GEMM (``LinearWithLoRA.fold_lora_a``) has every slot's shrink ``v`` in
that GEMM's extra columns. Instead of an expand launch that adds ``delta`` into ``y`` (read, add, write), the next
kernel, which reads ``y`` anyway, adds each token's delta as it loads its row: ``rms_norm`` (after o_proj and
down_proj: ``s = (y + delta) + residual``), ``silu_and_mul`` / ``gelu_tanh_and_mul`` (after gate/up) and
``rotary_and_cache`` (after q/k/v, when no per-head q/k norm comes between). Each
consumer rounds ``y + delta`` to ``y``'s dtype first, as the expand kernel rounds its sum into ``y``, so both paths
compute the same values up to the order of the rank sum. One launch fewer per LoRA'd linear; the B bytes are read
by the consumer instead.

Over a pool paged by rank (several pages per slot) a token's delta walks its slot's pages, so a high-rank token's
program would read many times the bytes of a rank-16 one. Two remedies, per consumer (:func:`use_consumer_launch`):
the row split (a high-rank token's program split over up to 4 programs, each over a share of its columns; rms_norm
sums their squares through a launch counter, the last normalises) and :func:`lora_delta_pair` (two tiles' pages
walked in one loop, their loads in flight together).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels._checks import check_device, check_dtype, check_last_dim_contiguous, check_shape
from loraplex.kernels._lora_checks import check_page_table, check_paging
from loraplex.kernels._triton import next_pow2, tl, triton
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import _check_slot_rows, lora_expand_slot_rows_ref
from loraplex.kernels.lora_mapping import LoRAMapping


@dataclass(frozen=True)
class LoRADelta:
    """The expand of one folded linear, not yet applied.

    ``v``: ``[n_slices, T, P, R]`` (the folded GEMM's extra columns: every page's shrink per token; last dim
    contiguous); ``lora_b``: ``n_slices`` contiguous ``[P, out_i, R]``; ``scaling``: ``n_slices`` ``[S]`` float32;
    ``mapping``: the step's :class:`LoRAMapping` (its ``token_slots [T] int32``, -1 = no adapter);
    ``page_table``: None (slot s is page s) or ``[S, max_pages] int32`` (slot s's rank row r is row ``r % PAGE`` of
    page ``page_table[s, r // PAGE]``); ``ranks``: ``[S] int32``, required with several pages per slot (rows past a
    slot's rank are not read); with at most one page per slot the rows past a rank are zero and it is not needed.
    """

    v: torch.Tensor
    lora_b: list[torch.Tensor]
    scaling: list[torch.Tensor]
    mapping: LoRAMapping
    page_table: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    @property
    def widths(self) -> list[int]:
        return [b.shape[1] for b in self.lora_b]


def check_delta(op: str, delta: LoRADelta, y: torch.Tensor, width: int | None = None) -> None:
    """``delta`` fits ``y`` (``[T, sum(out_i)]``, its dtype and device; ``width``: the columns it covers, when ``y``
    holds only the first of them). Raises ``KernelArgumentError``."""
    width = y.shape[1] if width is None else width
    _check_slot_rows(delta.v, delta.lora_b)
    if delta.page_table is not None:
        check_page_table(op, delta.page_table, y.device)
        if delta.page_table.shape[1] > 1:
            if delta.ranks is None:
                raise KernelArgumentError(f"{op}: a LoRA delta of several pages per slot needs ranks ([S] int32)")
            check_paging(op, delta.page_table, delta.ranks, delta.lora_b[0].shape[2], y.device)
    check_shape(op, "delta.v", delta.v, (len(delta.lora_b), y.shape[0], None, None))
    if sum(delta.widths) != width:
        raise KernelArgumentError(f"{op}: LoRA delta widths {delta.widths} do not add up to {width} columns")
    for i, (b, s) in enumerate(zip(delta.lora_b, delta.scaling)):
        check_dtype(op, f"delta.lora_b[{i}]", b, (y.dtype,))
        check_device(op, f"delta.lora_b[{i}]", b, y.device)
        if not b.is_contiguous():
            raise KernelArgumentError(f"{op}: delta.lora_b[{i}] must be contiguous")
        check_dtype(op, f"delta.scaling[{i}]", s, (torch.float32,))
        check_last_dim_contiguous(op, f"delta.scaling[{i}]", s)
    if delta.mapping.num_tokens != y.shape[0]:
        raise KernelArgumentError(f"{op}: LoRA delta for {delta.mapping.num_tokens} tokens, y has {y.shape[0]}")


def lora_delta_ref(delta: LoRADelta, y: torch.Tensor) -> torch.Tensor:
    """``y + delta`` (module docstring), rounded once to ``y``'s dtype (a new tensor), as the expand adds it."""
    out = y.clone()
    lora_expand_slot_rows_ref(delta.v, delta.lora_b, delta.scaling, out, delta.mapping, ranks=delta.ranks,
                              page_table=delta.page_table)
    return out


def slice_of_columns(delta: LoRADelta, start: int, width: int) -> tuple[int, int]:
    """(slice, first column in it) of columns ``start .. start + width`` of ``y``, which must lie in one slice.
    Raises ``KernelArgumentError`` otherwise."""
    offset = 0
    for i, w in enumerate(delta.widths):
        if offset <= start and start + width <= offset + w:
            return i, start - offset
        offset += w
    raise KernelArgumentError(f"LoRA delta: columns {start}..{start + width} span slices of widths {delta.widths}")


def delta_args(delta: LoRADelta | None, y: torch.Tensor, start: int, width: int) -> tuple:
    """The kernel arguments of :func:`lora_delta_cols` for columns ``start .. start + width`` of ``y`` (one
    slice): ``(token_slots, page_table, ranks, v slice, stride_vt, stride_vp, b, width_i, col0, scaling_i, PAGE)``;
    dummies (``y`` itself, zeros) without ``delta``."""
    if delta is None:
        return (y, y, y, y, 0, 0, y, 0, 0, y, 1)
    i, col0 = slice_of_columns(delta, start, width)
    v = delta.v[i]
    slots = delta.mapping.token_slots
    return (slots, delta.page_table if delta.page_table is not None else slots,
            delta.ranks if delta.ranks is not None and slot_pages(delta) > 1 else slots,
            v, v.stride(0), v.stride(1), delta.lora_b[i], delta.lora_b[i].shape[1], col0, delta.scaling[i],
            delta.lora_b[i].shape[2])


# How each consumer walks a slot's pages, measured on an H200 (Llama-2-7B shapes, batch 32; RESULTS.md, sessions 23
# and 24). CONSUMER_PAGES: pages loaded together (PAGES_AT_ONCE; session 23, 8-row pages, 24 x r8 + 4 x r16 + 4 x
# r64 adapters: rotary_and_cache 4 took 17.2 -> 13.7 us per launch, rms_norm 2 against 1 12.9 -> 13.8 us, the gated
# activations 4 against 1 13.7 -> 17.3 us). CONSUMER_PAIRED: two tiles' pages in one loop (lora_delta_pair: gate and
# up; both halves of rotary heads): False, "paged" (over several pages per slot only) or True. ROW_SPLIT: the row
# split's programs over several pages per slot (row_split). Session 24 (benchmarks/diag_lora_consumers.py), those
# mixed ranks, us per launch: rms_norm split over 4 programs 12.8 -> 9.8 (r16 6.2 either way); the activation paired
# and split over 2 14.5 -> 12.0 (split over 4 unpaired 17.9); rotary paired 19.9 -> 18.3. Paired in the default pool
# (one 16-row page per slot, 32 x r16): the decode step 5.91-5.92 -> 5.85-5.86 ms, its LoRA kernels 0.95 -> 0.89 ms.
CONSUMER_PAGES = {"rms_norm": 1, "silu_and_mul": 1, "rotary_and_cache": 4}
CONSUMER_PAIRED: dict[str, bool | str] = {"silu_and_mul": True, "rotary_and_cache": True}
_ROW_SPLIT = {"rms_norm": 4, "silu_and_mul": 2}


def use_consumer_launch(op: str, *, pages_at_once: int | None = None, paired: bool | str | None = None,
                        row_split: int | None = None) -> dict:
    """Set how consumer ``op`` walks a slot's pages (None: unchanged; benchmarks): pages loaded together (1, 2 or 4),
    paired tiles (False, "paged", True), the row split's programs (1, 2 or 4; ops that have one). Returns the
    previous settings as keywords of this function. Raises ``ValueError`` for anything else."""
    previous = {"pages_at_once": CONSUMER_PAGES.get(op), "paired": CONSUMER_PAIRED.get(op),
                "row_split": _ROW_SPLIT.get(op)}
    changes = [(name, value, table, choices) for name, value, table, choices in (
        ("pages_at_once", pages_at_once, CONSUMER_PAGES, (1, 2, 4)),
        ("paired", paired, CONSUMER_PAIRED, (False, "paged", True)),
        ("row_split", row_split, _ROW_SPLIT, (1, 2, 4))) if value is not None]
    for name, value, table, choices in changes:  # every value checked before any is set; True is not 1
        if op not in table or not any(type(value) is type(c) and value == c for c in choices):
            raise ValueError(f"{op}: {name}={value!r} (ops {sorted(table)}, values {choices})")
    for _name, value, table, _choices in changes:
        table[op] = value
    return previous


def paired(delta: LoRADelta | None, op: str) -> bool:
    """``PAIR`` of consumer ``op``'s launch: its ``CONSUMER_PAIRED`` setting ("paged": over several pages per slot)."""
    setting = CONSUMER_PAIRED[op]
    return slot_pages(delta) > 1 if setting == "paged" else bool(setting) and delta is not None


def slot_pages(delta: LoRADelta | None) -> int:
    """``SLOT_PAGES`` of :func:`lora_delta_cols`: 0 without a page table (slot s is page s), else the table's pages
    per slot (``max_pages``)."""
    return 0 if delta is None or delta.page_table is None else delta.page_table.shape[1]


# Row split: over a pool of several pages per slot, a consumer gives the token of a slot of rank r up to
# min(ceil(r / ROW_SPLIT_RANK), SPLIT) programs where it would give one, each over a share of that program's columns,
# so that no program reads more rank rows than at rank 16. On an H200 (Llama-2-7B shapes, batch 32, 8-row pages) a
# rank-64 row's programs walking its 8 pages alone took rms_norm from 6.4 to 13.2 us per launch, the gated
# activation from 10.5 to 14.5 and rotary from 8.3 to 13.7 (RESULTS.md, session 23).
ROW_SPLIT_RANK = 16


def row_split(delta: LoRADelta | None, op: str) -> tuple[int, int]:
    """``(SPLIT, SPLIT_RANK)`` of consumer ``op``'s launch (:func:`lora_row_programs`): ``SPLIT`` a power of two up
    to its ``ROW_SPLIT`` setting, enough for the highest rank ``delta``'s pool holds; 1 without several pages per
    slot (every slot reads a whole page there)."""
    pages = slot_pages(delta)
    if pages <= 1:
        return 1, ROW_SPLIT_RANK
    return min(_ROW_SPLIT[op], next_pow2(-(-pages * delta.lora_b[0].shape[2] // ROW_SPLIT_RANK))), ROW_SPLIT_RANK


@triton.jit
def lora_row_programs(t, token_slots_ptr, ranks_ptr, SPLIT: tl.constexpr, SPLIT_RANK: tl.constexpr):
    """Programs of token ``t`` under the row split: ``min(ceil(ranks[s] / SPLIT_RANK), SPLIT)`` (at least 1) for a
    token of slot ``s``, 1 without an adapter. Every program of a row must compute the same count (rms_norm's last
    program is the one whose counter increment reaches it): ``token_slots`` and ``ranks`` must not change during
    the launch (the engine writes both on the compute stream, in step order)."""
    n = tl.program_id(0) * 0 + 1
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    if slot >= 0:
        n = tl.maximum(tl.minimum((tl.load(ranks_ptr + slot) + SPLIT_RANK - 1) // SPLIT_RANK, SPLIT), 1)
    return n


# The consumers' launch shapes were measured at rank 16 (RESULTS.md, session 17); for higher ranks their column
# tiles narrow so that a [columns, BLOCK_R] B tile holds no more elements than at that rank.
MEASURED_BLOCK_R = 16


def tile_columns(columns: int, delta: LoRADelta | None) -> int:
    """``columns`` (a power of two, the tile width measured at rank 16) narrowed for a higher rank:
    ``columns * 16 // BLOCK_R``, at least 1."""
    return columns if delta is None else max(1, columns * MEASURED_BLOCK_R // max(MEASURED_BLOCK_R, block_r(delta)))


def block_r(delta: LoRADelta | None) -> int:
    """``BLOCK_R`` of :func:`lora_delta_cols`: every rank row of a page (1 without a delta)."""
    return 1 if delta is None else max(1, next_pow2(delta.lora_b[0].shape[2]))


@triton.jit
def _page_delta(t, cols, mask, page, rows, v_ptr, stride_vt, stride_vp, b_ptr, width, col0, rank_rows,
                BLOCK_R: tl.constexpr, WHOLE_PAGE: tl.constexpr):
    """float32 ``sum_{r < rows} v[t, page, r] * B[page, col0 + cols, r]`` (``rows <= rank_rows``, the page's rows).
    ``WHOLE_PAGE``: ``rows == rank_rows == BLOCK_R``, no rank mask, so that v and each column's B rows load as
    vectors (a runtime mask below 16 rows makes them element loads: 4x slower consumers on an H200 at 8-row pages)."""
    r = tl.arange(0, BLOCK_R)
    # a trailing rank axis on the column tile: [..., BLOCK_R]
    b_ptrs = b_ptr + page * width * rank_rows + tl.expand_dims((col0 + cols) * rank_rows, len(cols.shape)) + r
    if WHOLE_PAGE:
        vr = tl.load(v_ptr + t * stride_vt + page * stride_vp + r)
        b = tl.load(b_ptrs, mask=tl.expand_dims(mask, len(cols.shape)), other=0.0)
    else:
        r_mask = r < rows
        vr = tl.load(v_ptr + t * stride_vt + page * stride_vp + r, mask=r_mask, other=0.0)
        b = tl.load(b_ptrs, mask=tl.expand_dims(mask, len(cols.shape)) & r_mask, other=0.0)
    vr = vr.to(b_ptr.dtype.element_ty).to(tl.float32)
    return tl.sum(b.to(tl.float32) * vr, axis=len(cols.shape))


@triton.jit
def lora_delta_cols(t, cols, mask, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr, stride_vt, stride_vp, b_ptr,
                    width, col0, scale_ptr, rank_rows, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr,
                    PAGES_AT_ONCE: tl.constexpr):
    """float32 ``delta[t, cols]`` of one slice (module docstring) for a tile of columns ``cols`` of any rank (a row
    piece ``[N]``, heads x half a head ``[A, B]``; counted from the slice's column ``col0``): 0 without an adapter or
    with scaling 0 (then neither v nor B is read). ``b_ptr``: ``[P, width, rank_rows]``. ``SLOT_PAGES``
    (:func:`slot_pages`): 0, slot s is page s; 1, page ``page_table[s]``; more, the ``ceil(ranks[s] / rank_rows)``
    pages of row s of a ``[S, SLOT_PAGES]`` table, rows past ``ranks[s]`` unread (then ``rank_rows == BLOCK_R``,
    a pool's power-of-two page rows), ``PAGES_AT_ONCE`` loaded together."""
    delta, _ = lora_delta_pair(t, cols, mask, cols, mask, token_slots_ptr, page_table_ptr, ranks_ptr, v_ptr,
                               stride_vt, stride_vp, b_ptr, width, col0, scale_ptr, v_ptr, stride_vt, stride_vp, b_ptr,
                               width, col0, scale_ptr, rank_rows, BLOCK_R, SLOT_PAGES, PAGES_AT_ONCE, False)
    return delta


@triton.jit
def lora_delta_pair(t, cols, mask, cols2, mask2, token_slots_ptr, page_table_ptr, ranks_ptr,
                    v_ptr, stride_vt, stride_vp, b_ptr, width, col0, scale_ptr,
                    v2_ptr, stride_v2t, stride_v2p, b2_ptr, width2, col02, scale2_ptr,
                    rank_rows, BLOCK_R: tl.constexpr, SLOT_PAGES: tl.constexpr, PAGES_AT_ONCE: tl.constexpr,
                    PAIR: tl.constexpr):
    """:func:`lora_delta_cols` of two column tiles of one token at once (``PAIR``; columns ``cols2`` of a second
    slice, or of the same one: gate and up, both halves of rotary heads), their pages walked in one loop so that both
    tiles' loads are in flight together: ``(delta, delta2)``, each 0 where its scaling is (its B unread). Without
    ``PAIR``, the first tile's delta and zeros."""
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    delta = tl.zeros(cols.shape, tl.float32)
    delta2 = tl.zeros(cols2.shape, tl.float32)
    if slot >= 0:
        scale = tl.load(scale_ptr + slot)
        scale2 = scale
        if PAIR:
            scale2 = tl.load(scale2_ptr + slot)
        if (scale != 0.0) | (scale2 != 0.0):
            if PAIR:  # a slice of scaling 0 reads no B (its v may be anything: its result is dropped below)
                mask = tl.where(scale != 0.0, mask, False)  # (mask & (scale != 0): a TypeError in the interpreter)
                mask2 = tl.where(scale2 != 0.0, mask2, False)
            if SLOT_PAGES <= 1:
                page = slot
                if SLOT_PAGES == 1:
                    page = tl.load(page_table_ptr + slot).to(tl.int64)
                delta = _page_delta(t, cols, mask, page, rank_rows, v_ptr, stride_vt, stride_vp, b_ptr, width, col0,
                                    rank_rows, BLOCK_R, False)
                if PAIR:
                    delta2 = _page_delta(t, cols2, mask2, page, rank_rows, v2_ptr, stride_v2t, stride_v2p, b2_ptr,
                                         width2, col02, rank_rows, BLOCK_R, False)
            else:
                # whole pages (every page of the engine's pools: their ranks are multiples of the page rows),
                # PAGES_AT_ONCE per iteration (their loads independent, issued together; a page past the slot's
                # whole pages reads nothing), then the part of a last page below the rank
                rank = tl.load(ranks_ptr + slot)
                whole = rank // BLOCK_R
                row = page_table_ptr + slot * SLOT_PAGES
                if PAGES_AT_ONCE == 1:  # each page id loaded one page ahead
                    page = tl.load(row).to(tl.int64)
                    for j in range(whole):
                        page_next = tl.load(row + j + 1, mask=j + 1 < SLOT_PAGES, other=0).to(tl.int64)
                        delta += _page_delta(t, cols, mask, page, BLOCK_R, v_ptr, stride_vt, stride_vp, b_ptr, width,
                                             col0, BLOCK_R, BLOCK_R, True)
                        if PAIR:
                            delta2 += _page_delta(t, cols2, mask2, page, BLOCK_R, v2_ptr, stride_v2t, stride_v2p,
                                                  b2_ptr, width2, col02, BLOCK_R, BLOCK_R, True)
                        page = page_next
                else:
                    for j0 in range(0, whole, PAGES_AT_ONCE):
                        for u in tl.static_range(PAGES_AT_ONCE):
                            live = (tl.zeros([1], tl.int32) + j0 + u) < whole  # a tensor under the interpreter too
                            # past the whole pages: the last whole page's id, its B loads predicated off
                            page = tl.load(row + tl.minimum(j0 + u, whole - 1)).to(tl.int64)
                            delta += _page_delta(t, cols, mask & live, page, BLOCK_R, v_ptr, stride_vt, stride_vp,
                                                 b_ptr, width, col0, BLOCK_R, BLOCK_R, True)
                            if PAIR:
                                delta2 += _page_delta(t, cols2, mask2 & live, page, BLOCK_R, v2_ptr, stride_v2t,
                                                      stride_v2p, b2_ptr, width2, col02, BLOCK_R, BLOCK_R, True)
                if whole * BLOCK_R < rank:
                    page = tl.load(row + whole).to(tl.int64)
                    delta += _page_delta(t, cols, mask, page, rank - whole * BLOCK_R, v_ptr, stride_vt, stride_vp,
                                         b_ptr, width, col0, BLOCK_R, BLOCK_R, False)
                    if PAIR:
                        delta2 += _page_delta(t, cols2, mask2, page, rank - whole * BLOCK_R, v2_ptr, stride_v2t,
                                              stride_v2p, b2_ptr, width2, col02, BLOCK_R, BLOCK_R, False)
            if PAIR:
                delta = tl.where(scale != 0.0, delta * scale, 0.0)
                delta2 = tl.where(scale2 != 0.0, delta2 * scale2, 0.0)
            else:
                delta = delta * scale
    return delta, delta2
