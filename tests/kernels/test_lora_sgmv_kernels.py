"""LoRA SGMV shrink/expand: Triton kernels and references against per-token float32 loops and PEFT."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import (
    assert_lora_close,
    assert_sum_close,
    folded_gemm,
    naive_lora_expand,
    naive_lora_expand_magnitude,
    naive_lora_shrink,
    naive_lora_shrink_terms,
    naive_lora_terms,
    zipf_slots,
)

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.lora_expand import lora_expand_ref
from loraplex.kernels.lora_mapping import LoRAMapping
from loraplex.kernels.lora_fused import FUSED_LORA, fused_launch_shape
from loraplex.kernels.lora_linear import ADD_LORA
from loraplex.kernels.lora_shrink import _launch_lora_shrink, lora_shrink_ref
from loraplex.kernels.ops import Kernels

HIDDEN, SLOTS, RANK = 40, 5, 8
WIDTHS = [24, 8, 8]  # fused q/k/v slices of different widths (GQA)
NUM_TOKENS = 37  # > 2 token tiles of 16 for the biggest segments


def _slots(case: str) -> torch.Tensor:
    if case == "one_adapter":
        return torch.full((NUM_TOKENS,), 3, dtype=torch.int32)
    if case == "all_different":
        return torch.randperm(SLOTS)[: SLOTS - 1].to(torch.int32)  # every token its own adapter
    if case == "zipf":
        return zipf_slots(NUM_TOKENS, SLOTS)
    if case == "some_none":
        slots = zipf_slots(NUM_TOKENS, SLOTS)
        slots[torch.randperm(NUM_TOKENS)[:9]] = -1
        return slots
    if case == "all_none":
        return torch.full((6,), -1, dtype=torch.int32)
    raise AssertionError(case)


CASES = ["one_adapter", "all_different", "zipf", "some_none", "all_none"]


def _weights(dtype: torch.dtype, device: torch.device, mixed_ranks: bool):
    """Zero-padded A/B per slot; with mixed ranks slot s has rank RANK >> (s % 3), plus the ranks tensor."""
    ranks = [RANK >> (s % 3) if mixed_ranks else RANK for s in range(SLOTS)]
    lora_a, lora_b = [], []
    for width in WIDTHS:
        a = torch.randn(SLOTS, RANK, HIDDEN) / HIDDEN**0.5
        b = torch.randn(SLOTS, width, RANK)
        for s, r in enumerate(ranks):
            a[s, r:] = 0
            b[s, :, r:] = 0
        lora_a.append(a.to(device=device, dtype=dtype))
        lora_b.append(b.to(device=device, dtype=dtype))
    scaling = [(torch.rand(SLOTS) + 0.5).to(device) for _ in WIDTHS]
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device) if mixed_ranks else None
    return lora_a, lora_b, scaling, ranks_t


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_shrink_expand_kernels_match_naive(kernel_device, triton_kernels, case, dtype):
    device = kernel_device
    token_slots = _slots(case).to(device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN).to(device=device, dtype=dtype)
    lora_a, lora_b, scaling, ranks = _weights(dtype, device, mixed_ranks=case == "zipf")

    v = triton_kernels.lora_shrink(x, lora_a, mapping, ranks=ranks)
    assert v.shape == (len(WIDTHS), x.shape[0], RANK) and v.dtype == torch.float32
    assert_sum_close(v, naive_lora_shrink(x, lora_a, token_slots), naive_lora_shrink_terms(x, lora_a, token_slots),
                     dtype)

    y = torch.randn(x.shape[0], sum(WIDTHS)).to(device=device, dtype=dtype)
    expected = naive_lora_expand(v, lora_b, scaling, y, token_slots)
    magnitude = naive_lora_expand_magnitude(v, lora_b, scaling, y, token_slots)
    y_before = y.clone()
    triton_kernels.lora_expand(v, lora_b, scaling, y, mapping, ranks=ranks)
    if dtype == torch.float32:  # the expand of the same v in another order: |y| + |s| |v| |B| are its terms
        assert_sum_close(y, expected, y_before.float().cpu().abs() + magnitude, dtype)
    else:
        assert_lora_close(y, expected, magnitude, dtype, scale=2.0)
    none = (token_slots < 0).cpu()
    assert torch.equal(y.cpu()[none], y_before.cpu()[none]), "rows without adapter must be untouched"


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shrink_launcher_writes_every_lora_row_and_skips_the_rest(kernel_device, dtype):
    token_slots = _slots("some_none").to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN).to(device=kernel_device, dtype=dtype)
    lora_a, _, _, _ = _weights(dtype, kernel_device, mixed_ranks=False)
    out = torch.full((len(WIDTHS), x.shape[0], RANK), float("nan"), device=kernel_device)
    _launch_lora_shrink(x, lora_a, mapping, out=out, split_k=1)
    lora_rows = (token_slots >= 0).cpu()
    assert_sum_close(out.cpu()[:, lora_rows], naive_lora_shrink(x, lora_a, token_slots)[:, lora_rows],
                     naive_lora_shrink_terms(x, lora_a, token_slots)[:, lora_rows], dtype)
    assert torch.isnan(out.cpu()[:, ~lora_rows]).all(), "slot -1 rows must cost nothing (left unwritten)"


@pytest.mark.interpreter
@pytest.mark.parametrize("split_k", [2, 3])
def test_shrink_split_k_is_deterministic_and_correct(kernel_device, split_k):
    token_slots = _slots("some_none").to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=kernel_device)
    lora_a, _, _, _ = _weights(torch.float32, kernel_device, mixed_ranks=False)
    outs = []
    for _ in range(2):
        # Zero-filled: with split 1 (H fits one GPU K chunk) rows of slot -1 stay as they were.
        out = torch.zeros((len(WIDTHS), x.shape[0], RANK), device=kernel_device)
        _launch_lora_shrink(x, lora_a, mapping, out=out, split_k=split_k)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_sum_close(outs[0], naive_lora_shrink(x, lora_a, token_slots),
                     naive_lora_shrink_terms(x, lora_a, token_slots), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_references_match_naive(case, dtype):
    token_slots = _slots(case)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN).to(dtype)
    lora_a, lora_b, scaling, ranks = _weights(dtype, torch.device("cpu"), mixed_ranks=case != "one_adapter")
    v = lora_shrink_ref(x, lora_a, mapping, ranks=ranks)
    assert_sum_close(v, naive_lora_shrink(x, lora_a, token_slots), naive_lora_shrink_terms(x, lora_a, token_slots),
                     dtype, scale=0.1)
    y = torch.randn(x.shape[0], sum(WIDTHS)).to(dtype)
    expected = naive_lora_expand(v, lora_b, scaling, y, token_slots)
    magnitude = naive_lora_expand_magnitude(v, lora_b, scaling, y, token_slots)
    lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks)
    assert_lora_close(y, expected, magnitude, dtype)


def test_ranks_skip_padded_rows():
    # Junk (not zero) beyond ranks[s] must be ignored: the kernels and references treat it as zero.
    token_slots = torch.tensor([0, 1, 1, -1, 0], dtype=torch.int32)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(5, HIDDEN)
    a = torch.randn(2, RANK, HIDDEN)
    ranks = torch.tensor([2, 8], dtype=torch.int32)
    v = lora_shrink_ref(x, [a], mapping, ranks=ranks)
    truncated = a.clone()
    truncated[0, 2:] = 0
    assert_sum_close(v, naive_lora_shrink(x, [truncated], token_slots),
                     naive_lora_shrink_terms(x, [truncated], token_slots), torch.float32)


@pytest.mark.interpreter
def test_kernels_ignore_junk_beyond_ranks(kernel_device, triton_kernels):
    token_slots = torch.tensor([0, 1, 1, -1, 0, 1], dtype=torch.int32, device=kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(6, HIDDEN, device=kernel_device)
    a = torch.randn(2, RANK, HIDDEN, device=kernel_device)
    b = torch.randn(2, 16, RANK, device=kernel_device)
    scaling = [torch.tensor([0.5, 2.0], device=kernel_device)]
    ranks = torch.tensor([3, 8], dtype=torch.int32, device=kernel_device)
    a_trunc, b_trunc = a.clone(), b.clone()
    a_trunc[0, 3:] = 0
    b_trunc[0, :, 3:] = 0
    v = triton_kernels.lora_shrink(x, [a], mapping, ranks=ranks)
    y = torch.randn(6, 16, device=kernel_device)
    expected = naive_lora_expand(naive_lora_shrink(x, [a_trunc], token_slots), [b_trunc], scaling, y, token_slots)
    terms = naive_lora_terms(x, [a_trunc], [b_trunc], scaling, y, token_slots)
    triton_kernels.lora_expand(v, [b], scaling, y, mapping, ranks=ranks)
    assert_sum_close(v, naive_lora_shrink(x, [a_trunc], token_slots),
                     naive_lora_shrink_terms(x, [a_trunc], token_slots), torch.float32)
    assert_sum_close(y, expected, terms, torch.float32)


def _peft_model_and_pool(hidden: int, widths: list[int]):
    """A two-projection module with two PEFT adapters (different ranks and targets) and our slot-pool tensors."""
    nn = torch.nn
    peft = pytest.importorskip("peft")

    class TwoProj(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(hidden, widths[0], bias=False)
            self.k = nn.Linear(hidden, widths[1], bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.q(x), self.k(x)], dim=-1)

    model = peft.get_peft_model(
        TwoProj(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k"], init_lora_weights=False), "a0"
    )
    model.add_adapter("a1", peft.LoraConfig(r=8, lora_alpha=4, target_modules=["q"], init_lora_weights=False))
    model.eval()
    # Slot 0 free, slot 1 = a1, slot 2 = a0; R = 8, zero-padded.
    slot_of = {"a1": 1, "a0": 2}
    lora_a = [torch.zeros(3, 8, hidden) for _ in widths]
    lora_b = [torch.zeros(3, w, 8) for w in widths]
    scaling = [torch.zeros(3) for _ in widths]
    for i, name in enumerate(["q", "k"]):
        layer = getattr(model.base_model.model, name)
        for adapter, slot in slot_of.items():
            if adapter in layer.lora_A:
                a = layer.lora_A[adapter].weight.detach()
                lora_a[i][slot, : a.shape[0]] = a
                lora_b[i][slot, :, : a.shape[0]] = layer.lora_B[adapter].weight.detach()
                scaling[i][slot] = layer.scaling[adapter]
    return model, slot_of, lora_a, lora_b, scaling


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mixed_adapter_batch_matches_peft(kernel_device, backend):
    widths = [24, 8]
    model, slot_of, lora_a, lora_b, scaling = _peft_model_and_pool(HIDDEN, widths)
    names = ["a0", "__base__", "a1", "a0", "a1", "a1", "__base__", "a0"]
    x = torch.randn(len(names), HIDDEN)
    with torch.no_grad():
        expected = model(x, adapter_names=names)
        base = model.get_base_model()
        with model.disable_adapter():
            y = base(x)
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = torch.tensor([slot_of.get(n, -1) for n in names], dtype=torch.int32, device=device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    ranks = torch.tensor([0, 8, 4], dtype=torch.int32, device=device)
    terms = naive_lora_terms(x, lora_a, lora_b, scaling, y, token_slots)
    y = y.to(device)
    kernels = Kernels(backend)
    v = kernels.lora_shrink(x.to(device), [a.to(device) for a in lora_a], mapping, ranks=ranks)
    kernels.lora_expand(v, [b.to(device) for b in lora_b], [s.to(device) for s in scaling], y, mapping, ranks=ranks)
    assert_sum_close(y, expected, terms, torch.float32)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        ("x_dtype", "differs from the activations"),
        ("slot_too_big", "mapping has 5 slots"),
        ("width_sum", "y.shape"),
        ("ranks_dtype", "ranks.dtype"),
        ("tokens", "mapping.num_tokens"),
    ],
)
def test_bad_arguments_raise_typed_errors(mutate, fragment):
    token_slots = torch.tensor([0, 4, -1], dtype=torch.int32)
    mapping = LoRAMapping.from_token_slots(token_slots)
    lora_a, lora_b, scaling, _ = _weights(torch.float32, torch.device("cpu"), mixed_ranks=False)
    x = torch.randn(3, HIDDEN)
    y = torch.randn(3, sum(WIDTHS))
    v = torch.zeros(len(WIDTHS), 3, RANK)
    ranks = None
    if mutate == "x_dtype":
        x = x.half()
    elif mutate == "slot_too_big":
        lora_a = [a[:4].contiguous() for a in lora_a]
    elif mutate == "width_sum":
        y = y[:, :-1]
    elif mutate == "ranks_dtype":
        ranks = torch.zeros(SLOTS, dtype=torch.int64)
    elif mutate == "tokens":
        x = x[:2]
    with pytest.raises(KernelArgumentError, match=fragment):
        lora_shrink_ref(x, lora_a, mapping, ranks=ranks)
        lora_expand_ref(v, lora_b, scaling, y, mapping, ranks=ranks)


@pytest.mark.interpreter
@pytest.mark.parametrize(("case", "split_k", "expand_blocks"), [
    ("zipf", 1, (16, 16, 1)),
    ("some_none", 2, (16, 16, 2)),
    ("all_different", 3, (16, 8, 4)),
    ("one_adapter", 2, (16, 16, 2)),
    ("all_none", 2, None),
])
def test_add_lora_split_partials_match_naive(kernel_device, case, split_k, expand_blocks):
    """Shrink partials (uninitialised rows for slot -1) summed inside the expand == per-token fp32 loop."""
    token_slots = _slots(case).to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=kernel_device)
    lora_a, lora_b, scaling, ranks = _weights(torch.float32, kernel_device, mixed_ranks=case == "zipf")
    y = torch.randn(x.shape[0], sum(WIDTHS), device=kernel_device)
    expected = naive_lora_expand(naive_lora_shrink(x, lora_a, token_slots), lora_b, scaling, y, token_slots)
    terms = naive_lora_terms(x, lora_a, lora_b, scaling, y, token_slots)
    outs = []
    for _ in range(2):
        out = y.clone()
        ADD_LORA.triton(x, lora_a, lora_b, scaling, out, mapping, ranks=ranks, split_k=split_k,
                        expand_blocks=expand_blocks, fused=False)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), "split-K partial sums must be added in a fixed order"
    assert_sum_close(outs[0], expected, terms, torch.float32)
    none = (token_slots < 0).cpu()
    assert torch.equal(outs[0].cpu()[none], y.cpu()[none]), "rows without adapter must be untouched"


@pytest.mark.interpreter
@pytest.mark.parametrize(("shrink_blocks", "expand_blocks"), [
    ((16, 16, 2, 2), (16, 16, 2, 8, 3)),
    ((16, 16, 8), (16, 8, 4, 2)),
])
def test_add_lora_warps_and_stages_overrides_match_naive(kernel_device, shrink_blocks, expand_blocks):
    """The benchmark sweep's (num_warps, num_stages) tails on the block overrides launch the same kernels."""
    token_slots = _slots("zipf").to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=kernel_device)
    lora_a, lora_b, scaling, ranks = _weights(torch.float32, kernel_device, mixed_ranks=True)
    y = torch.randn(x.shape[0], sum(WIDTHS), device=kernel_device)
    expected = naive_lora_expand(naive_lora_shrink(x, lora_a, token_slots), lora_b, scaling, y, token_slots)
    terms = naive_lora_terms(x, lora_a, lora_b, scaling, y, token_slots)
    ADD_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks, split_k=2, shrink_blocks=shrink_blocks,
                    expand_blocks=expand_blocks)
    assert_sum_close(y, expected, terms, torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize(("shrink_blocks", "expand_blocks", "fragment"), [
    ((16, 16, 3), None, "num_warps=3: must be 1, 2, 4, 8 or 16"),
    (None, (16, 16, 2, 4, 3, 1), r"launch override \(4, 3, 1\): at most \(num_warps, num_stages\)"),
])
def test_add_lora_bad_launch_overrides_are_refused(kernel_device, shrink_blocks, expand_blocks, fragment):
    token_slots = _slots("zipf").to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=kernel_device)
    lora_a, lora_b, scaling, ranks = _weights(torch.float32, kernel_device, mixed_ranks=True)
    y = torch.randn(x.shape[0], sum(WIDTHS), device=kernel_device)
    with pytest.raises(KernelArgumentError, match=fragment):
        ADD_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks, shrink_blocks=shrink_blocks,
                        expand_blocks=expand_blocks)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_add_lora_bf16_matches_shrink_then_expand(kernel_device, backend):
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = _slots("zipf").to(device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=device, dtype=torch.bfloat16)
    lora_a, lora_b, scaling, ranks = _weights(torch.bfloat16, device, mixed_ranks=True)
    y = torch.randn(x.shape[0], sum(WIDTHS), device=device, dtype=torch.bfloat16)
    v = naive_lora_shrink(x, lora_a, token_slots)
    expected = naive_lora_expand(v, lora_b, scaling, y, token_slots)
    magnitude = naive_lora_expand_magnitude(v, lora_b, scaling, y, token_slots)
    Kernels(backend).add_lora(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
    assert_lora_close(y, expected, magnitude, torch.bfloat16, scale=2.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_add_lora_into_float32_delta_buffer(kernel_device, backend):
    """bf16 activations and weights, float32 output buffer (the decode path's side-stream delta)."""
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = _slots("some_none").to(device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=device, dtype=torch.bfloat16)
    lora_a, lora_b, scaling, _ = _weights(torch.bfloat16, device, mixed_ranks=False)
    delta = torch.zeros(x.shape[0], sum(WIDTHS), device=device)
    v = naive_lora_shrink(x, lora_a, token_slots)
    expected = naive_lora_expand(v, lora_b, scaling, delta, token_slots)
    magnitude = naive_lora_expand_magnitude(v, lora_b, scaling, delta, token_slots)
    Kernels(backend).add_lora(x, lora_a, lora_b, scaling, delta, mapping)
    assert delta.dtype == torch.float32
    assert_lora_close(delta, expected, magnitude, torch.bfloat16, scale=2.0)


# -- fused shrink+expand (one launch) ---------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_fused_kernel_matches_naive(kernel_device, triton_kernels, case, dtype):
    """y[t, off_i:] += scaling_i[s] * round_B(x[t] @ A_i[s].T) @ B_i[s].T against a per-token fp32 loop."""
    device = kernel_device
    token_slots = _slots(case).to(device)
    mapping = LoRAMapping.from_token_slots(token_slots, num_slots=SLOTS)
    x = torch.randn(token_slots.shape[0], HIDDEN).to(device=device, dtype=dtype)
    lora_a, lora_b, scaling, ranks = _weights(dtype, device, mixed_ranks=case == "zipf")
    y = torch.randn(x.shape[0], sum(WIDTHS)).to(device=device, dtype=dtype)
    v = naive_lora_shrink(x, lora_a, token_slots).to(dtype).float()  # rounded to B's dtype, as PEFT
    expected = naive_lora_expand(v, lora_b, scaling, y, token_slots)
    magnitude = naive_lora_expand_magnitude(v, lora_b, scaling, y, token_slots)
    y_before = y.clone()
    triton_kernels.fused_lora(x, lora_a, lora_b, scaling, y, mapping, ranks=ranks)
    assert_lora_close(y, expected, magnitude, dtype, scale=2.0)
    none = (token_slots < 0).cpu()
    assert torch.equal(y.cpu()[none], y_before.cpu()[none]), "rows without adapter must be untouched"


@pytest.mark.interpreter
@pytest.mark.parametrize("blocks", [(16, 32, 16, 1), (16, 16, 8, 2), (16, 64, 16, 4), (32, 32, 16, 1)])
def test_fused_kernel_launch_overrides(kernel_device, blocks):
    """Every tile shape (columns split over programs or looped in one, K in one or several chunks) agrees."""
    token_slots = _slots("some_none").to(kernel_device)
    mapping = LoRAMapping.from_token_slots(token_slots, num_slots=SLOTS)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=kernel_device)
    lora_a, lora_b, scaling, _ = _weights(torch.float32, kernel_device, mixed_ranks=False)
    y = torch.randn(x.shape[0], sum(WIDTHS), device=kernel_device)
    expected = naive_lora_expand(naive_lora_shrink(x, lora_a, token_slots), lora_b, scaling, y, token_slots)
    terms = naive_lora_terms(x, lora_a, lora_b, scaling, y, token_slots)
    FUSED_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, blocks=blocks)
    assert_sum_close(y, expected, terms, torch.float32)


