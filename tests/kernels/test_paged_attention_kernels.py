"""Paged attention: Triton decode/prefill kernels and the reference against a per-token float32 loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_test_utils import assert_close, make_paged_batch, naive_paged_attention, nan_like

from loraplex.kernels import attention_decode
from loraplex.kernels.attention import PAGED_ATTENTION, paged_attention_ref
from loraplex.kernels.attention_decode import (DecodeConfig, choose_num_splits, decode_context_buckets,
                                               paged_decode_attention)
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.attention_prefill import paged_prefill_attention
from loraplex.kernels.errors import KernelArgumentError

BLOCK_SIZE = 8
HEAD_DIM = 16
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_kv_heads, group): GQA ratios 1, 3 and 8.
HEADS = [(2, 1), (1, 3), (1, 8)]
# Context lengths around the block size: 1, bs-1, bs, bs+1, and several blocks.
DECODE_SEQ_LENS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]
# (query_len, seq_len): prefill of 1, bs-1, bs, bs+1 and > one 16-token tile; a decode
# row; extends after cached prefixes of bs and 1 positions.
MIXED = [(1, 1), (7, 7), (8, 8), (9, 9), (20, 20), (1, 8), (5, 13), (9, 10)]


def _scale() -> float:
    return HEAD_DIM**-0.5


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hkv{h[0]}g{h[1]}")
def test_decode_kernel_matches_naive(kernel_device, triton_kernels, heads, dtype):
    num_kv_heads, group = heads
    batch = make_paged_batch(
        [1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, num_kv_heads, group, HEAD_DIM, BLOCK_SIZE, dtype, kernel_device
    )
    out = triton_kernels.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(), out=nan_like(batch.query)
    )
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert_close(out, naive_paged_attention(batch, _scale()), dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k_matches_naive(kernel_device, poison_allocations, num_splits, dtype):
    # Longer contexts so that every split has work; the 1-token sequence leaves later splits empty.
    seq_lens = [1, 40, 33, 17]
    batch = make_paged_batch([1] * 4, seq_lens, 2, 3, HEAD_DIM, BLOCK_SIZE, dtype, kernel_device, num_padded_tokens=6)
    out = paged_decode_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.meta,
        _scale(),
        out=nan_like(batch.query),
        num_splits=num_splits,
    )
    expected = naive_paged_attention(batch, _scale())
    assert_close(out[:4], expected[:4], dtype)
    assert (out[4:] == 0).all(), "padding rows must be zeroed"


def test_choose_num_splits_fills_small_batches():
    cuda_like = torch.device("cpu")  # interpreter pretends to have 4 SMs: 4 programs per SM = 16 programs
    assert choose_num_splits(num_programs=64, max_seq_len=32768, device=cuda_like) == 1
    assert choose_num_splits(num_programs=1, max_seq_len=32768, device=cuda_like) == 16
    assert choose_num_splits(num_programs=3, max_seq_len=32768, device=cuda_like) == 8  # 6 rounded up to 2^k
    assert choose_num_splits(num_programs=1, max_seq_len=600, device=cuda_like) == 4  # 256-position chunks
    assert choose_num_splits(num_programs=1, max_seq_len=100, device=cuda_like) == 1
    assert choose_num_splits(num_programs=1, max_seq_len=1 << 20, device=cuda_like, programs_per_sm=64) == 64


def test_decode_context_buckets_split_where_the_stages_change(monkeypatch):
    assert decode_context_buckets(4096) == (511, 4096)
    assert decode_context_buckets(512) == (511, 512)
    assert decode_context_buckets(208) == (208,)
    monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", 64)
    assert decode_context_buckets(208) == (63, 208)
    for always in (0, 1):  # 3 stages for every context: no bucket of contexts under one position (no graph of them)
        monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", always)
        assert decode_context_buckets(208) == (208,)
    monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", 2)
    assert decode_context_buckets(208) == (1, 208)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_fma_tiles_for_mha_match_naive(kernel_device, poison_allocations, num_splits):
    """One-row FMA tiles (MHA), chunks re-cut per sequence: 4 splits of >= 16 positions over contexts 1..45."""
    seq_lens = [1, 16, 17, 45, 33]
    batch = make_paged_batch([1] * 5, seq_lens, 3, 1, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=1, num_splits=num_splits, min_chunk=16, use_dot=False)
    out = paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                 out=nan_like(batch.query), config=config)
    assert_close(out, naive_paged_attention(batch, _scale()), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize(("heads_per_program", "head_major"), [(2, False), (4, False), (1, True), (2, True)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("variant", [None, "window", "softcap"])
def test_decode_with_several_kv_heads_a_program_matches_naive(kernel_device, poison_allocations, heads_per_program,
                                                             head_major, num_splits, group, variant):
    """``heads_per_program``: one program's pipelined loop walks the tiles of 2 or 4 KV heads (MHA one-row FMA tiles
    and GQA dot tiles), the softmax state restarting at each head; ``head_major``: the grid's first axis is the KV
    heads. Every head's output (or split-K partial) equals the float32 loop's, over contexts of 1 position to several
    tiles and splits; padding rows zeroed."""
    seq_lens = [1, 16, 17, 45, 33]
    window = 20 if variant == "window" else None
    cap = 0.5 if variant == "softcap" else None
    batch = make_paged_batch([1] * 5, seq_lens, 4, group, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device,
                             num_padded_tokens=7)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=2, num_splits=num_splits, min_chunk=16,
                          use_dot=group > 1, heads_per_program=heads_per_program, head_major=head_major)
    out = paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                 out=nan_like(batch.query), config=config, sliding_window=window, softcap=cap)
    assert_close(out[:5], naive_paged_attention(batch, _scale(), window, cap)[:5], torch.float32)
    assert (out[5:] == 0).all(), "padding rows must be zeroed"


@pytest.mark.interpreter
@pytest.mark.parametrize("heads_per_program", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("variant", [None, "window+softcap"])
def test_decode_head_major_grid_is_bitwise_the_seq_major_grid(kernel_device, poison_allocations, heads_per_program,
                                                              num_splits, group, variant):
    """``head_major`` only reorders the grid: every program (sequence, KV heads, split) computes the same values, so
    outputs, split-K partials merged by the reduce kernel (which indexes them by ``b * num_q_heads + h``), prefill
    rows of a mixed batch left to the prefill kernel, and zeroed padding rows are bit for bit the seq-major grid's."""
    query_lens, seq_lens = [1, 1, 7, 1, 1, 1], [1, 16, 7, 45, 33, 17]
    batch = make_paged_batch(query_lens, seq_lens, 4, group, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device,
                             num_padded_tokens=16)
    kw = {"sliding_window": 20, "softcap": 0.5} if variant else {}
    outs = []
    for head_major in (False, True):
        config = DecodeConfig(block_n=16, num_warps=4, num_stages=2, num_splits=num_splits, min_chunk=16,
                              use_dot=group > 1, heads_per_program=heads_per_program, head_major=head_major)
        outs.append(PAGED_ATTENTION.triton(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                           out=nan_like(batch.query), decode_config=config, **kw))
    assert torch.equal(outs[0], outs[1])
    n = batch.meta.num_actual_tokens
    assert_close(outs[1][:n], naive_paged_attention(batch, _scale(), kw.get("sliding_window"), kw.get("softcap"))[:n],
                 torch.float32)
    assert (outs[1][n:] == 0).all(), "padding rows must be zeroed"


