"""LoRA SGMV over a paged pool ("ranks without padding", S-LoRA's unified paging): Triton kernels and torch
references against a float32 per-token loop that reads the pages itself.

Every pool here is poisoned: rows past a slot's rank (the tail of its last page) and free pages hold NaN, unused
page-table entries hold -1, pages are shuffled (a slot's pages are neither contiguous nor in order). A finite,
correct result shows that none of them was read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from kernel_test_utils import assert_lora_close, assert_sum_close, folded_gemm

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_linear import ADD_LORA
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_shrink import _launch_lora_shrink, shrink_partials
from loraplex.kernels.ops import Kernels

RANKS = [8, 16, 64, 128, 0, 40]  # slot 4 has rank 0; 40: partial 16-row tiles and partial pages
QKV = (32, [64, 16, 16])  # (H, widths): fused q/k/v with GQA widths
SINGLE = (40, [48])  # H not a multiple of the interpreter's 32-element K tiles


@dataclass
class PagedPool:
    """One layer's paged LoRA slices and the metadata the kernels take."""

    lora_a: list[torch.Tensor]  # [P, PAGE, H]
    lora_b: list[torch.Tensor]  # [P, out_i, PAGE]
    scaling: list[torch.Tensor]  # [S] fp32
    ranks: torch.Tensor  # [S] int32
    page_table: torch.Tensor  # [S, max_pages] int32, -1 past each slot's pages
    page: int
    rank_list: list[int]
    table: list[list[int]]


