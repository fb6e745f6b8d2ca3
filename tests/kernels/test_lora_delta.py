"""A folded linear's expand applied by the next kernel (LoRADelta): rms_norm and the gated activations, both
backends, against the float32 per-token loop followed by the plain op."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import (
    SUM_ORDER_ULPS, assert_close, assert_close_through, assert_sum_close, assert_within_ulps, folded_gemm,
    naive_lora_expand, naive_lora_shrink, naive_lora_terms, zipf_slots,
)

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_delta import LoRADelta
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.ops import Kernels

HIDDEN, SLOTS, RANK, T = 24, 4, 8, 19
SEVERAL_PAGES = False  # a test sets it: every _delta is then over a paged pool of several pages per slot
PAGED_RANKS = [RANK, 5, 0, 3]  # slot ranks of that pool (pages of RANK // 4 rows)


def _paged_delta(widths: list[int], dtype, device, token_slots, x, w, zero_scale: bool):
    """``_delta`` over a poisoned paged pool (test_lora_paged.make_pool: shuffled pages of RANK // 4 rows, NaN in
    free pages and past each rank; ranks PAGED_RANKS), the GEMM folded over every page."""
    from test_lora_paged import make_pool, naive_paged, paged_terms

    pool = make_pool(PAGED_RANKS[:SLOTS], RANK // 4, HIDDEN, widths, dtype, device)
    if zero_scale:
        pool.scaling[-1][1] = 0.0
    y, _ = folded_gemm(x, w, pool.lora_a)
    _, expected, _ = naive_paged(x, pool, y, token_slots)
    _, magnitude = paged_terms(x, pool, y, token_slots)
    if zero_scale:  # slot 1's last slice, of scaling 0, is never read: NaN in its pages of A (so in v) and B
        for page in (p for p in pool.table[1] if p >= 0):
            pool.lora_a[-1][page] = float("nan")
            pool.lora_b[-1][page] = float("nan")
    y, v = folded_gemm(x, w, pool.lora_a)
    assert v.isnan().any(), "the poison reaches the folded GEMM's columns"
    mapping = LoRAMapping.from_token_slots(token_slots.to(device))
    return y, LoRADelta(v, pool.lora_b, pool.scaling, mapping, page_table=pool.page_table, ranks=pool.ranks), \
        expected.to(device), magnitude


def _delta(widths: list[int], dtype, device, token_slots, *, pages: bool = False, zero_scale: bool = False):
    """A folded GEMM over x for ``widths`` slices: (y, LoRADelta, the expected y + delta in float32, the size of
    its terms ``|y| + |scaling| |B| (|A| |x|)`` on CPU, float32: the shrink's rounding carried through B too)."""
    x = torch.randn(T, HIDDEN).to(device=device, dtype=dtype)
    w = (torch.randn(sum(widths), HIDDEN) / HIDDEN**0.5).to(device=device, dtype=dtype)
    if SEVERAL_PAGES:
        return _paged_delta(widths, dtype, device, token_slots, x, w, zero_scale)
    lora_a = [(torch.randn(SLOTS, RANK, HIDDEN) / HIDDEN**0.5).to(device=device, dtype=dtype) for _ in widths]
    lora_b = [torch.randn(SLOTS, width, RANK).to(device=device, dtype=dtype) for width in widths]
    scaling = [(torch.rand(SLOTS) + 0.5).to(device) for _ in widths]
    if zero_scale:
        scaling[-1][1] = 0.0
    y, _ = folded_gemm(x, w, lora_a)
    expected_base = y.float().clone()
    if zero_scale and not pages:  # slot 1's last slice, of scaling 0, is never read: NaN in its A (so in v) and B
        clean_a, clean_b = [a.clone() for a in lora_a], [b.clone() for b in lora_b]
        lora_a[-1][1] = float("nan")
        lora_b[-1][1] = float("nan")
    y, v = folded_gemm(x, w, lora_a)
    table = None
    slot_a, slot_b = lora_a, lora_b
    if pages:  # one page per slot, pages permuted against slots
        order = torch.randperm(SLOTS)
        table = order.to(torch.int32).view(SLOTS, 1).to(device)
        slot_a = [a[order.to(device)] for a in lora_a]
        slot_b = [b[order.to(device)] for b in lora_b]
    if zero_scale and not pages:
        slot_a, slot_b = clean_a, clean_b
    mapping = LoRAMapping.from_token_slots(token_slots.to(device))
    expected = naive_lora_expand(naive_lora_shrink(x, slot_a, token_slots.to(device)), slot_b, scaling,
                                 expected_base, token_slots.to(device))
    magnitude = naive_lora_terms(x, slot_a, slot_b, scaling, expected_base, token_slots)
    return y, LoRADelta(v, lora_b, scaling, mapping, page_table=table), expected, magnitude


def _assert_through(got, reference_op, expected, magnitude, dtype) -> None:
    """``got`` against ``reference_op`` on ``expected`` rounded to ``dtype`` (on CPU), within the op's tolerance plus
    the rounding of a sum of terms of size ``magnitude`` carried through the op (kernel_test_utils.
    assert_close_through): SUM_ORDER_ULPS float32 ulps of it (a sum in another order, both sides), or in bf16 one
    ulp (v is the GEMM's bf16 output, not the float32 loop's) and 4 times the tolerance (gate x up amplifies it)."""
    ulps, scale = (SUM_ORDER_ULPS, 1.0) if dtype == torch.float32 else (1, 4.0)
    assert_close_through(got, lambda s: reference_op(s.to(dtype)), [expected.cpu()], [magnitude], dtype, ulps,
                         scale=scale)


def _slots() -> torch.Tensor:
    slots = zipf_slots(T, SLOTS)
    slots[torch.randperm(T)[:5]] = -1
    return slots


def _backend_device(backend, kernel_device):
    return kernel_device if backend == "triton" else torch.device("cpu")


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("pieces", [None, (8, 2)], ids=["one tile", "two passes over 8-column pieces"])
def test_rms_norm_with_a_delta_writes_its_outputs_split(kernel_device, backend, with_residual, pieces,
                                                        monkeypatch):
    """rms_norm with a LoRA delta and an FP8 linear's activation split (bf16): the outputs equal those without the
    split, bit for bit, and the split is fp8_linear.write_split_ref's of out, byte for byte (zeros as zeros). The
    row in one tile writes it in the same program (no separate split launch); two passes over pieces split after."""
    from loraplex.kernels import fp8_linear, rms_norm
    from loraplex.kernels.fp8_linear import ActivationSplit

    if backend == "reference" and pieces:
        pytest.skip("launch shapes are the Triton launcher's")
    device = _backend_device(backend, kernel_device)
    kernels = Kernels(backend)
    y, delta, _, _ = _delta([HIDDEN], torch.bfloat16, device, _slots(), pages=backend == "triton")
    weight = (torch.rand(HIDDEN) + 0.5).to(device=device, dtype=torch.bfloat16)
    residual = torch.randn(T, HIDDEN).to(device=device, dtype=torch.bfloat16) if with_residual else None
    blocks = {"lora_blocks": pieces} if pieces else {}
    separate = []
    split_activations = fp8_linear.split_activations
    monkeypatch.setattr(rms_norm, "split_activations",
                        lambda x, split: separate.append(1) or split_activations(x, split))
    split = ActivationSplit.empty(T, HIDDEN, device)
    got = kernels.rms_norm(y, weight, 1e-6, residual, lora=delta, split=split, **blocks)
    plain = kernels.rms_norm(y, weight, 1e-6, residual, lora=delta, **blocks)
    for a, b in zip(got if with_residual else [got], plain if with_residual else [plain]):
        assert torch.equal(a, b)
    out = got[0] if with_residual else got
    expected = ActivationSplit.empty(T, HIDDEN, device)
    fp8_linear.write_split_ref(out, expected)  # torch: on the GPU too, where the reference backend's tensors are CPU
    as_bytes = lambda q: torch.where(q.cpu().view(torch.uint8) == 0x80, 0, q.cpu().view(torch.uint8))  # noqa: E731
    assert torch.equal(split.s.cpu(), expected.s.cpu()) and torch.equal(as_bytes(split.q), as_bytes(expected.q))
    if backend == "triton":
        assert len(separate) == (1 if pieces else 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("pieces", [None, (8, 2)], ids=["one tile", "two passes over 8-column pieces"])
def test_rms_norm_adds_the_delta_before_the_residual(kernel_device, backend, dtype, with_residual, pieces):
    if backend == "reference" and pieces:
        pytest.skip("launch shapes are the Triton launcher's")
    device = _backend_device(backend, kernel_device)
    kernels = Kernels(backend)
    y, delta, expected, magnitude = _delta([HIDDEN], dtype, device, _slots(), pages=backend == "triton")
    weight = (torch.rand(HIDDEN) + 0.5).to(device=device, dtype=dtype)
    residual = torch.randn(T, HIDDEN).to(device=device, dtype=dtype) if with_residual else None
    blocks = {"lora_blocks": pieces} if pieces else {}
    got = kernels.rms_norm(y, weight, 1e-6, residual, lora=delta, **blocks)
    reference = Kernels("reference").rms_norm
    if with_residual:
        _assert_through(got[1], lambda s: reference(s, weight.cpu(), 1e-6, residual.cpu())[1], expected, magnitude,
                        dtype)
        _assert_through(got[0], lambda s: reference(s, weight.cpu(), 1e-6, residual.cpu())[0], expected, magnitude,
                        dtype)
    else:
        _assert_through(got, lambda s: reference(s, weight.cpu(), 1e-6), expected, magnitude, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op, widths", [("silu_and_mul", [10, 10]), ("gelu_tanh_and_mul", [20])])
def test_gated_activation_adds_the_delta_to_gate_and_up(kernel_device, backend, dtype, op, widths):
    """gate_proj/up_proj slices, or one fused gate_up_proj slice (Phi-3); a slot whose up slice has scaling 0."""
    device = _backend_device(backend, kernel_device)
    y, delta, expected, magnitude = _delta(widths, dtype, device, _slots(), zero_scale=True)
    got = getattr(Kernels(backend), op)(y, lora=delta)
    _assert_through(got, getattr(Kernels("reference"), op), expected, magnitude, dtype)


@pytest.mark.interpreter
def test_a_delta_that_does_not_fit_is_refused(kernel_device):
    y, delta, _, _ = _delta([10, 10], torch.float32, torch.device("cpu"), _slots())
    with pytest.raises(KernelArgumentError, match="widths"):
        Kernels("reference").rms_norm(y[:, :12], torch.ones(12), 1e-6, lora=delta)
    for backend in ("reference", "triton"):
        device = _backend_device(backend, kernel_device)
        y, delta, _, _ = _delta([6, 14], torch.float32, device, _slots())  # gate (10 columns) spans two slices
        with pytest.raises(KernelArgumentError, match="span slices"):
            Kernels(backend).silu_and_mul(y, lora=delta)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("shape", [(4, 4, 16), (6, 2, 24)], ids=["MHA", "GQA 3:1, 6 heads"])
@pytest.mark.parametrize("fused", [False, True], ids=["q/k/v slices", "one qkv_proj slice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_and_cache_adds_the_delta_to_q_k_and_v(kernel_device, backend, shape, fused, dtype):
    """q rotated in place and k/v written to the cache after each gets its delta (the float32 loop's, rounded);
    rows with slot -1 in the slot mapping write no cache; padding rows of the LoRA mapping (slot -1) get none."""
    from test_rotary_and_cache_kernel import _cached_rows, _composed, _inputs, _other_rows, _term_magnitude
    from test_rotary_kernel import hf_cache

    device = _backend_device(backend, kernel_device)
    hq, hkv, d = shape
    widths = [hq * d + 2 * hkv * d] if fused else [hq * d, hkv * d, hkv * d]
    y, delta, expected, magnitude = _delta(widths, dtype, device, _slots(), pages=backend == "triton")
    positions, _, _, _, _, key_cache, value_cache, slots = _inputs(hq, hkv, d, T, dtype, device)
    cache = hf_cache(d, 10000.0, None).to(device)
    q_size, kv_size = hq * d, hkv * d
    query, key, value = y.split([q_size, kv_size, kv_size], dim=-1)
    eq, ek, ev = expected.to(device=device, dtype=dtype).split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_kc, want_vc = _composed(positions, eq, ek, ev, key_cache, value_cache, slots, cache, d)
    key_before, value_before, y_before = key.clone(), value.clone(), y.float().cpu()  # q is rotated in place
    got_q = Kernels(backend).rotary_and_cache(positions, query, key, value, key_cache, value_cache, slots, cache,
                                              lora=delta)
    assert got_q.data_ptr() == query.data_ptr()
    valid = (slots >= 0).cpu()
    if dtype == torch.float32:
        # a sum of terms of size magnitude in another order (both sides), in both halves of a rotated pair (|cos|,
        # |sin| <= 1); the cache rows no slot names are untouched
        mq, mk, mv = magnitude.split([q_size, kv_size, kv_size], dim=-1)
        assert_sum_close(got_q, want_q, _term_magnitude(mq, d), dtype)
        for got, want, terms in ((key_cache, want_kc, _term_magnitude(mk[valid], d)), (value_cache, want_vc,
                                                                                        mv[valid])):
            assert_sum_close(_cached_rows(got, slots), _cached_rows(want, slots), terms, dtype)
            assert torch.equal(_other_rows(got, slots), _other_rows(want, slots))
    else:  # bf16: v is the GEMM's bf16 output, not the float32 loop's
        assert_close(value_cache, want_vc, dtype, scale=4.0)
        # q and k are rotated: a pair's output can nearly cancel, and so can y and its delta, so the error is
        # relative to the terms |y| + |delta| of both halves of the pair (the interpreter rounds float32 -> bf16
        # toward zero, torch to nearest: seeds 1030 and 1066 were 0.094 off a 0.03 output of 8-16 inputs, and on
        # the H200 the reference backend 1.1e-4 off an output near 1e-3; session 18)
        terms = y_before.abs() + (expected.cpu() - y_before).abs()
        tq, tk, _ = terms.split([q_size, kv_size, kv_size], dim=-1)
        assert_within_ulps(got_q, want_q, dtype, 16, _term_magnitude(tq, d))
        assert_within_ulps(_cached_rows(key_cache, slots), _cached_rows(want_kc, slots), dtype, 16,
                           _term_magnitude(tk[valid], d))
    assert torch.equal(key, key_before) and torch.equal(value, value_before), "k and v are only read"


def test_consumer_tiles_narrow_for_ranks_above_16():
    """A B tile of a consumer holds no more elements than at rank 16, where its launch shapes were measured."""
    from loraplex.kernels.lora_delta import tile_columns

    def delta_of_rank(rank):
        return LoRADelta(torch.zeros(1, 1, 1, rank), [torch.zeros(1, 8, rank)], [torch.zeros(1)],
                         LoRAMapping.from_token_slots(torch.zeros(1, dtype=torch.int32)))

    assert [tile_columns(4096, delta_of_rank(r)) for r in (4, 16, 64, 256)] == [4096, 4096, 1024, 256]
    assert [tile_columns(256, delta_of_rank(r)) for r in (16, 48, 256)] == [256, 64, 16]
    assert tile_columns(256, None) == 256 and tile_columns(16, delta_of_rank(256)) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "rotary_and_cache"])
def test_rank_64_deltas_take_narrower_tiles_and_stay_exact(kernel_device, op, monkeypatch):
    """Rank 64 (pool pages of 64 rows): the consumers' narrowed tiles (rms_norm in two passes) against the
    float32 loop."""
    import test_lora_delta as this

    monkeypatch.setattr(this, "RANK", 64)
    monkeypatch.setattr(this, "HIDDEN", 40)
    if op == "rms_norm":  # 40 columns: a 64-column tile at rank 16 narrows to 16 at rank 64, three passes' pieces
        y, delta, expected, magnitude = _delta([40], torch.float32, kernel_device, _slots())
        got = Kernels("triton").rms_norm(y, torch.ones(40, device=kernel_device), 1e-6, lora=delta)
        _assert_through(got, lambda s: Kernels("reference").rms_norm(s, torch.ones(40), 1e-6), expected, magnitude,
                        torch.float32)
    elif op == "silu_and_mul":
        y, delta, expected, magnitude = _delta([20, 20], torch.float32, kernel_device, _slots())
        got = Kernels("triton").silu_and_mul(y, lora=delta)
        _assert_through(got, Kernels("reference").silu_and_mul, expected, magnitude, torch.float32)
    else:
        test_rotary_and_cache_adds_the_delta_to_q_k_and_v(kernel_device, "triton", (4, 2, 8), False, torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "rotary_and_cache"])
@pytest.mark.parametrize("ranks", [[8, 5, 0, 3], [22, 9, 0, 3]], ids=["ranks 8,5,0,3", "ranks 22,9,0,3"])
def test_consumers_read_each_rank_row_from_its_page(kernel_device, backend, op, monkeypatch, ranks):
    """A shrink folded over a paged pool (several pages per slot, 2-row pages; rank 22: 11 whole pages, so the
    rotary kernel's 4-pages-at-once loop runs three times): each consumer sums its token's pages of v and B through
    the page table; NaN in free pages and past each rank is never read."""
    import test_lora_delta as this

    monkeypatch.setattr(this, "SEVERAL_PAGES", True)
    monkeypatch.setattr(this, "PAGED_RANKS", ranks)
    if op == "rms_norm":
        test_rms_norm_adds_the_delta_before_the_residual(kernel_device, backend, torch.float32, True, None)
    elif op == "rotary_and_cache":
        test_rotary_and_cache_adds_the_delta_to_q_k_and_v(kernel_device, backend, (6, 2, 24), False, torch.bfloat16)
    else:
        test_gated_activation_adds_the_delta_to_gate_and_up(kernel_device, backend, torch.float32, op,
                                                            [10, 10] if op == "silu_and_mul" else [20])


@pytest.mark.interpreter
@pytest.mark.parametrize("split_rank, hidden, ranks", [(4, 24, [22, 9, 0, 3]), (2, 40, [8, 5, 0, 3])],
                         ids=["rank 22 over 4 programs, 2 tiles", "rank 8 over 4 programs, 3 tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_splits_a_high_rank_row_over_programs(kernel_device, monkeypatch, split_rank, hidden, ranks, dtype,
                                                        with_residual):
    """The row split over a paged pool: a row whose rank exceeds the split rank (lowered here) takes up to 4
    programs over its column tiles (more programs than tiles, tiles not a multiple of the programs), the last to
    finish normalises the row from the others' stores; rows of one program and rows without an adapter take the
    whole-row path in the same launch. The launch counters are zero again after the launch."""
    import test_lora_delta as this
    from loraplex.kernels import _triton, lora_delta, rms_norm

    monkeypatch.setattr(this, "SEVERAL_PAGES", True)
    monkeypatch.setattr(this, "PAGED_RANKS", ranks)
    monkeypatch.setattr(this, "HIDDEN", hidden)
    monkeypatch.setattr(lora_delta, "ROW_SPLIT_RANK", split_rank)
    splits = []
    row_split = rms_norm.row_split
    monkeypatch.setattr(rms_norm, "row_split", lambda *args: splits.append(row_split(*args)) or splits[-1])
    test_rms_norm_adds_the_delta_before_the_residual(kernel_device, "triton", dtype, with_residual, None)
    assert [split for split, _ in splits] == [4]
    assert all(c.count_nonzero().item() == 0 for c in _triton._LAUNCH_COUNTERS.values())
    monkeypatch.setattr(lora_delta, "ROW_SPLIT_RANK", 64)  # no row above it: one program per row
    test_rms_norm_adds_the_delta_before_the_residual(kernel_device, "triton", dtype, with_residual, None)
    assert splits[-1][0] == 1


CONSUMER_LAUNCHES = [("silu_and_mul", {"paired": True}), ("silu_and_mul", {"paired": True, "pages_at_once": 2}),
                     ("silu_and_mul", {"row_split": 4}), ("silu_and_mul", {"row_split": 2, "paired": True}),
                     ("silu_and_mul", {"paired": False, "row_split": 1}),
                     ("rotary_and_cache", {"paired": False}),
                     ("rotary_and_cache", {"paired": True, "pages_at_once": 1}),
                     ("rms_norm", {"pages_at_once": 2, "row_split": 4})]


@pytest.mark.interpreter
@pytest.mark.parametrize("op, launch", CONSUMER_LAUNCHES, ids=[f"{op} {launch}" for op, launch in CONSUMER_LAUNCHES])
def test_every_consumer_launch_setting_reads_each_rank_row_from_its_page(kernel_device, monkeypatch, op, launch):
    """The settings benchmarks try (lora_delta.use_consumer_launch: both tiles' pages in one loop, pages loaded
    together, the row split at a split rank lowered to 4), over the poisoned paged pool of ranks 22, 9, 0, 3 in 2-row
    pages; the gated activation with a slot whose up slice has scaling 0 and NaN in its pages (paired: its B
    unread, its NaN v dropped)."""
    from loraplex.kernels import activation, lora_delta

    monkeypatch.setattr(lora_delta, "ROW_SPLIT_RANK", 4)
    monkeypatch.setattr(activation, "_LORA_BLOCK", 16)  # pieces of 4-8 columns: the split's later pieces hold columns
    previous = lora_delta.use_consumer_launch(op, **launch)
    try:
        test_consumers_read_each_rank_row_from_its_page(kernel_device, "triton", op, monkeypatch, [22, 9, 0, 3])
    finally:
        lora_delta.use_consumer_launch(op, **{k: v for k, v in previous.items() if v is not None})


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["silu_and_mul", "rotary_and_cache"])
def test_unpaired_tiles_over_a_pool_of_one_page_per_slot(kernel_device, op):
    """One loop per tile (not the default) over one-page pools: the gated activation with a zero-scale up slice
    (NaN in its A and B), rotary over q/k/v slices, against the float32 loop."""
    from loraplex.kernels.lora_delta import use_consumer_launch

    previous = use_consumer_launch(op, paired=False)
    try:
        if op == "silu_and_mul":
            test_gated_activation_adds_the_delta_to_gate_and_up(kernel_device, "triton", torch.float32, op, [10, 10])
        else:
            test_rotary_and_cache_adds_the_delta_to_q_k_and_v(kernel_device, "triton", (6, 2, 24), False,
                                                              torch.float32)
    finally:
        use_consumer_launch(op, paired=previous["paired"])


def test_consumer_launch_settings_are_checked():
    from loraplex.kernels.lora_delta import use_consumer_launch

    with pytest.raises(ValueError, match="row_split=3"):
        use_consumer_launch("rms_norm", row_split=3)
    with pytest.raises(ValueError, match="paired"):
        use_consumer_launch("rms_norm", paired=True)  # rms_norm has one tile per row
    with pytest.raises(ValueError, match="paired"):
        use_consumer_launch("silu_and_mul", paired="always")
    for bad in ({"row_split": True}, {"paired": 0}, {"pages_at_once": 2, "row_split": 2}):  # rotary has no split
        with pytest.raises(ValueError):
            use_consumer_launch("rotary_and_cache", **bad)
    assert use_consumer_launch("rotary_and_cache") == {"pages_at_once": 4, "paired": True, "row_split": None}, \
        "a refused call changes nothing"


def test_paired_follows_its_setting_and_the_pool():
    from loraplex.kernels.lora_delta import paired, use_consumer_launch

    one_page = _delta([10, 10], torch.float32, torch.device("cpu"), _slots())[1]
    several = _paged_delta([10, 10], torch.float32, torch.device("cpu"), _slots(), torch.randn(T, HIDDEN),
                           torch.randn(20, HIDDEN), False)[1]
    previous = use_consumer_launch("silu_and_mul")["paired"]
    try:
        got = {}
        for setting in (False, "paged", True):
            use_consumer_launch("silu_and_mul", paired=setting)
            got[setting] = (paired(one_page, "silu_and_mul"), paired(several, "silu_and_mul"),
                            paired(None, "silu_and_mul"))
    finally:
        use_consumer_launch("silu_and_mul", paired=previous)
    assert got == {False: (False, False, False), "paged": (False, True, False), True: (True, True, False)}


def test_a_delta_of_several_pages_needs_ranks():
    y, delta, _, _ = _paged_delta([10, 10], torch.float32, torch.device("cpu"), _slots(), torch.randn(T, HIDDEN),
                               torch.randn(20, HIDDEN), False)
    with pytest.raises(KernelArgumentError, match="needs ranks"):
        Kernels("reference").silu_and_mul(y, lora=LoRADelta(delta.v, delta.lora_b, delta.scaling, delta.mapping,
                                                            page_table=delta.page_table))
    odd = [b[..., :1].expand(-1, -1, 3).contiguous() for b in delta.lora_b]  # 3-row pages: not a power of two
    v3 = delta.v[..., :1].expand(-1, -1, -1, 3).contiguous()
    for backend in ("reference", "triton"):
        with pytest.raises(KernelArgumentError, match="power of two"):
            Kernels(backend).silu_and_mul(y, lora=LoRADelta(v3, odd, delta.scaling, delta.mapping,
                                                            page_table=delta.page_table, ranks=delta.ranks))
