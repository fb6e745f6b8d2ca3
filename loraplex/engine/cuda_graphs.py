"""CUDA graphs for decode-only steps and for mixed steps (decode rows + prompt chunks).

A decode step of B sequences launches hundreds of small kernels; replaying a
captured graph removes their launch gaps. Graphs are captured once, at
start, for a set of batch sizes; a decode step of B sequences is padded to
the next captured size (padding tokens: slot mapping -1 so nothing is
written, context length 1, no adapter).

Mixed steps (some sequences compute prompt tokens) replay full graphs over
padded token counts: one graph per token bucket T (powers of two from 16 up to
``max_num_batched_tokens``, and that budget itself), each for up to
``min(T - 1, max decode size)`` sequences. A step of t tokens in b sequences
replays the smallest bucket with ``t <= T`` and ``b`` within its sequences;
the padding tokens belong to no sequence (slot -1, position 0, no adapter)
and the padding sequences are empty (``q_len 0``: ``query_start_loc`` repeats
t), so the attention kernels skip them (their grids depend only on T and the
sequence count, see :mod:`loraplex.kernels.attention`). Steps that ask for
prompt logprobs, or do not fit a bucket, run eagerly.

Everything that varies between steps lives in static device buffers that
the graph reads: input ids, positions, slot mapping, query start offsets,
context lengths, block tables and the tokens' adapter slots. They are views of two packed buffers
(int64 and int32) with host mirrors (pinned on CUDA), so a step writes the
host side from Python lists and moves everything with two copies. Block-table
rows are rewritten only when they changed since the last step (a decode step
adds a block to a sequence once every ``block_size`` tokens). For LoRA the
host writes only each token's adapter slot: the graph itself groups the tokens
by slot (:func:`~loraplex.kernels.lora_mapping.plan_segments`, the eager path's
builder, captured: one segment per adapter slot, a work-item list padded with
idle items to its bound ``ceil(T / 16) + min(B, slots)``); three graphs per decode size and context bucket
are kept, keyed ``(size, with_lora, with_dora, context)`` (mixed ones ``(size, with_lora, with_dora)``): without
LoRA, with LoRA, and with LoRA and the DoRA rescale (steps where some slot holds a DoRA adapter; the graph also
captures each token's gain row, ``LoRABatch.gain_rows``), so plain-LoRA steps pay nothing for DoRA.
The launch grids and kernel configs are fixed at capture: LoRA for T tokens in ``max_loras`` segments;
decode attention for contexts of up to ``context`` positions, one graph per bucket of
:func:`~loraplex.kernels.attention_decode.decode_context_buckets` (the step replays the smallest holding its
longest context: short contexts run the short-context config even where ``max_model_len`` is long); mixed
steps' attention for ``max_model_len``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate

import torch

from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.kernels._triton import pdl_launches
from loraplex.kernels.attention_decode import decode_context_buckets
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import plan_segments

logger = logging.getLogger(__name__)

# Decode graphs of at most this many sequences launch the Triton kernels with programmatic dependent launches
# (kernels._triton.pdl_launches), each letting the next launch at its default trigger (kernels._triton.
# DEFAULT_PDL_TRIGGERS). Measured on an H200 (benchmarks/RESULTS.md, sessions 20-21, Llama-2-7B shapes): with every
# kernel triggering at its start, batch 1 4.03 -> 3.84 ms per step but batch 32 5.05 -> 5.42; with the GEMMs and
# decode attention triggering after their main loops, batches 1, 32 and 128 all gain against no PDL (session 21:
# 3.87 -> 3.69, 4.82 -> 4.73, 7.38 -> 7.30 ms per graph replay), so all decode graphs (batch 256 not measured).
# Mixed prefill+decode graphs launch without (not measured).
_PDL_MAX_DECODE_BATCH = 256
_CONTEXT_BUCKETS = True


def use_context_buckets(enabled: bool) -> bool:
    """Capture decode graphs per context bucket (:func:`~loraplex.kernels.attention_decode.decode_context_buckets`),
    or for ``max_model_len`` only (benchmarks' A/B); returns the previous setting. Runners built before keep
    theirs."""
    global _CONTEXT_BUCKETS
    previous, _CONTEXT_BUCKETS = _CONTEXT_BUCKETS, enabled
    return previous


def pdl_max_decode_batch(size: int) -> int:
    """Set the largest decode graph captured with programmatic dependent launches (benchmarks' A/B; 0: none);
    returns the previous value. Graphs captured before keep theirs."""
    global _PDL_MAX_DECODE_BATCH
    previous, _PDL_MAX_DECODE_BATCH = _PDL_MAX_DECODE_BATCH, size
    return previous


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to ``min(max_num_seqs, 256)``."""
    top = min(max_num_seqs, 256)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    return sizes if sizes[-1] == top else sizes + [top]


def default_mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token buckets of the mixed-step graphs: 16, 32, 64, ... below ``max_num_batched_tokens``, then it."""
    sizes = [1 << k for k in range(4, 16) if 1 << k < max_num_batched_tokens]
    return sizes + [max_num_batched_tokens] if max_num_batched_tokens >= 3 else []


def capture_query_lens(num_tokens: int, num_seqs: int, max_len: int) -> list[int] | None:
    """Query lengths of a batch shape that launches both attention kernels, for capturing a mixed graph:
    ``num_seqs`` sequences holding ``num_tokens`` tokens, the last one a decode row, none longer than
    ``max_len``; None when no such shape exists (``num_seqs < 2``, too few or too many tokens)."""
    if num_seqs < 2 or num_tokens <= num_seqs:
        return None
    lens, remaining = [1] * num_seqs, num_tokens - num_seqs
    for i in range(num_seqs - 1):
        extra = min(remaining, max_len - 1)
        lens[i] += extra
        remaining -= extra
    return lens if remaining == 0 else None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor


class _StagedInts:
    """A flat device integer buffer with a host mirror of the same layout.

    The host side is written through a NumPy view (fast from Python lists),
    then :meth:`upload` copies a prefix with one non-blocking copy. On CUDA the
    mirror is pinned and an event keeps the next host write from racing the
    previous copy.
    """

    _ALIGN = 16  # elements: region starts stay 64-byte aligned for the kernels

    def __init__(self, region_sizes: dict[str, int], dtype: torch.dtype, device: torch.device) -> None:
        self.offsets: dict[str, int] = {}
        total = 0
        for name, numel in region_sizes.items():
            self.offsets[name] = total
            total += -(-numel // self._ALIGN) * self._ALIGN
        cuda = device.type == "cuda"
        self.device_buffer = torch.zeros(total, dtype=dtype, device=device)
        self.host = torch.zeros(total, dtype=dtype, pin_memory=cuda)
        self.host_view = self.host.numpy()
        self._copied = torch.cuda.Event() if cuda else None

    def region(self, name: str, numel: int) -> tuple[torch.Tensor, object]:
        """(device view, host NumPy view) of ``numel`` elements starting at region ``name``."""
        start = self.offsets[name]
        return self.device_buffer[start:start + numel], self.host_view[start:start + numel]

    def wait_for_copy(self) -> None:
        """Block until the last upload has read the host mirror."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self, numel: int) -> None:
        """Copy host elements ``[0, numel)`` to the device (ordered on the current stream)."""
        self.device_buffer[:numel].copy_(self.host[:numel], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class CudaGraphRunner:
    """Captures and replays the model forward of decode-only steps."""

    def __init__(self, model: LlamaForCausalLM, kv_layers, block_size: int, max_model_len: int,
                 max_num_seqs: int, num_lora_slots: int, device: torch.device,
                 max_num_batched_tokens: int | None = None, dora: bool = True) -> None:
        """``max_num_batched_tokens``: the step token budget; None captures no mixed-step graphs. ``dora``:
        capture the DoRA variants too (a step holding a DoRA slot without them runs eagerly)."""
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_lora_slots = num_lora_slots
        self.dora = dora
        self.sizes = default_batch_sizes(max_num_seqs)
        self.context_buckets = decode_context_buckets(max_model_len) if _CONTEXT_BUCKETS else (max_model_len,)
        n = self.sizes[-1]  # sequences (and decode tokens) a graph can hold
        self.mixed_sizes = [t for t in default_mixed_sizes(max_num_batched_tokens or 0)
                            if capture_query_lens(t, self.mixed_num_seqs(t), max_model_len)]
        nt = max([n] + self.mixed_sizes)  # tokens a graph can hold
        self.table_width = -(-max_model_len // block_size)
        self._i64 = _StagedInts({"input_ids": nt, "positions": nt, "slot_mapping": nt}, torch.int64, device)
        self._i32 = _StagedInts({"seq_lens": n, "token_slots": nt, "query_start_loc": n + 1,
                                 "block_tables": n * self.table_width}, torch.int32, device)
        self.input_ids, self._host_input_ids = self._i64.region("input_ids", nt)
        self.positions, self._host_positions = self._i64.region("positions", nt)
        self.slot_mapping, self._host_slot_mapping = self._i64.region("slot_mapping", nt)
        self.seq_lens, self._host_seq_lens = self._i32.region("seq_lens", n)
        self.token_slots, self._host_token_slots = self._i32.region("token_slots", nt)
        self.mixed_query_start_loc, self._host_mixed_qsl = self._i32.region("query_start_loc", n + 1)
        tables, host_tables = self._i32.region("block_tables", n * self.table_width)
        self.block_tables = tables.view(n, self.table_width)
        self._host_block_tables = host_tables.reshape(n, self.table_width)
        self._table_rows: list[list[int]] = [[] for _ in range(n)]  # what each host row holds
        self._reset_host()
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, bool, bool, int], _Graph] = {}  # (size, with_lora, with_dora, context)
        self.mixed_graphs: dict[tuple[int, bool, bool], _Graph] = {}
        self.pool = None

    def mixed_num_seqs(self, num_tokens: int) -> int:
        """Sequences the mixed graph of ``num_tokens`` tokens holds: ``min(num_tokens - 1, max decode size)``
        (a mixed step has a sequence with at least two tokens)."""
        return min(num_tokens - 1, self.sizes[-1])

    def mixed_padded_size(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest mixed bucket holding ``num_tokens`` tokens in ``num_seqs`` sequences, or None."""
        return next((t for t in self.mixed_sizes if t >= num_tokens and self.mixed_num_seqs(t) >= num_seqs), None)

    def _reset_host(self) -> None:
        """Idle values: slot -1 (write nothing), context 1, no adapter; then upload them."""
        self._host_slot_mapping[:] = -1
        self._host_seq_lens[:] = 1
        self._host_mixed_qsl[:] = 0
        self._host_token_slots[:] = -1
        self._i64.upload(self._i64.host.numel())
        self._i32.upload(self._i32.host.numel())

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch_size: int) -> int | None:
        return next((s for s in self.sizes if s >= batch_size), None)

    # -- capture ----------------------------------------------------------
    def _meta(self, size: int, context: int) -> AttentionMetadata:
        """Capture metadata of the decode graph of ``size`` sequences of up to ``context`` positions."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size], max_query_len=1,
            max_seq_len=context, query_start_loc_host=list(range(size + 1)), seq_lens_host=[context] * size)

    def _lora(self, size: int, dora: bool = False) -> LoRABatch:
        """The step's LoRA grouping, built on the device from the static ``token_slots`` (captured)."""
        return LoRABatch(plan_segments(self.token_slots[:size], self.num_lora_slots, has_lora=True), dora=dora)

    def _mixed_meta(self, size: int) -> AttentionMetadata:
        """Capture metadata of the mixed graph of ``size`` tokens: the static buffers, and host lists of a
        shape with decode and prefill rows (so both attention kernels are captured, at grids sized by
        ``size`` tokens and :meth:`mixed_num_seqs` sequences)."""
        b = self.mixed_num_seqs(size)
        q_lens = capture_query_lens(size, b, self.max_model_len)
        return AttentionMetadata(
            query_start_loc=self.mixed_query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:size], max_query_len=max(q_lens),
            max_seq_len=self.max_model_len, query_start_loc_host=list(accumulate(q_lens, initial=0)),
            seq_lens_host=[self.max_model_len] * b)

    def _forward(self, size: int, with_lora: bool, with_dora: bool, context: int | None) -> torch.Tensor:
        """The forward a graph captures: a decode step of up to ``context`` positions, or (None) a mixed step."""
        lora = self._lora(size, with_dora) if with_lora else None
        meta = self._mixed_meta(size) if context is None else self._meta(size, context)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_layers, meta, lora)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every decode graph (size, with_lora, with_dora, context) and mixed graph (size, with_lora,
        with_dora), mixed-step ones (largest) first, sharing one memory pool."""
        variants = [(False, False)]  # (with_lora, with_dora)
        if self.num_lora_slots:
            variants += [(True, False), (True, True)] if self.dora else [(True, False)]
        plan = [(size, None) for size in reversed(self.mixed_sizes)]
        plan += [(size, context) for size in reversed(self.sizes) for context in reversed(self.context_buckets)]
        for size, context in plan:
            for with_lora, with_dora in variants:
                with pdl_launches(context is not None and size <= _PDL_MAX_DECODE_BATCH):
                    for _ in range(2):  # warm up: compile kernels, fill launch caches
                        self._forward(size, with_lora, with_dora, context)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        hidden = self._forward(size, with_lora, with_dora, context)
                if self.pool is None:
                    self.pool = graph.pool()
                if context is None:
                    self.mixed_graphs[(size, with_lora, with_dora)] = _Graph(graph, hidden)
                else:
                    self.graphs[(size, with_lora, with_dora, context)] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s and contexts up to %s, and %d for mixed-step "
                    "token counts %s", len(self.graphs), self.sizes, self.context_buckets, len(self.mixed_graphs),
                    self.mixed_sizes)

    # -- replay -----------------------------------------------------------
    def run(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[list[int]], lora_slots: list[int] | None, input_fix=None,
            dora: bool = False) -> torch.Tensor:
        """Fill the static buffers for B decode tokens and replay; returns ``[B, hidden]``.

        ``lora_slots``: adapter slot per sequence (-1 = none), or None when no
        sequence uses an adapter. ``input_fix``: ``(rows, ids)`` device tensors, token ids
        written over rows of ``token_ids`` after the upload (async scheduling), or None.
        ``dora``: some slot of ``lora_slots`` holds a DoRA adapter (the DoRA graph is replayed).
        """
        b = len(token_ids)
        size = self.padded_size(b)
        with_lora = self.num_lora_slots > 0 and lora_slots is not None and any(s >= 0 for s in lora_slots)
        self._i64.wait_for_copy()
        self._i32.wait_for_copy()
        self._fill(size, b, token_ids, positions, slot_mapping, seq_lens, block_tables)
        if with_lora:
            self._fill_lora(size, lora_slots)
        self._i64.upload(self._i64.host.numel())
        self._i32.upload(self._i32.offsets["block_tables"] + size * self.table_width)
        if input_fix is not None:
            self.input_ids[input_fix[0]] = input_fix[1]
        longest = max(seq_lens)
        context = next(c for c in self.context_buckets if c >= longest)
        entry = self.graphs[(size, with_lora, with_lora and dora, context)]
        entry.graph.replay()
        return entry.hidden[:b]

    def _fill(self, size, b, token_ids, positions, slot_mapping, seq_lens, block_tables) -> None:
        """Host side of the step's inputs; rows ``b..size`` are padding."""
        self._fill_tokens(size, token_ids, positions, slot_mapping)
        self._fill_seqs(size, seq_lens, block_tables)

    def _fill_tokens(self, size, token_ids, positions, slot_mapping) -> None:
        """Per-token inputs of ``len(token_ids)`` tokens; tokens up to ``size`` are padding (slot -1)."""
        t = len(token_ids)
        self._host_input_ids[:t] = token_ids
        self._host_input_ids[t:size] = 0
        self._host_positions[:t] = positions
        self._host_positions[t:size] = 0
        self._host_slot_mapping[:t] = slot_mapping
        self._host_slot_mapping[t:size] = -1

    def _fill_seqs(self, num_seqs, seq_lens, block_tables) -> None:
        """Context lengths and block-table rows of ``len(seq_lens)`` sequences; up to ``num_seqs`` padding."""
        b = len(seq_lens)
        self._host_seq_lens[:b] = seq_lens
        self._host_seq_lens[b:num_seqs] = 1
        # Entries past a row's blocks (and padding rows, which read one position or none)
        # may hold stale but valid block ids: the kernels never use them.
        rows, host_tables = self._table_rows, self._host_block_tables
        for i, table in enumerate(block_tables):
            if rows[i] != table:
                host_tables[i, :len(table)] = table
                rows[i] = list(table)

    def run_mixed(self, token_ids: list[int], positions, slot_mapping, query_lens: list[int], seq_lens: list[int],
                  block_tables: list[list[int]], token_lora_slots: list[int] | None,
                  dora: bool = False, input_fix=None) -> torch.Tensor:
        """Fill the static buffers for a mixed step of T tokens in B sequences and replay the smallest mixed
        graph that holds it; returns ``[T, hidden]``.

        ``positions`` / ``slot_mapping``: T ints each (lists or 1-D int64 host tensors / arrays);
        ``query_lens`` / ``seq_lens`` / ``block_tables``: per sequence; ``token_lora_slots``: adapter slot per
        token (-1 = none), or None when no token uses an adapter; ``dora`` and ``input_fix`` (token indices,
        device ids written over them after the upload: async scheduling's placeholders) as in :meth:`run`.
        Raises ``ValueError`` when no bucket holds the step (check :meth:`mixed_padded_size` first).
        """
        t, b = len(token_ids), len(seq_lens)
        size = self.mixed_padded_size(t, b)
        if size is None:
            raise ValueError(f"no mixed-step graph holds {t} tokens in {b} sequences (buckets {self.mixed_sizes})")
        num_seqs = self.mixed_num_seqs(size)
        with_lora = (self.num_lora_slots > 0 and token_lora_slots is not None
                     and any(s >= 0 for s in token_lora_slots))
        self._i64.wait_for_copy()
        self._i32.wait_for_copy()
        self._fill_tokens(size, token_ids, positions, slot_mapping)
        self._fill_seqs(num_seqs, seq_lens, block_tables)
        qsl = self._host_mixed_qsl
        qsl[0] = 0
        qsl[1:b + 1] = list(accumulate(query_lens))
        qsl[b + 1:num_seqs + 1] = t  # empty padding sequences
        if with_lora:
            self._fill_lora(size, token_lora_slots)
        self._i64.upload(self._i64.host.numel())
        self._i32.upload(self._i32.offsets["block_tables"] + num_seqs * self.table_width)
        if input_fix is not None:
            self.input_ids[input_fix[0]] = input_fix[1]
        entry = self.mixed_graphs[(size, with_lora, with_lora and dora)]
        entry.graph.replay()
        return entry.hidden[:t]

    def _fill_lora(self, size: int, lora_slots: list[int]) -> None:
        """Each token's adapter slot (-1 for padding rows); the graph groups them (no host sort)."""
        self._host_token_slots[:len(lora_slots)] = lora_slots
        self._host_token_slots[len(lora_slots):size] = -1
