"""LoRA shrink (SGMV, Punica: Chen et al. 2023): project tokens onto their adapter's LoRA A.

Semantics: :data:`LORA_SHRINK` (``v`` in float32).

Several slices (e.g. q/k/v or gate/up, all reading the same ``x``) run in one
launch. Grid = ((segment, token tile) work item, slice x split-K chunk): the tokens of one
segment share every load of the adapter's A tile.

Two layouts of the slot weights:

- rectangles, ``lora_a[i]`` ``[S, R, H]``: adapters of lower rank are zero-padded to R; an optional
  ``ranks [S]`` lets the kernel skip padded rows. One ``[max(16, R), BLOCK_K]`` A tile per K step.
- pages (S-LoRA, Sheng et al. 2023), ``lora_a[i]`` ``[P, PAGE, H]`` with ``page_table [S, max_pages]``:
  slot s's row r is ``lora_a[i][page_table[s, r // PAGE], r % PAGE]`` for ``r < ranks[s]``. The slot's rank
  is cut into tiles of 16 rows, each row's page gathered from the table::

      rank rows   | 0 .. 15         | 16 .. 31         | ... | .. ranks[s]-1 |  (R = max_pages * PAGE)
      PAGE = 8    | p0    | p1      | p2     | p3      | ...   (a tile spans 16 / PAGE pages)
      PAGE = 32   | p0 (first half) | p0 (second half) | p1 ... (a tile is a part of a page)

  Tile t goes to the ``t % PAGED_RANK_PROGRAMS``-th of that many programs per (token tile, slice, K chunk)
  (grid axis 1 = slices x programs x K chunks), so the work is ``ceil(ranks[s] / 16)`` tiles per slot,
  whatever R the pool allows, and a rank-64 slot's tiles run side by side.
"""

from __future__ import annotations

import torch