def test_fused_launch_shape_fills_the_device():
    """Columns per program: the fewest (a power of two of 16-column tiles) that give ~4 programs per SM
    (the CPU stands in for 4 SMs: 16 programs)."""
    cpu = torch.device("cpu")
    one = LoRAMapping.from_token_slots(torch.zeros(1, dtype=torch.int32), num_slots=4)  # W = 1 + 1 = 2
    assert fused_launch_shape(one, [24, 8, 8], cpu, 16, 16) == (1, 2)  # 6 rows x 2 column blocks
    assert fused_launch_shape(one, [256], cpu, 16, 16) == (2, 8)  # 2 rows: 8 blocks of 32 columns
    many = LoRAMapping.from_token_slots(torch.arange(32, dtype=torch.int32) % 8, num_slots=8)  # W = 2 + 8
    assert fused_launch_shape(many, [256, 256], cpu, 16, 16) == (16, 1)  # 20 rows fill it: one block


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_mixed_adapter_batch_matches_peft(kernel_device, backend):
    widths = [24, 8]
    model, slot_of, lora_a, lora_b, scaling = _peft_model_and_pool(HIDDEN, widths)
    names = ["a0", "__base__", "a1", "a0", "a1", "a1", "__base__", "a0"]
    x = torch.randn(len(names), HIDDEN)
    with torch.no_grad():
        expected = model(x, adapter_names=names)
        with model.disable_adapter():
            y = model.get_base_model()(x)
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = torch.tensor([slot_of.get(n, -1) for n in names], dtype=torch.int32, device=device)
    mapping = LoRAMapping.from_token_slots(token_slots, num_slots=3)
    ranks = torch.tensor([0, 8, 4], dtype=torch.int32, device=device)
    terms = naive_lora_terms(x, lora_a, lora_b, scaling, y, token_slots)
    y = y.to(device)
    Kernels(backend).fused_lora(x.to(device), [a.to(device) for a in lora_a], [b.to(device) for b in lora_b],
                                [s.to(device) for s in scaling], y, mapping, ranks=ranks)
    assert_sum_close(y, expected, terms, torch.float32)


