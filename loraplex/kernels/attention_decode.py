"""Paged decode attention: the sequences of a batch that have one query token this step.

Semantics: :data:`~loraplex.kernels.attention.PAGED_ATTENTION` with ``p = seq_lens[b] - 1`` for every sequence b
with ``q_len[b] == 1`` (with a sliding window of W tokens, positions before ``seq_lens[b] - W`` are skipped);
rows of the other sequences are left untouched (the prefill kernel writes them in a mixed batch).

Design (after FlashDecoding, Dao et al. 2023, and vLLM's Triton decode attention):

- One program per (sequence, KV head, split). All ``G`` query heads that share a KV head are one tile of
  ``max(16, G)`` rows, so each K/V position is read once per KV head (GQA); with ``G == 1`` (MHA) the tile
  is one row and the products are FMA reductions instead of a 16-row ``tl.dot``.
- The K/V gather and online softmax are :func:`~loraplex.kernels.attention_common.attend_kv_range`, shared
  with the prefill kernel; a tile of ``block_n`` positions spans whole KV blocks (``block_n`` is a multiple of
  the block size, or divides it).
- ``heads_per_program`` k > 1 (off by default: RESULTS.md session 29 measured at most 2.5% at batch 32 and a 6-7%
  loss at batch 128 for k = 2): one program per (sequence, k KV heads, split) walks the k heads' tiles in one
  software-pipelined loop of :func:`~loraplex.kernels.attention_common.attend_kv_tile` (the range's step), the
  softmax state restarting at each head's first tile and its output stored masked at its last.
- ``head_major`` (the default for MHA): the grid's fastest axis is the KV head, so the programs that run at once
  read whole K/V rows of the same positions (all heads of a position are contiguous in the cache).
- Split-K: ``num_splits`` programs share a sequence's context. Each sequence cuts *its own* context into
  chunks of ``max(min_chunk, cdiv(seq_len, num_splits))`` positions (rounded up to ``block_n``), so the grid
  is fixed by the batch size alone (CUDA graphs capture it once) while short contexts use fewer, fuller
  programs. A sequence whose context fits one chunk writes its output directly; otherwise each chunk writes
  a normalised partial and its log-sum-exp and a reduce kernel merges them.
- Configs (``block_n``, warps, pipeline stages, splits) come from :func:`decode_config`, a small shape-keyed
  heuristic; ``benchmarks/bench_attention.py --configs sweep`` times the alternatives on a GPU.

Configs on CUDA (from a sweep on an H200, ``benchmarks/bench_attention.py --configs sweep``, RESULTS.md session 18:
7 tiles x split targets x chunk floors over Llama-2-7B and Llama-3-8B heads, contexts 128-4096, batch 1-128; the
rule below is within 0.8 µs or 6% of each grid point's best):

=====================  =======  =====  ===================================  ==========================================
D x bytes <= 256       block_n  warps  stages                               splits
(bf16/fp16 D <= 128)
=====================  =======  =====  ===================================  ==========================================
as above               64       4      3 (2 where max_seq_len < 512: short  a power of 2 reaching 2 programs / SM
                                       contexts lose 6-9% to the third      (B x Hkv x splits >= 2 x SMs), at most the
                                       stage, long ones gain 3-7% from it)  power of 2 >= cdiv(max_seq_len,
                                                                            min_chunk); min_chunk one tile where
                                                                            B x Hkv < SMs / 4 (32 KV heads: batch 1;
                                                                            8: up to batch 4), else 4 tiles
D x bytes > 256        16*      4      2                                    (not swept) reaching 4 programs / SM,
                                                                            min_chunk 128
=====================  =======  =====  ===================================  ==========================================

(* or the KV block size, if larger, up to 64.) Every tile is ``max(16, G)`` query-head rows on ``tl.dot``, MHA
too. On the CPU interpreter tiles are 16 positions, one stage, and
MHA uses one-row FMA tiles (kept for that: on an H200 they read Llama-2-7B's KV at only ~1.3 TB/s, half of
what the dot tiles reach, so CUDA uses dot tiles for MHA too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loraplex.kernels._attention_checks import check_attention_args, check_attention_layout, prepare_out
from loraplex.kernels._triton import (cdiv, dot_dtype, dot_precision, next_pow2, num_sms, pdl_args,
                                      pdl_kv_prefetch_positions, pdl_prefetch, pdl_trigger, pdl_wait, require_triton,
                                      tl, triton)
from loraplex.kernels.attention_common import attend_kv_range, attend_kv_tile
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError

_OP = "paged_decode_attention"
_LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MAX_HEADS_PER_PROGRAM = 1
"""The most KV heads :func:`decode_config` gives one program (``DecodeConfig.heads_per_program``) on CUDA, where a
batch without split-K keeps at least :data:`HEADS_MIN_PROGRAMS_PER_SM` programs per SM; 1: one head each."""
HEADS_MIN_PROGRAMS_PER_SM = 3
MAX_GRID_YZ = 65535
"""CUDA's bound on a grid's second and third dimensions: the sequences of a head-major launch."""
HEAD_MAJOR: bool | None = None
"""``DecodeConfig.head_major`` of :func:`decode_config`'s CUDA configs; None: for MHA (one query head per KV head)
only. Measured on an H200 (RESULTS.md, session 30): Llama-2-7B decode steps 0.3-0.5% faster at batch 32 and 0.7-1.0%
at batch 128 in three A/B pairs; Llama-3-8B's GQA heads 2-3% slower at contexts 128-192 and batch 128 in the kernel
benchmark (not measured in the engine)."""
THREE_STAGES_FROM = 512
"""The ``max_seq_len`` (positions) from which :func:`decode_config`'s CUDA configs of up to 256 bytes a head row take
3 pipeline stages instead of 2."""


def decode_context_buckets(max_seq_len: int) -> tuple[int, ...]:
    """The ``max_seq_len`` values (ascending, the last ``max_seq_len``) at which :func:`decode_config`'s CUDA
    pick for contexts of up to ``max_seq_len`` positions changes: a CUDA graph captured for each, and replayed for
    the smallest holding the step's longest context, runs the pick of that context's bucket.

    Measured on an H200 (RESULTS.md, session 30; Llama-2-7B heads, context 160): 2 pipeline stages take 93 µs at
    batch 128 and 173 µs at 256, 3 stages 103 and 192 µs; at context 1024, 3 stages win at batch 32-128.
    A :data:`THREE_STAGES_FROM` of 1 or less (3 stages for every context) gives one bucket: a decode context holds
    at least one position."""
    if 1 < THREE_STAGES_FROM <= max_seq_len:
        return (THREE_STAGES_FROM - 1, max_seq_len)
    return (max_seq_len,)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the decode kernel.

    ``block_n``: KV positions per inner-loop tile; ``num_warps``; ``num_stages``: software-pipeline depth of
    the K/V loads; ``num_splits``: split-K programs per (sequence, KV head), 1..64; ``min_chunk``: fewest
    positions of context a split gets (a multiple of ``block_n``); ``use_dot``: ``tl.dot`` (16-row tiles)
    or FMA reductions (one-row tiles, MHA only); ``heads_per_program``: KV heads one program walks in a single
    software-pipelined loop over their tiles (the next head's first K/V tiles in flight while one head ends).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1
    min_chunk: int = 256
    use_dot: bool = True
    heads_per_program: int = 1
    head_major: bool = False

    def label(self) -> str:
        """Short name for benchmark tables, e.g. ``n64 w4 s2 k8 c256 dot`` (``h2``: two KV heads a program)."""
        return (f"n{self.block_n} w{self.num_warps} s{self.num_stages} k{self.num_splits} c{self.min_chunk} "
                f"{'dot' if self.use_dot else 'fma'}" + (f" h{self.heads_per_program}"
                                                         if self.heads_per_program > 1 else "")
                + (" hm" if self.head_major else ""))


def choose_num_splits(num_programs: int, max_seq_len: int, device: torch.device, *,
                      programs_per_sm: int = 4, min_chunk: int = 256) -> int:
    """Split-K factor, a power of two: enough splits that ``num_programs * splits`` reaches
    ``programs_per_sm`` programs per SM, no more than ``cdiv(max_seq_len, min_chunk)`` (rounded up to a power
    of two) and at most :data:`MAX_SPLITS`; 1 when the batch alone fills the device."""
    target = programs_per_sm * num_sms(device)
    if num_programs >= target or max_seq_len <= min_chunk:
        return 1
    wanted = next_pow2(cdiv(target, num_programs))
    return max(1, min(wanted, next_pow2(cdiv(max_seq_len, min_chunk)), MAX_SPLITS))


def decode_config(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, page: int, max_seq_len: int,
                  dtype: torch.dtype, device: torch.device) -> DecodeConfig:
    """The decode kernel's config for a batch shape (shape-keyed heuristic, H100/H200-sized on CUDA).

    ``max_seq_len`` sizes the split count only; under a CUDA graph it is the longest context the graph may
    see (the kernel re-chunks each sequence's real context at run time).
    """
    if device.type != "cuda":  # the CPU interpreter: small tiles so tests cover several tiles and splits
        block_n = max(16, page) if page <= 16 else page
        return DecodeConfig(block_n=block_n, num_warps=4, num_stages=1, min_chunk=block_n, use_dot=group > 1,
                            num_splits=choose_num_splits(num_seqs * num_kv_heads, max_seq_len, device,
                                                         programs_per_sm=1, min_chunk=block_n))
    programs = num_seqs * num_kv_heads
    if head_dim * torch.finfo(dtype).bits // 8 > 256:  # not swept: 16-position tiles (32 KB of K+V per stage)
        block_n = max(16, min(page, 64))
        min_chunk = max(128, block_n)
        return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2, min_chunk=min_chunk, use_dot=True,
                            num_splits=choose_num_splits(programs, max_seq_len, device, programs_per_sm=4,
                                                         min_chunk=min_chunk))
    # 64-position tiles, 3 pipeline stages from 512 positions of context (a CUDA graph's max_seq_len is the top of its
    # context bucket, decode_context_buckets); a tile never splits a KV block of up to 64 positions.
    block_n = 64
    num_stages = 3 if max_seq_len >= THREE_STAGES_FROM else 2
    min_chunk = block_n if 4 * programs < num_sms(device) else 4 * block_n
    splits = choose_num_splits(programs, max_seq_len, device, programs_per_sm=2, min_chunk=min_chunk)
    # MHA too takes 16-row tl.dot tiles on CUDA: measured on an H200 (benchmarks/RESULTS.md, session 5), the
    # one-row FMA tiles read Llama-2-7B's KV at ~1.3 TB/s, the dot tiles of GQA at 3.3-3.9 TB/s.
    head_major = (group == 1 if HEAD_MAJOR is None else HEAD_MAJOR) and num_seqs <= MAX_GRID_YZ
    heads = 1
    while (splits == 1 and 2 * heads <= MAX_HEADS_PER_PROGRAM and num_kv_heads % (2 * heads) == 0
           and programs // (2 * heads) >= HEADS_MIN_PROGRAMS_PER_SM * num_sms(device)):
        heads *= 2
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=num_stages, num_splits=splits, min_chunk=min_chunk,
                        use_dot=True, heads_per_program=heads, head_major=head_major)


def check_decode_config(config: DecodeConfig, group: int, page: int, num_kv_heads: int, num_seqs: int) -> None:
    """Raise :class:`KernelArgumentError` for a config the kernel cannot run (``num_kv_heads``: the heads that
    ``heads_per_program`` must divide; ``num_seqs``: the launch's sequences, at most :data:`MAX_GRID_YZ` with
    ``head_major``)."""
    problems = []
    if config.head_major and num_seqs > MAX_GRID_YZ:
        problems.append(f"head_major=True with {num_seqs} sequences (a grid dimension of at most {MAX_GRID_YZ})")
    hp = config.heads_per_program
    if hp not in (1, 2, 4, 8) or num_kv_heads % hp:
        problems.append(f"heads_per_program={hp} (1, 2, 4 or 8, dividing the {num_kv_heads} KV heads)")
    if config.block_n < 16 or config.block_n & (config.block_n - 1):
        problems.append(f"block_n={config.block_n} (a power of two >= 16)")
    if config.block_n % page and page % config.block_n:
        problems.append(f"block_n={config.block_n} (a multiple or divisor of the block size {page})")
    if not 1 <= config.num_splits <= MAX_SPLITS:
        problems.append(f"num_splits={config.num_splits} (1..{MAX_SPLITS})")
    if config.min_chunk < config.block_n or config.min_chunk % config.block_n:
        problems.append(f"min_chunk={config.min_chunk} (a multiple of block_n)")
    if not config.use_dot and group != 1:
        problems.append(f"use_dot=False with {group} query heads per KV head (FMA tiles are one row)")
    if config.num_warps not in (1, 2, 4, 8, 16) or not 1 <= config.num_stages <= 6:
        problems.append(f"num_warps={config.num_warps}, num_stages={config.num_stages}")
    if problems:
        raise KernelArgumentError(f"{_OP}: bad config: " + "; ".join(problems))


@triton.jit
def _decode_chunk(span, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Positions per split of a sequence whose (windowed) context has ``span`` positions."""
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(chunk, MIN_CHUNK)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    window,
    softcap,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH_N: tl.constexpr = 0,
    LINE: tl.constexpr = 64,
    HEADS: tl.constexpr = 1,
    HEAD_MAJOR: tl.constexpr = False,
):
    # PREFETCH_N > 0 (PDL launches only; the engine's are its decode graphs): the step's metadata (uploaded before the
    # graph; no kernel of the step writes it) is read before the wait, and the K/V lines of the chunk's first
    # PREFETCH_N positions are asked into L2. Every program still waits before it ends, also where it has nothing to
    # do: the next kernel's wait covers this grid only, so this grid must not finish before the kernel before it.
    if PREFETCH_N == 0:
        pdl_wait(USE_PDL)
    # grid (sequences, KV heads / HEADS, splits), or with HEAD_MAJOR (KV heads / HEADS, sequences, splits): program
    # (b, j, split) the heads j * HEADS + [0, HEADS)
    if HEAD_MAJOR:
        b = tl.program_id(1)
        kvh = tl.program_id(0) * HEADS
        num_q_heads = tl.num_programs(0) * HEADS * GROUP
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1) * HEADS
        num_q_heads = tl.num_programs(1) * HEADS * GROUP
    split = tl.program_id(2)
    tok = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - tok
    if q_len != 1:  # a prefill row of a mixed batch (or an empty padding sequence): not ours
        if PREFETCH_N > 0:
            pdl_wait(USE_PDL)
        return
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    chunk = _decode_chunk(seq_len - lo, num_splits, BLOCK_N, MIN_CHUNK)
    num_active = tl.cdiv(seq_len - lo, chunk)
    if split >= num_active:
        if PREFETCH_N > 0:
            pdl_wait(USE_PDL)
        return
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if PREFETCH_N > 0:
        pf_pos = start + tl.arange(0, PREFETCH_N)
        pf_mask = pf_pos < end
        pf_blk = tl.load(block_tables_ptr + b * stride_bt + pf_pos // PAGE, mask=pf_mask, other=0).to(tl.int64)
        pf_line = tl.arange(0, BLOCK_D // LINE) * LINE
        pf_row = pf_blk * stride_kb + (pf_pos % PAGE).to(tl.int64) * stride_ks + kvh * stride_kh
        pdl_prefetch(k_cache_ptr + pf_row[:, None] + pf_line[None, :], pf_mask[:, None], k_cache_ptr, True)
        pf_row = pf_blk * stride_vb + (pf_pos % PAGE).to(tl.int64) * stride_vs + kvh * stride_vh
        pdl_prefetch(v_cache_ptr + pf_row[:, None] + pf_line[None, :], pf_mask[:, None], v_cache_ptr, True)
        pdl_wait(USE_PDL)

    tok = tok.to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    if HEADS == 1:
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        m_i, l_i, acc = attend_kv_range(
            q.to(DOT_DTYPE), g, m_i, l_i, acc, k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh, bt_row,
            start, end, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale, softcap, window,
            PAGE, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_DTYPE, PRECISION, USE_DOT, False, SLIDING, SOFTCAP,
        )
        pdl_trigger(USE_PDL)
        if num_active == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            row = (b * num_q_heads + heads) * num_splits + split
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g < GROUP)
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=q_mask)
    else:
        # one pipelined loop over the HEADS heads' tiles: iteration i is tile i % n of head i // n; the softmax
        # state restarts at a head's first tile (all three: a non-finite l or acc of the head before would survive
        # the rescale, 0 * inf = NaN) and the head's output is stored (masked) at its last
        n_tiles = tl.cdiv(end - start, BLOCK_N)
        for i in tl.range(0, HEADS * n_tiles, num_stages=NUM_STAGES):
            j = i // n_tiles
            tile = i - j * n_tiles
            heads = (kvh + j) * GROUP + g
            q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
            first = tile == 0
            m_i = tl.where(first, float("-inf"), m_i)
            l_i = tl.where(first, 0.0, l_i)
            acc = tl.where(first, 0.0, acc)
            m_i, l_i, acc = attend_kv_tile(
                q.to(DOT_DTYPE), g, m_i, l_i, acc, k_cache_ptr + (kvh + j) * stride_kh,
                v_cache_ptr + (kvh + j) * stride_vh, bt_row, start + tile * BLOCK_N, end, stride_kb, stride_ks,
                stride_vb, stride_vs, qk_scale, softcap, window, PAGE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_DTYPE,
                PRECISION, USE_DOT, False, SLIDING, SOFTCAP,
            )
            # the stores above, branch-free and masked (a branch in the loop body keeps Triton from pipelining it)
            last = (g * 0 + tile) == n_tiles - 1
            direct = (g * 0 + num_active) == 1
            out = acc / l_i[:, None]
            tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=q_mask & (last & direct)[:, None])
            row = (b * num_q_heads + heads) * num_splits + split
            tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=(g < GROUP) & last & ~direct)
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out,
                     mask=q_mask & (last & ~direct)[:, None])
        pdl_trigger(USE_PDL)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    window,
    num_splits,
    stride_ot,
    stride_oh,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLIDING: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    # out = sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max) over the sequence's active splits.
    b = tl.program_id(0)
    h = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + b)
    if tl.load(query_start_loc_ptr + b + 1) - tok != 1:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    num_active = tl.cdiv(seq_len - lo, _decode_chunk(seq_len - lo, num_splits, BLOCK_N, MIN_CHUNK))
    if num_active == 1:  # the split program wrote the output itself
        return
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * tl.num_programs(1) + h) * num_splits + s
    active = s < num_active
    lse = tl.load(part_lse_ptr + row, mask=active, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                    mask=active[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tok = tok.to(tl.int64)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def launch_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None,
    config: DecodeConfig,
) -> None:
    """Launch the decode kernel (and its reduce) over all ``meta.num_seqs`` sequences; those whose ``q_len``
    is not 1 are skipped on the device. Arguments are checked by the caller."""
    num_seqs = meta.num_seqs
    _, num_q_heads, head_dim = query.shape
    page, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    splits = config.num_splits
    if splits > 1:
        part_out = torch.empty((num_seqs, num_q_heads, splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_seqs, num_q_heads, splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # never written: every sequence has one active split
    pdl = pdl_args(query.device, _OP)
    block_d = max(16, next_pow2(head_dim))
    grid = (num_seqs, num_kv_heads // config.heads_per_program, splits)
    _paged_decode_kernel[(grid[1], grid[0], splits) if config.head_major else grid](
        query,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        part_out,
        part_lse,
        scale if softcap is not None else scale * _LOG2E,  # with a cap the kernel converts to base 2 after tanh
        sliding_window or 0,
        softcap or 0.0,
        splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        meta.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)) if config.use_dot else 1,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=config.block_n,
        MIN_CHUNK=config.min_chunk,
        NUM_STAGES=config.num_stages,
        DOT_DTYPE=dot_dtype(query.dtype, query.device),
        PRECISION=dot_precision(query.dtype, query.device),
        USE_DOT=config.use_dot,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        HEADS=config.heads_per_program, HEAD_MAJOR=config.head_major, num_warps=config.num_warps, **pdl,
        **_prefetch_args(pdl, head_dim, block_d, key_cache.element_size(), config.heads_per_program),
    )
    if splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_out,
            part_lse,
            meta.seq_lens,
            meta.query_start_loc,
            out,
            sliding_window or 0,
            splits,
            out.stride(0),
            out.stride(1),
            BLOCK_N=config.block_n,
            MIN_CHUNK=config.min_chunk,
            BLOCK_S=16 if splits <= 16 else next_pow2(splits),  # few variants of this small kernel
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            SLIDING=sliding_window is not None,
            num_warps=4 if head_dim >= 128 else 1, **pdl_args(query.device, _OP),
        )


def _prefetch_args(pdl: dict, head_dim: int, block_d: int, itemsize: int, heads_per_program: int = 1) -> dict:
    """``PREFETCH_N`` and ``LINE`` (elements per 128-byte line) of a decode launch with ``pdl`` (:func:`pdl_args`):
    :func:`~loraplex.kernels._triton.pdl_kv_prefetch_positions`, or none where the head rows are not a whole number of
    lines filling the kernel's ``block_d`` columns (``HEAD_DIM == BLOCK_D``, a multiple of ``LINE``) or a program
    walks several heads (the read-ahead covers one head's chunk)."""
    line = 128 // itemsize
    positions = pdl_kv_prefetch_positions(pdl["USE_PDL"])
    if head_dim % line or block_d != head_dim or heads_per_program > 1:
        positions = 0
    return {"PREFETCH_N": positions, "LINE": line}


def resolve_decode_config(query: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata,
                          num_splits: int | None, config: DecodeConfig | None) -> DecodeConfig:
    """``config`` (or :func:`decode_config`'s pick), with ``num_splits`` overriding its split count; checked."""
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    if config is None:
        config = decode_config(meta.num_seqs, num_kv_heads, group, query.shape[2], page, meta.max_seq_len,
                               query.dtype, query.device)
    if num_splits is not None:
        config = replace(config, num_splits=num_splits)
    check_decode_config(config, group, page, num_kv_heads, meta.num_seqs)
    return config


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`~loraplex.kernels.attention.paged_attention_ref` for ``meta.max_query_len == 1``.

    ``config``: launch config (default :func:`decode_config`); ``num_splits`` (1..64) overrides its split-K
    factor.

    Raises:
        KernelArgumentError: as the reference, ``meta.max_query_len != 1``, or a bad config.
        TritonUnavailableError: triton is not installed.
    """
    require_triton(_OP)
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    if meta.max_query_len != 1:
        raise KernelArgumentError(f"{_OP}: meta.max_query_len={meta.max_query_len}, the decode kernel needs 1")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise KernelArgumentError(f"{_OP}: num_splits={num_splits}, expected 1..{MAX_SPLITS}")
    config = resolve_decode_config(query, key_cache, meta, num_splits, config)
    out = prepare_out(query, meta, out)
    check_attention_layout(_OP, query, key_cache, value_cache, out)
    if meta.num_seqs:
        launch_decode(query, key_cache, value_cache, meta, scale, out, sliding_window, softcap, config)
    return out
