"""LoRA expand (SGMV, Punica: Chen et al. 2023): add each token's scaled ``v @ B.T`` into its output slice.

Semantics: :data:`LORA_EXPAND`.

Slices may have different widths (fused q/k/v with GQA, gate/up) and all run
in one launch; ``off_i = out_0 + ... + out_{i-1}``. Grid = ((segment, token
tile) work item, slice x output tiles): a segment's tokens share every load of the
adapter's B tile. The sum is formed in float32 and rounded once into ``y``;
on tensor cores ``v`` is rounded to B's dtype first (as PEFT computes in it).

Rectangles (``lora_b[i]`` ``[S, out_i, R]``, lower ranks zero-padded) take one ``[BLOCK_N, max(16, R)]`` B tile
per column tile. Pages (``lora_b[i]`` ``[P, out_i, PAGE]``, S-LoRA's unified paging) take ``ceil(ranks[s] / 16)``
tiles of 16 rank columns, one after another in the program, each column's page gathered from ``page_table[s]``;
``v_tile @ B_tile.T`` is summed over the tiles in one float32 accumulator and added into ``y`` once.
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
    int32_table,
    launch_options,
    next_pow2,
    pdl_args,
    pdl_wait,
    pointer_table,
    require_triton,
    tl,
    tl_dtype,
    triton,
)
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.op import Op

_OP = "lora_expand"
# Batches of at most this many tokens use the shrink's decode launch shapes (lora_shrink._block_sizes).
DECODE_MAX_TOKENS = 256
DECODE_BLOCK_M = 16  # token rows per program: the expand at every size, the shrink up to DECODE_MAX_TOKENS
# Decode batches of more than this many tokens (up to DECODE_MAX_TOKENS) take shapes of their own, shrink and expand:
# there a batch holds up to as many adapters as tokens (one-token segments), and fewer, longer programs win.
LARGE_DECODE_TOKENS = 128
# Rank rows per tile with pages (shrink and expand): a program loops over ceil(ranks[s] / 16) tiles (16: the
# smallest bf16 tensor-core K, and the rank the rectangle launch shapes were tuned at).
PAGED_BLOCK_R = 16


def multi_page(page_table: torch.Tensor | None) -> bool:
    """Whether a page table gives slots several pages (the paged kernel path). With one page per slot
    (``PAGE = R``) the kernels take the rectangle path, each slot's rectangle being its page."""
    return page_table is not None and page_table.shape[1] > 1


def rank_tile(max_rank: int, page_table: torch.Tensor | None) -> int:
    """``BLOCK_R``, the rank rows of one program's tile (shrink and expand): :data:`PAGED_BLOCK_R` with several
    pages per slot, else all of R (``max(16, next_pow2(R))``, for rectangles and one page per slot)."""
    return PAGED_BLOCK_R if multi_page(page_table) else max(16, next_pow2(max_rank))