@pytest.mark.interpreter
@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_decode_several_heads_a_program_keeps_heads_independent(kernel_device, heads_per_program):
    """A non-finite value in one KV head's cache (a position the sequence reads) poisons that head's query heads
    only, as in the reference: the next head walked by the same program restarts its softmax state from scratch."""
    batch = make_paged_batch([1, 1], [20, 20], 2, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    batch.value_cache[batch.block_tables[0][0], 3, 0, 5] = float("nan")  # sequence 0, position 3, KV head 0
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=1, min_chunk=16, heads_per_program=heads_per_program)
    out = paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                 out=nan_like(batch.query), config=config)
    expected = naive_paged_attention(batch, _scale())
    assert torch.isnan(out[0, :2]).any() and torch.isnan(expected[0, :2]).any()
    assert_close(out[0, 2:], expected[0, 2:], torch.float32)  # KV head 1 of sequence 0
    assert_close(out[1], expected[1], torch.float32)


def test_decode_config_is_checked():
    batch = make_paged_batch([1], [9], 1, 2, HEAD_DIM, 8, torch.float32, torch.device("cpu"))
    for bad, fragment in [(DecodeConfig(use_dot=False), "FMA tiles are one row"),
                          (DecodeConfig(block_n=24), "block_n=24"),
                          (DecodeConfig(block_n=32, min_chunk=48), "min_chunk=48"),
                          (DecodeConfig(num_splits=65), "num_splits=65"),
                          (DecodeConfig(heads_per_program=3), "heads_per_program=3"),
                          (DecodeConfig(heads_per_program=4), "dividing the 1 KV heads")]:
        with pytest.raises(KernelArgumentError, match=fragment):
            paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(), config=bad)


