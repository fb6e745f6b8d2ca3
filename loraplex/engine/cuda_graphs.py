"""CUDA graphs for decode-only steps.

A decode step of B sequences launches hundreds of small kernels; replaying a
captured graph removes their launch gaps. Graphs are captured once, at
start, for a set of batch sizes; a decode step of B sequences is padded to
the next captured size (padding tokens: slot mapping -1 so nothing is
written, context length 1, no adapter). Batches with prompt tokens, or
larger than the largest size, run eagerly.

Everything that varies between steps lives in static device buffers that
the graph reads: input ids, positions, slot mapping, context lengths, block
tables and the tokens' adapter slots. They are views of two packed buffers
(int64 and int32) with host mirrors (pinned on CUDA), so a step writes the
host side from Python lists and moves everything with two copies. Block-table
rows are rewritten only when they changed since the last step (a decode step
adds a block to a sequence once every ``block_size`` tokens). For LoRA the
host writes only each token's adapter slot: the graph itself groups the tokens
by slot (:func:`~loraplex.kernels.lora_mapping.plan_segments`, the eager path's
builder, captured: one segment per adapter slot, a work-item list padded with
idle items to its bound ``ceil(B / 16) + min(B, slots)``); two graphs per size
are kept, with and without LoRA.
The launch grids are fixed at capture: attention is sized for
``max_model_len``, LoRA for B tokens in ``max_loras`` segments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import plan_segments

logger = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to ``min(max_num_seqs, 256)``."""
    top = min(max_num_seqs, 256)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    return sizes if sizes[-1] == top else sizes + [top]


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
                 max_num_seqs: int, num_lora_slots: int, device: torch.device) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_lora_slots = num_lora_slots
        self.sizes = default_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.table_width = -(-max_model_len // block_size)
        self._i64 = _StagedInts({"input_ids": n, "positions": n, "slot_mapping": n}, torch.int64, device)
        self._i32 = _StagedInts({"seq_lens": n, "token_slots": n, "block_tables": n * self.table_width},
                                torch.int32, device)
        self.input_ids, self._host_input_ids = self._i64.region("input_ids", n)
        self.positions, self._host_positions = self._i64.region("positions", n)
        self.slot_mapping, self._host_slot_mapping = self._i64.region("slot_mapping", n)
        self.seq_lens, self._host_seq_lens = self._i32.region("seq_lens", n)
        self.token_slots, self._host_token_slots = self._i32.region("token_slots", n)
        tables, host_tables = self._i32.region("block_tables", n * self.table_width)
        self.block_tables = tables.view(n, self.table_width)
        self._host_block_tables = host_tables.reshape(n, self.table_width)
        self._table_rows: list[list[int]] = [[] for _ in range(n)]  # what each host row holds
        self._reset_host()
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.pool = None

    def _reset_host(self) -> None:
        """Idle values: slot -1 (write nothing), context 1, no adapter; then upload them."""
        self._host_slot_mapping[:] = -1
        self._host_seq_lens[:] = 1
        self._host_token_slots[:] = -1
        self._i64.upload(self._i64.host.numel())
        self._i32.upload(self._i32.host.numel())

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, batch_size: int) -> int | None:
        return next((s for s in self.sizes if s >= batch_size), None)

    # -- capture ----------------------------------------------------------
    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size], max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_host=list(range(size + 1)),
            seq_lens_host=[self.max_model_len] * size)

    def _lora(self, size: int) -> LoRABatch:
        """The step's LoRA grouping, built on the device from the static ``token_slots`` (captured)."""
        return LoRABatch(plan_segments(self.token_slots[:size], self.num_lora_slots, has_lora=True))

    def _forward(self, size: int, with_lora: bool) -> torch.Tensor:
        lora = self._lora(size) if with_lora else None
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_layers, self._meta(size), lora)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, lora) graph, largest first, sharing one memory pool."""
        variants = [False, True] if self.num_lora_slots else [False]
        for size in reversed(self.sizes):
            for with_lora in variants:
                for _ in range(2):  # warm up: compile kernels, fill launch caches
                    self._forward(size, with_lora)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    hidden = self._forward(size, with_lora)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(size, with_lora)] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.sizes)

    # -- replay -----------------------------------------------------------
    def run(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_tables: list[list[int]], lora_slots: list[int] | None) -> torch.Tensor:
        """Fill the static buffers for B decode tokens and replay; returns ``[B, hidden]``.

        ``lora_slots``: adapter slot per sequence (-1 = none), or None when no
        sequence uses an adapter.
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
        entry = self.graphs[(size, with_lora)]
        entry.graph.replay()
        return entry.hidden[:b]

    def _fill(self, size, b, token_ids, positions, slot_mapping, seq_lens, block_tables) -> None:
        """Host side of the step's inputs; rows ``b..size`` are padding."""
        self._host_input_ids[:b] = token_ids
        self._host_input_ids[b:size] = 0
        self._host_positions[:b] = positions
        self._host_positions[b:size] = 0
        self._host_slot_mapping[:b] = slot_mapping
        self._host_slot_mapping[b:size] = -1
        self._host_seq_lens[:b] = seq_lens
        self._host_seq_lens[b:size] = 1
        # Entries past a row's blocks (and padding rows, which read one position)
        # may hold stale but valid block ids: the kernels never use them.
        rows, host_tables = self._table_rows, self._host_block_tables
        for i, table in enumerate(block_tables):
            if rows[i] != table:
                host_tables[i, :len(table)] = table
                rows[i] = list(table)

    def _fill_lora(self, size: int, lora_slots: list[int]) -> None:
        """Each token's adapter slot (-1 for padding rows); the graph groups them (no host sort)."""
        self._host_token_slots[:len(lora_slots)] = lora_slots
        self._host_token_slots[len(lora_slots):size] = -1