@triton.jit
def _load_v(v_ptrs, v_mask, split_k, stride_v_split, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """``[BLOCK_M, BLOCK_R]`` float32 tile of ``v``: the sum of ``split_k`` partial shrink results, added in a fixed
    order (deterministic); masked-off elements are not read. A runtime loop on purpose: unrolled (``split_k`` a
    compile-time constant, the loads issued together) it measured slower on an H200 (one q/v layer at 256 tokens x
    256 adapters: expand 67 -> 82 us; a Llama-2-7B layer at 32 x 32: 96 -> 110 us; RESULTS.md, session 13)."""
    v = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for split in range(split_k):
        v += tl.load(v_ptrs + split * stride_v_split, mask=v_mask, other=0.0)
    return v


@triton.jit
def _add_into_y(y_ptr, tok, stride_yt, offset, cols, row_mask, col_mask, delta):
    """``y[tok, offset + cols] += delta`` (float32 sum, rounded once to y's dtype)."""
    y_ptrs = y_ptr + tok[:, None] * stride_yt + offset + cols[None, :]
    y_mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _page_ids(page_row, r, rank, PAGE: tl.constexpr):
    """int64 page of each rank row in ``r`` (``[BLOCK_R]``) from ``page_row`` (the slot's row of the page table):
    ``page_row[r // PAGE]``; rows ``>= rank`` get 0 and their entries are not read."""
    return tl.load(page_row + r // PAGE, mask=r < rank, other=0).to(tl.int64)


@triton.jit
def _paged_tile_dot(acc, v_row, row_mask, r, rank, split_k, stride_v_split, page, b_base, page_stride, cols, col_mask,
                    stride_v_slot, PAGE: tl.constexpr, B_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, V_PAGED: tl.constexpr):
    """``acc + v[:, r] @ B[cols, r].T`` for one tile of rank columns ``r``, B paged ([P, width, PAGE], column r in
    page ``page`` (:func:`_page_ids`) at ``r % PAGE``); columns ``>= rank`` of v and B are not read. ``V_PAGED``:
    v holds every page's rows per token (a folded shrink, ``[.., P, PAGE]`` with page stride ``stride_v_slot``),
    column r read from page ``page`` too."""
    r_mask = r < rank
    if V_PAGED:
        v_cols = page * stride_v_slot + r % PAGE
    else:
        v_cols = r
    v = _load_v(v_row + v_cols[None, :], row_mask[:, None] & r_mask[None, :], split_k, stride_v_split, BLOCK_M,
                BLOCK_R)
    # One page id per rank column, even where a tile lies in one page: on an H200 (Triton 3.6, 32 tokens x 32
    # adapters, all r=16, PAGE 16) the expands of a Llama-2-7B layer took 77 us so, 94 us with one page id per tile
    # (which lets the compiler load 16 bytes along r); rectangles: 63 us.
    b = tl.load(b_base + (page * page_stride)[None, :] + cols[:, None] * PAGE + (r % PAGE)[None, :],
                mask=col_mask[:, None] & r_mask[None, :], other=0.0)
    return tl.dot(v.to(B_DTYPE).to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)), acc, input_precision=PRECISION)