def make_pool(ranks: list[int], page: int, hidden: int, widths: list[int], dtype: torch.dtype,
              device: torch.device, max_pages: int | None = None, spare_pages: int = 3) -> PagedPool:
    """Shuffled pages; NaN in every row no slot uses (free pages, the tails of last pages)."""
    needed = [-(-r // page) for r in ranks]
    max_pages = max_pages or max(1, max(needed))
    num_pages = sum(needed) + spare_pages
    ids = torch.randperm(num_pages).tolist()
    table, start = [], 0
    for n in needed:
        table.append(ids[start : start + n] + [-1] * (max_pages - n))
        start += n
    lora_a = [torch.full((num_pages, page, hidden), float("nan")) for _ in widths]
    lora_b = [torch.full((num_pages, w, page), float("nan")) for w in widths]
    for s, rank in enumerate(ranks):
        pages = [table[s][r // page] for r in range(rank)]
        offsets = [r % page for r in range(rank)]
        for a, b in zip(lora_a, lora_b):
            a[pages, offsets] = torch.randn(rank, hidden) / hidden**0.5
            b[pages, :, offsets] = torch.randn(rank, b.shape[1]) / max(rank, 1) ** 0.5
    return PagedPool(
        lora_a=[a.to(device, dtype) for a in lora_a],
        lora_b=[b.to(device, dtype) for b in lora_b],
        scaling=[(torch.rand(len(ranks)) + 0.5).to(device) for _ in widths],
        ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        page_table=torch.tensor(table, dtype=torch.int32, device=device),
        page=page,
        rank_list=list(ranks),
        table=table,
    )


def naive_paged(x: torch.Tensor, pool: PagedPool, y: torch.Tensor, token_slots: torch.Tensor):
    """Per token, in float32, reading each rank row from its page with Python ints: ``(v, y + delta,
    magnitude)``; ``v`` ``[n_slices, T, R]`` is 0 past the slot's rank and for slot -1, ``magnitude`` is
    ``|scaling| |v| @ |B|`` (the size of the delta's terms, for bf16's rounding of v)."""
    max_rank = pool.page_table.shape[1] * pool.page
    slots = token_slots.tolist()
    v = torch.zeros(len(pool.lora_a), len(slots), max_rank)
    out = y.float().cpu().clone()
    magnitude = torch.zeros_like(out)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        rows = [(pool.table[s][r // pool.page], r % pool.page) for r in range(pool.rank_list[s])]
        offset = 0
        for i, (a, b) in enumerate(zip(pool.lora_a, pool.lora_b)):
            width = b.shape[1]
            a_rows = torch.stack([a[p, o].float().cpu() for p, o in rows]) if rows else torch.zeros(0, a.shape[2])
            b_cols = torch.stack([b[p, :, o].float().cpu() for p, o in rows]) if rows else torch.zeros(0, width)
            vt = x[t].float().cpu() @ a_rows.T
            v[i, t, : len(rows)] = vt
            scale = float(pool.scaling[i][s])
            out[t, offset : offset + width] += scale * (vt @ b_cols)
            magnitude[t, offset : offset + width] += abs(scale) * (vt.abs() @ b_cols.abs())
            offset += width
    return v, out, magnitude


def paged_terms(x: torch.Tensor, pool: PagedPool, y: torch.Tensor, token_slots: torch.Tensor):
    """:func:`naive_paged` over ``|x|``, ``|A|``, ``|B|``, ``|scaling|`` and ``|y|``: ``(the shrink's terms |x| |A|^T
    [n_slices, T, R], the terms of y + delta [T, N])``, float32 on CPU (a sum's rounding scales with its terms)."""
    abs_pool = dataclasses.replace(pool, lora_a=[a.abs() for a in pool.lora_a], lora_b=[b.abs() for b in pool.lora_b],
                                   scaling=[s.abs() for s in pool.scaling])
    shrink_terms, terms, _ = naive_paged(x.abs(), abs_pool, y.abs(), token_slots)
    return shrink_terms, terms


def token_slots(num_tokens: int, num_slots: int) -> torch.Tensor:
    """1 token: the rank-128 slot; else every slot (the rank-0 one too) and some slot -1 tokens, shuffled."""
    if num_tokens == 1:
        return torch.tensor([RANKS.index(128)], dtype=torch.int32)
    slots = [-1] * max(1, num_tokens // 8)
    slots += [i % num_slots for i in range(num_tokens - len(slots))]
    return torch.tensor(slots, dtype=torch.int32)[torch.randperm(num_tokens)]


def used_columns(pool: PagedPool, slots: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` bool: column r of token t's ``v`` is one of its slot's rank rows (False for slot -1)."""
    ranks = torch.tensor([pool.rank_list[s] if s >= 0 else 0 for s in slots.tolist()])
    return torch.arange(pool.page_table.shape[1] * pool.page)[None, :] < ranks[:, None]


def _check_y(y: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
             terms: torch.Tensor) -> None:
    """float32: a sum in another order than the loop's (``terms`` from :func:`paged_terms`); bf16: the rounding of
    ``v`` to B's dtype (``magnitude`` from :func:`naive_paged`)."""
    if dtype == torch.float32:
        assert_sum_close(y, expected, terms, dtype)
    else:
        assert_lora_close(y, expected, magnitude, dtype, scale=2.0)


# (PAGE, T, (H, widths), dtype, max_pages): PAGE 8 (a 16-row tile spans 2 pages), 16, 32 (a tile is half a page);
# max_pages None = just enough for rank 128, else a pool allowing larger ranks than any slot has.
CASES = [
    (8, 40, QKV, torch.float32, None),
    (16, 7, QKV, torch.bfloat16, None),
    (32, 40, SINGLE, torch.float32, 8),
    (16, 1, SINGLE, torch.float32, None),
    (8, 7, SINGLE, torch.bfloat16, None),
    (16, 40, QKV, torch.bfloat16, 16),
    (32, 7, QKV, torch.float32, None),
    (8, 1, QKV, torch.bfloat16, None),
]


def _case_id(case) -> str:
    page, tokens, (hidden, widths), dtype, max_pages = case
    return f"page{page}-T{tokens}-{'x'.join(map(str, widths))}-{str(dtype)[6:]}" + (f"-R{max_pages * page}"
                                                                                    if max_pages else "")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_paged_add_lora_matches_per_token_loop(kernel_device, backend, case):
    page, tokens, (hidden, widths), dtype, max_pages = case
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(RANKS, page, hidden, widths, dtype, device, max_pages)
    slots = token_slots(tokens, len(RANKS)).to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x = torch.randn(tokens, hidden).to(device, dtype)
    y = torch.randn(tokens, sum(widths)).to(device, dtype)
    _, expected, magnitude = naive_paged(x, pool, y, slots)
    _, terms = paged_terms(x, pool, y, slots)
    y_before = y.clone()
    Kernels(backend).add_lora(x, pool.lora_a, pool.lora_b, pool.scaling, y, mapping, ranks=pool.ranks,
                              page_table=pool.page_table)
    _check_y(y, expected, magnitude, dtype, terms)
    untouched = ((slots < 0) | (slots == RANKS.index(0))).cpu()
    assert torch.equal(y.cpu()[untouched], y_before.cpu()[untouched]), "slot -1 and rank-0 rows must not change"


@pytest.mark.interpreter
@pytest.mark.parametrize(("tokens", "dtype"), [(7, torch.float32), (40, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_one_page_per_slot_takes_the_rectangle_path_through_the_table(kernel_device, backend, tokens, dtype):
    """PAGE = R (the engine's pool when page rows equal max_lora_rank): each slot's rectangle is its page
    ``page_table[s, 0]`` (shuffled, NaN past each rank and in free pages, -1 for the rank-0 slot), read by the
    rectangle launch shapes with a table lookup."""
    ranks = [8, 16, 0, 16, 3]
    hidden, widths = QKV
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(ranks, 16, hidden, widths, dtype, device)
    while all(row[0] in (s, -1) for s, row in enumerate(pool.table)):  # the table must not be the identity
        pool = make_pool(ranks, 16, hidden, widths, dtype, device)
    assert pool.page_table.shape == (5, 1)
    slots = torch.tensor([i % 5 for i in range(tokens - 2)] + [-1, -1], dtype=torch.int32)
    slots = slots[torch.randperm(tokens)].to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(ranks))
    x = torch.randn(tokens, hidden).to(device, dtype)
    y = torch.randn(tokens, sum(widths)).to(device, dtype)
    pool.rank_list = ranks
    _, expected, magnitude = naive_paged(x, pool, y, slots)
    _, terms = paged_terms(x, pool, y, slots)
    Kernels(backend).add_lora(x, pool.lora_a, pool.lora_b, pool.scaling, y, mapping, ranks=pool.ranks,
                              page_table=pool.page_table)
    _check_y(y, expected, magnitude, dtype, terms)


@pytest.mark.interpreter
@pytest.mark.parametrize(("page", "dtype"), [(8, torch.float32), (16, torch.bfloat16), (32, torch.float32)], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_paged_shrink_writes_zeros_past_each_rank(kernel_device, backend, page, dtype):
    """``v[i, t, r] = x[t] @ A_i[s][r]`` for r < ranks[s], exactly 0 for r >= ranks[s] and for slot -1 tokens."""
    hidden, widths = QKV
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(RANKS, page, hidden, widths, dtype, device)
    slots = token_slots(7, len(RANKS)).to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x = torch.randn(7, hidden).to(device, dtype)
    v = Kernels(backend).lora_shrink(x, pool.lora_a, mapping, ranks=pool.ranks, page_table=pool.page_table)
    expected, _, _ = naive_paged(x, pool, torch.zeros(7, sum(widths)), slots)
    terms, _ = paged_terms(x, pool, torch.zeros(7, sum(widths)), slots)
    assert v.shape == (len(widths), 7, pool.page_table.shape[1] * page) and v.dtype == torch.float32
    assert_sum_close(v, expected, terms, dtype, scale=0.1 if dtype == torch.bfloat16 else 1.0)
    assert (v.cpu()[:, ~used_columns(pool, slots)] == 0).all(), "columns past a rank and slot -1 rows must be 0"


@pytest.mark.interpreter
@pytest.mark.parametrize("page", [8, 32])
def test_paged_shrink_launcher_fills_lora_rows_and_leaves_the_rest(kernel_device, page):
    """With a NaN-filled ``out`` and one split: every LoRA token's row is written (zeros past the rank), rows of
    slot -1 tokens stay as they were."""
    hidden, widths = SINGLE
    pool = make_pool(RANKS, page, hidden, widths, torch.float32, kernel_device)
    slots = token_slots(7, len(RANKS)).to(kernel_device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x = torch.randn(7, hidden, device=kernel_device)
    out = torch.full((1, 7, pool.page_table.shape[1] * page), float("nan"), device=kernel_device)
    _launch_lora_shrink(x, pool.lora_a, mapping, ranks=pool.ranks, page_table=pool.page_table, out=out, split_k=1)
    expected, _, _ = naive_paged(x, pool, torch.zeros(7, sum(widths)), slots)
    terms, _ = paged_terms(x, pool, torch.zeros(7, sum(widths)), slots)
    lora_rows = (slots >= 0).cpu()
    assert_sum_close(out.cpu()[:, lora_rows], expected[:, lora_rows], terms[:, lora_rows], torch.float32)
    assert torch.isnan(out.cpu()[:, ~lora_rows]).all()


@pytest.mark.interpreter
@pytest.mark.parametrize(("page", "split_k", "dtype"), [
    (8, 2, torch.float32), (16, 3, torch.bfloat16), (32, 2, torch.float32),
], ids=str)
def test_paged_split_k_partials_summed_by_the_expand(kernel_device, poison_allocations, page, split_k, dtype):
    """shrink_partials (NaN-poisoned, so columns past a rank and slot -1 rows are NaN) summed inside the expand;
    deterministic, and equal to the per-token loop."""
    hidden, widths = 96, QKV[1]  # 3 K tiles of 32 under the interpreter: 2 or 3 chunks
    pool = make_pool(RANKS, page, hidden, widths, dtype, kernel_device)
    slots = token_slots(40, len(RANKS)).to(kernel_device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x = torch.randn(40, hidden).to(kernel_device, dtype)
    y = torch.randn(40, sum(widths)).to(kernel_device, dtype)
    blocks = (16, 32)  # K tiles of 32 on the GPU too: H = 96 splits into exactly split_k chunks
    partials = shrink_partials(x, pool.lora_a, mapping, pool.ranks, split_k, blocks, page_table=pool.page_table)
    assert partials.shape == (split_k, len(widths), 40, pool.page_table.shape[1] * page)
    v, expected, magnitude = naive_paged(x, pool, y, slots)
    shrink_terms, terms = paged_terms(x, pool, y, slots)
    rows = (slots >= 0).cpu()
    used = used_columns(pool, slots)
    summed = partials.sum(0).cpu()
    assert_sum_close(summed[:, used], v[:, used], shrink_terms[:, used], dtype)
    outs = []
    for _ in range(2):
        out = y.clone()
        ADD_LORA.triton(x, pool.lora_a, pool.lora_b, pool.scaling, out, mapping, ranks=pool.ranks,
                        page_table=pool.page_table, split_k=split_k, shrink_blocks=blocks)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "split-K partial sums must be added in a fixed order"
    _check_y(outs[0], expected, magnitude, dtype, terms)
    assert torch.equal(outs[0].cpu()[~rows], y.cpu()[~rows])


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_paged_expand_reads_no_column_past_a_rank(kernel_device, backend):
    """The expand alone, given a ``v`` that is NaN past every slot's rank and on slot -1 rows."""
    hidden, widths = QKV
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(RANKS, 8, hidden, widths, torch.float32, device)
    slots = token_slots(7, len(RANKS)).to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x, y = torch.randn(7, hidden, device=device), torch.randn(7, sum(widths), device=device)
    v, expected, _ = naive_paged(x, pool, y, slots)
    _, terms = paged_terms(x, pool, y, slots)
    for t, s in enumerate(slots.tolist()):
        v[:, t, pool.rank_list[s] if s >= 0 else 0 :] = float("nan")
    Kernels(backend).lora_expand(v.to(device), pool.lora_b, pool.scaling, y, mapping, ranks=pool.ranks,
                                 page_table=pool.page_table)
    assert_sum_close(y, expected, terms, torch.float32)


@pytest.mark.interpreter
def test_paged_all_rank_16_equals_the_rectangle_kernels(kernel_device):
    """The same adapters as 16-row rectangles and as pages of 16 (the engine's move): the same y."""
    hidden, widths = QKV
    ranks = [16] * 4
    pool = make_pool(ranks, 16, hidden, widths, torch.float32, kernel_device)
    rect_a = [a[pool.page_table[:, 0].long()].contiguous() for a in pool.lora_a]  # [S, 16, H]
    rect_b = [b[pool.page_table[:, 0].long()].contiguous() for b in pool.lora_b]  # [S, out_i, 16]
    slots = token_slots(7, 4).to(kernel_device)
    mapping = LoRAMapping.from_token_slots(slots, 4)
    x, y = torch.randn(7, hidden, device=kernel_device), torch.randn(7, sum(widths), device=kernel_device)
    paged, rect = y.clone(), y.clone()
    ADD_LORA.triton(x, pool.lora_a, pool.lora_b, pool.scaling, paged, mapping, ranks=pool.ranks,
                    page_table=pool.page_table)
    ADD_LORA.triton(x, rect_a, rect_b, pool.scaling, rect, mapping)
    assert_sum_close(paged, rect, paged_terms(x, pool, y, slots)[1], torch.float32)


def _error_case(mutate: str, device: torch.device = torch.device("cpu")):
    hidden, widths = QKV
    pool = make_pool([8, 16, 0], 8, hidden, widths, torch.float32, device)
    slots = torch.tensor([0, 1, -1, 2], dtype=torch.int32, device=device)
    kw = dict(ranks=pool.ranks, page_table=pool.page_table)
    a, b, scaling = pool.lora_a, pool.lora_b, pool.scaling
    if mutate == "no_ranks":
        kw["ranks"] = None
    elif mutate == "table_dtype":
        kw["page_table"] = pool.page_table.long()
    elif mutate == "table_1d":
        kw["page_table"] = pool.page_table[:, 0].contiguous()
    elif mutate == "table_rows":  # fewer page-table rows (slots) than the mapping uses
        kw["page_table"] = pool.page_table[:2].contiguous()
        kw["ranks"] = pool.ranks[:2].contiguous()
    elif mutate == "ranks_len":
        kw["ranks"] = pool.ranks[:2].contiguous()
    elif mutate == "b_page":  # B pages of 4 rank columns under A pages of 8 rows
        b = [t.reshape(t.shape[0], t.shape[1], 2, 4)[:, :, 0].contiguous() for t in b]
    elif mutate == "b_pages_count":
        b = [t[:-1].contiguous() for t in b]
    elif mutate == "a_pages_differ":
        a = [a[0], a[1][:, :4].contiguous(), a[2]]
    elif mutate == "page_not_pow2":
        a = [torch.zeros(t.shape[0], 6, hidden, device=device) for t in a]
        b = [torch.zeros(t.shape[0], t.shape[1], 6, device=device) for t in b]
    elif mutate == "scaling_per_page":
        scaling = [torch.ones(a[0].shape[0], device=device) for _ in widths]
    return a, b, scaling, slots, kw


ERRORS = [
    ("no_ranks", "ranks is required with a page_table"),
    ("table_dtype", r"page_table.dtype=torch.int64"),
    ("table_1d", r"page_table.shape="),
    ("table_rows", "mapping has 3 slots"),
    ("ranks_len", r"ranks.shape=\(2,\)"),
    ("b_page", r"differ in \(P, PAGE\)"),
    ("b_pages_count", r"differ in \(P, PAGE\)"),
    ("a_pages_differ", r"differ in \(P, PAGE\)"),
    ("page_not_pow2", "power of two"),
    ("scaling_per_page", r"scaling\[0\].shape"),
]


@pytest.mark.parametrize(("mutate", "fragment"), ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_paged_arguments_raise_typed_errors(request, backend, mutate, fragment):
    # the Triton case skips without triton; "scaling_per_page" runs the shrink before the expand's checks
    device = request.getfixturevalue("kernel_device") if backend == "triton" else torch.device("cpu")
    a, b, scaling, slots, kw = _error_case(mutate, device)
    mapping = LoRAMapping.from_token_slots(slots, 3)
    x = torch.randn(4, a[0].shape[2], device=device)
    y = torch.randn(4, sum(t.shape[1] for t in b), device=device)
    with pytest.raises(KernelArgumentError, match=fragment):
        Kernels(backend).add_lora(x, a, b, scaling, y, mapping, **kw)


def test_fused_kernel_refuses_pages():
    a, b, scaling, slots, kw = _error_case("none")
    mapping = LoRAMapping.from_token_slots(slots, 3)
    x, y = torch.randn(4, a[0].shape[2]), torch.randn(4, sum(t.shape[1] for t in b))
    with pytest.raises(KernelArgumentError, match="benchmark-only kernel, rectangles only"):
        ADD_LORA.triton(x, a, b, scaling, y, mapping, fused=True, **kw)


@pytest.mark.parametrize(("ranks", "table", "fragment"), [
    ([8, 17, 0], None, r"ranks\[1\]=17, expected 0..16"),
    ([8, 16, 0], [[0, -1], [99, 1], [-1, -1]], r"page_table\[1\] uses pages \[99, 1\]"),
])
def test_reference_refuses_ranks_and_pages_outside_the_pool(ranks, table, fragment):
    """The references read the page table (the kernels cannot without a device sync): they name bad contents."""
    a, b, scaling, slots, kw = _error_case("none")
    kw["ranks"] = torch.tensor(ranks, dtype=torch.int32)
    if table is not None:
        kw["page_table"] = torch.tensor(table, dtype=torch.int32)
    mapping = LoRAMapping.from_token_slots(slots, 3)
    x, y = torch.randn(4, a[0].shape[2]), torch.randn(4, sum(t.shape[1] for t in b))
    with pytest.raises(KernelArgumentError, match=fragment):
        ADD_LORA.reference(x, a, b, scaling, y, mapping, **kw)



@pytest.mark.interpreter
@pytest.mark.parametrize("paged", [True, False], ids=["pages", "one-page"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_untargeted_module_weights_are_not_read(kernel_device, backend, paged):
    """``scaling_i[s] == 0`` (adapter s does not target slice i): that slice of s's tokens gets nothing and its A/B
    (NaN here) are never read, in the shrink or the expand; every other (slot, slice) as the per-token loop."""
    ranks = [8, 16, 64] if paged else [8, 16, 3]
    hidden, widths = QKV
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(ranks, 8 if paged else 16, hidden, widths, torch.float32, device)
    pool.scaling[1][1] = 0.0  # slot 1 leaves the k slice alone
    pool.scaling[0][2] = 0.0  # slot 2 leaves the q slice alone
    expected_pool = PagedPool(**{**pool.__dict__, "lora_a": [a.clone() for a in pool.lora_a],
                                 "lora_b": [b.clone() for b in pool.lora_b]})
    for slice_id, slot in ((1, 1), (0, 2)):
        pages = [p for p in pool.table[slot] if p >= 0]
        pool.lora_a[slice_id][pages] = float("nan")
        pool.lora_b[slice_id][pages] = float("nan")
    slots = torch.tensor([0, 1, 2, -1, 1, 2, 0], dtype=torch.int32).to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(ranks))
    x = torch.randn(7, hidden).to(device)
    y = torch.randn(7, sum(widths)).to(device)
    _, expected, magnitude = naive_paged(x, expected_pool, y, slots)
    _, terms = paged_terms(x, expected_pool, y, slots)
    Kernels(backend).add_lora(x, pool.lora_a, pool.lora_b, pool.scaling, y, mapping, ranks=pool.ranks,
                              page_table=pool.page_table)
    _check_y(y, expected, magnitude, torch.float32, terms)


@pytest.mark.interpreter
@pytest.mark.parametrize(("page", "tokens", "dtype"), [(8, 40, torch.float32), (16, 7, torch.bfloat16),
                                                       (32, 1, torch.float32)], ids=str)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_folded_expand_reads_each_rank_row_from_its_page(kernel_device, backend, page, tokens, dtype):
    """The shrink folded into the base GEMM over every page of the pool (``LinearWithLoRA.fold_lora_a``): token t's
    rank row r is ``v[i, t, page_table[s, r // PAGE], r % PAGE]``, its B column from the same page. The GEMM's
    columns of free pages and of rows past a rank are NaN (the pool's poison) and must not be read."""
    hidden, widths = QKV
    device = kernel_device if backend == "triton" else torch.device("cpu")
    pool = make_pool(RANKS, page, hidden, widths, dtype, device)
    slots = token_slots(tokens, len(RANKS)).to(device)
    mapping = LoRAMapping.from_token_slots(slots, len(RANKS))
    x = torch.randn(tokens, hidden).to(device, dtype)
    w = (torch.randn(sum(widths), hidden) / hidden**0.5).to(device, dtype)
    y, v = folded_gemm(x, w, pool.lora_a)
    assert v.isnan().any() and not y.isnan().any()
    _, expected, magnitude = naive_paged(x, pool, y, slots)
    _, terms = paged_terms(x, pool, y, slots)
    y_before = y.clone()
    Kernels(backend).lora_expand_slot_rows(v, pool.lora_b, pool.scaling, y, mapping, ranks=pool.ranks,
                                           page_table=pool.page_table)
    # bf16: v is the GEMM's bf16 output, the expected delta the float32 loop's
    _check_y(y, expected, magnitude, dtype, terms) if dtype == torch.float32 else \
        assert_lora_close(y, expected, magnitude, dtype, scale=4.0)
    untouched = ((slots < 0) | (slots == RANKS.index(0))).cpu()
    assert torch.equal(y.cpu()[untouched], y_before.cpu()[untouched]), "slot -1 and rank-0 rows must not change"
