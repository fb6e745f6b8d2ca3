"""Turns a step plan into tensors, runs the model, samples.

One step = prepare inputs (once, vectorised) -> block moves -> forward ->
logits of the rows that need them -> sample. Nothing here decides *what*
runs (that is the scheduler) or *what it means* (that is the engine).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from loraplex.engine.cuda_graphs import CudaGraphRunner
from loraplex.engine.kv_cache import KVCache
from loraplex.engine.models.llama import LlamaForCausalLM, LoRABatch
from loraplex.engine.outputs import TopLogprobs
from loraplex.engine.host_copy import host_to_device, tensor_to_device
from loraplex.engine.sampler import Sampler, SamplingBatch, SamplingRow, _build_output, top_logprobs
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import PLACEHOLDER_TOKEN, Sequence
from loraplex.engine.step_plan import StepPlan
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
    packed = torch.cat(parts)
    packed = tensor_to_device(packed, device)
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


@dataclass(frozen=True)
class _HostStep:
    """One step's inputs on the host: per-token ``token_ids``, ``seq_index``, ``positions`` and
    ``slot_mapping`` (int64 tensors but the ids), per-sequence ``q_lens``, ``seq_lens``, ``tables`` (block-id
    lists; ``block_tables`` padded ``[B, W] int32``) and ``query_start`` (B + 1 offsets)."""

    token_ids: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    query_start: list[int]
    seq_index: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


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


class PendingStep:
    """A launched step: its sampled ids may still be on the device. :meth:`result` reads them
    back (the host waits for the step there, not before) and returns the :class:`StepResult`.
    ``token_ids`` ``[rows] int64`` device tensor (None: no row sampled)."""

    def __init__(self, batch: ScheduledBatch, owner: list[int], token_ids: torch.Tensor | None,
                 sampled_logprobs: torch.Tensor | None, ready: StepResult | None) -> None:
        self.batch, self.owner = batch, owner
        self.token_ids, self.sampled_logprobs = token_ids, sampled_logprobs
        self._ready = ready
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None
        self._copied = None
        if ready is None and token_ids.is_cuda:
            # Copy the samples back now, behind this step only: reading them later with
            # .tolist() would also wait for every step launched after this one.
            ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            lps = torch.empty(sampled_logprobs.shape, dtype=sampled_logprobs.dtype, pin_memory=True)
            ids.copy_(token_ids, non_blocking=True)
            lps.copy_(sampled_logprobs, non_blocking=True)
            self._host, self._copied = (ids, lps), torch.cuda.Event()
            self._copied.record()

    def result(self) -> StepResult:
        if self._ready is None:
            if self._copied is not None:
                self._copied.synchronize()
                ids, lps = self._host[0].tolist(), self._host[1].tolist()
            else:
                ids, lps = self.token_ids.tolist(), self.sampled_logprobs.tolist()
            samples: list[list[SampledToken]] = [[] for _ in self.batch.seqs]
            for i, token_id, logprob in zip(self.owner, ids, lps):
                samples[i].append(SampledToken(token_id, logprob, None))
            self._ready = StepResult(samples, [None] * len(self.batch.seqs))
        return self._ready


class ModelRunner:
    """Runs one :class:`ScheduledBatch` on the device: ``execute(batch)`` builds the step's input tensors
    (token ids, positions, :class:`AttentionMetadata`, the LoRA mapping from ``slot_of``), applies the batch's
    block copies to ``kv_cache``, runs the model's forward (eagerly, or by replaying a captured CUDA graph for
    decode-only steps), computes the logits of the rows that sample and returns a :class:`StepResult` of sampled
    tokens (and prompt logprobs when asked). It decides nothing about which sequences run or what outputs mean."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device,
                 slot_of=None, dora_slots: set[int] | None = None) -> None:
        """``slot_of(lora_int_id) -> int`` gives the device slot of a pinned adapter; ``dora_slots``: the
        slots holding DoRA adapters (``LoRADeviceWeights.dora_slots``, read at each step)."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.slot_of = slot_of
        self.dora_slots = dora_slots if dora_slots is not None else set()
        self.vocab_size = model.spec.vocab_size
        self.eos_token_ids = set(model.spec.eos_token_ids)
        self.graphs: CudaGraphRunner | None = None
        self._last_sampled: torch.Tensor | None = None  # [rows] int64 device: the last launched step's samples
        self._last_rows: dict[int, int] = {}  # seq_id -> its row in _last_sampled
        self.grammar_masks = GrammarMaskFiller(self.vocab_size, device)
        # Called with each step's plan before its forward (the tensor-parallel driver broadcasts it).
        self.on_step: Callable[[StepPlan], None] | None = None

    def enable_cuda_graphs(self, max_model_len: int, max_num_seqs: int, num_lora_slots: int,
                           max_num_batched_tokens: int | None = None, dora: bool = True) -> None:
        """Capture decode graphs (CUDA only), and mixed-step graphs up to ``max_num_batched_tokens`` tokens
        when given; decode-only and mixed steps then replay them. ``dora``: also capture the DoRA variants
        (False where DoRA adapters are refused: tensor parallelism)."""
        graphs = CudaGraphRunner(self.model, self.kv_cache.layers, self.block_size, max_model_len,
                                 max_num_seqs, num_lora_slots, self.device, max_num_batched_tokens, dora=dora)
        try:
            graphs.capture()
        except RuntimeError as exc:  # keep serving, eagerly, and say so
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            return
        self.graphs = graphs

    # -- inputs -----------------------------------------------------------
    def plan_step(self, batch: ScheduledBatch) -> StepPlan:
        """The forward inputs of ``batch`` as host lists (what tensor-parallel ranks receive), with the
        graph decision: a decode graph, a mixed-step graph over a padded token bucket, or eager."""
        token_ids: list[int] = []
        q_lens, seq_lens, tables = [], [], []
        for item in batch.seqs:
            end = item.start_position + item.num_new_tokens
            token_ids += item.seq.token_ids[item.start_position:end]
            q_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(item.block_ids)
        lora_slots = self._lora_slots(batch)
        dora = lora_slots is not None and not self.dora_slots.isdisjoint(lora_slots)
        graphs_hold_it = not dora or (self.graphs is not None and self.graphs.dora)
        use_graph = graphs_hold_it and self._graph_fits(batch)
        use_mixed = graphs_hold_it and not use_graph and self._mixed_graph_fits(batch)
        return StepPlan(token_ids, q_lens, seq_lens, tables, lora_slots, batch.block_copies,
                        use_graph=use_graph, use_mixed_graph=use_mixed, lora_dora=dora)

    def _host_step(self, plan: StepPlan) -> _HostStep:
        """The step's per-token and per-sequence inputs on the host (vectorised torch ops, no device copy)."""
        bs = self.block_size
        token_ids, q_lens, seq_lens, tables = plan.token_ids, plan.q_lens, plan.seq_lens, plan.block_tables
        num_seqs, num_tokens = len(q_lens), len(token_ids)
        query_start = list(accumulate(q_lens, initial=0))
        # position of token t of sequence b = t - query_start[b] + start[b]
        offsets = [e - q - qs for e, q, qs in zip(seq_lens, q_lens, query_start)]
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), _host_ints(q_lens, torch.int64),
                                            output_size=num_tokens)
        positions = torch.arange(num_tokens) + _host_ints(offsets, torch.int64)[seq_index]
        block_tables = _padded_rows(tables)
        slot_mapping = block_tables[seq_index, positions // bs].to(torch.int64) * bs + positions % bs
        return _HostStep(token_ids, q_lens, seq_lens, tables, query_start, seq_index, positions, block_tables,
                         slot_mapping)

    def prepare_inputs(self, plan: StepPlan) -> StepInputs:
        """Host lists -> vectorised host tensors -> two packed copies to the device."""
        host = self._host_step(plan)
        token_ids, q_lens, seq_lens, query_start = host.token_ids, host.q_lens, host.seq_lens, host.query_start
        seq_index, positions, block_tables, slot_mapping = (host.seq_index, host.positions, host.block_tables,
                                                            host.slot_mapping)
        lora_slots = plan.lora_slots
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
            lora = LoRABatch(plan_segments(lora_tensors[0], self.model.num_lora_slots(), has_lora=True),
                             dora=plan.lora_dora)
        return StepInputs(input_ids, positions_dev, meta, lora, [q - 1 for q in query_start[1:]])

    # -- step -------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run the step and wait for its result (``launch(batch).result()``)."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingStep:
        """Queue the step on the device and return without reading its samples back when no
        row needs top logprobs or prompt logprobs (else the result is read now). Input tokens
        that are still placeholders (async scheduling: sampled by the previous launched step)
        are taken from that step's device samples."""
        # Structured-output masks of this step's rows are filled on a worker thread while
        # the inputs are prepared and the forward pass runs; sampling waits for them.
        plan = self._sampling_plan(batch)
        mask = self.grammar_masks.submit([seq.grammar for _, seq in plan]) if plan else None
        step = self.plan_step(batch)
        if self.on_step is not None:  # tensor parallelism: the other ranks run the same plan
            self.on_step(step)
        hidden = self.forward(step, self._placeholder_inputs(batch))
        prompt_lps = None
        if not step.use_graph and any(s.prompt_logprobs for s in batch.seqs):
            prompt_lps = self._prompt_logprobs(batch, hidden)
        return self._sample(batch, plan, step.sample_token_index, hidden, mask, prompt_lps)

    def _placeholder_inputs(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """(batch rows whose last input token is a placeholder, the row of the previous launched
        step that sampled it)."""
        rows, src = [], []
        for b, item in enumerate(batch.seqs):
            seq = item.seq
            if seq.num_pending_tokens and seq.token_ids[item.start_position + item.num_new_tokens - 1] == PLACEHOLDER_TOKEN:
                rows.append(b)
                src.append(self._last_rows[seq.seq_id])
        return rows, src

    def _fixed_inputs(self, index: list[int], src: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices on the device, their ids from the previous step's samples) or None."""
        if not index:
            return None
        if index == src == list(range(len(index))):  # steady decode: the same rows, in the same order
            return slice(0, len(index)), self._last_sampled[:len(index)]
        return (host_to_device(index, torch.int64, self.device),
                self._last_sampled.index_select(0, host_to_device(src, torch.int64, self.device)))

    @torch.inference_mode()
    def forward(self, step: StepPlan, placeholders: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
        """Block moves, then the forward pass of ``step``: ``[rows, hidden]`` (one row per token, or one per
        sequence when a decode graph is replayed). ``placeholders``: (batch rows whose last input token is a
        placeholder, the previous launched step's sample row holding it) — async scheduling, driver only."""
        self.kv_cache.apply(step.block_copies)
        rows, src = placeholders or ([], [])
        fix = None
        if rows:  # a placeholder is its row's last input token: the row the step samples from
            last = step.sample_token_index
            fix = self._fixed_inputs([last[b] for b in rows], src)
        if step.use_graph:
            return self._run_graph(step, fix)
        if step.use_mixed_graph:
            return self._run_mixed_graph(step, fix)
        inputs = self.prepare_inputs(step)
        if fix is not None:
            inputs.input_ids[fix[0]] = fix[1]
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta, inputs.lora)

    def _graph_fits(self, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and len(batch.seqs) <= self.graphs.max_batch_size
                and all(s.num_new_tokens == 1 and not s.prompt_logprobs for s in batch.seqs))

    def _mixed_graph_fits(self, batch: ScheduledBatch) -> bool:
        """A step with prompt tokens replays a mixed graph when one holds it, no row asks for prompt
        logprobs (those read every position's logits, outside the graph). Async-scheduling placeholders
        (always their row's last and only new token, see :meth:`_placeholder_inputs`) are written over from the
        previous step's device samples after the upload, as for decode graphs."""
        if self.graphs is None or not self.graphs.mixed_sizes or any(s.prompt_logprobs for s in batch.seqs):
            return False
        num_tokens = sum(s.num_new_tokens for s in batch.seqs)
        return self.graphs.mixed_padded_size(num_tokens, len(batch.seqs)) is not None

    def _run_mixed_graph(self, step: StepPlan, input_fix=None) -> torch.Tensor:
        """Replay the mixed graph for the step; returns ``[T, hidden]``. ``input_fix``: as for
        :meth:`CudaGraphRunner.run` (token indices of the step, their ids on the device)."""
        host = self._host_step(step)
        token_slots = None
        if step.lora_slots is not None:
            token_slots = _host_ints(step.lora_slots, torch.int32)[host.seq_index].tolist()
        return self.graphs.run_mixed(host.token_ids, host.positions.numpy(), host.slot_mapping.numpy(), host.q_lens,
                                     host.seq_lens, host.tables, token_slots, dora=step.lora_dora,
                                     input_fix=input_fix)

    def _run_graph(self, step: StepPlan, input_fix=None) -> torch.Tensor:
        bs = self.block_size
        positions = [n - 1 for n in step.seq_lens]
        slots = [table[pos // bs] * bs + pos % bs for table, pos in zip(step.block_tables, positions)]
        return self.graphs.run(step.token_ids, positions, slots, step.seq_lens, step.block_tables, step.lora_slots,
                               input_fix=input_fix, dora=step.lora_dora)

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

    def _sample(self, batch: ScheduledBatch, plan: list[tuple[int, Sequence]], sample_index: list[int],
                hidden: torch.Tensor, mask: PendingMask | None, prompt_lps) -> PendingStep:
        owner = [i for i, _ in plan]
        if prompt_lps is None:
            prompt_lps = [None] * len(batch.seqs)
        if not plan:
            return PendingStep(batch, owner, None, None, StepResult([[] for _ in batch.seqs], prompt_lps))
        rows = [self._sampling_row(seq) for _, seq in plan]
        row_index = [sample_index[i] for i in owner]
        if row_index != list(range(hidden.shape[0])):
            hidden = hidden[host_to_device(row_index, torch.int64, hidden.device)]
        seq_slots = self._lora_slots(batch) if self.model.vocab_lora is not None else None
        logits = self.model.compute_logits(hidden, None if seq_slots is None else [seq_slots[i] for i in owner])
        sampling = SamplingBatch.build(rows, self.vocab_size, logits.device)
        if mask is not None:
            sampling.grammar_bitmask = mask.result()
        raw_logprobs, token_ids = self.sampler.sample_on_device(logits, sampling)
        self._last_sampled = token_ids
        self._last_rows = {seq.seq_id: r for r, (_, seq) in enumerate(plan)}
        if all(n is None for n in sampling.num_logprobs) and not any(p is not None for p in prompt_lps):
            sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            return PendingStep(batch, owner, token_ids, sampled, None)
        out = _build_output(raw_logprobs, token_ids, sampling.num_logprobs)
        result: list[list[SampledToken]] = [[] for _ in batch.seqs]
        for i, token_id, logprob, top in zip(owner, out.token_ids, out.sampled_logprobs, out.logprobs):
            result[i].append(SampledToken(token_id, logprob, top))
        return PendingStep(batch, owner, token_ids, None, StepResult(result, prompt_lps))

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
        seq_slots = self._lora_slots(batch) if self.model.vocab_lora is not None else None
        for b, item in enumerate(batch.seqs):
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
            row_slots = None if seq_slots is None else [seq_slots[b]] * count
            logits = self.model.compute_logits(hidden[lo:lo + count], row_slots)
            targets = prompt[item.start_position + 1:item.start_position + 1 + count]
            logp = torch.log_softmax(logits, dim=-1)
            ids = host_to_device(targets, torch.int64, logp.device)
            result.append(top_logprobs(logp, ids, item.seq.group.params.prompt_logprobs))
        return result

