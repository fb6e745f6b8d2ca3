"""Paged attention entry point (prefill, extend, decode and mixed batches) and its reference.

Semantics: :data:`PAGED_ATTENTION`, where token t is query i of sequence b, ``G = Hq / Hkv`` and
``K_b``/``V_b`` are sequence b's positions gathered through ``block_tables[b]`` from the caches; ``lo = 0``
(full causal) or ``max(0, p - W + 1)`` with a sliding window of W tokens (Mistral; HF's ``kv_idx > q_idx - W``);
with a soft-cap c the scores s become ``c * tanh(s / c)`` before the mask (Gemma 2).

The Triton path is one launcher for any mix of rows: sequences with one query token go to the decode kernel
(:mod:`loraplex.kernels.attention_decode`: one program per sequence x KV head (or k of them) x split, one-token
tiles of the KV head's query heads), the others to the prefill/extend kernel
(:mod:`loraplex.kernels.attention_prefill`: 64-row tiles of tokens x query heads); both skip the other's rows on
the device and share the paged K/V gather + online-softmax loop (:mod:`loraplex.kernels.attention_common`).
Grids depend only on the token and sequence counts (and the decode config), so a CUDA graph captured for a (T, B)
shape replays any batch of at most T tokens and B sequences.
"""

from __future__ import annotations

import torch

from loraplex.kernels._attention_checks import check_attention_args, check_attention_layout, prepare_out
from loraplex.kernels._triton import require_triton
from loraplex.kernels.attention_decode import DecodeConfig, launch_decode, resolve_decode_config
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.attention_prefill import launch_prefill
from loraplex.kernels.op import Op

_OP = "paged_attention"


def _launch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    decode_config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton launch of :func:`paged_attention_ref`: the decode kernel over the 1-token rows, the prefill kernel
    over the others (each launched only when the step has such rows). ``decode_config`` overrides
    :func:`~loraplex.kernels.attention_decode.decode_config`'s pick."""
    require_triton(_OP)
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    out = prepare_out(query, meta, out)
    check_attention_layout(_OP, query, key_cache, value_cache, out)
    if meta.num_seqs == 0:
        return out
    has_decode, has_prefill = meta.has_decode_rows, meta.max_query_len > 1
    if has_decode:
        config = resolve_decode_config(query, key_cache, meta, None, decode_config)
        launch_decode(query, key_cache, value_cache, meta, scale, out, sliding_window, softcap, config)
    if has_prefill:
        launch_prefill(query, key_cache, value_cache, meta, scale, out, sliding_window, softcap,
                       skip_decode=has_decode)
    return out


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill/extend/decode batch over the paged KV cache (plain torch).

    Args:
        query: ``[T, Hq, D]`` fp16/bf16/fp32 (head_dim stride 1 for Triton).
        key_cache, value_cache: ``[N, block_size, Hkv, D]``, same dtype, already holding this step's K/V.
        meta: :class:`AttentionMetadata` of the step.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[T, Hq, D]`` output (query dtype); rows of padding tokens are zeroed.
        sliding_window: W tokens a query attends to (itself included); ``None`` = full causal.
        softcap: attention logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``.

    Returns:
        ``[T, Hq, D]`` in the query dtype (``out`` when given).

    Raises:
        KernelArgumentError: bad shape/dtype/device/layout, metadata, window or soft-cap.
        TritonUnavailableError: Triton backend without triton installed.

    The reference loops over sequences (never tokens): gathers the sequence's K/V through its
    block table, repeats KV heads for GQA, applies the causal mask and a float32
    softmax, and casts back to the query dtype. Memory is
    ``O(Hq * q_len * seq_len)`` floats per sequence, so use it for tests and CPU runs.
    """
    check_attention_args(_OP, query, key_cache, value_cache, meta, scale, out, sliding_window, softcap)
    out = prepare_out(query, meta, out)
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    qsl = meta.query_start_loc_host
    for b, seq_len in enumerate(meta.seq_lens_host):
        q = query[qsl[b] : qsl[b + 1]].float()  # [q_len, Hq, D]
        # With a window, blocks wholly before the first query's window are not read (their table entries may
        # be freed placeholders, see loraplex.engine.kv_cache_manager); their positions are masked anyway.
        first_read = 0 if sliding_window is None else max(0, seq_len - q.shape[0] - sliding_window + 1)
        k, v = _gather_kv(key_cache, value_cache, meta.block_tables[b], seq_len, block_size,
                          first_read // block_size)
        k = k.repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q_len, seq_len]
        if softcap is not None:  # HF Gemma 2: scores / cap, tanh, * cap (before the mask)
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        if sliding_window is not None:
            scores.masked_fill_(k_pos[None, None, :] <= q_pos[None, :, None] - sliding_window, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qsl[b] : qsl[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


PAGED_ATTENTION = Op(
    name=_OP,
    semantics="out[t, h] = softmax(cap(scale * q[t, h] @ K_b[lo:p+1, h // G].T)) @ V_b[lo:p+1, h // G], "
    "p = seq_lens[b] - q_len[b] + i for query i of sequence b, lo = 0 or max(0, p - sliding_window + 1), "
    "cap(s) = s or softcap * tanh(s / softcap)",
    reference=paged_attention_ref,
    triton=_launch_paged_attention,
)


def _gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, block_size: int,
    first_block: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one sequence: ``[seq_len, Hkv, D]`` float32 each, in position order; the positions of blocks
    before ``first_block`` are zeros (their table entries are not read)."""
    num_blocks = -(-seq_len // block_size)
    blocks = block_row[first_block:num_blocks].long()
    skipped = first_block * block_size
    k = torch.zeros((seq_len, *key_cache.shape[2:]), dtype=torch.float32, device=key_cache.device)
    v = torch.zeros_like(k)
    k[skipped:] = key_cache[blocks].flatten(0, 1)[: seq_len - skipped].float()
    v[skipped:] = value_cache[blocks].flatten(0, 1)[: seq_len - skipped].float()
    return k, v
