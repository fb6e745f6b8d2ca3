"""Argument checks shared by the LoRA shrink/expand launchers and references.

Two layouts of the slot weights: *rectangles* (``lora_a[i]`` ``[S, R, H]``, ``lora_b[i]`` ``[S, out_i, R]``,
lower ranks zero-padded) and *pages* (``lora_a[i]`` ``[P, PAGE, H]``, ``lora_b[i]`` ``[P, out_i, PAGE]``, slot s's
rank rows found through ``page_table [S, max_pages]``). Only :func:`paged_rows` (the references) reads contents.
"""

from __future__ import annotations

import torch

from loraplex.kernels._checks import check_contiguous, check_device, check_dtype, check_same_dtype, check_shape
from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_mapping import LoRAMapping


def check_mapping(op: str, mapping: LoRAMapping, num_tokens: int, num_slots: int, device: torch.device) -> None:
    """``mapping`` covers ``num_tokens`` tokens on ``device`` and has at most ``num_slots`` slots."""
    if not isinstance(mapping, LoRAMapping):
        raise KernelArgumentError(f"{op}: mapping has type {type(mapping).__name__}, expected LoRAMapping")
    if mapping.num_tokens != num_tokens:
        raise KernelArgumentError(f"{op}: mapping.num_tokens={mapping.num_tokens}, expected {num_tokens}")
    if mapping.num_slots > num_slots:
        raise KernelArgumentError(
            f"{op}: mapping has {mapping.num_slots} slots, but the weights have {num_slots} slots"
        )
    check_device(op, "mapping.sorted_token_ids", mapping.sorted_token_ids, device)


def check_weight_list(
    op: str, name: str, weights: list[torch.Tensor], like: torch.Tensor, last_dim: int | None
) -> None:
    """Each ``weights[i]`` is a contiguous ``[S, *, last_dim]`` tensor (same S) with ``like``'s dtype and device."""
    if not isinstance(weights, (list, tuple)) or not weights:
        raise KernelArgumentError(f"{op}: {name} must be a non-empty list of tensors, got {type(weights).__name__}")
    num_slots = weights[0].shape[0] if weights[0].dim() == 3 else None
    for i, w in enumerate(weights):
        check_shape(op, f"{name}[{i}]", w, (num_slots, None, last_dim))
        check_same_dtype(op, f"{name}[{i}]", w, "the activations", like)
        check_device(op, f"{name}[{i}]", w, like.device)
        check_contiguous(op, f"{name}[{i}]", w)


def check_ranks(op: str, ranks: torch.Tensor | None, num_slots: int, device: torch.device) -> None:
    """Optional ``ranks`` is ``[S] int32`` on ``device``."""
    if ranks is None:
        return
    check_dtype(op, "ranks", ranks, (torch.int32,))
    check_shape(op, "ranks", ranks, (num_slots,))
    check_device(op, "ranks", ranks, device)
    check_contiguous(op, "ranks", ranks)


MAX_PAGE_ROWS = 256


def check_page_table(op: str, page_table: torch.Tensor, device: torch.device) -> None:
    """``page_table`` is a contiguous ``[S, max_pages] int32`` tensor on ``device``."""
    if not isinstance(page_table, torch.Tensor):
        raise KernelArgumentError(f"{op}: page_table has type {type(page_table).__name__}, expected a tensor")
    check_dtype(op, "page_table", page_table, (torch.int32,))
    check_shape(op, "page_table", page_table, (None, None))
    check_device(op, "page_table", page_table, device)
    check_contiguous(op, "page_table", page_table)


def check_paging(op: str, page_table: torch.Tensor, ranks: torch.Tensor | None, page_rows: int,
                 device: torch.device) -> int:
    """A paged pool's metadata: ``page_table`` ``[S, max_pages] int32`` contiguous on ``device``, ``ranks`` (required)
    ``[S] int32``, ``page_rows`` (PAGE, the weights' rank rows per page) a power of two in ``1..256`` (any size
    >= 1 with one page per slot, ``max_pages == 1``: the rectangle path). Returns S."""
    check_page_table(op, page_table, device)
    if ranks is None:
        raise KernelArgumentError(f"{op}: ranks is required with a page_table ([S] int32, S = page_table.shape[0])")
    check_ranks(op, ranks, page_table.shape[0], device)
    one_page = page_table.shape[1] == 1 and page_rows >= 1
    if not one_page and (not 1 <= page_rows <= MAX_PAGE_ROWS or page_rows & (page_rows - 1)):
        raise KernelArgumentError(f"{op}: page size (rank rows per page)={page_rows}, expected a power of two in "
                                  f"1..{MAX_PAGE_ROWS}")
    return page_table.shape[0]


def check_same_pages(op: str, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]) -> None:
    """Paged A ``[P, PAGE, H]`` and B ``[P, out_i, PAGE]`` slices share P (pages) and PAGE (rank rows per page)."""
    pages_a = {(a.shape[0], a.shape[1]) for a in lora_a if a.dim() == 3}
    pages_b = {(b.shape[0], b.shape[2]) for b in lora_b if isinstance(b, torch.Tensor) and b.dim() == 3}
    if len(pages_a | pages_b) > 1:
        raise KernelArgumentError(f"{op}: paged lora_a [P, PAGE, H] and lora_b [P, out_i, PAGE] differ in (P, PAGE): "
                                  f"lora_a {sorted(pages_a)}, lora_b {sorted(pages_b)}")


def paged_rows(op: str, page_table: torch.Tensor, ranks: torch.Tensor, num_pages: int, page_rows: int
               ) -> list[tuple[list[int], list[int]]]:
    """Per slot s: ``(pages, offsets)`` of its rank rows ``r < ranks[s]`` (``page_table[s, r // PAGE]``,
    ``r % PAGE``), read on the host (the torch references). Raises :class:`KernelArgumentError` for a rank
    outside ``0..max_pages * PAGE`` or a used page id outside ``0..P-1``."""
    max_rank = page_table.shape[1] * page_rows
    table, rank_host = page_table.tolist(), ranks.tolist()
    out = []
    for s, rank in enumerate(rank_host):
        if not 0 <= rank <= max_rank:
            raise KernelArgumentError(f"{op}: ranks[{s}]={rank}, expected 0..{max_rank} (max_pages * PAGE)")
        used = table[s][: -(-rank // page_rows)]
        if any(not 0 <= p < num_pages for p in used):
            raise KernelArgumentError(f"{op}: page_table[{s}] uses pages {used}, expected ids in 0..{num_pages - 1}")
        out.append(([used[r // page_rows] for r in range(rank)], [r % page_rows for r in range(rank)]))
    return out
