"""rotary_and_cache: the fused kernel against the composed references (rotary_embedding_ref, then
reshape_and_cache_ref) and against the two Triton launches it replaces; the reference against HF's
apply_rotary_pos_emb and a per-token Python loop over the cache slots."""

from __future__ import annotations

import pytest
import torch
from kernel_test_utils import assert_within_ulps, nan_like
from test_rotary_kernel import SCALINGS, _hf_apply, hf_cache

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.reshape_and_cache import RESHAPE_AND_CACHE, reshape_and_cache_ref
from loraplex.kernels.rotary import ROTARY_EMBEDDING, rotary_embedding_ref
from loraplex.kernels.rotary_and_cache import ROTARY_AND_CACHE, rotary_and_cache_ref

MAX_POS = 96  # the table length of test_rotary_kernel.hf_cache
BLOCK_SIZE = 4
# (query heads, KV heads, head_dim): MHA, GQA 4:1, GQA 3:1 with a non-power-of-two head count and half.
SHAPES = [(4, 4, 16), (4, 1, 16), (6, 2, 24)]
# As in test_rotary_kernel: fp16 rounds like HF bit for bit in the interpreter, fp32 within an ulp or two of
# the summands, bf16 loses up to an ulp per rounding to the interpreter's truncating cast.
ULPS = {torch.float32: 2, torch.float16: 0, torch.bfloat16: 3}


