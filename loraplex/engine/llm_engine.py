"""The synchronous engine: requests in, one scheduling step at a time, outputs out.

``LLMEngine.step()`` = ``Scheduler.schedule`` -> ``ModelRunner.execute`` ->
``Scheduler.update_from_output`` (all post-step state: computed tokens, sampled
tokens, ``n > 1`` forks, detokenization and stop checks, finishing and freeing)
-> outputs of the requests that progressed. The engine writes no ``Sequence``
field after building it. The async server wrapper and the offline :class:`~loraplex.LLM`
both drive it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from loraplex.engine.config import ConfigError, EngineConfig, served_adapter_spec
from loraplex.engine.detokenizer import SequenceTextState
from loraplex.engine.fairness import TenantServiceStats, TenantShare
from loraplex.engine.kv_cache import KVCache, size_kv_cache
from loraplex.engine.kv_cache_manager import KVCacheManager, uniform_sliding_window
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.model_runner import ModelRunner, PendingStep
from loraplex.engine.models.llama import VocabLoRA
from loraplex.adapters.model_spec import UnsupportedModelError
from loraplex.engine.models.loader import build_model, load_model_spec
from loraplex.engine.models.quantization import quantize_linears_fp8
from loraplex.engine.input_processor import (  # noqa: F401 - the errors are re-exported
    ContextLengthExceededError,
    EmptyPromptError,
    InputProcessor,
    InvalidPromptError,
    InvalidRequestError,
    ProcessedPrompt,
    PromptTooLongError,
    TokenIdOutOfVocabError,
)
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from loraplex.engine.sequence import RequestGroup, Sequence
from loraplex.engine.structured_output import StructuredOutputError, StructuredOutputManager
from loraplex.engine.worker import TensorParallelDriver, bind_lora
from loraplex.kernels.ops import Kernels, default_backend

if TYPE_CHECKING:
    from loraplex.adapters.slot_pool import SlotPoolStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for the API's ``/admin/stats``, ``/metrics`` and the console."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_free: int
    block_size: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    prefix_hit_rate: float
    num_preemptions: int
    generated_tokens_total: int
    prompt_tokens_total: int
    tokens_per_s: float
    lora: SlotPoolStats | None = None  # None when the engine runs without LoRA
    scheduling_policy: str = "fcfs"
    tenants: tuple[TenantServiceStats, ...] = ()  # per tenant: queue, running, tokens served, counter
    # Per adapter (``lora_name``): sequences running / waiting (swapped ones count as waiting), as
    # vLLM's ``running_lora_adapters`` / ``waiting_lora_adapters``; adapters with none are left out.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


@dataclass
class _Throughput:
    """Tokens per second over a sliding window of recent steps."""

    window_s: float = 10.0
    events: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.events.append((now, num_tokens))
        self._expire(now)

    def rate(self) -> float:
        """Tokens/s over the steps of the last ``window_s`` seconds (0 once idle that long)."""
        self._expire(time.monotonic())
        if len(self.events) < 2:
            return 0.0
        span = self.events[-1][0] - self.events[0][0]
        return (sum(n for _, n in self.events) - self.events[0][1]) / span if span > 0 else 0.0

    def _expire(self, now: float) -> None:
        while self.events and now - self.events[0][0] > self.window_s:
            self.events.popleft()


class LLMEngine:
    """Paged-KV continuous-batching engine over one Llama-family model.

    Raises at construction: ``FileNotFoundError`` (model folder), ``ValueError``
    (unsupported architecture, bad config), ``KVCacheTooSmallError``.
    """

    def __init__(self, config: EngineConfig, dummy_weights: bool = False) -> None:
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.model_path = _resolve_model(config)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.spec = load_model_spec(self.model_path)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        torch.manual_seed(config.seed)
        # What adapters are checked against: the modules of lora_target_modules; without vocab_size under tensor
        # parallelism (adapters on embed_tokens / lm_head are not sharded, so they are refused when checked).
        self.adapter_spec = served_adapter_spec(config.lora_target_modules, self.spec,
                                                vocab=config.tensor_parallel_size == 1)
        if self.spec.checkpoint_quantization is not None and config.tensor_parallel_size > 1:
            raise UnsupportedModelError("FP8 checkpoints (config.quantization_config) are not implemented with "
                                        "tensor parallelism; serve them with tensor_parallel_size=1")
        # Tensor parallelism: this process is rank 0 (the driver) and holds rank 0's shard.
        self.tp = TensorParallelDriver(config, self.model_path, dummy_weights) if config.tensor_parallel_size > 1 else None
        self.rank_spec = self.spec if self.tp is None else self.tp.state.local_spec
        if self.tp is None:
            kernels = Kernels(default_backend(self.device))
            self.model = build_model(self.model_path, self.spec, self.dtype, self.device, kernels, dummy_weights,
                                     config.seed)
        else:
            self.device, self.model = self.tp.state.device, self.tp.state.model
        self.quantization = None
        if config.quantization == "fp8" and self.spec.checkpoint_quantization is None:
            self.quantization = quantize_linears_fp8(self.model)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the unquantized weights' memory goes to the KV cache
        self.eos_token_ids = set(self.spec.eos_token_ids) or {self.tokenizer.eos_token_id}
        self.input_processor = InputProcessor(self.tokenizer, self.spec.vocab_size, self.max_model_len)
        self.lora_pool = self._build_lora_pool() if config.enable_lora else None
        self._build_kv_cache()
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device,
                                  slot_of=self.lora_pool.slot_of if self.lora_pool else None,
                                  dora_slots=self.lora_pool.weights.dora_slots if self.lora_pool else None)
        self.runner.eos_token_ids = self.eos_token_ids
        graphs = ((self.max_model_len, config.max_num_seqs, config.max_loras if self.lora_pool else 0,
                   config.max_num_batched_tokens, self.tp is None)  # DoRA variants: not with tensor parallelism
                  if self.device.type == "cuda" and not config.enforce_eager else None)
        if self.tp is not None:
            self.tp.start_workers(self.runner, self.kv_sizing, self.kv_cache.num_swap_blocks, graphs)
        elif graphs is not None:
            self.runner.enable_cuda_graphs(*graphs)
        self.groups: dict[str, RequestGroup] = {}
        self._structured: StructuredOutputManager | None = None
        self._structured_lock = threading.Lock()
        self._next_seq_id = 0
        self._throughput = _Throughput()
        self._generated_total = 0
        self._prompt_total = 0
        self._preemptions = 0
        self._inflight: tuple[ScheduledBatch, PendingStep] | None = None  # async scheduling: launched, not applied
        self.num_overlapped_steps = 0  # steps launched while the previous one was not applied yet
        self._sent: dict[str, dict[int, tuple[int, int]]] = {}  # delta outputs: request -> seq index -> (tokens, chars) sent

    # -- construction -----------------------------------------------------
    def _build_lora_pool(self):
        from loraplex.adapters import LoRASlotPool

        pool = LoRASlotPool(self.adapter_spec, dtype=self.dtype, device=self.device, config=self.config.lora_config(self.device),
                            weights=self.tp.state.lora_weights if self.tp is not None else None)
        if self.config.lora_fold_shrink == "on" and self.tp is None and any(
                not lin.can_fold_shrink(self.dtype) for _, lin in self.model.lora_linears() if lin.qweight is not None):
            raise ConfigError("lora_fold_shrink", "on", "with FP8 weights needs their GEMM's split activations (bf16 "
                              f"on a compute capability 9 GPU, Triton kernels), not {self.dtype} on {self.device}")
        if bind_lora(self.model, pool.weights, self.config.lora_fold_shrink if self.tp is None else "off") \
                and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights the folded ones replaced: to the KV cache, as with FP8
        if self.tp is None:  # DoRA installs read the base weights (refused with tensor parallelism)
            pool.weights.bind_base_weights(self.model.base_weight_rows)
        weights = pool.weights
        if weights.has_vocab:  # adapters on embed_tokens / lm_head (not with tensor parallelism)
            self.model.bind_vocab_lora(VocabLoRA(weights.embed_a_t, weights.embed_b, weights.head_a, weights.head_b,
                                                 weights.vocab_scaling, weights.full, weights.full_index,
                                                 weights.full_index_host, weights.vocab_lora_host))
        if self.device.type == "cuda":  # compiled kernels: checked on this device before serving adapters
            from loraplex.kernels.self_check import check_add_lora, check_folded_lora, check_fp8_folded_shrink

            bound = [lin for _, lin in self.model.lora_linears() if lin.lora_a]  # the linears bound to the pool
            shapes = {(lin.weight_in_features, tuple(lin.out_sizes)) for lin in bound}
            check_add_lora(sorted(shapes), self.config.max_loras, self.config.max_lora_rank, self.dtype, self.device,
                           page_rows=pool.weights.page_rows)
            folded = {(lin.weight_in_features, tuple(lin.out_sizes)) for lin in bound if lin.folded_a is not None}
            if folded:
                check_folded_lora(sorted(folded), self.rank_spec.hidden_size, self.config.max_loras,
                                  self.config.max_lora_rank, self.dtype, self.device,
                                  page_rows=pool.weights.page_rows)
            fp8_folded = {(lin.weight_in_features, lin.qweight.shape[0], lin.folded_a.shape[0]) for lin in bound
                          if lin.qweight is not None and lin.folded_a is not None}
            if fp8_folded:
                check_fp8_folded_shrink(sorted(fp8_folded), self.dtype, self.device)
        return pool

    def _build_kv_cache(self) -> None:
        c = self.config
        window = uniform_sliding_window(self.rank_spec.layer_windows)
        sizing = size_kv_cache(self.rank_spec, self.dtype, self.device, block_size=c.block_size,
                               max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
                               num_kv_blocks=c.num_kv_blocks, kv_cache_memory_bytes=c.kv_cache_memory_bytes,
                               gpu_memory_utilization=c.gpu_memory_utilization,
                               activation_bytes=self._activation_bytes(), sliding_window=window,
                               max_num_batched_tokens=c.max_num_batched_tokens)
        num_swap = c.swap_space_bytes // (sizing.bytes_per_token * c.block_size)
        self.kv_sizing = sizing
        self.kv_cache = KVCache(self.rank_spec, sizing, self.dtype, self.device, num_swap)
        if window is not None:
            logger.info("every layer attends to the last %d tokens: KV blocks wholly outside the window are freed "
                        "as sequences advance (about %d blocks per long sequence)", window,
                        -(-window // c.block_size) + 1)
        self.kv_manager = KVCacheManager(sizing.num_blocks, c.block_size, c.enable_prefix_caching, num_swap,
                                         sliding_window=window)
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens, c.max_loras,
                                                   self.max_model_len, max_lookahead_loras=c.max_cpu_loras,
                                                   max_adapter_wait_steps=c.max_adapter_wait_steps,
                                                   policy=c.scheduling_policy,
                                                   prompt_token_weight=c.fair_prompt_token_weight,
                                                   output_token_weight=c.fair_output_token_weight),
                                   self.kv_manager, self.lora_pool)

    def _activation_bytes(self) -> int:
        """Upper estimate of one step's activation memory (kept out of the KV cache),
        plus a margin for CUDA graphs and the sampler."""
        s, elem = self.spec, torch.empty((), dtype=self.dtype).element_size()
        per_token = (3 * s.intermediate_size + 6 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
        logits = self.config.max_num_seqs * s.vocab_size * 4 * 4
        return 2 * self.config.max_num_batched_tokens * per_token * elem + logits + (1 << 30)

    # -- adapters ---------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter after validating it; raises ``AdapterError`` for a bad one.

        With ``lora_request.version_id`` declared only its config and safetensors header are
        read now (tensors at first use); without it the tensors are read and hashed now.
        """
        self._require_lora()
        return self.lora_pool.add_lora(lora_request)

    def preload_lora(self, lora_request: LoRARequest) -> bool:
        """``add_lora``, then read the adapter into the host cache now (unless it is resident or
        cached already) so its first request does not wait for the disk. Returns ``add_lora``'s
        result; raises ``AdapterError`` for a bad adapter or a failed read."""
        added = self.add_lora(lora_request)
        self.lora_pool.preload(lora_request.lora_int_id)
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter: it accepts no new requests from now on, and the requests it accepted (queued,
        swapped or running) finish on it first; then it is dropped. Returns False if it is unknown or already
        being removed."""
        self._require_lora()
        return self.lora_pool.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.lora_pool.list_loras()} if self.lora_pool else set()

    def close(self) -> None:
        """Stop the adapter reader threads (reads not started are cancelled). The engine's
        device memory is released once the engine is garbage (``gc.collect()`` then
        ``torch.cuda.empty_cache()`` hand it back to the device)."""
        if self.lora_pool is not None:
            self.lora_pool.close()
        self.runner.grammar_masks.close()
        if self.tp is not None:
            self.tp.close()

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler/cache for this model's tokenizer (built at first use; thread-safe)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer, self.spec.vocab_size,
                                                           sorted(self.eos_token_ids))
            return self._structured

    def _require_lora(self) -> None:
        if self.lora_pool is None:
            raise InvalidRequestError("LoRA is disabled: start the engine with enable_lora=True")

    # -- requests ---------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | ProcessedPrompt,
                    params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None, tenant: TenantShare | None = None) -> None:
        """Queue a request. ``prompt`` is text, token ids, or what ``input_processor.process``
        returned for it with the same ``params`` (the checks are not repeated). ``tenant``: who it is served for and
        that tenant's weight (the fair policy shares service by it; ``None``: the anonymous
        tenant ``""`` of weight 1).

        An unknown adapter is registered first (``add_lora``: cheap with a declared
        ``version_id``). Its tensors are read in the background when the scheduler first
        wants it; if that read fails, the request finishes with ``finish_reason="error"``
        and ``RequestOutput.error`` set.

        With ``params.structured_outputs`` its grammar is compiled (cached) and each of the
        ``n`` sequences gets its own matcher.

        Raises:
            InvalidPromptError: the prompt is refused by ``InputProcessor.process`` (``EmptyPromptError``,
                ``TokenIdOutOfVocabError``, ``PromptTooLongError``, ``ContextLengthExceededError``).
            InvalidRequestError: duplicate id, LoRA disabled, a structured-output constraint that does
                not compile (message names the problem).
            AdapterError: the adapter fails validation at registration.
        """
        params = params or SamplingParams()
        if request_id in self.groups:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        text, token_ids = processed.text, processed.token_ids
        version = self._adapter_version(lora_request)
        group = RequestGroup(request_id, text, token_ids, params, lora_request, version)
        if tenant is not None:
            group.tenant_id, group.tenant_weight = tenant.tenant_id, tenant.weight
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for index in range(params.n):
            group.seqs.append(self._new_sequence(group, index, processed.max_tokens))
        if params.structured_outputs is not None:
            try:
                for seq in group.seqs:
                    seq.grammar = self.structured_outputs.new_state(params.structured_outputs)
            except StructuredOutputError as exc:
                raise InvalidRequestError(f"structured_outputs: {exc}") from None
        if group.lora_int_id:
            self.lora_pool.hold(group.lora_int_id)  # a remove_lora from now on lets this request finish
        self.groups[request_id] = group
        self._prompt_total += len(token_ids)
        self.scheduler.add(group.seqs[0])

    def _adapter_version(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        self._require_lora()
        self.lora_pool.add_lora(lora_request)  # no-op (False) when registered already
        return self.lora_pool.version_id(lora_request.lora_int_id)

    def _new_sequence(self, group: RequestGroup, index: int, max_tokens: int) -> Sequence:
        generator = None
        if group.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(group.params.seed + index)
        state = SequenceTextState(self.tokenizer, group.prompt_token_ids, group.params, self.eos_token_ids, max_tokens,
                                  defer_text=group.params.output_kind == "final_only")
        self._next_seq_id += 1
        return Sequence(self._next_seq_id, group, index, list(group.prompt_token_ids), len(group.prompt_token_ids),
                        generator, state, logprobs=[] if group.params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks and adapter pin (no-op if unknown)."""
        group = self._forget(request_id)
        if group is not None:
            self.scheduler.finish_group(group, "abort")
            self._sent.pop(request_id, None)

    def _forget(self, request_id: str) -> RequestGroup | None:
        """Take an ended (or ending) request out of the engine: its group, None if unknown; its adapter hold
        released (a pending ``remove_lora`` completes once no request holds or pins the adapter)."""
        group = self.groups.pop(request_id, None)
        if group is not None and group.lora_int_id:
            self.lora_pool.release(group.lora_int_id)
        return group

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that progressed.

        Sync (``async_scheduling=False``): schedule -> run -> apply the results -> outputs.

        Async (``async_scheduling=True``): step N+1 is scheduled and launched while step N
        still runs on the device; then N's samples are read back and applied, so a call
        returns the outputs of the step launched by the previous call. A token sampled in
        step N enters step N+1 on the device (a placeholder on the host until then), so a
        sequence that stops at N's token has run one more step for nothing (its blocks are
        freed then; that extra token is dropped). Step N is applied *before* N+1 is scheduled
        (a sync step) when the host needs its tokens first: an ``n > 1`` fork, prompt
        logprobs, or a sampled request with logprobs, structured output, penalties or
        ``min_tokens``. Tokens are identical to the sync engine's.
        """
        if not self.config.async_scheduling:
            batch = self._schedule()
            outputs = self._fail_requests(batch) if batch.failures else []
            if batch.is_empty:
                self._idle(outputs)
                return outputs
            pending = self.runner.launch(batch)
            self.scheduler.commit(batch)
            return outputs + self._apply(batch, pending)
        outputs: list[RequestOutput] = []
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not _overlappable(inflight[0]):
            outputs += self._apply(*inflight)
            inflight = None
        batch = self._schedule()
        if batch.failures:
            outputs += self._fail_requests(batch)
        if not batch.is_empty:
            if inflight is not None:
                self.num_overlapped_steps += 1
            pending = self.runner.launch(batch)
            self.scheduler.commit(batch)
            self._inflight = (batch, pending)
        if inflight is not None:
            outputs += self._apply(*inflight)
        elif batch.is_empty:
            self._idle(outputs)
        return outputs

    def _schedule(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self._preemptions += batch.num_preempted
        return batch

    def _idle(self, outputs: list[RequestOutput]) -> None:
        if self.lora_pool is not None and not outputs:
            self.lora_pool.wait_for_loads(timeout_s=0.005)  # idle until an adapter read lands

    def _apply(self, batch: ScheduledBatch, pending: PendingStep) -> list[RequestOutput]:
        """Read the step's samples back (waiting for the device) and apply them; the outputs."""
        update = self.scheduler.update_from_output(batch, pending.result())
        self._generated_total += update.num_generated_tokens
        self._throughput.add(batch.num_tokens)
        outputs = []
        for group, finished in update.groups:
            if finished:
                self._forget(group.request_id)
            if finished or group.params.output_kind != "final_only":
                outputs.append(self._make_output(group, finished))
        return outputs

    def _fail_requests(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Final outputs (``finish_reason="error"``) of the requests whose adapter could not be read."""
        outputs = []
        for failure in batch.failures:
            for seq in failure.seqs:
                group = self._forget(seq.group.request_id)
                if group is None:
                    continue  # another sequence of this group was reported already
                name = group.lora_request.lora_name if group.lora_request else None
                error = f"adapter {name!r} (lora_int_id={failure.lora_int_id}) could not be loaded: {failure.error}"
                logger.warning("request %s failed: %s", group.request_id, error)
                self.scheduler.finish_group(group, "error")
                outputs.append(self._make_output(group, True, error))
        return outputs

    def _make_output(self, group: RequestGroup, finished: bool, error: str | None = None) -> RequestOutput:
        """The group's output: its whole state (``cumulative`` / ``final_only``) or what is new since
        its previous output (``delta``: only the new tokens, text, logprobs and text ends are
        sliced; nothing already sent is copied)."""
        seqs = group.seqs if group.forked else group.seqs[:1]
        if group.params.output_kind == "delta":
            outputs = self._delta_outputs(group, seqs, finished)
        else:
            outputs = []
            for seq in seqs:
                ends = seq.text_state.token_text_ends
                outputs.append(CompletionOutput(
                    index=seq.index, text=seq.text_state.stream_text,
                    token_ids=seq.output_token_ids[:len(seq.output_token_ids) - seq.num_pending_tokens],
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason, token_text_ends=list(ends) if ends is not None else None))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             group.prompt_logprobs, group.lora_request.lora_name if group.lora_request else None,
                             group.num_cached_tokens, error,
                             None if group.first_scheduled_time is None
                             else max(0.0, group.first_scheduled_time - group.arrival_time))

    def _delta_outputs(self, group: RequestGroup, seqs: list[Sequence], finished: bool) -> list[CompletionOutput]:
        sent = self._sent.get(group.request_id)
        if sent is None:
            sent = self._sent[group.request_id] = {}
        outputs = []
        for seq in seqs:
            tokens_from, chars_from = sent.get(seq.index, (0, 0))
            state = seq.text_state
            tokens_to, chars_to = len(seq.output_token_ids) - seq.num_pending_tokens, state.stream_end
            ends = state.token_text_ends
            outputs.append(CompletionOutput(
                index=seq.index, text=state.text[chars_from:chars_to],
                token_ids=seq.output_token_ids[tokens_from:tokens_to],
                logprobs=seq.logprobs[tokens_from:tokens_to] if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, token_text_ends=ends[tokens_from:tokens_to] if ends is not None else None))
            sent[seq.index] = (tokens_to, max(chars_from, chars_to))
        if finished:
            del self._sent[group.request_id]
        return outputs

    # -- stats ------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        pool = self.kv_manager.pool.stats()
        prefix = self.kv_manager.prefix_stats
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.used,
            kv_blocks_cached=pool.cached, kv_blocks_free=pool.free, block_size=self.config.block_size,
            prefix_queries_tokens=prefix.queries_tokens, prefix_hits_tokens=prefix.hits_tokens,
            prefix_hit_rate=prefix.hit_rate, num_preemptions=self._preemptions,
            generated_tokens_total=self._generated_total, prompt_tokens_total=self._prompt_total,
            tokens_per_s=self._throughput.rate(), lora=self.lora_pool.stats() if self.lora_pool else None,
            scheduling_policy=self.config.scheduling_policy, tenants=self.scheduler.tenant_stats(),
            running_lora_adapters=_sequences_per_adapter(self.scheduler.running),
            waiting_lora_adapters=_sequences_per_adapter([*self.scheduler.waiting, *self.scheduler.swapped]))


def _sequences_per_adapter(seqs) -> dict[str, int]:
    """``lora_name`` -> how many of ``seqs`` run on that adapter (base-model sequences left out)."""
    counts: dict[str, int] = {}
    for seq in seqs:
        lora = seq.group.lora_request
        if lora is not None:
            counts[lora.lora_name] = counts.get(lora.lora_name, 0) + 1
    return counts


def _overlappable(batch: ScheduledBatch) -> bool:
    """Whether the next step may be scheduled before ``batch``'s samples are applied: no fork,
    no prompt logprobs, no sampled row that needs its tokens on the host (top logprobs,
    grammar, penalties or min_tokens read the output so far)."""
    for item in batch.seqs:
        if item.num_samples > 1 or item.prompt_logprobs:
            return False
        if item.num_samples:
            p = item.seq.group.params
            if (p.logprobs is not None or p.structured_outputs is not None or p.min_tokens > 0
                    or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
                return False
    return True


def _resolve_model(config: EngineConfig) -> Path:
    from loraplex.engine.demo_models import resolve_model

    return resolve_model(config.model, Path(config.download_dir) if config.download_dir else None)