def test_add_lora_refuses_two_kernel_overrides_for_the_fused_path():
    token_slots = _slots("zipf")
    mapping = LoRAMapping.from_token_slots(token_slots, num_slots=SLOTS)
    lora_a, lora_b, scaling, _ = _weights(torch.float32, torch.device("cpu"), mixed_ranks=False)
    x, y = torch.randn(token_slots.shape[0], HIDDEN), torch.randn(token_slots.shape[0], sum(WIDTHS))
    with pytest.raises(KernelArgumentError, match="not to the fused kernel"):
        ADD_LORA.triton(x, lora_a, lora_b, scaling, y, mapping, split_k=2, fused=True)


def test_cuda_launch_shapes_are_the_measured_ones():
    """The H200 sweeps of sessions 8 and 13 (RESULTS.md): shrink H chunks of 256 elements up to 8 tokens, 512 up to
    128, 1024 beyond (partials bounded to 32 MiB past 256), in 256-element K tiles (128 from 129 to 256 tokens);
    expand 128-column tiles up to 8 tokens, 256 beyond, back to 128 when a B tile would pass 32 KiB (large ranks),
    and eight 128-column tiles per program from 129 to 256 tokens. Chosen from the device type alone, so checked
    here on the CPU."""
    from loraplex.kernels import lora_expand, lora_shrink

    cuda = torch.device("cuda")

    def mapping(tokens: int) -> LoRAMapping:
        return LoRAMapping.from_token_slots(torch.arange(tokens, dtype=torch.int32) % 4, num_slots=4)

    splits = {t: lora_shrink.partial_split_k(mapping(t), 4096, 3, cuda, 16)
              for t in (1, 8, 9, 32, 128, 129, 256, 257, 512)}
    assert splits == {1: 16, 8: 16, 9: 8, 32: 8, 128: 8, 129: 4, 256: 4, 257: 4, 512: 4}
    assert lora_shrink.partial_split_k(mapping(512), 11008, 1, cuda, 16) == 11
    # Past 256 tokens the partials stay under 32 MiB: a long high-rank chunk is not split at all.
    assert lora_shrink.partial_split_k(mapping(8192), 4096, 3, cuda, max_rank=256) == 1  # 25 MiB per split
    assert lora_shrink.partial_split_k(mapping(8192), 4096, 3, cuda, max_rank=16) == 4  # 1.5 MiB per split
    assert lora_shrink.partial_split_k(mapping(8192), 4096, 1, cuda, max_rank=128) == 4  # 4 MiB: 8 would fit
    assert lora_shrink._block_sizes(mapping(32), cuda) == (16, 256)
    assert lora_shrink._block_sizes(mapping(129), cuda) == (16, 128)  # session 13: 129-256 tokens
    assert lora_shrink._block_sizes(mapping(512), cuda) == (64, 256)
    assert lora_expand._block_sizes(mapping(8), cuda) == (16, 128, 1)
    assert lora_expand._block_sizes(mapping(32), cuda) == (16, 256, 1)
    assert lora_expand._block_sizes(mapping(256), cuda) == (16, 128, 8)
    assert lora_expand._block_sizes(mapping(512), cuda) == (16, 256, 1)
    assert lora_expand.launch_shape(mapping(256), cuda, 16, 2) == (16, 128, 8)
    assert lora_expand.launch_shape(mapping(256), cuda, 64, 2) == (16, 256, 1)  # big ranks: one column tile
    assert lora_expand.launch_shape(mapping(256), cuda, 128, 2) == (16, 128, 1)
    assert lora_expand.launch_shape(mapping(32), cuda, 128, 2) == (16, 128, 1)
    assert lora_expand.cap_block_n(256, 16, 2) == 256
    assert lora_expand.cap_block_n(256, 64, 2) == 256
    assert lora_expand.cap_block_n(256, 128, 2) == 128
    assert lora_expand.cap_block_n(256, 64, 4) == 128
    assert lora_expand.cap_block_n(128, 256, 4) == 128


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["zipf", "some_none", "all_different"])
def test_expand_of_a_shrink_folded_into_the_base_gemm_matches_naive(kernel_device, backend, dtype, case):
    """Each token reads its own slot's rows of the folded GEMM's extra columns (bf16 there, as the GEMM writes
    them); the base columns get the float32 loop's LoRA delta, tokens without an adapter keep the base output.
    A slot with scaling 0 on the k slice (an untargeted module) adds nothing there."""
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = _slots(case).to(device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN).to(device=device, dtype=dtype)
    w = (torch.randn(sum(WIDTHS), HIDDEN) / HIDDEN**0.5).to(device=device, dtype=dtype)
    lora_a, lora_b, scaling, _ = _weights(dtype, device, mixed_ranks=False)
    scaling[1][2] = 0.0
    y, v = folded_gemm(x, w, lora_a)  # y: a row-strided view, the expand adds into the GEMM's own output
    base = y.clone()
    v_naive = naive_lora_shrink(x, lora_a, token_slots)
    expected = naive_lora_expand(v_naive, lora_b, scaling, base.clone(), token_slots)
    magnitude = naive_lora_expand_magnitude(v_naive, lora_b, scaling, base, token_slots)
    Kernels(backend).lora_expand_slot_rows(v, lora_b, scaling, y, mapping)
    assert_lora_close(y, expected, magnitude, dtype, scale=2.0)
    none = (token_slots < 0).cpu()
    assert torch.equal(y.cpu()[none], base.cpu()[none]), "rows without adapter must be untouched"
    k = slice(WIDTHS[0], WIDTHS[0] + WIDTHS[1])
    on_slot2 = (token_slots == 2).cpu()
    assert torch.equal(y.cpu()[on_slot2][:, k], base.cpu()[on_slot2][:, k]), "scaling 0 adds nothing"


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_folded_expand_reads_each_slot_through_its_one_page(kernel_device, backend):
    """One page per slot: slot s's B and row of v are page page_table[s, 0] (pages permuted against slots)."""
    device = kernel_device if backend == "triton" else torch.device("cpu")
    token_slots = _slots("zipf").to(device)
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN, device=device)
    w = torch.randn(sum(WIDTHS), HIDDEN, device=device) / HIDDEN**0.5
    pages_a, pages_b, scaling, _ = _weights(torch.float32, device, mixed_ranks=False)  # [P = SLOTS, ...] pages
    page_of = torch.randperm(SLOTS)
    page_table = page_of.to(torch.int32).view(SLOTS, 1).to(device)
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device=device)
    y, v = folded_gemm(x, w, pages_a)
    base = y.clone()
    slot_a = [a[page_of.to(device)] for a in pages_a]  # slot s's rectangle
    slot_b = [b[page_of.to(device)] for b in pages_b]
    v_naive = naive_lora_shrink(x, slot_a, token_slots)
    expected = naive_lora_expand(v_naive, slot_b, scaling, base.clone(), token_slots)
    magnitude = naive_lora_expand_magnitude(v_naive, slot_b, scaling, base, token_slots)
    Kernels(backend).lora_expand_slot_rows(v, pages_b, scaling, y, mapping, ranks=ranks, page_table=page_table)
    assert_lora_close(y, expected, magnitude, torch.float32, scale=2.0)


def test_folded_expand_refuses_a_wrong_v_and_pages_without_ranks():
    token_slots = _slots("zipf")
    mapping = LoRAMapping.from_token_slots(token_slots)
    x = torch.randn(token_slots.shape[0], HIDDEN)
    w = torch.randn(sum(WIDTHS), HIDDEN)
    lora_a, lora_b, scaling, _ = _weights(torch.float32, torch.device("cpu"), mixed_ranks=False)
    y, v = folded_gemm(x, w, lora_a)
    table = torch.zeros(SLOTS, 2, dtype=torch.int32)
    half = [b[..., : RANK // 2].contiguous() for b in lora_b]
    with pytest.raises(KernelArgumentError, match="ranks is required"):
        Kernels("reference").lora_expand_slot_rows(v[..., : RANK // 2], half, scaling, y, mapping, page_table=table)
    with pytest.raises(KernelArgumentError, match="v.shape"):
        Kernels("reference").lora_expand_slot_rows(v[:, :, :2], lora_b, scaling, y, mapping)
