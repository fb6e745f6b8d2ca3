"""The synchronous engine: requests in, one scheduling step at a time, outputs out.

``LLMEngine.step()`` = schedule -> model runner -> update sequences (append
sampled tokens, fork ``n > 1`` groups, detokenize, stop checks) -> free the
finished. The async server wrapper and the offline :class:`~loraplex.LLM`
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

from loraplex.engine.config import EngineConfig
from loraplex.engine.detokenizer import SequenceTextState
from loraplex.engine.fairness import TenantServiceStats, TenantShare
from loraplex.engine.kv_cache import KVCache, size_kv_cache
from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.model_runner import ModelRunner, SampledToken, StepResult
from loraplex.engine.models.loader import build_model, load_model_spec
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from loraplex.engine.sequence import RequestGroup, Sequence
from loraplex.engine.structured_output import StructuredOutputError, StructuredOutputManager
from loraplex.kernels.ops import Kernels, default_backend

if TYPE_CHECKING:
    from loraplex.adapters.slot_pool import SlotPoolStats

logger = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    """The prompt leaves no room for output under ``max_model_len``."""


class InvalidRequestError(ValueError):
    """A request the engine cannot run (empty prompt, bad token id, duplicate id, LoRA disabled)."""


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
        kernels = Kernels(default_backend(self.device))
        self.model = build_model(self.model_path, self.spec, self.dtype, self.device, kernels, dummy_weights,
                                 config.seed)
        self.eos_token_ids = set(self.spec.eos_token_ids) or {self.tokenizer.eos_token_id}
        self.lora_pool = self._build_lora_pool() if config.enable_lora else None
        self._build_kv_cache()
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device,
                                  slot_of=self.lora_pool.slot_of if self.lora_pool else None)
        self.runner.eos_token_ids = self.eos_token_ids
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.enable_cuda_graphs(self.max_model_len, config.max_num_seqs,
                                           config.max_loras if self.lora_pool else 0)
        self.groups: dict[str, RequestGroup] = {}
        self._structured: StructuredOutputManager | None = None
        self._structured_lock = threading.Lock()
        self._next_seq_id = 0
        self._throughput = _Throughput()
        self._generated_total = 0
        self._prompt_total = 0
        self._preemptions = 0

    # -- construction -----------------------------------------------------
    def _build_lora_pool(self):
        from loraplex.adapters import LoRASlotPool

        spec = self.spec.adapter_spec
        pool = LoRASlotPool(spec, dtype=self.dtype, device=self.device, config=self.config.lora_config(self.device))
        for layer, lin in self.model.lora_linears():
            lin.bind_lora([pool.a[layer][m] for m in lin.module_names], [pool.b[layer][m] for m in lin.module_names],
                          [pool.scaling[layer][m] for m in lin.module_names])
        return pool

    def _build_kv_cache(self) -> None:
        c = self.config
        sizing = size_kv_cache(self.spec, self.dtype, self.device, block_size=c.block_size,
                               max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
                               num_kv_blocks=c.num_kv_blocks, kv_cache_memory_bytes=c.kv_cache_memory_bytes,
                               gpu_memory_utilization=c.gpu_memory_utilization,
                               activation_bytes=self._activation_bytes())
        num_swap = c.swap_space_bytes // (sizing.bytes_per_token * c.block_size)
        self.kv_sizing = sizing
        self.kv_cache = KVCache(self.spec, sizing, self.dtype, self.device, num_swap)
        self.kv_manager = KVCacheManager(sizing.num_blocks, c.block_size, c.enable_prefix_caching, num_swap)
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
        """Unregister an adapter; running requests on it finish first."""
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
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None, tenant: TenantShare | None = None) -> None:
        """Queue a request. ``prompt`` is text or token ids. ``tenant``: who it is served for and
        that tenant's weight (the fair policy shares service by it; ``None``: the anonymous
        tenant ``""`` of weight 1).

        An unknown adapter is registered first (``add_lora``: cheap with a declared
        ``version_id``). Its tensors are read in the background when the scheduler first
        wants it; if that read fails, the request finishes with ``finish_reason="error"``
        and ``RequestOutput.error`` set.

        With ``params.structured_outputs`` its grammar is compiled (cached) and each of the
        ``n`` sequences gets its own matcher.

        Raises:
            InvalidRequestError: duplicate id, empty prompt, token id outside the vocabulary, LoRA disabled,
                a structured-output constraint that does not compile (message names the problem).
            PromptTooLongError: ``len(prompt_tokens) >= max_model_len``.
            AdapterError: the adapter fails validation at registration.
        """
        params = params or SamplingParams()
        if request_id in self.groups:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        version = self._adapter_version(lora_request)
        group = RequestGroup(request_id, text, token_ids, params, lora_request, version)
        if tenant is not None:
            group.tenant_id, group.tenant_weight = tenant.tenant_id, tenant.weight
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        max_tokens = self._effective_max_tokens(params, len(token_ids))
        for index in range(params.n):
            group.seqs.append(self._new_sequence(group, index, max_tokens))
        if params.structured_outputs is not None:
            try:
                for seq in group.seqs:
                    seq.grammar = self.structured_outputs.new_state(params.structured_outputs)
            except StructuredOutputError as exc:
                raise InvalidRequestError(f"structured_outputs: {exc}") from None
        self.groups[request_id] = group
        self._prompt_total += len(token_ids)
        self.scheduler.add(group.seqs[0])

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                                     f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens fit")

    def _adapter_version(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        self._require_lora()
        self.lora_pool.add_lora(lora_request)  # no-op (False) when registered already
        return self.lora_pool.version_id(lora_request.lora_int_id)

    def _effective_max_tokens(self, params: SamplingParams, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        return room if params.max_tokens is None else min(params.max_tokens, room)

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
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that progressed."""
        batch = self.scheduler.schedule()
        self._preemptions += batch.num_preempted
        failed = self._fail_requests(batch) if batch.failures else []
        if batch.is_empty:
            if self.lora_pool is not None and not failed:
                self.lora_pool.wait_for_loads(timeout_s=0.005)  # idle until an adapter read lands
            return failed
        result = self.runner.execute(batch)
        touched = self._postprocess(batch, result)
        self._throughput.add(batch.num_tokens)
        return failed + [self._make_output(g, finished) for g, finished in touched
                         if finished or g.params.output_kind == "cumulative"]

    def _fail_requests(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Final outputs (``finish_reason="error"``) of the requests whose adapter could not be read."""
        outputs = []
        for failure in batch.failures:
            for seq in failure.seqs:
                group = self.groups.pop(seq.group.request_id, None)
                if group is None:
                    continue  # another sequence of this group was reported already
                name = group.lora_request.lora_name if group.lora_request else None
                error = f"adapter {name!r} (lora_int_id={failure.lora_int_id}) could not be loaded: {failure.error}"
                logger.warning("request %s failed: %s", group.request_id, error)
                for member in group.seqs:
                    if not member.is_finished:
                        self.scheduler.finish(member)
                    member.finish_reason = "error"
                outputs.append(self._make_output(group, True, error))
        return outputs

    def _postprocess(self, batch: ScheduledBatch, result: StepResult) -> list[tuple[RequestGroup, bool]]:
        """Apply the step's results; returns each touched group with whether it finished."""
        touched: dict[str, RequestGroup] = {}
        cache_full_blocks = self.kv_manager.cache_full_blocks
        for item, samples, plp in zip(batch.seqs, result.samples, result.prompt_logprobs):
            seq = item.seq
            group = seq.group
            seq.num_computed_tokens += item.num_new_tokens
            cache_full_blocks(seq)
            if plp is not None:  # plp[k] is for prompt token start + 1 + k; keep the missing ones
                group.prompt_logprobs.extend(plp[len(group.prompt_logprobs) - 1 - item.start_position:])
            if samples:
                if len(samples) == 1 and group.forked:  # the common decode step
                    self._append_token(seq, samples[0])
                else:
                    self._take_samples(seq, samples)
                touched[group.request_id] = group
            elif plp:
                touched[group.request_id] = group
        out = []
        for group in touched.values():
            finished = group.is_finished
            if finished:
                self.groups.pop(group.request_id, None)
            out.append((group, finished))
        return out

    def _take_samples(self, seq: Sequence, samples: list[SampledToken]) -> None:
        group = seq.group
        if len(samples) > 1:
            group.forked = True
            for child, sample in zip(group.seqs[1:], samples[1:]):
                child.num_computed_tokens = seq.num_computed_tokens
                self.kv_manager.fork(seq, child)
                self.scheduler.add_forked(child)
                self._append_token(child, sample)
        elif group.params.n == 1:
            group.forked = True
        self._append_token(seq, samples[0])

    def _append_token(self, seq: Sequence, sample: SampledToken) -> None:
        seq.append_token(sample.token_id)
        if seq.grammar is not None and not seq.grammar.accept(sample.token_id):
            # The mask allows only grammar tokens, so this means a bug: end the sequence, say so.
            logger.error("request %s: token %d refused by its grammar after %d tokens; sequence aborted",
                         seq.group.request_id, sample.token_id, seq.grammar.num_accepted_tokens)
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            return
        seq.cumulative_logprob += sample.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(sample.top_logprobs or {sample.token_id: sample.logprob})
        self._generated_total += 1
        state: SequenceTextState = seq.text_state
        state.update(sample.token_id)
        if state.finished:
            seq.finish_reason, seq.stop_reason = state.finish_reason, state.stop_reason
            self.scheduler.finish(seq)

    def _make_output(self, group: RequestGroup, finished: bool, error: str | None = None) -> RequestOutput:
        outputs = []
        for seq in group.seqs if group.forked else group.seqs[:1]:
            ends = seq.text_state.token_text_ends
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text_state.stream_text, token_ids=list(seq.output_token_ids),
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, token_text_ends=list(ends) if ends is not None else None))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             group.prompt_logprobs, group.lora_request.lora_name if group.lora_request else None,
                             group.num_cached_tokens, error,
                             None if group.first_scheduled_time is None
                             else max(0.0, group.first_scheduled_time - group.arrival_time))

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


def _resolve_model(config: EngineConfig) -> Path:
    from loraplex.engine.demo_models import resolve_model

    return resolve_model(config.model, Path(config.download_dir) if config.download_dir else None)