# Per-step ints are not specialised (no recompile when a count becomes 1 or a multiple of 16).
@triton.jit(do_not_specialize=["num_tiles", "split_k"])
def _lora_expand_kernel(
    v_ptr,
    b_ptrs,
    scaling_ptrs,
    slice_widths_ptr,
    slice_offsets_ptr,
    y_ptr,
    tiles_ptr,
    num_tiles,
    sorted_token_ids_ptr,
    segment_starts_ptr,
    segment_lens_ptr,
    segment_slots_ptr,
    ranks_ptr,
    page_table_ptr,
    max_rank,
    n_tiles,
    stride_v_split,
    stride_v_slice,
    stride_vt,
    stride_v_slot,
    stride_yt,
    split_k,
    HAS_RANKS: tl.constexpr,
    PAGE: tl.constexpr,  # rank columns per page; 0 = rectangles ([S, width, R] slices)
    SLOT_PAGE: tl.constexpr,  # PAGE == 0 with one page per slot: the rectangle is page page_table[slot, 0]
    V_PAGED: tl.constexpr,  # PAGE != 0 and v holds every page's rows per token (slot_rows): rank row r read in its page
    B_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    seg = tl.load(tiles_ptr + tl.program_id(0))
    m_tile = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
    slice_id = tl.program_id(1) // n_tiles
    n_first = (tl.program_id(1) % n_tiles) * (BLOCK_N * N_ITERS)
    width = tl.load(slice_widths_ptr + slice_id)
    seg_len = tl.load(segment_lens_ptr + seg)
    if (m_tile * BLOCK_M >= seg_len) | (n_first >= width):
        return
    slot = tl.load(segment_slots_ptr + seg).to(tl.int64)
    # scaling 0: a module the slot's adapter does not target adds nothing (v, B and y unread)
    scale = tl.load(tl.load(scaling_ptrs + slice_id).to(tl.pointer_type(tl.float32)) + slot)
    if scale == 0.0:
        return
    rank = max_rank
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + slot), max_rank)
    if PAGE != 0:
        if rank <= 0:  # a rank-0 slot adds nothing: y is not even read
            return
        # column r of slot s's B_i lives in page page_table[s, r // PAGE]; the first tile's pages are loaded now,
        # beside the token ids
        page_row = page_table_ptr + slot * (max_rank // PAGE)
        r_first = tl.arange(0, BLOCK_R)
        page_first = _page_ids(page_row, r_first, rank, PAGE)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seg_len
    seg_start = tl.load(segment_starts_ptr + seg)
    tok = tl.load(sorted_token_ids_ptr + seg_start + rows, mask=row_mask, other=0).to(tl.int64)
    if PAGE == 0:
        # one tile of all R rank columns: v loaded once for the program's N_ITERS column tiles
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        wslot = slot
        if SLOT_PAGE:
            wslot = tl.load(page_table_ptr + slot).to(tl.int64)
        # stride_v_slot != 0: v holds every slot's (page's) row per token (a folded shrink), this slot's is read
        v = _load_v(v_ptr + slice_id * stride_v_slice + tok[:, None] * stride_vt + wslot * stride_v_slot + r[None, :],
                    row_mask[:, None] & r_mask[None, :], split_k, stride_v_split, BLOCK_M, BLOCK_R)
        v = v.to(B_DTYPE).to(DOT_DTYPE)
        b_base = tl.load(b_ptrs + slice_id).to(tl.pointer_type(B_DTYPE))
        offset = tl.load(slice_offsets_ptr + slice_id)
        for it in tl.static_range(N_ITERS):
            cols = n_first + it * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < width
            # B_i is a contiguous [S, width, max_rank] tensor (with SLOT_PAGE: [P, width, max_rank], page wslot).
            b = tl.load(
                b_base + wslot * width * max_rank + cols[:, None] * max_rank + r[None, :],
                mask=col_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            delta = tl.dot(v, tl.trans(b.to(DOT_DTYPE)), input_precision=PRECISION) * scale
            _add_into_y(y_ptr, tok, stride_yt, offset, cols, row_mask, col_mask, delta)
    else:
        # BLOCK_R-column tiles of the slot's rank (B_i a contiguous [P, width, PAGE] tensor): the first one straight
        # (all of a rank <= BLOCK_R), the rest in a loop, summed in one float32 accumulator.
        v_row = v_ptr + slice_id * stride_v_slice + tok[:, None] * stride_vt
        b_base = tl.load(b_ptrs + slice_id).to(tl.pointer_type(B_DTYPE))
        offset = tl.load(slice_offsets_ptr + slice_id)
        page_stride = width.to(tl.int64) * PAGE
        for it in tl.static_range(N_ITERS):
            cols = n_first + it * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < width
            acc = _paged_tile_dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), v_row, row_mask, r_first, rank, split_k,
                                  stride_v_split, page_first, b_base, page_stride, cols, col_mask, stride_v_slot,
                                  PAGE, B_DTYPE, DOT_DTYPE, PRECISION, BLOCK_M, BLOCK_R, V_PAGED)
            # Each tile's page ids are loaded one tile ahead. On an H200 (32 tokens x 32 adapters) this layout ran
            # 77 us per layer for an all-r=16 batch and 103 for a mixed one (24 x r=8, 4 x 16, 4 x 64; PAGE 8),
            # against 89 and 113 with the ids loaded inside the iteration (also with that loop unpipelined).
            page = _page_ids(page_row, r_first + BLOCK_R, rank, PAGE)
            for r_tile in range(1, tl.cdiv(rank, BLOCK_R)):
                r = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
                page_next = _page_ids(page_row, r + BLOCK_R, rank, PAGE)
                acc = _paged_tile_dot(acc, v_row, row_mask, r, rank, split_k, stride_v_split, page, b_base,
                                      page_stride, cols, col_mask, stride_v_slot, PAGE, B_DTYPE, DOT_DTYPE, PRECISION,
                                      BLOCK_M, BLOCK_R, V_PAGED)
                page = page_next
            _add_into_y(y_ptr, tok, stride_yt, offset, cols, row_mask, col_mask, acc * scale)


def _check_slot_rows(v: torch.Tensor, lora_b: list[torch.Tensor]) -> torch.Tensor:
    """Checks of a ``slot_rows`` ``v`` (``[n_slices, T, P, R]``, P slots or pages); returns its ``[n_slices, T, R]``
    view of page 0 for :func:`_check_args`."""
    check_shape(_OP, "v", v, (len(lora_b), None, lora_b[0].shape[0], lora_b[0].shape[2]))
    check_dtype(_OP, "v", v, (torch.float32, lora_b[0].dtype))
    check_last_dim_contiguous(_OP, "v", v)
    return v[:, :, 0]