from loraplex.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
)
from loraplex.kernels._lora_checks import check_mapping, check_paging, check_ranks, check_weight_list, paged_rows
from loraplex.kernels._triton import (
    cdiv,
    dot_dtype,
    dot_precision,
    launch_options,
    next_pow2,
    num_sms,
    pdl_args,
    pdl_wait,
    pointer_table,
    require_triton,
    tl,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import (
    DECODE_BLOCK_M,
    DECODE_MAX_TOKENS,
    LARGE_DECODE_TOKENS,
    PAGED_BLOCK_R,
    _page_ids,
    multi_page,
    rank_tile,
)
from loraplex.kernels.lora_mapping import LoRAMapping, max_tiles
from loraplex.kernels.op import Op

_OP = "lora_shrink"
_MAX_SPLIT_K = 16
_MAX_PARTIAL_SPLIT_K = 32
# On CUDA the H reduction is split into chunks of this many elements (see shrink_partials):
# many short programs instead of a few long serial loops. Tuned on an H200 with 256-element K
# tiles (benchmarks/bench_lora_kernels.py --sweep-sgmv, RESULTS.md session 8: one Llama-2-7B
# layer at 32 adapters, 1 token 48.1 -> 42.0 us with 256 instead of 512, 32 tokens best at 512,
# 512 tokens best at 1024).
SHRINK_K_PER_SPLIT = 256
# Past DECODE_MAX_TOKENS the split-K partials ([SPLIT, n_slices, T, R] float32, read again by every
# expand column tile) are kept under this many bytes: a long prompt chunk with a high rank already
# fills the device and would only move more bytes (measured up to 512 tokens at r=16 only).
PROMPT_PARTIALS_MAX_BYTES = 32 << 20


def shrink_k_per_split(num_tokens: int) -> int:
    """H elements per shrink program on CUDA: 256 up to 8 tokens, 512 up to 128, else 1024 (from 129 to 256
    tokens in 128-element K tiles, :func:`_block_sizes`; RESULTS.md, session 13)."""
    if num_tokens <= 8:
        return SHRINK_K_PER_SPLIT
    return 2 * SHRINK_K_PER_SPLIT if num_tokens <= LARGE_DECODE_TOKENS else 4 * SHRINK_K_PER_SPLIT


@triton.jit
def _shrink_rank_tile(
    x_ptr, a_rows, out_ptr, k_split, stride_o_split, slice_id, stride_o_slice, stride_ot, r, rank, max_rank, tok,
    row_mask, stride_xt, k_per_split, hidden_size,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``out[k_split, slice_id, tok, r] = x[tok, K] @ A[r, K].T`` over the K chunk ``k_split`` (``k_per_split``
    elements of H) for one tile of rank rows ``r < max_rank`` (``a_rows``: ``[BLOCK_R]`` pointers to each row's
    element 0; rows ``r >= rank`` are not read, they count as 0)."""
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_start = k_split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden_size)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        x = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_rows[:, None] + k[None, :], mask=(r[:, None] < rank) & k_mask[None, :], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), input_precision=PRECISION)
    o_ptrs = out_ptr + k_split * stride_o_split + slice_id * stride_o_slice + tok[:, None] * stride_ot + r[None, :]
    tl.store(o_ptrs, acc, mask=row_mask[:, None] & (r[None, :] < max_rank))


# Per-step ints are not specialised (no recompile when a count becomes 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_tiles", "split_k"])
def _lora_shrink_kernel(
    x_ptr,
    a_ptrs,
    out_ptr,
    tiles_ptr,
    num_tiles,
    sorted_token_ids_ptr,
    segment_starts_ptr,
    segment_lens_ptr,
    segment_slots_ptr,
    ranks_ptr,
    page_table_ptr,
    scaling_ptrs,
    hidden_size,
    max_rank,
    k_per_split,
    stride_xt,
    stride_a_slot,
    stride_a_rank,
    stride_o_split,
    stride_o_slice,
    stride_ot,
    split_k,
    HAS_RANKS: tl.constexpr,
    PAGE: tl.constexpr,  # rank rows per page; 0 = rectangles ([S, R, H] slices, stride_a_slot per slot)
    ZERO_TAIL: tl.constexpr,  # pages: also write 0 to columns ranks[s]..R-1 (else left unwritten)
    RANK_PROGRAMS: tl.constexpr,  # pages: programs sharing a slot's rank tiles (tile t -> program t % RANK_PROGRAMS)
    SLOT_PAGE: tl.constexpr,  # PAGE == 0 with one page per slot: the rectangle is page page_table[slot, 0]
    SKIP_ZERO_SCALE: tl.constexpr,  # scaling_ptrs given: a (slot, slice) whose scaling is 0 is not computed
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    seg = tl.load(tiles_ptr + tl.program_id(0))
    m_tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    slice_id = tl.program_id(1) // (split_k * RANK_PROGRAMS)
    k_split = tl.program_id(1) % split_k
    first_tile = (tl.program_id(1) // split_k) % RANK_PROGRAMS
    seg_len = tl.load(segment_lens_ptr + seg)
    if m_tile * BLOCK_M >= seg_len:
        return
    slot = tl.load(segment_slots_ptr + seg).to(tl.int64)
    if SKIP_ZERO_SCALE:  # a module the slot's adapter does not target: its delta is 0, its (zero) weights unread
        scale_ptr = tl.load(scaling_ptrs + slice_id).to(tl.pointer_type(tl.float32))
        if tl.load(scale_ptr + slot) == 0.0:
            return
    rank = max_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if PAGE != 0:
        if not ZERO_TAIL:
            if first_tile * BLOCK_R >= rank:  # no tile of this slot's rank for this program
                return

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    seg_start = tl.load(segment_starts_ptr + seg)
    tok = tl.load(sorted_token_ids_ptr + seg_start + rows, mask=row_mask, other=0).to(tl.int64)
    if PAGE == 0:
        # one tile of all R rows of the slot's rectangle (with SLOT_PAGE: its one page)
        r = tl.arange(0, BLOCK_R)
        a_base = tl.load(a_ptrs + slice_id).to(tl.pointer_type(x_ptr.dtype.element_ty))
        wslot = slot
        if SLOT_PAGE:
            wslot = tl.load(page_table_ptr + slot).to(tl.int64)
        _shrink_rank_tile(x_ptr, a_base + wslot * stride_a_slot + r * stride_a_rank, out_ptr, k_split, stride_o_split,
                          slice_id, stride_o_slice, stride_ot, r, rank, max_rank, tok, row_mask, stride_xt,
                          k_per_split, hidden_size, BLOCK_M, BLOCK_R, BLOCK_K, DOT_DTYPE, PRECISION)
    else:
        # BLOCK_R-row tiles of the slot's rank (every RANK_PROGRAMS-th from first_tile), each row's page gathered
        # from page_table[slot]
        a_base = tl.load(a_ptrs + slice_id).to(tl.pointer_type(x_ptr.dtype.element_ty))
        page_row = page_table_ptr + slot * (max_rank // PAGE)
        for r0 in range(first_tile * BLOCK_R, rank, RANK_PROGRAMS * BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            page = _page_ids(page_row, r, rank, PAGE)
            _shrink_rank_tile(x_ptr, a_base + page * stride_a_slot + (r % PAGE) * stride_a_rank, out_ptr, k_split,
                              stride_o_split, slice_id, stride_o_slice, stride_ot, r, rank, max_rank, tok, row_mask,
                              stride_xt, k_per_split, hidden_size, BLOCK_M, BLOCK_R, BLOCK_K, DOT_DTYPE,
                              PRECISION)
        if ZERO_TAIL:  # tiles past the rank: the first one that is this program's, then every RANK_PROGRAMS-th
            behind = tl.maximum(tl.cdiv(rank, BLOCK_R) - first_tile, 0)
            tail = first_tile + tl.cdiv(behind, RANK_PROGRAMS) * RANK_PROGRAMS
            for r0 in range(tail * BLOCK_R, max_rank, RANK_PROGRAMS * BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                o_ptrs = out_ptr + k_split * stride_o_split + slice_id * stride_o_slice + tok[:, None] * stride_ot
                tl.store(o_ptrs + r[None, :], tl.zeros([BLOCK_M, BLOCK_R], tl.float32),
                         mask=row_mask[:, None] & (r[None, :] < max_rank))


def _check_args(x: torch.Tensor, lora_a: list[torch.Tensor], mapping: LoRAMapping, ranks: torch.Tensor | None,
                page_table: torch.Tensor | None = None) -> int:
    """Shape/dtype/device/layout checks (no tensor contents read); returns R, the max rank (with pages
    ``max_pages * PAGE``)."""
    check_dtype(_OP, "x", x, FLOAT_DTYPES)
    check_shape(_OP, "x", x, (None, None))
    check_weight_list(_OP, "lora_a", lora_a, x, x.shape[1])
    if len({a.shape[1] for a in lora_a}) != 1:
        what = "page sizes (PAGE)" if page_table is not None else "ranks"
        raise KernelArgumentError(f"{_OP}: lora_a {what} differ: {[a.shape[1] for a in lora_a]}; "
                                  + ("use one PAGE" if page_table is not None else "pad them to one R"))
    if page_table is None:
        check_mapping(_OP, mapping, x.shape[0], lora_a[0].shape[0], x.device)
        check_ranks(_OP, ranks, lora_a[0].shape[0], x.device)
        return lora_a[0].shape[1]
    num_slots = check_paging(_OP, page_table, ranks, lora_a[0].shape[1], x.device)
    check_mapping(_OP, mapping, x.shape[0], num_slots, x.device)
    return page_table.shape[1] * lora_a[0].shape[1]


def _block_sizes(mapping: LoRAMapping, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): GPU-sized on CUDA, small under the CPU interpreter."""
    if device.type != "cuda":
        return 16, 32
    if mapping.num_tokens <= LARGE_DECODE_TOKENS:
        return DECODE_BLOCK_M, 256
    if mapping.num_tokens <= DECODE_MAX_TOKENS:
        return DECODE_BLOCK_M, 128
    return 64, 256


# Pages: a slot's 16-row rank tiles are shared by up to this many programs (tile t -> program t % 4), so a rank-64
# adapter's shrink takes as long as a rank-16 one's; past rank 64 a program loops. On an H200 (32 tokens x 32
# adapters, 24 x r=8, 4 x r=16, 4 x r=64): 88 -> 58 us per layer with 4 programs (2: 68, 8: 63); all-r=16 batch
# 46 -> 47 (the programs of tiles past a slot's rank exit at once).
PAGED_RANK_PROGRAMS = 4


# Bytes of one A tile ([BLOCK_R, BLOCK_K]) at most: ranks up to 256 (and fp32) take shorter K tiles so
# that the pipelined x and A tiles fit in shared memory (sm_90: 227 KiB per block).
_MAX_A_TILE_BYTES = 32768


def cap_block_k(block_k: int, max_rank: int, itemsize: int) -> int:
    """``block_k`` shortened (a power of two, >= 16) until ``BLOCK_R * BLOCK_K * itemsize <= 32 KiB``
    (``BLOCK_R = max(16, next_pow2(max_rank))``; with pages ``max_rank`` is the tile's :data:`PAGED_BLOCK_R`)."""
    block_r = max(16, next_pow2(max_rank))
    return max(16, min(block_k, _MAX_A_TILE_BYTES // (block_r * itemsize)))


def choose_split_k(num_programs: int, hidden_size: int, block_k: int, device: torch.device) -> int:
    """Split the H reduction when segments x tiles x slices cannot fill the device (decode batches)."""
    sms = num_sms(device)
    if 2 * num_programs >= sms:  # half the SMs busy: splitting costs two extra kernels (zero + sum)
        return 1
    return max(1, min(cdiv(2 * sms, num_programs), cdiv(hidden_size, 4 * block_k), _MAX_SPLIT_K))


def _launch_lora_shrink(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`lora_shrink_ref`; returns ``out``, a new zeroed ``[n_slices, T, R] fp32`` by default.

    Only rows of LoRA tokens are written: with ``split_k == 1`` rows of slot -1
    tokens in a given ``out`` are left untouched; with ``split_k > 1`` partial
    sums go to a zeroed scratch buffer that is summed (in a fixed order, so
    results are deterministic) into every row of ``out``. ``split_k``: 1..16,
    default by batch and device size.
    """
    require_triton(_OP)
    max_rank = _check_args(x, lora_a, mapping, ranks, page_table)
    num_tokens, hidden_size = x.shape
    if out is None:
        out = torch.zeros((len(lora_a), num_tokens, max_rank), dtype=torch.float32, device=x.device)
    check_shape(_OP, "out", out, (len(lora_a), num_tokens, max_rank))
    check_dtype(_OP, "out", out, (torch.float32,))
    check_device(_OP, "out", out, x.device)
    check_last_dim_contiguous(_OP, "x", x)
    if not out.is_contiguous():
        raise KernelArgumentError(f"{_OP}: out must be contiguous, got stride()={out.stride()}")
    if split_k is not None and not 1 <= split_k <= _MAX_SPLIT_K:
        raise KernelArgumentError(f"{_OP}: split_k={split_k}, expected 1..{_MAX_SPLIT_K}")
    if not mapping.has_lora or max_rank == 0:
        return out
    block_m, block_k = _block_sizes(mapping, x.device)
    block_k = cap_block_k(block_k, rank_tile(max_rank, page_table), x.element_size())
    programs = max_tiles(mapping.num_tokens, mapping.num_slots, block_m) * len(lora_a)
    split = split_k or choose_split_k(programs, hidden_size, block_k, x.device)
    k_per_split = cdiv(cdiv(hidden_size, split), block_k) * block_k
    split = cdiv(hidden_size, k_per_split)
    target = out if split == 1 else torch.zeros((split, *out.shape), dtype=torch.float32, device=x.device)
    _run_kernel(x, lora_a, mapping, target, ranks, page_table, max_rank, k_per_split, (block_m, block_k),
                zero_tail=split == 1)
    if split > 1:
        torch.sum(target, dim=0, out=out)
    return out


def _run_kernel(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    target: torch.Tensor,
    ranks: torch.Tensor | None,
    page_table: torch.Tensor | None,
    max_rank: int,
    k_per_split: int,
    blocks: tuple[int, ...],
    zero_tail: bool = False,
    scaling: list[torch.Tensor] | None = None,
) -> None:
    """Launch over ``target`` = ``[n_slices, T, R]`` (one split) or ``[SPLIT, n_slices, T, R]`` fp32. With pages
    the columns ``ranks[s]..R-1`` of LoRA rows are written (zeros) only with ``zero_tail``. ``blocks``:
    ``(BLOCK_M, BLOCK_K)``, or with ``(num_warps, num_stages)`` after them (benchmark sweeps; else 4 warps and
    Triton's default stages)."""
    block_m, block_k = blocks[:2]
    launch = launch_options(_OP, blocks[2:])
    split = target.shape[0] if target.dim() == 4 else 1
    tiles = mapping.tiles(block_m)
    paged = multi_page(page_table)
    rank_programs = max(1, min(PAGED_RANK_PROGRAMS, cdiv(max_rank, PAGED_BLOCK_R))) if paged else 1
    _lora_shrink_kernel[(tiles.shape[1], len(lora_a) * split * rank_programs)](
        x,
        pointer_table(lora_a),
        target,
        tiles,
        tiles.shape[1],
        mapping.sorted_token_ids,
        mapping.segment_starts,
        mapping.segment_lens,
        mapping.segment_slots,
        ranks if ranks is not None else mapping.segment_slots,
        page_table if page_table is not None else mapping.segment_slots,
        pointer_table(scaling) if scaling is not None else mapping.segment_slots,
        x.shape[1],
        max_rank,
        k_per_split,
        x.stride(0),
        lora_a[0].stride(0),
        lora_a[0].stride(1),
        target.stride(0) if split > 1 else 0,
        target.stride(-3),
        target.stride(-2),
        split,
        HAS_RANKS=ranks is not None,
        PAGE=lora_a[0].shape[1] if paged else 0,
        ZERO_TAIL=zero_tail and paged,
        RANK_PROGRAMS=rank_programs,
        SLOT_PAGE=page_table is not None and not paged,
        SKIP_ZERO_SCALE=scaling is not None,
        BLOCK_M=block_m,
        BLOCK_R=rank_tile(max_rank, page_table),
        BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
        PRECISION=dot_precision(x.dtype, x.device),
        **launch, **pdl_args(x.device, _OP),
    )


def partial_split_k(mapping: LoRAMapping, hidden_size: int, n_slices: int, device: torch.device,
                    max_rank: int) -> int:
    """SPLIT for :func:`shrink_partials`: on CUDA, H in :func:`shrink_k_per_split` chunks (past 256 tokens no
    more splits than keep the partials under ``PROMPT_PARTIALS_MAX_BYTES``); elsewhere as
    :func:`choose_split_k` (1 once segments x tiles x slices fill the device)."""
    block_m, block_k = _block_sizes(mapping, device)
    if device.type == "cuda":
        split = min(cdiv(hidden_size, shrink_k_per_split(mapping.num_tokens)), _MAX_PARTIAL_SPLIT_K)
        if mapping.num_tokens > DECODE_MAX_TOKENS:
            per_split = n_slices * mapping.num_tokens * max(1, max_rank) * 4
            split = max(1, min(split, PROMPT_PARTIALS_MAX_BYTES // per_split))
        return split
    programs = max_tiles(mapping.num_tokens, mapping.num_slots, block_m) * n_slices
    return choose_split_k(programs, hidden_size, block_k, device)


def shrink_partials(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    ranks: torch.Tensor | None = None,
    split_k: int | None = None,
    blocks: tuple[int, ...] | None = None,
    *,
    page_table: torch.Tensor | None = None,
    scaling: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Split-K shrink without the reduction: ``p[k, i, t] = x[t, Hk] @ A_i[slot[t]][:, Hk].T``.

    ``sum_k p[k]`` is :data:`LORA_SHRINK`'s ``v`` on rows of LoRA tokens; the
    expand kernel forms that sum while loading (so there is no zero-fill and no
    sum kernel). Rows of slot -1 tokens are left unwritten (uninitialised); with
    pages so are (some of) the columns ``r >= ranks[slot]`` (the expand never reads them). With ``scaling``
    (the expand's ``[S]`` float32 per slice) the rows of slice ``i`` for tokens whose slot has
    ``scaling[i][s] == 0`` (a module its adapter does not target) are left unwritten too, and their A
    unread: the expand skips those (slot, slice) pairs as well.

    Args:
        x, lora_a, mapping, ranks, page_table: as :func:`lora_shrink_ref`.
        split_k: number of H chunks (``1..32``); default :func:`partial_split_k`.
        blocks: (BLOCK_M, BLOCK_K[, num_warps[, num_stages]]) override (benchmarks sweep it).

    Returns:
        ``[SPLIT, n_slices, T, R]`` float32 (SPLIT may be smaller than asked when H is small).

    Raises:
        KernelArgumentError: as :func:`lora_shrink_ref`, or ``split_k`` out of range.
        TritonUnavailableError: triton is not installed.
    """
    require_triton(_OP)
    max_rank = _check_args(x, lora_a, mapping, ranks, page_table)
    check_last_dim_contiguous(_OP, "x", x)
    num_tokens, hidden_size = x.shape
    split = split_k or partial_split_k(mapping, hidden_size, len(lora_a), x.device, max_rank)
    if not 1 <= split <= _MAX_PARTIAL_SPLIT_K:
        raise KernelArgumentError(f"{_OP}: split_k={split}, expected 1..{_MAX_PARTIAL_SPLIT_K}")
    block_m, block_k = blocks[:2] if blocks else _block_sizes(mapping, x.device)
    if blocks is None:
        block_k = cap_block_k(block_k, rank_tile(max_rank, page_table), x.element_size())
    k_per_split = cdiv(cdiv(hidden_size, split), block_k) * block_k
    split = cdiv(hidden_size, k_per_split)
    out = torch.empty((split, len(lora_a), num_tokens, max_rank), dtype=torch.float32, device=x.device)
    if mapping.has_lora and max_rank > 0:
        _run_kernel(x, lora_a, mapping, out, ranks, page_table, max_rank, k_per_split,
                    (block_m, block_k, *(blocks[2:] if blocks else ())), scaling=scaling)
    return out


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGMV shrink for several LoRA A slices (plain torch: a float32 matmul per segment, not per token).

    Args:
        x: ``[T, H]`` fp16/bf16/fp32 activations (last dim stride 1 for Triton).
        lora_a: list of ``n_slices`` contiguous tensors, dtype of ``x``: rectangles ``[S, R, H]`` (lower-rank
            adapters zero-padded to R), or with ``page_table`` pages ``[P, PAGE, H]`` (all slices one P and
            PAGE; PAGE a power of two in 1..256).
        mapping: :class:`LoRAMapping` of the step (``num_tokens == T``, slots ``< S``).
        ranks: ``[S] int32``; ``ranks[s]`` >= the true rank of every slice of slot s. Rows r >= ranks[s]
            are treated as zero and not read. Optional for rectangles, required with ``page_table``.
        page_table: optional ``[S, max_pages] int32``, contiguous: row r < ranks[s] of slot s is
            ``lora_a[i][page_table[s, r // PAGE], r % PAGE]`` (R = max_pages * PAGE, ``ranks[s] <= R``);
            entries past slot s's ``ceil(ranks[s] / PAGE)`` pages are not read (may be -1).

    Returns:
        ``v`` ``[n_slices, T, R]`` float32 (with pages 0 in columns ``r >= ranks[slot]``).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, a slot >= S, ``page_table`` without ``ranks``,
            slices of different R (PAGE); here (which reads the page table) also a rank outside 0..R or a
            used page id outside 0..P-1.
        TritonUnavailableError: Triton backend without triton installed.
    """
    max_rank = _check_args(x, lora_a, mapping, ranks, page_table)
    out = torch.zeros((len(lora_a), x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    rank_host = ranks.tolist() if ranks is not None else None
    rows = paged_rows(_OP, page_table, ranks, lora_a[0].shape[0], lora_a[0].shape[1]) if page_table is not None \
        else None
    for slot, start, length in mapping.segments_host():
        tokens = mapping.sorted_token_ids[start : start + length].long()
        xs = x[tokens].float()
        for i, a in enumerate(lora_a):
            if rows is not None:
                pages, offsets = rows[slot]
                out[i, tokens, : len(pages)] = xs @ a[pages, offsets].float().T  # only the slot's rank rows
                continue
            weight = a[slot].to(torch.float32, copy=True)
            if rank_host is not None:
                weight[rank_host[slot] :] = 0.0
            out[i, tokens] = xs @ weight.T
    return out


LORA_SHRINK = Op(
    name=_OP,
    semantics="v[i, t] = x[t] @ A_i[slot[t]].T, and v[i, t] = 0 where slot[t] == -1; with pages A_i[s] = rows "
    "r < ranks[s] of pages page_table[s] (row r: lora_a[i][page_table[s, r // PAGE], r % PAGE]), v[i, t, r] = 0 "
    "for r >= ranks[slot[t]]",
    reference=lora_shrink_ref,
    triton=_launch_lora_shrink,
)
