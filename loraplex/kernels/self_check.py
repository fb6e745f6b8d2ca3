"""Start-up self-check of the batched LoRA ops on the serving device (``add_lora``, and for linears that fold
their shrink into the base GEMM the slot-rows expand and a norm that adds the expand, against their references).

The Triton kernels are tested under the CPU interpreter in CI; compiled on a GPU they take other launch
shapes. Before an engine serves adapters on a GPU it runs the op once per layer shape, for one decode token,
a decode batch and a prompt chunk (each with its own launch shapes), against the float32 reference:
a mismatch raises :class:`LoRAKernelMismatch` and the engine refuses to start, rather than serve wrong
tokens. Semantics checked: :data:`~loraplex.kernels.lora_linear.ADD_LORA`, on rectangles or (``page_rows``)
on a paged pool with mixed ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.fp8_linear import FP8_DTYPE, FP8_LINEAR
from loraplex.kernels.lora_delta import LoRADelta
from loraplex.kernels.lora_expand import LORA_EXPAND_SLOT_ROWS
from loraplex.kernels.lora_linear import ADD_LORA
from loraplex.kernels.lora_mapping import plan_segments
from loraplex.kernels.rms_norm import RMS_NORM

TOKEN_COUNTS = (1, 32, 300)  # one decode token, a decode batch, a prompt chunk (their own launch shapes)
FP8_FOLD_TOKEN_COUNTS = (1, 32, 64)  # the FP8 fold's steps and launch shapes (it folds up to 64 tokens)


class LoRAKernelMismatch(RuntimeError):
    """The LoRA op disagrees with its float32 reference on this device (the message says where)."""


def check_add_lora(shapes: Sequence[tuple[int, Sequence[int]]], num_slots: int, rank: int, dtype: torch.dtype,
                   device: torch.device, *, seed: int = 0, page_rows: int | None = None) -> None:
    """Run ``ADD_LORA.triton`` for each ``(in_features, out_widths)`` in ``shapes`` at every count of
    :data:`TOKEN_COUNTS` (20% of the tokens without adapter, the rest over ``min(num_slots, 4)`` slots)
    and compare with ``ADD_LORA.reference`` in float32: ``max |ours - ref| <= 0.03 * max |delta| + 0.05``
    (bf16 rounding of the shrink result and of y). Raises :class:`LoRAKernelMismatch`.

    Without ``page_rows`` the slots are ``[S, rank, H]`` / ``[S, out, rank]`` rectangles. With ``page_rows``
    (PAGE, a power of two in 1..256) they are a paged pool (:func:`paged_pool`): mixed ranks, shuffled pages,
    NaN in every row no slot uses, so a kernel that reads one fails the check."""
    gen = torch.Generator().manual_seed(seed)
    slots_used = max(1, min(num_slots, 4))
    for hidden, widths in shapes:
        for tokens in TOKEN_COUNTS:
            base = min(round(0.2 * tokens), tokens - 1)
            token_slots = torch.tensor([-1] * base + [i % slots_used for i in range(tokens - base)], dtype=torch.int32)
            token_slots = token_slots[torch.randperm(tokens, generator=gen)].to(device)
            mapping = plan_segments(token_slots, num_slots)
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            y = torch.randn(tokens, sum(widths), generator=gen).to(device, dtype)
            if page_rows is None:
                a = [(torch.randn(num_slots, rank, hidden, generator=gen) / hidden**0.5).to(device, dtype)
                     for _ in widths]
                b = [(torch.randn(num_slots, w, rank, generator=gen) / rank**0.5).to(device, dtype) for w in widths]
                paging = {}
            else:
                pool = paged_pool(hidden, widths, num_slots, rank, page_rows, gen)
                a = [t.to(device, dtype) for t in pool.lora_a]
                b = [t.to(device, dtype) for t in pool.lora_b]
                paging = dict(ranks=pool.ranks.to(device), page_table=pool.page_table.to(device))
            scaling = [torch.full((num_slots,), 2.0, device=device) for _ in widths]
            ours, ref = y.clone(), y.to(torch.float32, copy=True)
            ADD_LORA.triton(x, a, b, scaling, ours, mapping, **paging)
            ADD_LORA.reference(x.float(), [t.float() for t in a], [t.float() for t in b], scaling, ref, mapping,
                               **paging)
            err = (ours.float() - ref).abs().max().item()
            delta = (ref - y.float()).abs().max().item()
            if not err <= 0.03 * delta + 0.05:
                layout = f"pages of {page_rows} rows, ranks {paging['ranks'].tolist()}" if paging else "rectangles"
                raise LoRAKernelMismatch(
                    f"add_lora on {device} ({dtype}): max error {err:.4g} against the float32 reference "
                    f"(delta scale {delta:.4g}) for {tokens} tokens, in_features={hidden}, widths={list(widths)}, "
                    f"rank={rank}, slots={num_slots}, {layout}; refusing to serve adapters with a wrong LoRA kernel "
                    "(enable_lora=False serves the base model)")


def check_folded_lora(shapes: Sequence[tuple[int, Sequence[int]]], hidden_size: int, num_slots: int, rank: int,
                      dtype: torch.dtype, device: torch.device, *, page_rows: int | None = None,
                      seed: int = 0) -> None:
    """For linears that fold their shrink into the base GEMM: ``LORA_EXPAND_SLOT_ROWS.triton`` for each
    ``(in_features, out_widths)`` of ``shapes``, and ``RMS_NORM.triton`` with a ``LoRADelta`` of ``hidden_size``
    columns (the kernel helper every consumer of a deferred expand shares), at every count of
    :data:`TOKEN_COUNTS`, against the references in float32 (the bound of :func:`check_add_lora`). ``v`` is random
    here (it is a GEMM's output in the engine). With ``page_rows < rank`` the B weights are a paged pool
    (:func:`paged_pool`: several pages per slot, NaN where no slot's rank reaches) and ``v`` holds every page's
    rows. Raises :class:`LoRAKernelMismatch`."""
    gen = torch.Generator().manual_seed(seed)
    slots_used = max(1, min(num_slots, 4))
    paged = page_rows is not None and page_rows < rank
    for tokens in TOKEN_COUNTS:
        base = min(round(0.2 * tokens), tokens - 1)
        token_slots = torch.tensor([-1] * base + [i % slots_used for i in range(tokens - base)], dtype=torch.int32)
        mapping = plan_segments(token_slots[torch.randperm(tokens, generator=gen)].to(device), num_slots)
        for widths, norm in [(list(w), False) for _, w in shapes] + [([hidden_size], True)]:
            if paged:
                pool = paged_pool(1, widths, num_slots, rank, page_rows, gen)
                b = [t.to(device, dtype) for t in pool.lora_b]
                paging = dict(ranks=pool.ranks.to(device), page_table=pool.page_table.to(device))
                pages, rows = b[0].shape[0], page_rows
            else:
                b = [(torch.randn(num_slots, w, rank, generator=gen) / rank**0.5).to(device, dtype) for w in widths]
                paging, pages, rows = {}, num_slots, rank
            v = torch.randn(len(widths), tokens, pages, rows, generator=gen).to(device, dtype)
            scaling = [torch.full((num_slots,), 2.0, device=device) for _ in widths]
            y = torch.randn(tokens, sum(widths), generator=gen).to(device, dtype)
            ref = y.to(torch.float32, copy=True)
            LORA_EXPAND_SLOT_ROWS.reference(v.float(), [t.float() for t in b], scaling, ref, mapping, **paging)
            if norm:
                weight = torch.ones(hidden_size, device=device, dtype=dtype)
                ours = RMS_NORM.triton(y, weight, 1e-6, lora=LoRADelta(v, b, scaling, mapping, **paging)).float()
                ref, y = RMS_NORM.reference(ref, weight.float(), 1e-6), RMS_NORM.reference(y.float(), weight.float(),
                                                                                            1e-6)
                what = f"rms_norm with a LoRA delta of {hidden_size} columns"
            else:
                ours = y.clone()
                LORA_EXPAND_SLOT_ROWS.triton(v, b, scaling, ours, mapping, **paging)
                what = f"lora_expand_slot_rows, widths={widths}"
            err = (ours.float() - ref).abs().max().item()
            delta = (ref - y.float()).abs().max().item()
            if not err <= 0.03 * delta + 0.05:
                raise LoRAKernelMismatch(
                    f"{what} on {device} ({dtype}): max error {err:.4g} against the float32 reference (delta scale "
                    f"{delta:.4g}) for {tokens} tokens, rank={rank}, slots={num_slots}"
                    + (f", pages of {page_rows} rows" if paged else "") + "; refusing to serve adapters "
                    "with a wrong LoRA kernel (lora_fold_shrink='off' serves them without these kernels)")


@dataclass(frozen=True)
class PagedPool:
    """A paged LoRA pool for one linear (CPU, float32): ``lora_a`` ``n x [P, PAGE, H]``, ``lora_b``
    ``n x [P, out_i, PAGE]``, ``ranks`` ``[S] int32``, ``page_table`` ``[S, max_pages] int32`` (-1 past a slot's
    pages)."""

    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    ranks: torch.Tensor
    page_table: torch.Tensor


def paged_pool(hidden: int, widths: Sequence[int], num_slots: int, rank: int, page_rows: int,
               gen: torch.Generator, spare_pages: int = 2) -> PagedPool:
    """Slot s has rank ``(rank, rank // 2, max(1, rank // 4))[s % 3]`` and ``ceil(rank_s / page_rows)`` pages; page
    ids are shuffled over ``sum of pages + spare_pages`` pages; rows no slot uses (the tail of a last page, the
    spare pages) hold NaN. ``max_pages = ceil(rank / page_rows)``."""
    ranks = [(rank, rank // 2, max(1, rank // 4))[s % 3] for s in range(num_slots)]
    needed = [-(-r // page_rows) for r in ranks]
    max_pages = max(1, -(-rank // page_rows))
    ids = torch.randperm(sum(needed) + spare_pages, generator=gen).tolist()
    table, start = [], 0
    for n in needed:
        table.append(ids[start : start + n] + [-1] * (max_pages - n))
        start += n
    num_pages = len(ids)
    lora_a = [torch.full((num_pages, page_rows, hidden), float("nan")) for _ in widths]
    lora_b = [torch.full((num_pages, w, page_rows), float("nan")) for w in widths]
    for s, r in enumerate(ranks):
        pages, offsets = [table[s][i // page_rows] for i in range(r)], [i % page_rows for i in range(r)]
        for a, b in zip(lora_a, lora_b):
            a[pages, offsets] = torch.randn(r, hidden, generator=gen) / hidden**0.5
            b[pages, :, offsets] = torch.randn(r, b.shape[1], generator=gen) / max(r, 1) ** 0.5
    return PagedPool(lora_a, lora_b, torch.tensor(ranks, dtype=torch.int32), torch.tensor(table, dtype=torch.int32))


def check_fp8_folded_shrink(shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device, *,
                            seed: int = 0) -> None:
    """For FP8 linears that fold their shrink into their GEMM: ``FP8_LINEAR.triton`` with ``lora_a`` for each
    ``(in_features, out_features, a_rows)`` of ``shapes`` at every count of :data:`FP8_FOLD_TOKEN_COUNTS`, its A
    columns (``x @ lora_a.T``, bf16 x bf16 in the split GEMM's extra column tiles) against the float32 reference:
    ``max |ours - ref| <= 0.01 * max |ref| + 1e-3`` (the bf16 output's rounding). The weight's columns are the
    GEMM's own (served without adapters too), so the weight is zeros of the real shape (it places the A tiles).
    Raises :class:`LoRAKernelMismatch`."""
    gen = torch.Generator().manual_seed(seed)
    for hidden, out_features, a_rows in shapes:
        weight = torch.zeros(out_features, hidden, dtype=FP8_DTYPE, device=device)
        scale = torch.full((out_features,), 1e-3, device=device)
        lora_a = (torch.randn(a_rows, hidden, generator=gen) / hidden**0.5).to(device, dtype)
        for tokens in FP8_FOLD_TOKEN_COUNTS:
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            ours = FP8_LINEAR.triton(x, weight, scale, lora_a=lora_a)[:, out_features:].float()
            ref = x.float() @ lora_a.float().T
            err = (ours - ref).abs().max().item()
            if not err <= 0.01 * ref.abs().max().item() + 1e-3:
                raise LoRAKernelMismatch(
                    f"fp8_linear with a folded shrink on {device} ({dtype}): max error {err:.4g} against the float32 "
                    f"reference (scale {ref.abs().max().item():.4g}) for {tokens} tokens, in_features={hidden}, "
                    f"out_features={out_features}, {a_rows} A rows; refusing to serve adapters with a wrong LoRA "
                    "kernel (lora_fold_shrink='off' serves them without it)")