def _check_args(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    ranks: torch.Tensor | None,
    page_table: torch.Tensor | None = None,
    v_dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    slot_rows: bool = False,
) -> int:
    """Shape/dtype/device/layout checks (no tensor contents read); returns R (with pages ``max_pages * PAGE``).
    ``slot_rows``: ``v`` is one page's ``[n_slices, T, PAGE]`` view of a :data:`LORA_EXPAND_SLOT_ROWS` ``v``."""
    check_dtype(_OP, "y", y, FLOAT_DTYPES)
    check_shape(_OP, "y", y, (None, None))
    check_dtype(_OP, "v", v, v_dtypes)
    # y is the layer output (B's dtype) or a float32 delta buffer.
    like = lora_b[0] if y.dtype == torch.float32 and isinstance(lora_b, (list, tuple)) and lora_b else y
    if page_table is None:
        check_weight_list(_OP, "lora_b", lora_b, like, v.shape[-1] if v.dim() == 3 else None)
        num_slots = lora_b[0].shape[0]
        max_rank = lora_b[0].shape[2]
    else:
        # [P, out_i, PAGE]: one P and one PAGE for every slice
        check_weight_list(_OP, "lora_b", lora_b, like, lora_b[0].shape[-1] if lora_b[0].dim() == 3 else None)
        num_slots = check_paging(_OP, page_table, ranks, lora_b[0].shape[2], y.device)
        max_rank = page_table.shape[1] * lora_b[0].shape[2]
    check_device(_OP, "y", y, lora_b[0].device)
    check_shape(_OP, "v", v, (len(lora_b), y.shape[0], lora_b[0].shape[2] if slot_rows else max_rank))
    check_device(_OP, "v", v, y.device)
    if not isinstance(scaling, (list, tuple)) or len(scaling) != len(lora_b):
        raise KernelArgumentError(f"{_OP}: scaling must be a list of {len(lora_b)} tensors, got {scaling!r}")
    for i, s in enumerate(scaling):
        check_shape(_OP, f"scaling[{i}]", s, (num_slots,))
        check_dtype(_OP, f"scaling[{i}]", s, (torch.float32,))
        check_device(_OP, f"scaling[{i}]", s, y.device)
    widths = [b.shape[1] for b in lora_b]
    if sum(widths) != y.shape[1]:
        raise KernelArgumentError(f"{_OP}: y.shape[1]={y.shape[1]} != sum of lora_b widths {widths}")
    check_mapping(_OP, mapping, y.shape[0], num_slots, y.device)
    if page_table is None:
        check_ranks(_OP, ranks, num_slots, y.device)
    return max_rank


# Bytes of one B tile ([BLOCK_N, BLOCK_R]) at most for the 256-column tiles: ranks above 64 (32 in fp32)
# keep the 128-column tiles every rank used before those tiles were measured (session 8).
_MAX_B_TILE_BYTES = 32768


def cap_block_n(block_n: int, max_rank: int, itemsize: int) -> int:
    """``block_n`` (from :func:`_block_sizes`) lowered to 128 when a ``[block_n, BLOCK_R]`` B tile would exceed
    32 KiB."""
    block_r = max(16, next_pow2(max_rank))
    return block_n if block_n <= 128 or block_n * block_r * itemsize <= _MAX_B_TILE_BYTES else 128