def test_head_major_grid_is_refused_beyond_the_grid_bound(monkeypatch):
    """The head-major grid puts the sequences on a grid dimension CUDA bounds (65535): more are refused."""
    monkeypatch.setattr(attention_decode, "MAX_GRID_YZ", 2)
    batch = make_paged_batch([1] * 3, [9] * 3, 1, 2, HEAD_DIM, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(KernelArgumentError, match="head_major=True with 3 sequences"):
        paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                               config=DecodeConfig(head_major=True))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hkv{h[0]}g{h[1]}")
def test_prefill_kernel_mixed_batch_matches_naive(kernel_device, triton_kernels, heads, dtype):
    num_kv_heads, group = heads
    query_lens = [q for q, _ in MIXED]
    seq_lens = [s for _, s in MIXED]
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_kv_heads,
        group,
        HEAD_DIM,
        BLOCK_SIZE,
        dtype,
        kernel_device,
        num_padded_tokens=sum(query_lens) + 3,
    )
    out = triton_kernels.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(), out=nan_like(batch.query)
    )
    n = batch.meta.num_actual_tokens
    assert_close(out[:n], naive_paged_attention(batch, _scale())[:n], dtype)
    assert (out[n:] == 0).all(), "padding rows must be zeroed"


@pytest.mark.interpreter
def test_prefill_kernel_strided_query_and_head_dim_not_power_of_two(kernel_device, triton_kernels):
    # The query is a view into a fused qkv output (row stride > Hq * D); D = 24 is padded to 32 in-kernel.
    head_dim, num_kv_heads, group = 24, 2, 2
    batch = make_paged_batch([6, 1], [11, 9], num_kv_heads, group, head_dim, 4, torch.float32, kernel_device)
    qkv = torch.randn(batch.query.shape[0], (num_kv_heads * group + 2 * num_kv_heads) * head_dim, device=kernel_device)
    query = qkv[:, : num_kv_heads * group * head_dim].view(-1, num_kv_heads * group, head_dim)
    batch.query = query
    out = triton_kernels.paged_attention(query, batch.key_cache, batch.value_cache, batch.meta, head_dim**-0.5)
    assert_close(out, naive_paged_attention(batch, head_dim**-0.5), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_prefill_then_decode_matches_dense_causal_attention(kernel_device, triton_kernels, dtype):
    """Through the Triton ops: write K/V chunk by chunk, attend, compare with dense SDPA over the whole sequence."""
    device = kernel_device
    num_kv_heads, group, total = 2, 4, 23
    chunks = [8, 9, 4, 1, 1]  # chunked prefill of 21 tokens, then two decode steps
    q_all = torch.randn(total, num_kv_heads * group, HEAD_DIM, device=device).to(dtype)
    k_all = torch.randn(total, num_kv_heads, HEAD_DIM, device=device).to(dtype)
    v_all = torch.randn(total, num_kv_heads, HEAD_DIM, device=device).to(dtype)
    table = [5, 0, 3, 7]  # 4 blocks of 8 positions, out of order
    key_cache = torch.zeros(8, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    outputs, done = [], 0
    for n in chunks:
        meta = AttentionMetadata.build([n], [done + n], [table], BLOCK_SIZE, device)
        k, v = k_all[done : done + n], v_all[done : done + n]
        triton_kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        outputs.append(triton_kernels.paged_attention(q_all[done : done + n], key_cache, value_cache, meta, _scale()))
        done += n
    got = torch.cat(outputs)
    q = q_all.float().transpose(0, 1)  # [Hq, T, D]
    k = k_all.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = v_all.float().repeat_interleave(group, dim=1).transpose(0, 1)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=_scale()).transpose(0, 1)
    assert_close(got, dense, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hkv{h[0]}g{h[1]}")
def test_reference_matches_naive(heads, dtype):
    num_kv_heads, group = heads
    query_lens = [q for q, _ in MIXED] + [1, 1]
    seq_lens = [s for _, s in MIXED] + [BLOCK_SIZE + 1, 1]
    batch = make_paged_batch(
        query_lens, seq_lens, num_kv_heads, group, HEAD_DIM, BLOCK_SIZE, dtype, torch.device("cpu"), 70
    )
    out = paged_attention_ref(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(), out=nan_like(batch.query)
    )
    n = batch.meta.num_actual_tokens
    assert_close(out[:n], naive_paged_attention(batch, _scale())[:n], dtype, scale=0.5)
    assert (out[n:] == 0).all()


# (query_len, seq_len) for sliding windows: prefills longer than the window and than a 16-token tile,
# extends whose window starts inside the cached prefix, decode rows.
WINDOW_MIXED = [(1, 1), (20, 20), (33, 33), (5, 40), (9, 26), (1, 30), (1, 7)]
WINDOWS = [1, 5, 16]


@pytest.mark.interpreter
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window_prefill_kernel_matches_naive(kernel_device, triton_kernels, window, dtype):
    query_lens, seq_lens = [q for q, _ in WINDOW_MIXED], [s for _, s in WINDOW_MIXED]
    batch = make_paged_batch(query_lens, seq_lens, 1, 3, HEAD_DIM, BLOCK_SIZE, dtype, kernel_device,
                             num_padded_tokens=sum(query_lens) + 2)
    out = triton_kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                         out=nan_like(batch.query), sliding_window=window)
    n = batch.meta.num_actual_tokens
    expected = naive_paged_attention(batch, _scale(), window)
    assert_close(out[:n], expected[:n], dtype)
    assert (out[n:] == 0).all()
    assert not torch.allclose(expected[:n], naive_paged_attention(batch, _scale())[:n])  # the window matters


@pytest.mark.interpreter
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_decode_kernel_matches_naive(kernel_device, window, num_splits):
    seq_lens = [1, 4, 17, 40, 33]  # shorter than, equal to and longer than the window; splits before it stay empty
    batch = make_paged_batch([1] * 5, seq_lens, 2, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    out = paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                 out=nan_like(batch.query), num_splits=num_splits, sliding_window=window)
    assert_close(out, naive_paged_attention(batch, _scale(), window), torch.float32)


def _free_blocks_outside_window(batch, window: int) -> AttentionMetadata:
    """As the KV manager of a sliding-window model does: each block wholly before the first query's window
    (positions < seq_len - q_len - W + 1) is NaN-filled (freed: anything may be there) and its table entry
    points at a NaN-filled spare block (a stand-in for the placeholder, so a read shows up as NaN)."""
    used = {blk for table in batch.block_tables for blk in table}
    spare = next(b for b in range(batch.key_cache.shape[0]) if b not in used)
    tables = []
    for q_len, seq_len, table in zip(batch.query_lens, batch.seq_lens, batch.block_tables):
        dropped = max(0, seq_len - q_len - window + 1) // batch.block_size
        for blk in table[:dropped] + [spare]:
            batch.key_cache[blk] = float("nan")
            batch.value_cache[blk] = float("nan")
        tables.append([spare] * dropped + table[dropped:])
    return AttentionMetadata.build(batch.query_lens, batch.seq_lens, tables, batch.block_size,
                                   batch.key_cache.device, batch.meta.slot_mapping.shape[0])


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window_kernels_never_read_blocks_outside_the_window(kernel_device, window):
    """Mixed batch (prefill tiles + decode rows, split-K too) and the reference, with the blocks before each
    sequence's window freed: same output as with every block in place (a read would bring NaN)."""
    query_lens, seq_lens = [q for q, _ in WINDOW_MIXED], [s for _, s in WINDOW_MIXED]
    batch = make_paged_batch(query_lens, seq_lens, 1, 3, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    expected = naive_paged_attention(batch, _scale(), window)
    meta = _free_blocks_outside_window(batch, window)
    assert meta.block_tables.tolist() != batch.meta.block_tables.tolist()  # some block was freed
    for config in (None, DecodeConfig(block_n=16, num_warps=4, num_stages=1, num_splits=3, min_chunk=16)):
        out = PAGED_ATTENTION.triton(batch.query, batch.key_cache, batch.value_cache, meta, _scale(),
                                     sliding_window=window, decode_config=config)
        assert_close(out, expected, torch.float32)
    ref = paged_attention_ref(batch.query.cpu(), batch.key_cache.cpu(), batch.value_cache.cpu(),
                              AttentionMetadata.build(query_lens, seq_lens, meta.block_tables.tolist(), BLOCK_SIZE,
                                                      "cpu"), _scale(), sliding_window=window)
    assert_close(ref, expected, torch.float32)


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_reference_matches_naive(window):
    query_lens, seq_lens = [q for q, _ in WINDOW_MIXED], [s for _, s in WINDOW_MIXED]
    batch = make_paged_batch(query_lens, seq_lens, 1, 3, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    out = paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                              sliding_window=window)
    assert_close(out, naive_paged_attention(batch, _scale(), window), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 5])
def test_softcap_kernels_match_naive(kernel_device, triton_kernels, window):
    """Gemma 2's attention logit soft-capping (a small cap, so that it changes the result), prefill and decode."""
    cap = 0.5
    query_lens, seq_lens = [q for q, _ in WINDOW_MIXED], [s for _, s in WINDOW_MIXED]
    batch = make_paged_batch(query_lens, seq_lens, 1, 3, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    out = triton_kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                         sliding_window=window, softcap=cap)
    expected = naive_paged_attention(batch, _scale(), window, cap)
    assert_close(out, expected, torch.float32)
    assert not torch.allclose(expected, naive_paged_attention(batch, _scale(), window), atol=1e-3)
    assert_close(paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                     sliding_window=window, softcap=cap), expected, torch.float32)
    decode = make_paged_batch([1] * 4, [1, 9, 30, 17], 2, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    out = paged_decode_attention(decode.query, decode.key_cache, decode.value_cache, decode.meta, _scale(),
                                 num_splits=2, sliding_window=window, softcap=cap)
    assert_close(out, naive_paged_attention(decode, _scale(), window, cap), torch.float32)


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_bad_sliding_window_is_refused(window):
    batch = make_paged_batch([2], [4], 1, 1, HEAD_DIM, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(KernelArgumentError, match=f"sliding_window={window!r}"):
        paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(), sliding_window=window)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda b: setattr(b, "query", b.query.to(torch.int32)), "query.dtype"),
        (lambda b: setattr(b, "query", b.query[:, :3]), "not a multiple"),
        (lambda b: setattr(b, "value_cache", b.value_cache.half()), "value_cache.dtype"),
        (lambda b: setattr(b, "key_cache", b.key_cache[..., :8]), "key_cache.shape"),
    ],
)
def test_bad_arguments_raise_typed_errors(mutate, fragment):
    batch = make_paged_batch([2, 1], [4, 3], 2, 2, HEAD_DIM, 4, torch.float32, torch.device("cpu"))
    mutate(batch)
    with pytest.raises(KernelArgumentError, match=fragment):
        paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale())


