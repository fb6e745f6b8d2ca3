"""CUDA graphs for decode-only steps.

A decode step of B sequences launches hundreds of small kernels; replaying a
captured graph removes their launch gaps. Graphs are captured once, at
start, for a set of batch sizes; a decode step of B sequences is padded to
the next captured size (padding tokens: slot mapping -1 so nothing is
written, context length 1, no adapter). Batches with prompt tokens, or
larger than the largest size, run eagerly.

Everything that varies between steps lives in static device buffers that
the graph reads: input ids, positions, slot mapping, context lengths, block
tables and the SGMV segment arrays. For LoRA the graph always has one
segment per adapter slot (unused slots have length 0, so their programs
exit at once); two graphs per size are kept, with and without LoRA.
The launch grids are fixed at capture: attention is sized for
``max_model_len``, LoRA for B tokens in ``max_loras`` segments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import LoRAMapping

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
        width = -(-max_model_len // block_size)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, width, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.token_slots = torch.full((n,), -1, **i32)
        self.sorted_token_ids = torch.arange(n, **i32)
        self.segment_starts = torch.zeros(max(num_lora_slots, 1), **i32)
        self.segment_lens = torch.zeros(max(num_lora_slots, 1), **i32)
        self.segment_slots = torch.arange(max(num_lora_slots, 1), **i32)
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.pool = None

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
        s = self.num_lora_slots
        mapping = LoRAMapping(
            token_slots=self.token_slots[:size], sorted_token_ids=self.sorted_token_ids[:size],
            segment_starts=self.segment_starts, segment_lens=self.segment_lens, segment_slots=self.segment_slots,
            num_tokens=size, num_segments=s, max_segment_len=size, has_lora=True,
            segment_starts_host=[0] * s, segment_lens_host=[size] * s, segment_slots_host=list(range(s)))
        return LoRABatch(mapping)

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
            block_tables: list[list[int]], lora_slots: list[int]) -> torch.Tensor:
        """Fill the static buffers for B decode tokens and replay; returns ``[B, hidden]``."""
        b = len(token_ids)
        size = self.padded_size(b)
        with_lora = self.num_lora_slots > 0 and any(s >= 0 for s in lora_slots)
        self._fill(size, b, token_ids, positions, slot_mapping, seq_lens, block_tables)
        if with_lora:
            self._fill_lora(size, lora_slots)
        entry = self.graphs[(size, with_lora)]
        entry.graph.replay()
        return entry.hidden[:b]

    def _fill(self, size, b, token_ids, positions, slot_mapping, seq_lens, block_tables) -> None:
        pad = size - b
        host = torch.tensor([token_ids + [0] * pad, positions + [0] * pad, slot_mapping + [-1] * pad,
                             seq_lens + [1] * pad], dtype=torch.int64)
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        self.seq_lens[:size].copy_(host[3], non_blocking=True)
        width = max(len(t) for t in block_tables)
        rows = [t + [0] * (width - len(t)) for t in block_tables] + [[0] * width] * pad
        self.block_tables[:size, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)

    def _fill_lora(self, size: int, lora_slots: list[int]) -> None:
        """SGMV segments over all slots, computed on the host (B is small)."""
        slots = lora_slots + [-1] * (size - len(lora_slots))
        order = sorted(range(size), key=lambda t: slots[t])
        counts = [0] * self.num_lora_slots
        for s in slots:
            if s >= 0:
                counts[s] += 1
        start = sum(1 for s in slots if s < 0)
        starts = []
        for c in counts:
            starts.append(start)
            start += c
        host = torch.tensor([slots, order], dtype=torch.int32)
        self.token_slots[:size].copy_(host[0], non_blocking=True)
        self.sorted_token_ids[:size].copy_(host[1], non_blocking=True)
        self.segment_starts.copy_(torch.tensor(starts, dtype=torch.int32), non_blocking=True)
        self.segment_lens.copy_(torch.tensor(counts, dtype=torch.int32), non_blocking=True)
