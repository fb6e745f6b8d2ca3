"""Persistent decode attention, as an experiment (issue 16): one pipelined loop over a program's K/V tiles.

The engine's decode kernel (``attention_decode._paged_decode_kernel``) runs one program per (sequence, KV head); at
batch 32 x 32 heads x contexts 128-192 each program reads 2-3 tiles of 64 positions, and the kernel reads the KV at
~0.74-0.77 of the copy bandwidth whatever its tile (RESULTS.md sessions 18 and 21). Hypothesis: a program's
startup (q, its block table, the first tiles' latency) and the last wave's tail cost what is left. Here a fixed
grid of ``P`` programs (a few per SM) each walks a list of (sequence, KV head, tile) work items in one software-
pipelined loop, so the next item's first K/V tiles are in flight while the current item finishes; the online softmax
state resets at an item's first tile and the output is stored at its last (masked, no branches). The host builds
the lists (whole items per program, cut where the running tile count crosses ``p * total / P``).

A stream-K variant (``--streamk``) makes the lists unnecessary: each program finds its range of the batch's tiles
from ``seq_lens`` on the device (equal tile counts, an item cut where a range ends), walks it in the same loop, and
leaves a cut item's partial softmax state in a workspace; the program that completes an item merges them.

For each case: the engine kernel's default config (and with two heads a program, ``DecodeConfig.heads_per_program``),
the persistent kernel at several ``P`` / stages / tiles / tile bodies (``--bodies``) and the stream-K kernel, each
checked against the engine kernel's output (bf16 tolerance) and timed by CUDA-graph replay over rotating caches
(``bench_attention``'s timer); µs per call and the fraction of the copy bandwidth. Usage (CUDA)::

    python benchmarks/diag_persistent_decode.py [--cases 32x128,32x160,32x192,128x160] [--streamk 2,4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import GraphTimer, _shuffled_tables, copy_bandwidth_gbs, rotation_layers  # noqa: E402

from loraplex.kernels._triton import dot_dtype, dot_precision, num_sms, tl, triton  # noqa: E402
from loraplex.kernels.attention_common import attend_kv_tile  # noqa: E402
from loraplex.kernels.attention_decode import paged_decode_attention, resolve_decode_config  # noqa: E402
from loraplex.kernels.attention_metadata import AttentionMetadata  # noqa: E402


@triton.jit
def _attend_top(q, m_i, l_i, acc, k_ptr, v_ptr, head_off, bt_row, pos, p_mask, d, qk_scale, stride_kb, stride_ks,
                PAGE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Fold the positions ``pos`` (``p_mask``: in the sequence) of one K/V tile into the rows' base-2 online softmax
    ``(m_i, l_i, acc)`` (:mod:`loraplex.kernels.attention_common`'s semantics), K and V both loaded at the top;
    ``head_off``: the KV head's offset in a cache row, ``bt_row``: the sequence's block table row."""
    blk = tl.load(bt_row + pos // PAGE, mask=p_mask, other=0).to(tl.int64)
    row = blk * stride_kb + (pos % PAGE).to(tl.int64) * stride_ks + head_off
    k = tl.load(k_ptr + row[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=p_mask[:, None], other=0.0)
    s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale
    s = tl.where(p_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    pe = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pe, 1)
    acc = acc * alpha[:, None] + tl.dot(pe.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _persistent_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, item_ptr, tile_ptr, count_ptr, out_ptr, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_bt, num_kv_heads, max_iters,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SHARED_BODY: tl.constexpr = False,
):
    # program p: work items i < count[p]; item[p, i] = b * Hkv + kvh; tile[p, i] = t << 10 | valid << 2 | first << 1
    # | last (positions t * BLOCK_N + [0, valid)). m/l/acc: base-2 online softmax over the item's positions.
    p = tl.program_id(0)
    n = tl.load(count_ptr + p)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for it in tl.range(0, n, num_stages=NUM_STAGES):
        item = tl.load(item_ptr + p * max_iters + it)
        word = tl.load(tile_ptr + p * max_iters + it)
        b = item // num_kv_heads
        kvh = item % num_kv_heads
        first = (word >> 1) & 1
        last = word & 1
        valid = (word >> 2) & 255
        pos = (word >> 10) * BLOCK_N + tl.arange(0, BLOCK_N)
        p_mask = tl.arange(0, BLOCK_N) < valid
        heads = kvh * GROUP + g
        q_mask = g[:, None] < GROUP
        q = tl.load(q_ptr + b * (num_kv_heads * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=q_mask, other=0.0)
        m_i = tl.where(first == 1, float("-inf"), m_i)
        l_i = tl.where(first == 1, 0.0, l_i)
        acc = tl.where(first == 1, 0.0, acc)
        if SHARED_BODY:  # the engine kernels' tile body (V loaded after the softmax in program order)
            m_i, l_i, acc = attend_kv_tile(
                q.to(DOT_DTYPE), g, m_i, l_i, acc, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_kh,
                bt_ptr + b * stride_bt, (word >> 10) * BLOCK_N, (word >> 10) * BLOCK_N + valid, stride_kb, stride_ks,
                stride_kb, stride_ks, qk_scale, 0.0, 0, PAGE, HEAD_DIM, HEAD_DIM, BLOCK_N, DOT_DTYPE, PRECISION, True,
                False, False, False)
        else:  # K and V both loaded at the top
            m_i, l_i, acc = _attend_top(q, m_i, l_i, acc, k_ptr, v_ptr, kvh * stride_kh, bt_ptr + b * stride_bt, pos,
                                        p_mask, d, qk_scale, stride_kb, stride_ks, PAGE, DOT_DTYPE, PRECISION)
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * (num_kv_heads * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask & ((g[:, None] * 0 + last) > 0))


@triton.jit
def _locate(it, bb, lens, n_seq, cum, num_kv_heads):
    """(b, h, t, tiles of the item, its first global tile, the sequence's length) of global tile ``it``: items are
    (sequence b, KV head h), heads fastest, each ``cdiv(seq_len, BLOCK_N)`` tiles; ``cum`` is the inclusive prefix
    sum of the sequences' tiles (``n_seq * num_kv_heads``), so sequences of no tile are skipped."""
    b = tl.sum((cum <= it).to(tl.int32), 0)
    here = bb == b
    n_b = tl.maximum(tl.sum(tl.where(here, n_seq, 0), 0), 1)
    seq_first = tl.sum(tl.where(here, cum - n_seq * num_kv_heads, 0), 0)
    h = (it - seq_first) // n_b
    return b, h, it - seq_first - h * n_b, n_b, seq_first + h * n_b, tl.sum(tl.where(here, lens, 0), 0)


@triton.jit
def _streamk_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, counter_ptr, qk_scale, num_seqs,
    stride_kb, stride_ks, stride_kh, stride_bt, num_kv_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    # Stream-K over the decode batch's K/V tiles (Osama et al., PPoPP 2023, applied to attention as in "Lean
    # Attention", Sanovar et al. 2024): the global tiles (sequence, KV head, tile), heads fastest, are split into P
    # equal contiguous ranges on the device (from seq_lens; no host lists), one per program, walked in one
    # pipelined loop (the softmax state restarts at an item's first tile; stores masked, no branch). An item wholly
    # inside a range is stored at its last tile; one cut by a range boundary leaves a partial (m, l, acc) in
    # workspace slot (p, 0) (the range's first segment) or (p, 1) (its last), and the program
    # that completes the item's tiles (a counter per item) merges its partials in program order:
    # out = sum_q 2^(m_q - m) acc_q / sum_q 2^(m_q - m) l_q, m = max_q m_q (base-2 log-sum-exp).
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    bb = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + bb, mask=bb < num_seqs, other=0)
    n_seq = tl.cdiv(lens, BLOCK_N)
    cum = tl.cumsum(n_seq * num_kv_heads, 0)
    total = tl.sum(n_seq * num_kv_heads, 0).to(tl.int64)
    start = (p * total // programs).to(tl.int32)
    end = ((p + 1) * total // programs).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    q_mask = g[:, None] < GROUP
    part = (g[:, None] * HEAD_DIM + d[None, :])  # a partial's acc within its slot; m and l: [2, BLOCK_G]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for it in tl.range(start, end, num_stages=NUM_STAGES):
        b, h, t, n_b, item_first, seq_len = _locate(it, bb, lens, n_seq, cum, num_kv_heads)
        pos = t * BLOCK_N + n
        p_mask = pos < seq_len
        heads = h * GROUP + g
        q = tl.load(q_ptr + b * (num_kv_heads * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=q_mask, other=0.0)
        m_i = tl.where(t == 0, float("-inf"), m_i)  # (the range's first tile starts from the initial state)
        l_i = tl.where(t == 0, 0.0, l_i)
        acc = tl.where(t == 0, 0.0, acc)
        m_i, l_i, acc = _attend_top(q, m_i, l_i, acc, k_ptr, v_ptr, h * stride_kh, bt_ptr + b * stride_bt, pos,
                                    p_mask, d, qk_scale, stride_kb, stride_ks, PAGE, DOT_DTYPE, PRECISION)
        ends = (g * 0 + t) == n_b - 1  # the item's last tile, as a row vector (masks below)
        whole = ends & ((g * 0 + item_first) >= start)
        tl.store(out_ptr + b * (num_kv_heads * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask & whole[:, None])
        cut = ends & ((g * 0 + item_first) < start)  # the range's first item ends here, begun in an earlier range
        slot = (p * 2).to(tl.int64)
        tl.store(ws_acc_ptr + slot * (BLOCK_G * HEAD_DIM) + part, acc, mask=cut[:, None])
        tl.store(ws_ml_ptr + slot * (2 * BLOCK_G) + g, m_i, mask=cut)
        tl.store(ws_ml_ptr + slot * (2 * BLOCK_G) + BLOCK_G + g, l_i, mask=cut)
    if start < end:
        b0, h0, t0, n0, first0, _len0 = _locate(start, bb, lens, n_seq, cum, num_kv_heads)
        b1, h1, t1, n1, first1, _len1 = _locate(end - 1, bb, lens, n_seq, cum, num_kv_heads)
        if t1 != n1 - 1:  # the range's last item goes on in the next range: its partial, slot 0 if begun here
            slot = (p * 2 + tl.where(first1 <= start, 0, 1)).to(tl.int64)
            tl.store(ws_acc_ptr + slot * (BLOCK_G * HEAD_DIM) + part, acc)
            tl.store(ws_ml_ptr + slot * (2 * BLOCK_G) + g, m_i)
            tl.store(ws_ml_ptr + slot * (2 * BLOCK_G) + BLOCK_G + g, l_i)
        tl.debug_barrier()  # every thread's partials stored before the counters say so (the atomics release them)
        for which in tl.static_range(2):
            # which 0: the first item, cut at the range's start and ended in it; 1: the last item, not ended
            if which == 0:
                has = (first0 < start) & (first0 + n0 - 1 <= end - 1)
                item, item_first, n_item, count = b0 * num_kv_heads + h0, first0, n0, first0 + n0 - start
                b_o, h_o = b0, h0
            else:
                has = t1 != n1 - 1
                item, item_first, n_item = b1 * num_kv_heads + h1, first1, n1
                count = end - tl.maximum(first1, start)
                b_o, h_o = b1, h1
            if has:
                if tl.atomic_add(counter_ptr + item, count, sem="acq_rel", scope="gpu") + count == n_item:
                    q_first = ((item_first + 1).to(tl.int64) * programs - 1) // total
                    q_last = ((item_first + n_item).to(tl.int64) * programs - 1) // total
                    m_o = tl.full([BLOCK_G], float("-inf"), tl.float32)
                    l_o = tl.zeros([BLOCK_G], tl.float32)
                    acc_o = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
                    for qp in range(q_first, q_last + 1):
                        q_start = qp * total // programs
                        # an empty range left no partial (a row vector, as the loads' masks)
                        filled = (g * 0 + q_start) < (qp + 1) * total // programs
                        q_slot = qp * 2 + tl.where(q_start >= item_first, 0, 1)
                        m_q = tl.load(ws_ml_ptr + q_slot * (2 * BLOCK_G) + g, mask=filled, other=float("-inf"),
                                      cache_modifier=".cg")
                        l_q = tl.load(ws_ml_ptr + q_slot * (2 * BLOCK_G) + BLOCK_G + g, mask=filled, other=0.0,
                                      cache_modifier=".cg")
                        acc_q = tl.load(ws_acc_ptr + q_slot * (BLOCK_G * HEAD_DIM) + part, mask=filled[:, None],
                                        other=0.0, cache_modifier=".cg")
                        m_new = tl.maximum(m_o, m_q)
                        a_o = tl.exp2(m_o - m_new)
                        a_q = tl.where(m_q == float("-inf"), 0.0, tl.exp2(m_q - m_new))
                        l_o = l_o * a_o + l_q * a_q
                        acc_o = acc_o * a_o[:, None] + acc_q * a_q[:, None]
                        m_o = m_new
                    heads_o = h_o * GROUP + g
                    tl.store(out_ptr + b_o * (num_kv_heads * GROUP * HEAD_DIM) + heads_o[:, None] * HEAD_DIM
                             + d[None, :], (acc_o / l_o[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
                    tl.atomic_xchg(counter_ptr + item, 0, sem="relaxed", scope="gpu")  # zero for the next launch


def streamk_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, out: torch.Tensor, programs: int, block_n: int,
                   stages: int, counters: torch.Tensor, num_warps: int = 4) -> torch.Tensor:
    """Decode attention of every sequence (one query token each: ``query`` ``[B, Hq, D]``, ``seq_lens`` ``[B]``
    int32 positions, 0 for none) over paged ``k_cache``/``v_cache`` ``[blocks, page, Hkv, D]`` by
    :func:`_streamk_decode_kernel` on ``programs`` programs, into ``out`` ``[B, Hq, D]``; ``counters``: at least
    ``B * Hkv`` int32 zeros (zero again after). Diag only: no sliding window, soft cap or mixed batch; D a power of
    two."""
    num_seqs, heads, dim = query.shape
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    group = heads // hkv
    block_g = max(16, group)
    ws_acc = torch.empty(programs * 2 * block_g * dim, dtype=torch.float32, device=query.device)
    ws_ml = torch.empty(programs * 2 * 2 * block_g, dtype=torch.float32, device=query.device)
    _streamk_decode_kernel[(programs,)](
        query, k_cache, v_cache, block_tables, seq_lens, out, ws_acc, ws_ml, counters, scale * 1.4426950408889634,
        num_seqs, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), hkv,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n,
        BLOCK_B=max(16, 1 << (num_seqs - 1).bit_length()), NUM_STAGES=stages,
        DOT_DTYPE=dot_dtype(query.dtype, query.device), PRECISION=dot_precision(query.dtype, query.device),
        num_warps=num_warps)
    return out


def work_lists(seq_lens: list[int], num_kv_heads: int, programs: int, block_n: int, device: torch.device):
    """(item [P, I], tile [P, I], count [P]) int32: whole items per program, cut at ``p * total / P`` tiles."""
    items = [(b, h) for b in range(len(seq_lens)) for h in range(num_kv_heads)]
    tiles_of = [-(-seq_lens[b] // block_n) for b, _ in items]
    total = sum(tiles_of)
    lists: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    done = 0
    for (b, h), n in zip(items, tiles_of):
        p = min(programs - 1, done * programs // total)
        for t in range(n):
            valid = min(block_n, seq_lens[b] - t * block_n)
            lists[p].append((b * num_kv_heads + h, t << 10 | valid << 2 | (t == 0) << 1 | (t == n - 1)))
        done += n
    width = max(len(x) for x in lists)
    item = torch.zeros(programs, width, dtype=torch.int32)
    tile = torch.zeros(programs, width, dtype=torch.int32)
    for p, entries in enumerate(lists):
        for i, (a, w) in enumerate(entries):
            item[p, i], tile[p, i] = a, w
    count = torch.tensor([len(x) for x in lists], dtype=torch.int32)
    return item.to(device), tile.to(device), count.to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="32x128,32x160,32x192,128x160",
                    help="batch x context (Llama-2-7B heads: 32 x 128, MHA)")
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--programs-per-sm", default="2,3,4,6")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--tiles", default="32,64")
    ap.add_argument("--bodies", default="top",
                    help="top: K and V loaded at the top of the iteration; shared: the engine kernels' tile body "
                         "(attention_common.attend_kv_tile)")
    ap.add_argument("--streamk", default="2,4",
                    help="programs per SM of the stream-K kernel (device-side ranges of equal tile counts), swept "
                         "with --tiles and --stages; empty: none")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = GraphTimer()
    copy_gbs = copy_bandwidth_gbs(1 << 30, dev, timer)
    report = {"copy_GBps": copy_gbs, "rows": []}
    print(json.dumps(report), flush=True)
    heads, hkv, dim, page = 32, args.kv_heads, 128, 16
    group = heads // hkv
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        blocks_per_seq = -(-context // page)
        num_blocks = batch * blocks_per_seq
        kv_bytes = 2 * batch * context * hkv * dim * 2
        layers = rotation_layers(kv_bytes, 256 << 20, 256, 16 << 30)
        shape = (layers * num_blocks, page, hkv, dim)
        k_cache = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
        v_cache = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
        tables = _shuffled_tables(batch, blocks_per_seq)
        seq_lens = [context] * batch
        meta = AttentionMetadata.build([1] * batch, seq_lens, tables, page, dev)
        bt = torch.tensor(tables, dtype=torch.int32, device=dev)
        query = torch.randn(batch, heads, dim, device=dev).to(torch.bfloat16)
        scale = dim ** -0.5
        out = torch.empty_like(query)
        expected = paged_decode_attention(query, k_cache[:num_blocks], v_cache[:num_blocks], meta, scale).float()

        default = resolve_decode_config(query, k_cache, meta, None, None)

        def engine(layer: int, config=default) -> None:
            lo = layer * num_blocks
            paged_decode_attention(query, k_cache[lo:lo + num_blocks], v_cache[lo:lo + num_blocks], meta, scale,
                                   out=out, config=config)

        rows = {"engine": timer([lambda i=i: engine(i) for i in range(layers)])}
        if default.num_splits == 1 and hkv % 2 == 0:  # the engine kernel walking two heads a program
            two = replace(default, heads_per_program=2)
            rows["engine, 2 heads a program"] = timer([lambda i=i: engine(i, two) for i in range(layers)])
        for block_n in (int(x) for x in args.tiles.split(",")):
            for per_sm in (int(x) for x in args.programs_per_sm.split(",")):
                programs = per_sm * num_sms(dev)
                item, tile, count = work_lists(seq_lens, hkv, programs, block_n, dev)
                for stages, body in ((int(x), b) for x in args.stages.split(",") for b in args.bodies.split(",")):
                    def persistent(layer: int, stages=stages, block_n=block_n, programs=programs, item=item,
                                   tile=tile, count=count, body=body) -> None:
                        kc = k_cache[layer * num_blocks:(layer + 1) * num_blocks]
                        vc = v_cache[layer * num_blocks:(layer + 1) * num_blocks]
                        _persistent_decode_kernel[(programs,)](
                            query, kc, vc, bt, item, tile, count, out, scale * 1.4426950408889634,
                            kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0), hkv, item.shape[1],
                            GROUP=group, BLOCK_G=max(16, group), HEAD_DIM=dim, PAGE=page, BLOCK_N=block_n,
                            NUM_STAGES=stages, DOT_DTYPE=dot_dtype(query.dtype, dev),
                            PRECISION=dot_precision(query.dtype, dev), SHARED_BODY=body == "shared", num_warps=4)

                    key = f"persistent n{block_n} P={per_sm}/SM s{stages}" + (" shared" if body == "shared" else "")
                    try:
                        out.fill_(float("nan"))
                        persistent(0)
                        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
                    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
                        rows[key] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
                        continue
                    rows[key] = timer([lambda i=i, f=persistent: f(i) for i in range(layers)])
        lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        counters = torch.zeros(batch * hkv, dtype=torch.int32, device=dev)
        for block_n in (int(x) for x in args.tiles.split(",")):
            for per_sm in (int(x) for x in args.streamk.split(",") if x):
                for stages in (int(x) for x in args.stages.split(",")):
                    def streamk(layer: int, block_n=block_n, programs=per_sm * num_sms(dev), stages=stages) -> None:
                        streamk_decode(query, k_cache[layer * num_blocks:(layer + 1) * num_blocks],
                                       v_cache[layer * num_blocks:(layer + 1) * num_blocks], bt, lens_t, scale, out,
                                       programs, block_n, stages, counters)

                    key = f"streamk n{block_n} P={per_sm}/SM s{stages}"
                    try:
                        out.fill_(float("nan"))
                        streamk(0)
                        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
                        assert counters.count_nonzero().item() == 0
                    except Exception as exc:  # noqa: BLE001 - reported, the sweep goes on
                        rows[key] = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
                        counters.zero_()  # for the next variant
                        continue
                    rows[key] = timer([lambda i=i, f=streamk: f(i) for i in range(layers)])
        line = {"batch": batch, "context": context, "kv_mib": kv_bytes / (1 << 20),
                "floor_us": kv_bytes / (copy_gbs * 1e3),
                "us": {k: round(v, 2) if isinstance(v, float) else v for k, v in rows.items()}}
        best = min((v, k) for k, v in rows.items() if isinstance(v, float))
        line["best"] = [best[1], round(best[0], 2), round(line["floor_us"] / best[0], 3)]
        line["engine_frac"] = round(line["floor_us"] / rows["engine"], 3)
        report["rows"].append(line)
        print(json.dumps(line), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