def _inputs(num_q_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int, dtype: torch.dtype,
            device: torch.device):
    """q/k/v as row-strided views of one fused qkv output; random positions; distinct random slots with
    a few -1 rows; caches of random junk (untouched slots must stay as they were)."""
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 2
    positions = torch.randint(0, MAX_POS, (num_tokens,))
    positions[0] = MAX_POS - 1
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:num_tokens]
    slots[torch.randperm(num_tokens)[: max(1, num_tokens // 4)]] = -1
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size) * 2).to(device=device, dtype=dtype)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(shape).to(device=device, dtype=dtype)
    value_cache = torch.randn(shape).to(device=device, dtype=dtype)
    return positions.to(device), qkv, query, key, value, key_cache, value_cache, slots.to(device)


def _composed(positions, query, key, value, key_cache, value_cache, slots, cache, head_dim):
    """rotary_embedding_ref then reshape_and_cache_ref, on copies: (rotated q, key cache, value cache)."""
    q, k, kc, vc = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
    rotary_embedding_ref(positions, q, k, cache, head_dim)
    t = k.shape[0]
    reshape_and_cache_ref(k.view(t, -1, head_dim), value.reshape(t, -1, head_dim), kc, vc, slots)
    return q, kc, vc


def _term_magnitude(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per element, |x1| + |x2| of its head pair: a bound on the rotated summands."""
    heads = x.float().cpu().reshape(x.shape[0], -1, head_dim).abs()
    pair = heads[..., : head_dim // 2] + heads[..., head_dim // 2 :]
    return torch.cat((pair, pair), dim=-1).reshape(x.shape)


def _cached_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows of the valid slots, ``[valid T, Hkv * D]``."""
    valid = slots[slots >= 0].cpu()
    return cache.cpu()[valid // BLOCK_SIZE, valid % BLOCK_SIZE].flatten(1)


def _other_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache rows no valid slot names, ``[rows, Hkv, D]``."""
    rows = cache.cpu().flatten(0, 1)
    keep = torch.ones(rows.shape[0], dtype=torch.bool)
    keep[slots[slots >= 0].cpu().long()] = False
    return rows[keep]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}d")
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out"])
def test_kernel_matches_composed_references(kernel_device, triton_kernels, dtype, shape, in_place):
    num_q_heads, num_kv_heads, head_dim = shape
    scaling = "llama3" if head_dim == 16 else "default"
    cache = hf_cache(head_dim, 500000.0 if scaling == "llama3" else 10000.0, SCALINGS[scaling], device=kernel_device)
    positions, qkv, query, key, value, key_cache, value_cache, slots = _inputs(
        num_q_heads, num_kv_heads, head_dim, 11, dtype, kernel_device)
    expected_q, expected_kc, expected_vc = _composed(positions, query, key, value, key_cache, value_cache, slots,
                                                     cache, head_dim)
    kv_before = qkv[:, num_q_heads * head_dim :].clone()
    q_before = query.clone()
    out = None if in_place else nan_like(query)
    result = triton_kernels.rotary_and_cache(positions, query, key, value, key_cache, value_cache, slots, cache,
                                             out=out)
    assert result.data_ptr() == (query if in_place else out).data_ptr()
    if not in_place:
        assert torch.equal(query, q_before)  # the input q is left as it was
    assert torch.equal(qkv[:, num_q_heads * head_dim :], kv_before)  # key and value are only read
    valid = (slots >= 0).cpu()
    # Every slot not in slot_mapping keeps its junk; value rows are copies (bit-exact).
    untouched = torch.ones(key_cache.shape[:2], dtype=torch.bool)
    untouched.view(-1)[slots[slots >= 0].cpu()] = False
    assert torch.equal(key_cache.cpu()[untouched], expected_kc.cpu()[untouched])
    assert torch.equal(value_cache.cpu(), expected_vc.cpu())
    interpreted = torch.device(kernel_device).type == "cpu"
    ulps = ULPS[dtype] if interpreted else max(ULPS[dtype], 1)  # GPU: FMA contraction
    assert_within_ulps(result, expected_q, dtype, ulps, _term_magnitude(q_before, head_dim))
    assert_within_ulps(_cached_rows(key_cache, slots), _cached_rows(expected_kc, slots), dtype, ulps,
                       _term_magnitude(key.cpu()[valid], head_dim))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}d")
def test_kernel_equals_the_two_launches_it_replaces(kernel_device, triton_kernels, dtype, shape):
    """Bit for bit what the rotary_embedding and reshape_and_cache kernels give (they share the rounding
    code); on a GPU the compiler may contract differently in the two kernels, so ulps there."""
    num_q_heads, num_kv_heads, head_dim = shape
    cache = hf_cache(head_dim, 10000.0, SCALINGS["yarn"], device=kernel_device)
    positions, _, query, key, value, key_cache, value_cache, slots = _inputs(
        num_q_heads, num_kv_heads, head_dim, 9, dtype, kernel_device)
    q2, k2, kc2, vc2 = query.clone(), key.clone(), key_cache.clone(), value_cache.clone()
    ROTARY_EMBEDDING.triton(positions, q2, k2, cache, head_dim)
    t = k2.shape[0]
    RESHAPE_AND_CACHE.triton(k2.view(t, num_kv_heads, head_dim), value.reshape(t, num_kv_heads, head_dim), kc2, vc2,
                             slots)
    q1 = ROTARY_AND_CACHE.triton(positions, query, key, value, key_cache, value_cache, slots, cache)
    assert torch.equal(value_cache, vc2)
    if torch.device(kernel_device).type == "cpu":
        assert torch.equal(q1, q2) and torch.equal(key_cache, kc2)
    else:
        assert_within_ulps(q1, q2, dtype, 1, _term_magnitude(q2, head_dim))
        assert_within_ulps(key_cache.flatten(2), kc2.flatten(2), dtype, 1, kc2.flatten(2).abs())


@pytest.mark.interpreter
def test_padding_only_and_empty_batches(kernel_device, triton_kernels):
    """All rows padding: q still rotated, the cache untouched; no rows: nothing launched."""
    cache = hf_cache(16, 10000.0, None, device=kernel_device)
    positions, _, query, key, value, key_cache, value_cache, slots = _inputs(2, 1, 16, 4, torch.float32,
                                                                             kernel_device)
    slots.fill_(-1)
    kc, vc = key_cache.clone(), value_cache.clone()
    expected_q, _, _ = _composed(positions, query, key, value, key_cache, value_cache, slots, cache, 16)
    q = triton_kernels.rotary_and_cache(positions, query, key, value, key_cache, value_cache, slots, cache)
    assert_within_ulps(q, expected_q, torch.float32, 2, _term_magnitude(expected_q, 16))
    assert torch.equal(key_cache, kc) and torch.equal(value_cache, vc)
    empty = triton_kernels.rotary_and_cache(positions[:0], query[:0], key[:0], value[:0], key_cache, value_cache,
                                            slots[:0], cache)
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_hf_rope_then_a_slot_loop(dtype):
    """The reference against an independent composition: HF apply_rotary_pos_emb, then per-token slot writes."""
    head_dim = 16
    cache = hf_cache(head_dim, 500000.0, SCALINGS["llama3"])
    positions, _, query, key, value, key_cache, value_cache, slots = _inputs(4, 2, head_dim, 10, dtype,
                                                                             torch.device("cpu"))
    hf_q, hf_k = _hf_apply(positions, query, key, "llama3", head_dim)
    kc, vc = key_cache.clone(), value_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // BLOCK_SIZE, s % BLOCK_SIZE] = hf_k[t].view(-1, head_dim)
            vc[s // BLOCK_SIZE, s % BLOCK_SIZE] = value[t].view(-1, head_dim)
    out = nan_like(query)
    result = rotary_and_cache_ref(positions, query, key, value, key_cache, value_cache, slots, cache, out=out)
    assert result is out and torch.equal(out, hf_q)
    assert torch.equal(key_cache, kc) and torch.equal(value_cache, vc)


def _args(device=torch.device("cpu")):
    cache = hf_cache(16, 10000.0, None)
    positions, _, query, key, value, key_cache, value_cache, slots = _inputs(2, 1, 16, 6, torch.float32, device)
    return dict(positions=positions, query=query, key=key, value=value, key_cache=key_cache,
                value_cache=value_cache, slot_mapping=slots, cos_sin_cache=cache)


@pytest.mark.parametrize(
    ("field", "bad", "fragment"),
    [
        ("positions", lambda a: a["positions"].int(), "positions.dtype"),
        ("slot_mapping", lambda a: a["slot_mapping"].int(), "slot_mapping.dtype"),
        ("value", lambda a: a["value"][:, :8], "value.shape"),
        ("key", lambda a: a["key"][:5], "key.shape"),
        ("key_cache", lambda a: a["key_cache"].half(), "key_cache.dtype"),
        ("value_cache", lambda a: a["value_cache"][:1], "value_cache.shape"),
        ("key_cache", lambda a: torch.zeros(4, BLOCK_SIZE, 1, 15), "head_dim"),
        ("query", lambda a: a["query"][:, :24], "not a multiple of head_dim"),
        ("cos_sin_cache", lambda a: a["cos_sin_cache"].double(), "cos_sin_cache.dtype"),
        ("out", lambda a: torch.zeros(6, 16), "out.shape"),
    ],
)
def test_bad_arguments_raise_typed_errors(kernel_device, field, bad, fragment):
    args = _args(kernel_device)
    args[field] = bad(args)
    for fn in (ROTARY_AND_CACHE.triton, rotary_and_cache_ref):
        with pytest.raises(KernelArgumentError, match=fragment):
            fn(**args)


def test_reference_rejects_positions_and_slots_outside_the_tables():
    args = _args()
    args["positions"] = args["positions"] + MAX_POS
    with pytest.raises(KernelArgumentError, match="positions span"):
        rotary_and_cache_ref(**args)
    args = _args()
    args["slot_mapping"][0] = args["key_cache"].shape[0] * BLOCK_SIZE
    with pytest.raises(KernelArgumentError, match="slot_mapping values span"):
        rotary_and_cache_ref(**args)