def _block_sizes(mapping: LoRAMapping, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, N_ITERS): GPU-sized on CUDA, small under the CPU interpreter.

    16-row tiles at every size; one 128-column tile per program up to 8 tokens, one 256-column tile beyond
    (:func:`cap_block_n` lowers it for big ranks), except from 129 to 256 tokens: eight 128-column tiles per
    program (``N_ITERS`` 8: ``v`` loaded once for 1,024 columns), one 256-column tile again for ranks above 32
    (:func:`_launch_lora_expand`).
    """
    if device.type != "cuda":
        return 16, 16, 2
    # Tuned on an H200 (benchmarks/bench_lora_kernels.py --sweep-sgmv, RESULTS.md session 8): one
    # 128-column tile per program for a handful of tokens, one 256-column tile beyond (32 tokens x 32
    # adapters: 112.6 -> 103.8 us per layer; 512 tokens: 16-row tiles instead of 64, 522 -> 305 us).
    # Session 13, a q/v adapter's qkv linear at 256 tokens: with the shrink's 1024-element H chunks in 128-element
    # K tiles, 114.4 -> 94.3 us at 256 adapters and 50.4 -> 45.8 us at 64.
    if mapping.num_tokens <= 8:
        return DECODE_BLOCK_M, 128, 1
    if LARGE_DECODE_TOKENS < mapping.num_tokens <= DECODE_MAX_TOKENS:
        return DECODE_BLOCK_M, 128, 8
    return DECODE_BLOCK_M, 256, 1


def launch_shape(mapping: LoRAMapping, device: torch.device, block_r: int, itemsize: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, N_ITERS) of a launch: :func:`_block_sizes` for a ``[BLOCK_N, block_r]`` B tile of
    ``itemsize``-byte elements; a rank tile above 32 takes one column tile per program (eight ``[128, R]`` B tiles
    would not fit in registers), :func:`cap_block_n` lowering its width."""
    block_m, block_n, n_iters = _block_sizes(mapping, device)
    if n_iters > 1 and block_r > 32 and device.type == "cuda":
        block_n, n_iters = 256, 1
    return block_m, cap_block_n(block_n, block_r, itemsize), n_iters


