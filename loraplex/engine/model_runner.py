"""Turns a step plan into tensors, runs the model, samples.

One step = prepare inputs (once, vectorised) -> block moves -> forward ->
logits of the rows that need them -> sample. Nothing here decides *what*
runs (that is the scheduler) or *what it means* (that is the engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.engine.cuda_graphs import CudaGraphRunner
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.engine.outputs import TopLogprobs
from loraplex.engine.sampler import Sampler, SamplingBatch, SamplingRow, top_logprobs
from loraplex.engine.scheduler import ScheduledBatch, ScheduledSeq
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import LoRAMapping

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
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
        token_ids: list[int] = []
        q_lens, seq_lens, starts, tables, slots = [], [], [], [], []
        for item in batch.seqs:
            seq = item.seq
            end = item.start_position + item.num_new_tokens
            token_ids.extend(seq.token_ids[item.start_position:end])
            q_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            starts.append(item.start_position)
            tables.append(seq.block_ids)
            slots.append(self._lora_slot(item))
        dev = self.device
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        query_start = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=query_start[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
        positions = torch.arange(int(query_start[-1])) - query_start[:-1][seq_index] + torch.tensor(starts)[seq_index]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        block_of = block_tables[seq_index, positions // self.block_size].to(torch.int64)
        slot_mapping = block_of * self.block_size + positions % self.block_size
        meta = AttentionMetadata(
            query_start_loc=query_start.to(torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            block_tables=block_tables.to(dev),
            slot_mapping=slot_mapping.to(dev),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_host=query_start.tolist(),
            seq_lens_host=seq_lens,
        )
        lora = None
        if any(s >= 0 for s in slots):
            token_slots = torch.tensor(slots, dtype=torch.int32)[seq_index].to(dev)
            lora = LoRABatch(LoRAMapping.from_token_slots(token_slots))
        return StepInputs(torch.tensor(token_ids, dtype=torch.int64).to(dev), positions.to(dev), meta, lora,
                          (query_start[1:] - 1).tolist())

    def _lora_slot(self, item: ScheduledSeq) -> int:
        lora_id = item.seq.group.lora_int_id
        return self.slot_of(lora_id) if lora_id else -1

    # -- step -------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.kv_cache.apply(batch.block_copies)
        if self._graph_fits(batch):
            hidden = self._run_graph(batch)
            sample_index = list(range(len(batch.seqs)))
            return StepResult(self._sample(batch, sample_index, hidden), [None] * len(batch.seqs))
        inputs = self.prepare_inputs(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta, inputs.lora)
        samples = self._sample(batch, inputs.sample_token_index, hidden)
        prompt_lps = self._prompt_logprobs(batch, hidden)
        return StepResult(samples, prompt_lps)

    def _graph_fits(self, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and len(batch.seqs) <= self.graphs.max_batch_size
                and all(s.num_new_tokens == 1 and not s.prompt_logprobs for s in batch.seqs))

    def _run_graph(self, batch: ScheduledBatch) -> torch.Tensor:
        bs = self.block_size
        token_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for item in batch.seqs:
            pos = item.start_position
            token_ids.append(item.seq.token_ids[pos])
            positions.append(pos)
            slots.append(item.seq.block_ids[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(item.seq.block_ids)
        lora_slots = [self._lora_slot(item) for item in batch.seqs]
        return self.graphs.run(token_ids, positions, slots, seq_lens, tables, lora_slots)

    def _sample(self, batch: ScheduledBatch, sample_token_index: list[int],
                hidden: torch.Tensor) -> list[list[SampledToken]]:
        rows: list[SamplingRow] = []
        row_index: list[int] = []
        owner: list[int] = []
        for i, item in enumerate(batch.seqs):
            for child in range(item.num_samples):
                seq = item.seq.group.seqs[item.seq.index + child]
                rows.append(SamplingRow(params=item.seq.group.params, prompt_token_ids=item.seq.group.prompt_token_ids,
                                        output_token_ids=item.seq.output_token_ids, generator=seq.generator,
                                        eos_token_ids=self.eos_token_ids))
                row_index.append(sample_token_index[i])
                owner.append(i)
        result: list[list[SampledToken]] = [[] for _ in batch.seqs]
        if not rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(row_index, device=hidden.device)])
        out = self.sampler(logits, SamplingBatch.build(rows, self.vocab_size, logits.device))
        for r, i in enumerate(owner):
            result[i].append(SampledToken(out.token_ids[r], out.sampled_logprobs[r], out.logprobs[r]))
        return result

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

