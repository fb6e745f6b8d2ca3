"""The start-up self-check of add_lora (rectangles and paged pools): passes for the real kernel, refuses a wrong
one with the shape."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import lora_linear, self_check
from loraplex.kernels.op import Op


@pytest.mark.interpreter
def test_the_kernel_passes_and_a_wrong_kernel_is_refused(kernel_device, monkeypatch):
    self_check.check_add_lora([(32, (16, 8))], num_slots=3, rank=4, dtype=torch.float32, device=kernel_device)

    def off_by_a_tenth(x, lora_a, lora_b, scaling, y, mapping, **kw):
        lora_linear.ADD_LORA.triton(x, lora_a, lora_b, [s * 1.1 for s in scaling], y, mapping, **kw)

    wrong = Op(name="add_lora", semantics="", reference=lora_linear.add_lora_ref, triton=lora_linear._launch_add_lora)
    monkeypatch.setattr(self_check, "ADD_LORA", wrong)
    object.__setattr__(wrong, "triton", off_by_a_tenth)
    with pytest.raises(self_check.LoRAKernelMismatch, match=r"for 1 tokens, in_features=32, widths=\[16, 8\]"):
        self_check.check_add_lora([(32, (16, 8))], num_slots=3, rank=4, dtype=torch.float32, device=kernel_device)


@pytest.mark.interpreter
@pytest.mark.parametrize("page_rows", [2, 16])  # a 16-row tile spans 8 pages / is half a page
def test_the_paged_kernel_passes_and_a_wrong_one_is_refused(kernel_device, monkeypatch, page_rows):
    self_check.check_add_lora([(32, (16, 8))], num_slots=4, rank=8, dtype=torch.float32, device=kernel_device,
                              page_rows=page_rows)

    def reads_the_previous_slots_pages(x, lora_a, lora_b, scaling, y, mapping, *, ranks, page_table, **kw):
        lora_linear.ADD_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks.roll(1).contiguous(),
                                    page_table=page_table.roll(1, 0).contiguous(), **kw)

    wrong = Op(name="add_lora", semantics="", reference=lora_linear.add_lora_ref, triton=lora_linear._launch_add_lora)
    monkeypatch.setattr(self_check, "ADD_LORA", wrong)
    object.__setattr__(wrong, "triton", reads_the_previous_slots_pages)
    with pytest.raises(self_check.LoRAKernelMismatch, match=rf"for 1 tokens, .* pages of {page_rows} rows, "
                       r"ranks \[8, 4, 2, 8\]"):
        self_check.check_add_lora([(32, (16, 8))], num_slots=4, rank=8, dtype=torch.float32, device=kernel_device,
                                  page_rows=page_rows)


def test_paged_pool_has_mixed_ranks_shuffled_pages_and_nan_where_unused():
    pool = self_check.paged_pool(8, [4, 2], num_slots=5, rank=8, page_rows=4, gen=torch.Generator().manual_seed(1))
    assert pool.ranks.tolist() == [8, 4, 2, 8, 4]
    table = pool.page_table.tolist()
    assert [sum(p >= 0 for p in row) for row in table] == [2, 1, 1, 2, 1] and table[1][1] == -1
    used = [p for row in table for p in row if p >= 0]
    assert len(set(used)) == len(used) == 7 and max(used) < 9  # 7 pages used, 2 spare
    assert used != sorted(used), "page ids are shuffled"
    a, b = pool.lora_a[0], pool.lora_b[1]
    assert a.shape == (9, 4, 8) and b.shape == (9, 2, 4)
    assert torch.isfinite(a[table[0]]).all() and torch.isnan(a[table[2][0], 2:]).all()  # rank 2: rows 2-3 unused
    spare = [p for p in range(9) if p not in used]
    assert torch.isnan(a[spare]).all() and torch.isnan(b[spare]).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("page_rows", [None, 2], ids=["one page per slot", "2-row pages"])
def test_the_folded_kernels_pass_and_a_wrong_one_is_refused(kernel_device, monkeypatch, page_rows):
    """The slot-rows expand and the norm that adds a deferred expand: pass as built (with 2-row pages, ranks 4, 2
    and 1: two pages, one, half of one); an expand reading the next slot's (page's) rows of v is refused, naming
    the kernel."""
    from loraplex.kernels import lora_expand

    self_check.check_folded_lora([(32, (16, 8))], hidden_size=24, num_slots=3, rank=4, dtype=torch.float32,
                                 device=kernel_device, page_rows=page_rows)

    def next_slots_rows(v, lora_b, scaling, y, mapping, **kw):
        lora_expand._launch_lora_expand_slot_rows(v.roll(1, 2), lora_b, scaling, y, mapping, **kw)

    wrong = Op(name="lora_expand_slot_rows", semantics="", reference=lora_expand.lora_expand_slot_rows_ref,
               triton=lora_expand._launch_lora_expand_slot_rows)
    monkeypatch.setattr(self_check, "LORA_EXPAND_SLOT_ROWS", wrong)
    object.__setattr__(wrong, "triton", next_slots_rows)
    with pytest.raises(self_check.LoRAKernelMismatch, match=r"lora_expand_slot_rows, widths=\[16, 8\] .* for 1 tokens"):
        self_check.check_folded_lora([(32, (16, 8))], hidden_size=24, num_slots=3, rank=4, dtype=torch.float32,
                                     device=kernel_device, page_rows=page_rows)


@pytest.mark.interpreter
def test_the_fp8_folded_shrink_passes_and_a_wrong_one_is_refused(kernel_device, monkeypatch):
    """check_fp8_folded_shrink (bf16, the split path forced as on an H200): the real kernel passes; one whose A
    columns are off by 5% is refused, naming the shape."""
    from loraplex.kernels import fp8_linear

    monkeypatch.setattr(fp8_linear, "default_activations", lambda dtype, device, num_tokens: "split")
    self_check.check_fp8_folded_shrink([(64, 48, 40)], torch.bfloat16, kernel_device)

    def a_columns_off(x, weight, scale, bias=None, *, lora_a=None, **kw):
        return fp8_linear._launch_fp8_linear(x, weight, scale, bias, lora_a=lora_a * 1.05, **kw)

    wrong = Op(name="fp8_linear", semantics="", reference=fp8_linear.fp8_linear_ref,
               triton=fp8_linear._launch_fp8_linear)
    object.__setattr__(wrong, "triton", a_columns_off)
    monkeypatch.setattr(self_check, "FP8_LINEAR", wrong)
    with pytest.raises(self_check.LoRAKernelMismatch, match=r"for 1 tokens, in_features=64, out_features=48, 40 A"):
        self_check.check_fp8_folded_shrink([(64, 48, 40)], torch.bfloat16, kernel_device)