def _launch_lora_expand(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    blocks: tuple[int, ...] | None = None,
    slot_rows: bool = False,
) -> None:
    """Triton launch of :func:`lora_expand_ref`; ``v`` may also be ``[SPLIT, n_slices, T, R]`` partial sums.

    Rows of ``v`` for tokens without an adapter are never read, nor (with pages) columns ``r >= ranks[slot]``.
    ``blocks``: (BLOCK_M, BLOCK_N, N_ITERS[, num_warps[, num_stages]]) override (benchmarks sweep it).
    ``slot_rows``: ``v`` is ``[n_slices, T, P, R]`` (float32 or B's dtype, any strides but a contiguous last
    dim), every slot's (page's) shrink per token, as one GEMM over all of the pool's A gives it
    (:data:`LORA_EXPAND_SLOT_ROWS`); token t reads ``v[i, t, slot[t]]``, or with a page table rank row r from
    ``v[i, t, page_table[slot[t], r // PAGE], r % PAGE]``.
    """
    require_triton(_OP)
    if slot_rows:
        v3, split = _check_slot_rows(v, lora_b), 1
    else:
        split = v.shape[0] if v.dim() == 4 else 1
        v3 = v[0] if v.dim() == 4 else v
    max_rank = _check_args(v3, lora_b, scaling, y, mapping, ranks, page_table,
                           (torch.float32, lora_b[0].dtype) if slot_rows else (torch.float32,), slot_rows)
    check_last_dim_contiguous(_OP, "y", y)
    for i, s in enumerate(scaling):
        check_last_dim_contiguous(_OP, f"scaling[{i}]", s)
    if not slot_rows and not v.is_contiguous():
        raise KernelArgumentError(f"{_OP}: v must be contiguous, got stride()={v.stride()}")
    if not mapping.has_lora or max_rank == 0:
        return
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    paged = multi_page(page_table)  # one page per slot: the rectangle path
    block_r = rank_tile(max_rank, page_table)
    block_m, block_n, n_iters = blocks[:3] if blocks else launch_shape(mapping, y.device, block_r,
                                                                        lora_b[0].element_size())
    launch = launch_options(_OP, blocks[3:] if blocks else ())
    n_tiles = cdiv(max(widths), block_n * n_iters)
    tiles = mapping.tiles(block_m)
    _lora_expand_kernel[(tiles.shape[1], len(lora_b) * n_tiles)](
        v,
        pointer_table(lora_b),
        pointer_table(scaling),
        int32_table(widths, y.device),
        int32_table(offsets, y.device),
        y,
        tiles,
        tiles.shape[1],
        mapping.sorted_token_ids,
        mapping.segment_starts,
        mapping.segment_lens,
        mapping.segment_slots,
        ranks if ranks is not None else mapping.segment_slots,
        page_table if page_table is not None else mapping.segment_slots,
        max_rank,
        n_tiles,
        v.stride(0) if split > 1 else 0,
        v.stride(0) if slot_rows else v3.stride(0),
        v.stride(1) if slot_rows else v3.stride(1),
        v.stride(2) if slot_rows else 0,
        y.stride(0),
        split,
        HAS_RANKS=ranks is not None,
        PAGE=lora_b[0].shape[2] if paged else 0,
        SLOT_PAGE=page_table is not None and not paged,
        V_PAGED=slot_rows and paged,
        B_DTYPE=tl_dtype(lora_b[0].dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        N_ITERS=n_iters,
        BLOCK_R=block_r,
        DOT_DTYPE=dot_dtype(lora_b[0].dtype, y.device),
        PRECISION=dot_precision(lora_b[0].dtype, y.device),
        **launch, **pdl_args(y.device, _OP),
    )



def lora_expand_ref(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> None:
    """SGMV expand for several LoRA B slices, in place on ``y`` (plain torch: a float32 matmul per segment and slice).

    Args:
        v: ``[n_slices, T, R]`` float32, contiguous (the output of :data:`~loraplex.kernels.lora_shrink.LORA_SHRINK`).
        lora_b: list of ``n_slices`` contiguous tensors, dtype of ``y``: rectangles ``[S, out_i, R]``, or with
            ``page_table`` pages ``[P, out_i, PAGE]`` (all slices one P and PAGE; PAGE a power of two in 1..256).
        scaling: list of ``n_slices`` ``[S]`` float32 tensors (``alpha / r``; 0 for untargeted modules).
        y: ``[T, sum(out_i)]`` base-layer output (dtype of B), or a float32 delta buffer (last dim stride 1
            for Triton); updated in place.
        mapping: :class:`LoRAMapping` of the step (``num_tokens == T``, slots ``< S``).
        ranks: ``[S] int32``; ``ranks[s]`` >= the true rank of every slice of slot s (columns r >= ranks[s] of
            B and v are not read). Optional for rectangles, required with ``page_table``.
        page_table: optional ``[S, max_pages] int32``, contiguous: column r < ranks[s] of slot s's B_i is
            ``lora_b[i][page_table[s, r // PAGE], :, r % PAGE]`` (R = max_pages * PAGE, ``ranks[s] <= R``);
            entries past slot s's ``ceil(ranks[s] / PAGE)`` pages are not read (may be -1).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, widths not summing to ``y.shape[1]``, a slot >= S,
            ``page_table`` without ``ranks``; here (which reads the page table) also a rank outside 0..R or a
            used page id outside 0..P-1.
        TritonUnavailableError: Triton backend without triton installed.
    """
    _check_args(v, lora_b, scaling, y, mapping, ranks, page_table)
    rank_host = ranks.tolist() if ranks is not None else None
    rows = paged_rows(_OP, page_table, ranks, lora_b[0].shape[0], lora_b[0].shape[2]) if page_table is not None \
        else None
    scaling_host = [s.tolist() for s in scaling]
    for slot, start, length in mapping.segments_host():
        tokens = mapping.sorted_token_ids[start : start + length].long()
        offset = 0
        for i, b in enumerate(lora_b):
            width = b.shape[1]
            if scaling_host[i][slot] == 0.0:  # an untargeted module: nothing added, its weights unread
                offset += width
                continue
            if rows is not None:
                pages, offsets = rows[slot]
                weight = b[pages, :, offsets].float()  # [rank, out_i]: only the slot's rank columns
                delta = scaling_host[i][slot] * (v[i, tokens, : len(pages)] @ weight)
            else:
                weight = b[slot].to(torch.float32, copy=True)  # [out_i, R]
                if rank_host is not None:
                    weight[:, rank_host[slot] :] = 0.0
                delta = scaling_host[i][slot] * (v[i, tokens] @ weight.T)
            y[tokens, offset : offset + width] = (y[tokens, offset : offset + width].float() + delta).to(y.dtype)
            offset += width


LORA_EXPAND = Op(
    name=_OP,
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * v[i, t] @ B_i[s].T, s = slot[t]; nothing for s == -1 "
    "or scaling_i[s] == 0; "
    "with pages B_i[s] = columns r < ranks[s] of pages page_table[s] (column r: lora_b[i][page_table[s, r // PAGE], "
    ":, r % PAGE])",
    reference=lora_expand_ref,
    triton=_launch_lora_expand,
)


def slot_rows_view(out: torch.Tensor, base_columns: int, n_slices: int, pages: int, rank: int) -> torch.Tensor:
    """The ``[n_slices, T, pages, rank]`` ``v`` of :data:`LORA_EXPAND_SLOT_ROWS` inside the output ``out [T, N]`` of a
    GEMM over ``[W (base_columns rows); A_0 (pages x rank rows, page-major); A_1; ...]``: its columns past
    ``base_columns`` (a view, no copy)."""
    extra = out[:, base_columns:]
    return extra.as_strided((n_slices, out.shape[0], pages, rank), (pages * rank, out.stride(0), rank, 1),
                            extra.storage_offset())


def lora_expand_slot_rows_ref(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> None:
    """SGMV expand of a shrink computed for every slot: each token reads its own slot's row of ``v``.

    This is the expand of a shrink folded into the base GEMM (``y_ext = x @ [W; A_0; ...; A_{n-1}].T``, every
    slot's A rows under W; ``loraplex.engine.models.llama.LinearWithLoRA``): the GEMM's extra columns are ``v``.

    Args:
        v: ``[n_slices, T, P, PAGE]`` float32 or B's dtype, last dim contiguous, other strides free (a view of the
            GEMM's output): ``v[i, t, p] = x[t] @ A_i[p].T`` (P: slots, or with a ``page_table`` pages).
        lora_b, scaling, y, mapping, ranks: as :func:`lora_expand_ref`.
        page_table: optional ``[S, max_pages] int32`` (``ranks`` required): rank row r < ranks[s] of slot s is row
            ``r % PAGE`` of page ``page_table[s, r // PAGE]``, in B_i and in ``v``.

    Raises:
        KernelArgumentError: as :func:`lora_expand_ref`, or a ``v`` of another shape or dtype.
        TritonUnavailableError: Triton backend without triton installed.
    """
    v3 = _check_slot_rows(v, lora_b)
    max_rank = _check_args(v3, lora_b, scaling, y, mapping, ranks, page_table, (torch.float32, lora_b[0].dtype),
                           slot_rows=True)
    slots = mapping.token_slots.long()
    picked = torch.zeros(v.shape[0], y.shape[0], max_rank, dtype=torch.float32, device=v.device)
    if page_table is None:  # each token's row of v is its slot's
        lora = (slots >= 0).nonzero().flatten()
        picked[:, lora] = v[:, lora, slots[lora]].float()
    else:  # each rank row from its page (only rows below the slot's rank: the rest may be anything)
        rows = paged_rows(LORA_EXPAND_SLOT_ROWS.name, page_table, ranks, lora_b[0].shape[0], lora_b[0].shape[2])
        for s in slots[slots >= 0].unique().tolist():
            pages, offsets = rows[s]
            tokens = (slots == s).nonzero().flatten()
            picked[:, tokens, : len(pages)] = v[:, tokens][:, :, pages, offsets].float()
    lora_expand_ref(picked, lora_b, scaling, y, mapping, ranks=ranks, page_table=page_table)


def _launch_lora_expand_slot_rows(
    v: torch.Tensor,
    lora_b: list[torch.Tensor],
    scaling: list[torch.Tensor],
    y: torch.Tensor,
    mapping: LoRAMapping,
    *,
    ranks: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    blocks: tuple[int, ...] | None = None,
) -> None:
    """Triton launch of :func:`lora_expand_slot_rows_ref` (the expand kernel reading ``v`` per slot)."""
    _launch_lora_expand(v, lora_b, scaling, y, mapping, ranks=ranks, page_table=page_table, blocks=blocks,
                        slot_rows=True)


LORA_EXPAND_SLOT_ROWS = Op(
    name="lora_expand_slot_rows",
    semantics="y[t, off_i:off_i+out_i] += scaling_i[s] * v[i, t, s] @ B_i[s].T, s = slot[t]; nothing for s == -1 "
    "or scaling_i[s] == 0; with pages, rank row r < ranks[s] of v[i, t] and of B_i[s] is row r % PAGE of page "
    "page_table[s, r // PAGE]",
    reference=lora_expand_slot_rows_ref,
    triton=_launch_lora_expand_slot_rows,
)
