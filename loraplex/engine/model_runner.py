"""Turns a step plan into tensors, runs the model, samples.

One step = prepare inputs (once, vectorised) -> block moves -> forward ->
logits of the rows that need them -> sample. Nothing here decides *what*
runs (that is the scheduler) or *what it means* (that is the engine).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from itertools import accumulate

import torch

from loraplex.engine.cuda_graphs import CudaGraphRunner
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.engine.outputs import TopLogprobs
from loraplex.engine.sampler import Sampler, SamplingBatch, SamplingRow, top_logprobs
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence
from loraplex.engine.structured_output import GrammarMaskFiller, PendingMask
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import plan_segments

logger = logging.getLogger(__name__)


def _host_ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor from a list of ints (through ``array``: faster than ``torch.tensor``)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_ARRAY_CODES[dtype], values), dtype=dtype)


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def _padded_rows(rows: list[list[int]]) -> torch.Tensor:
    """``[len(rows), max_len] int32`` host tensor, rows right-padded with 0."""
    width = max(len(r) for r in rows)
    flat: list[int] = []
    zeros = [0] * width
    for r in rows:
        flat += r
        flat += zeros[len(r):]
    return _host_ints(flat, torch.int32).view(len(rows), width)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move same-dtype 1-D host tensors to ``device`` with one copy; returns views of
    the packed device tensor, each starting 16 elements aligned (as a fresh tensor
    would, so the kernels see the same pointer alignment)."""
    if device.type == "cpu":
        return tensors
    parts, starts, offset = [], [], 0
    for t in tensors:
        padded = -(-t.numel() // _ALIGN) * _ALIGN
        parts += [t, t.new_zeros(padded - t.numel())]
        starts.append(offset)
        offset += padded
    packed = torch.cat(parts).to(device)
    return [packed[start:start + t.numel()] for start, t in zip(starts, tensors)]


_ALIGN = 16


@dataclass(frozen=True)
class StepInputs:
    """Flattened inputs of one step (T tokens, B sequences).

    ``input_ids [T] int64``, ``positions [T] int64``, ``meta`` (offsets, block
    tables, slot mapping), ``lora`` (token -> adapter slot, or None when no
    token uses an adapter), ``sample_token_index [B]`` (index in T of each
    sequence's last token).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    lora: LoRABatch | None
    sample_token_index: list[int]


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: TopLogprobs | None


@dataclass
class StepResult:
    """Per scheduled sequence (by position in the batch): ``samples[i]`` is the
    list of sampled tokens (empty for a prompt chunk that does not reach the
    end, ``n`` entries for a fork); ``prompt_logprobs[i]`` the prompt
    logprobs for the positions computed this step (None when not asked)."""

    samples: list[list[SampledToken]]
    prompt_logprobs: list[list[TopLogprobs] | None]


class ModelRunner:
    """Runs one :class:`ScheduledBatch` on the device: ``execute(batch)`` builds the step's input tensors
    (token ids, positions, :class:`AttentionMetadata`, the LoRA mapping from ``slot_of``), applies the batch's
    block copies to ``kv_cache``, runs the model's forward (eagerly, or by replaying a captured CUDA graph for
    decode-only steps), computes the logits of the rows that sample and returns a :class:`StepResult` of sampled
    tokens (and prompt logprobs when asked). It decides nothing about which sequences run or what outputs mean."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device,
                 slot_of=None) -> None:
        """``slot_of(lora_int_id) -> int`` gives the device slot of a pinned adapter."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.slot_of = slot_of
        self.vocab_size = model.spec.vocab_size
        self.eos_token_ids = set(model.spec.eos_token_ids)
        self.graphs: CudaGraphRunner | None = None
        self.grammar_masks = GrammarMaskFiller(self.vocab_size, device)

    def enable_cuda_graphs(self, max_model_len: int, max_num_seqs: int, num_lora_slots: int) -> None:
        """Capture decode graphs (CUDA only); decode-only steps then replay them."""
        graphs = CudaGraphRunner(self.model, self.kv_cache.layers, self.block_size, max_model_len,
                                 max_num_seqs, num_lora_slots, self.device)
        try:
            graphs.capture()
        except RuntimeError as exc:  # keep serving, eagerly, and say so
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            return
        self.graphs = graphs

    # -- inputs -----------------------------------------------------------
    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Host lists -> vectorised host tensors -> two packed copies to the device."""
        bs = self.block_size
        token_ids: list[int] = []
        q_lens, seq_lens, tables = [], [], []
        for item in batch.seqs:
            end = item.start_position + item.num_new_tokens
            token_ids += item.seq.token_ids[item.start_position:end]
            q_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(item.seq.block_ids)
        num_seqs, num_tokens = len(q_lens), len(token_ids)
        query_start = list(accumulate(q_lens, initial=0))
        # position of token t of sequence b = t - query_start[b] + start[b]
        offsets = [e - q - qs for e, q, qs in zip(seq_lens, q_lens, query_start)]
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), _host_ints(q_lens, torch.int64),
                                            output_size=num_tokens)
        positions = torch.arange(num_tokens) + _host_ints(offsets, torch.int64)[seq_index]
        block_tables = _padded_rows(tables)
        slot_mapping = block_tables[seq_index, positions // bs].to(torch.int64) * bs + positions % bs
        lora_slots = self._lora_slots(batch)
        host_i32 = [_host_ints(query_start, torch.int32), _host_ints(seq_lens, torch.int32), block_tables.view(-1)]
        if lora_slots is not None:
            host_i32.append(_host_ints(lora_slots, torch.int32)[seq_index])  # token_slots; grouped on the device
        input_ids, positions_dev, slot_mapping_dev = _to_device(
            [_host_ints(token_ids, torch.int64), positions, slot_mapping], self.device)
        query_start_dev, seq_lens_dev, block_tables_dev, *lora_tensors = _to_device(host_i32, self.device)
        meta = AttentionMetadata(
            query_start_loc=query_start_dev,
            seq_lens=seq_lens_dev,
            block_tables=block_tables_dev.view(block_tables.shape),
            slot_mapping=slot_mapping_dev,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_host=query_start,
            seq_lens_host=seq_lens,
        )
        lora = None
        if lora_slots is not None:
            lora = LoRABatch(plan_segments(lora_tensors[0], self.model.num_lora_slots(), has_lora=True))
        return StepInputs(input_ids, positions_dev, meta, lora, [q - 1 for q in query_start[1:]])

    # -- step -------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        # Structured-output masks of this step's rows are filled on a worker thread while
        # the inputs are prepared and the forward pass runs; sampling waits for them.
        plan = self._sampling_plan(batch)
        mask = self.grammar_masks.submit([seq.grammar for _, seq in plan]) if plan else None
        self.kv_cache.apply(batch.block_copies)
        if self._graph_fits(batch):
            hidden = self._run_graph(batch)
            sample_index = list(range(len(batch.seqs)))
            return StepResult(self._sample(batch, plan, sample_index, hidden, mask), [None] * len(batch.seqs))
        inputs = self.prepare_inputs(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta, inputs.lora)
        samples = self._sample(batch, plan, inputs.sample_token_index, hidden, mask)
        prompt_lps = self._prompt_logprobs(batch, hidden)
        return StepResult(samples, prompt_lps)

    def _graph_fits(self, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and len(batch.seqs) <= self.graphs.max_batch_size
                and all(s.num_new_tokens == 1 and not s.prompt_logprobs for s in batch.seqs))

    def _run_graph(self, batch: ScheduledBatch) -> torch.Tensor:
        bs = self.block_size
        token_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for item in batch.seqs:
            seq, pos = item.seq, item.start_position
            block_ids = seq.block_ids
            token_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(block_ids)
        return self.graphs.run(token_ids, positions, slots, seq_lens, tables, self._lora_slots(batch))

    def _lora_slots(self, batch: ScheduledBatch) -> list[int] | None:
        """Adapter slot of each sequence (-1 = base model); None when no sequence uses an adapter."""
        lora_ids = [item.seq.group.lora_int_id for item in batch.seqs]
        if not any(lora_ids):
            return None
        slot = {lora_id: self.slot_of(lora_id) for lora_id in set(lora_ids) if lora_id}
        slot[0] = -1
        return [slot[lora_id] for lora_id in lora_ids]

    @staticmethod
    def _sampling_plan(batch: ScheduledBatch) -> list[tuple[int, Sequence]]:
        """(index in ``batch.seqs``, sequence sampled) per sampling row, in row order."""
        plan: list[tuple[int, Sequence]] = []
        for i, item in enumerate(batch.seqs):
            if item.num_samples == 1:
                plan.append((i, item.seq))
            elif item.num_samples > 1:  # a fork: row c samples for the group's sequence index + c
                seqs = item.seq.group.seqs
                plan += [(i, seqs[item.seq.index + c]) for c in range(item.num_samples)]
        return plan

    def _sample(self, batch: ScheduledBatch, plan: list[tuple[int, Sequence]], sample_token_index: list[int],
                hidden: torch.Tensor, mask: PendingMask | None) -> list[list[SampledToken]]:
        if not plan:
            return [[] for _ in batch.seqs]
        rows = [self._sampling_row(seq) for _, seq in plan]
        owner = [i for i, _ in plan]
        row_index = [sample_token_index[i] for i in owner]
        if row_index != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(row_index, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        sampling = SamplingBatch.build(rows, self.vocab_size, logits.device)
        if mask is not None:
            sampling.grammar_bitmask = mask.result()
        out = self.sampler(logits, sampling)
        samples = zip(out.token_ids, out.sampled_logprobs, out.logprobs)
        if owner == list(range(len(batch.seqs))):  # one sample per sequence (the decode case)
            return [[SampledToken(token_id, logprob, top)] for token_id, logprob, top in samples]
        result: list[list[SampledToken]] = [[] for _ in batch.seqs]
        for i, (token_id, logprob, top) in zip(owner, samples):
            result[i].append(SampledToken(token_id, logprob, top))
        return result

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sequence's sampling input, built once (it holds the live output list)."""
        if seq.sampling_row is None:
            group = seq.group
            seq.sampling_row = SamplingRow(params=group.params, prompt_token_ids=group.prompt_token_ids,
                                           output_token_ids=seq.output_token_ids, generator=seq.generator,
                                           eos_token_ids=self.eos_token_ids)
        return seq.sampling_row

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor):
        result: list[list[TopLogprobs] | None] = []
        offset = 0
        for item in batch.seqs:
            lo, n = offset, item.num_new_tokens
            offset += n
            if not item.prompt_logprobs:
                result.append(None)
                continue
            prompt = item.seq.group.prompt_token_ids
            # position p predicts token p + 1; only prompt tokens count.
            count = min(n, len(prompt) - 1 - item.start_position)
            if count <= 0:
                result.append([])
                continue
            logits = self.model.compute_logits(hidden[lo:lo + count])
            targets = prompt[item.start_position + 1:item.start_position + 1 + count]
            logp = torch.log_softmax(logits, dim=-1)
            ids = torch.tensor(targets, device=logp.device)
            result.append(top_logprobs(logp, ids, item.seq.group.params.prompt_logprobs))
        return result