def test_decode_kernel_rejects_prefill_metadata(kernel_device):
    batch = make_paged_batch([2], [4], 1, 1, HEAD_DIM, 4, torch.float32, kernel_device)
    with pytest.raises(KernelArgumentError, match="max_query_len=2"):
        paged_decode_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale())


def test_short_block_table_is_rejected():
    batch = make_paged_batch([1], [9], 1, 1, HEAD_DIM, 4, torch.float32, torch.device("cpu"))
    meta = batch.meta
    narrow = AttentionMetadata(
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables[:, :2].contiguous(),
        meta.slot_mapping,
        meta.max_query_len,
        meta.max_seq_len,
        meta.query_start_loc_host,
        meta.seq_lens_host,
    )
    with pytest.raises(KernelArgumentError, match="max_seq_len=9 exceeds"):
        paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, narrow, _scale())


@pytest.mark.interpreter
def test_prefill_kernel_alone_handles_decode_rows_too(kernel_device):
    """paged_prefill_attention (no decode kernel) over a mixed batch: 1-token rows go through prefill tiles."""
    query_lens, seq_lens = [q for q, _ in MIXED], [s for _, s in MIXED]
    batch = make_paged_batch(query_lens, seq_lens, 1, 3, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device)
    out = paged_prefill_attention(batch.query, batch.key_cache, batch.value_cache, batch.meta, _scale(),
                                  out=nan_like(batch.query))
    assert_close(out, naive_paged_attention(batch, _scale()), torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_graph_shaped_metadata_with_padding_sequences(kernel_device, num_splits):
    """As a CUDA graph captured for (T=40 tokens, B=8 sequences) replays a smaller mixed batch: the launch is
    sized by host lists of the capture shape (decode and prefill rows, max_seq_len 64) while the device
    tensors hold 5 real sequences (two prompt chunks, three decodes) plus 3 empty padding sequences
    (q_len 0) and padding tokens. Real rows match the float32 loop; the kernels touch nothing else."""
    query_lens, seq_lens = [1, 9, 1, 13, 1], [30, 9, 5, 20, 17]
    batch = make_paged_batch(query_lens, seq_lens, 2, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, kernel_device,
                             num_padded_tokens=40)
    real = batch.meta
    n = real.num_actual_tokens
    pad = 3
    qsl = torch.cat([real.query_start_loc, real.query_start_loc[-1:].repeat(pad)])
    seq_lens_dev = torch.cat([real.seq_lens, torch.ones(pad, dtype=torch.int32, device=kernel_device)])
    tables = torch.zeros(8, 8, dtype=torch.int32, device=kernel_device)  # 8 blocks x 8 = max_seq_len 64
    tables[:5, :real.block_tables.shape[1]] = real.block_tables
    capture_qsl = [0, 33] + list(range(34, 41))  # one 33-token chunk and 7 decodes: both kernels launched
    meta = AttentionMetadata(qsl, seq_lens_dev, tables, real.slot_mapping, max_query_len=33, max_seq_len=64,
                             query_start_loc_host=capture_qsl, seq_lens_host=[64] * 8)
    out = nan_like(batch.query)
    config = DecodeConfig(block_n=16, num_warps=4, num_stages=1, num_splits=num_splits, min_chunk=16)
    PAGED_ATTENTION.triton(batch.query, batch.key_cache, batch.value_cache, meta, _scale(), out=out,
                           decode_config=config)
    assert_close(out[:n], naive_paged_attention(batch, _scale())[:n], torch.float32)
    assert torch.isnan(out[n:]).all(), "padding tokens belong to no sequence: no kernel writes them"
