"""Iteration-level scheduler (continuous batching, Orca / vLLM style).

There are no prefill and decode phases: every step moves each scheduled
sequence's ``num_computed_tokens`` towards ``num_tokens`` under one token
budget (``max_num_batched_tokens``). Running sequences go first (oldest
first), so decodes keep flowing while long prompts are chunked (chunked
prefill); then swapped sequences (oldest first; one whose adapter cannot start now is
skipped in place); then waiting sequences are admitted
(FCFS, or fair across tenants, below) while budget, ``max_num_seqs`` and KV
blocks allow. Admission looks the prompt up in the prefix cache without side
effects and commits the hit together with the new blocks, so a request that
waits many steps for blocks is counted once in the prefix-cache stats.

When blocks run out the newest running sequence is preempted: its blocks are
swapped to host memory when swap space is configured and has room, otherwise
freed and recomputed later (vLLM's recompute preemption). A preempted
sequence resumes with identical results.

Adapters: at most ``max_loras`` distinct adapters are in the running set
(each running adapter holds a pinned slot), so a step never needs more slots
than exist. A sequence is admitted only when its adapter is *ready*
(``AdapterPins.ensure_ready``: resident or in host memory, so pinning it
never touches the disk); asking starts a background read, so disk loads stay
off the step's critical path. The waiting queue is scanned in FCFS order
(at most ``max_waiting_scan`` entries per step) and a request whose adapter
does not fit (``max_loras`` distinct adapters already running) or is not
ready is skipped and keeps its place: no head-of-line blocking, base model
requests never wait for slots, and requests of running adapters join the
batch (requests group by adapter). Among requests needing a new adapter the
oldest ready one takes the first free slot. The scan still stops at the first
request that the token budget, ``max_num_seqs`` or the KV blocks cannot take.

::

    waiting (FCFS): | r0 A(full) | r1 base | r2 B(loading) | r3 C(running) | r4 D(ready) | ...
                      skipped      admit     skipped          admit          admit if a slot is free

Aging (no waiting request is overtaken forever): skipping a request whose
adapter needs a slot could starve it while resident adapters keep receiving
new requests, since no slot would ever drain. Once the oldest request blocked
on a slot has waited more than ``max_adapter_wait_steps`` steps, one running
adapter is *drained*: it admits no new sequence (its swapped ones resume while
it is resident), and the slot it frees is reserved for the starved request's adapter (no other new adapter
may take the last free slot while the starved one does not run; other free
slots stay usable). An adapter refused for weight pages or full-module slots
(``AdapterPins.resources_fit``) ages the same way, except that while it is
the starved one no other new adapter starts at all (each would take pages),
and once a drained adapter has emptied without freeing enough, the next
running adapter drains. A drain ends in the step its starved adapter starts
(or fails to read). The drained adapter is the one with the fewest running
sequences, ties broken by the oldest last admission (it empties soonest).
Bound: a request blocked only on a slot gets one after at most
``max_adapter_wait_steps`` + (the longest remaining run of the drained
adapter's sequences) steps, i.e. about ``max_adapter_wait_steps`` plus one
request duration (see ``SchedulerConfig``); the other adapters lose at most
that one slot meanwhile.

Tenants (``SchedulerConfig.policy``): ``"fcfs"`` admits waiting requests in
arrival order whoever sent them; ``"fair"`` admits the waiting request of the
backlogged tenant with the least weighted service so far (the Virtual Token
Counter of Sheng et al., OSDI 2024; see :mod:`loraplex.engine.fairness`),
first-come-first-served within a tenant. Both policies keep everything above:
adapter-blocked requests are skipped in place, the aging drain, the scan
stopping at the first request the budget or the KV blocks cannot take (so a
large request is never overtaken forever), swapped sequences resumed oldest
first. Under ``"fair"`` a preemption takes the newest running sequence of the
most-served tenant. Every planned token is charged to its tenant (prompt
tokens computed for the first time, output tokens sampled) under both
policies, so per-tenant service is always reported.

Readiness is asked for at most ``max_lookahead_loras`` distinct adapters per
step (the host cache size), so prefetches never evict each other before they
are pinned; past that bound no read starts, but an adapter already resident or
in host memory (``AdapterPins.is_ready``, no side effects) is still admitted:
no request of a ready adapter waits on another adapter's read. After
admission, the adapters of queued requests the scan did not reach (it stops
at the token budget or ``max_num_seqs``) are asked too: their reads start
ahead of need. The pins of one step write their device slots together at the
end of admission (``AdapterPins.batched_installs``). An adapter whose read fails fails exactly its waiting and swapped
requests (``ScheduledBatch.failures``); everyone else keeps running.

Post-step state: :meth:`Scheduler.update_from_output` applies a step's
:class:`~loraplex.engine.model_runner.StepResult` (computed tokens advance, blocks are
hashed, prompt logprobs kept, sampled tokens appended, ``n > 1`` groups forked, sequences
finished on EOS / stop token / stop string / length / grammar refusal). Nobody else writes
a :class:`Sequence` after it was built. Recompute preemption, finish and abort share one
reset path (``_reset``: leave the queue, give back every block, 0 computed tokens).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import time
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from loraplex.adapters.errors import AdapterError
from loraplex.engine.fairness import TenantServiceStats, VirtualTokenCounter
from loraplex.engine.kv_cache_manager import BlockCopies, KVCacheManager
from loraplex.engine.sequence import PLACEHOLDER_TOKEN, RequestGroup, Sequence, SequenceStatus

if TYPE_CHECKING:
    from loraplex.engine.model_runner import SampledToken, StepResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: compute tokens
    ``[start_position, start_position + num_new_tokens)``; sample
    ``num_samples`` next tokens from the last one (0 while a prompt chunk
    does not reach the end; ``n`` when a group forks). ``block_ids`` is the
    sequence's block table (the KV cache manager's live list; read it, never
    change it). Read-only after the scheduler builds it (not frozen: a frozen
    dataclass costs ~4x more to build, once per running sequence per step)."""

    seq: Sequence
    start_position: int
    num_new_tokens: int
    num_samples: int
    prompt_logprobs: bool
    block_ids: list[int]


@dataclass(slots=True)
class StepUpdate:
    """What :meth:`Scheduler.update_from_output` changed: ``groups``, each request group that
    got tokens or prompt logprobs this step (batch order) with whether it is finished now;
    ``num_generated_tokens``, the tokens appended."""

    groups: list[tuple[RequestGroup, bool]]
    num_generated_tokens: int


@dataclass(frozen=True)
class AdapterLoadFailure:
    """Sequences dropped (now FINISHED, blocks freed) because adapter ``lora_int_id`` could not
    be read; ``error`` is the adapter error's message."""

    lora_int_id: int
    error: str
    seqs: tuple[Sequence, ...]


@dataclass(frozen=True)
class ScheduledBatch:
    """The step plan handed to the model runner; ``failures`` are for the engine to report."""

    seqs: tuple[ScheduledSeq, ...]
    block_copies: BlockCopies
    num_preempted: int
    failures: tuple[AdapterLoadFailure, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_waiting_scan``: waiting entries examined per step, at most.
    ``max_lookahead_loras``: distinct adapters (not yet running) asked for readiness per step
    before reads stop starting (a ready adapter past it is still admitted); keep it <= the
    host adapter cache size so prefetched adapters are not evicted
    by later prefetches before they are pinned.
    ``max_adapter_wait_steps``: scheduler steps a request blocked on an adapter slot may wait
    before one running adapter is drained for it (aging, see the module docstring); its first
    token then comes within this many steps plus one request duration of the drained adapter.
    ``policy``: ``"fcfs"`` or ``"fair"`` (module docstring). ``prompt_token_weight`` /
    ``output_token_weight``: the service weights of a computed prompt token and a generated token
    (VTC's w_p and w_q; the paper uses 1 and 2)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_model_len: int
    max_waiting_scan: int = 256
    max_lookahead_loras: int = 8
    max_adapter_wait_steps: int = 32
    policy: Literal["fcfs", "fair"] = "fcfs"
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0


class AdapterPins(Protocol):
    """Adapter slot pinning: a running sequence holds one pin on its adapter."""

    def pin(self, lora_int_id: int) -> int:
        """Pin the adapter's slot (loading it synchronously if it is not ready)."""
        ...

    def unpin(self, lora_int_id: int) -> None: ...

    def ensure_ready(self, lora_int_id: int) -> bool:
        """True when ``pin`` will not touch the disk; else start a prefetch (idempotent), False.

        Raises ``AdapterError`` when the adapter cannot be read (its requests fail).
        """
        ...

    def is_ready(self, lora_int_id: int) -> bool:
        """True when ``pin`` will not touch the disk (resident or in host memory); starts nothing
        and raises nothing (a lookup without side effects: ``ensure_ready`` is the commit)."""
        ...

    def batched_installs(self) -> AbstractContextManager[None]:
        """Pins inside it write the device slots once, together, at exit (one step's admissions)."""
        ...

    def resources_fit(self, lora_int_id: int) -> bool:
        """Whether the adapter's weight pages and ``modules_to_save`` copies (if any) would find room now."""
        ...


class _AdapterGate:
    """One step's adapter admission: the running adapters, readiness answers, failed adapters."""

    def __init__(self, pins: AdapterPins | None, active: set[int], config: SchedulerConfig) -> None:
        self.pins = pins
        self.active = active
        self.max_loras = config.max_loras
        self.max_lookahead = config.max_lookahead_loras
        self.ready: dict[int, bool] = {}
        self.asked = 0  # distinct adapters asked for readiness this step
        self.failed: dict[int, str] = {}
        self.draining = 0  # adapter admitting nothing new (its slot drains); 0 = none
        self.reserved_for = 0  # adapter the next free slot is kept for; 0 = none
        self.reserve_all = False  # reserved_for waits for pages / full-module slots: no other new adapter starts
        self.resource_blocked: set[int] = set()  # ready adapters refused this step for pages / full-module slots
        self.drain_over = False  # the adapter the drain was for started (or failed) this step

    def admits(self, lora: int, swapped: bool = False) -> bool:
        """Whether a sequence on adapter ``lora`` (0 = base model) may start running now (``swapped``: it is resuming
        after a swap-out; a draining adapter's swapped sequences still may, while it is resident)."""
        if not lora:
            return True
        if lora == self.draining and not (swapped and lora in self.active):
            return False
        if lora in self.active:
            return True
        ready = self._is_ready(lora)  # asked even when no slot is free: a prefetch ahead of time
        free_slots = self.max_loras - len(self.active)
        if self.reserved_for and lora != self.reserved_for and self.reserved_for not in self.active:
            # one free slot stays kept for the starved adapter (others may take the rest); when it waits for
            # weight pages or full-module slots, no other adapter starts (each would take some)
            free_slots = 0 if self.reserve_all else free_slots - 1
        if not (ready and free_slots > 0):
            return False
        if not self.resources_fit(lora):
            self.resource_blocked.add(lora)
            return False
        return True

    def resources_fit(self, lora: int) -> bool:
        """The adapter's weight pages and full-module slots would be found now (always without a pool)."""
        return self.pins is None or self.pins.resources_fit(lora)

    def blocked_on_slot(self, lora: int, resource_blocked: set[int] = frozenset()) -> bool:
        """``lora`` is an adapter that needs a slot none is free for, or one of ``resource_blocked`` (refused for
        weight pages or full-module slots at the last admission): an aging candidate."""
        if not lora or lora in self.active or lora in self.failed:
            return False
        return len(self.active) >= self.max_loras or lora in resource_blocked

    def admitted(self, lora: int) -> None:
        if lora:
            self.active.add(lora)
        if lora and lora == self.reserved_for:  # the drain served its purpose: nothing is held back any more
            self.end_drain()

    def end_drain(self) -> None:
        """Nothing is held back for the rest of the step (and the scheduler drops its drain)."""
        self.drain_over = True
        self.draining = self.reserved_for = 0
        self.reserve_all = False

    def prefetch(self, lora: int) -> None:
        """Ask whether ``lora`` is ready (starting its read if not), without admitting anything."""
        self._is_ready(lora)

    def lookahead_full(self) -> bool:
        """Whether ``max_lookahead_loras`` adapters were asked for readiness this step."""
        return self.asked >= self.max_lookahead

    def fail(self, lora: int, error: str) -> None:
        """``lora`` cannot be read: its queued requests fail at the end of the step (``Scheduler._fail_adapters``)."""
        self.failed[lora] = error
        self.ready[lora] = False
        if lora == self.reserved_for:  # the starved adapter cannot be read: stop holding others back
            self.end_drain()

    def _is_ready(self, lora: int) -> bool:
        """A resident or host-cached adapter is ready at once, whatever reads are in flight or
        however many adapters were asked before it; a read starts only while fewer than
        ``max_lookahead_loras`` distinct adapters were asked this step (ready ones included: they
        hold host-cache entries that the new reads must not evict before they are pinned).

        A True answer is checked again at each question (``is_ready``, a lookup): a background read that
        finished since may have taken the adapter's host-cache entry, and a pin would then read the disk on the
        step's thread. False answers hold for the step."""
        if self.pins is None:
            return True
        if lora in self.failed:
            return False
        known = self.ready.get(lora)
        if known is False:
            return False
        if self.pins.is_ready(lora):  # never refused, but it holds a host-cache entry: counted once
            if known is None:
                self.asked += 1
                self.ready[lora] = True
            return True
        if known is None:
            if self.asked >= self.max_lookahead:
                return False
            self.asked += 1
        try:
            ready = self.pins.ensure_ready(lora)
        except AdapterError as exc:
            self.fail(lora, str(exc))
            return False
        self.ready[lora] = ready
        return ready


class Scheduler:
    """Decides which sequences run each step and how many tokens each computes; owns the waiting, running and
    swapped queues. ``schedule()`` returns a :class:`ScheduledBatch` (running first, then swapped, then waiting
    FCFS, under ``max_num_batched_tokens`` and ``max_num_seqs``) and allocates, swaps and frees KV blocks through
    ``kv`` (the :class:`KVCacheManager`) and adapter slots through ``pins``; ``update_from_output`` applies the
    step's results (all post-step state); ``finish`` / ``finish_group`` end sequences. It never touches tensors (see the module docstring for preemption and adapter admission)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, pins: AdapterPins | None = None) -> None:
        self.config = config
        self.kv = kv
        self.pins = pins
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_steps = 0
        # (drained adapter, adapter it drains for, whether that one waits for pages / full-module slots)
        self._drain: tuple[int, int, bool] | None = None
        self._resource_blocked: set[int] = set()  # adapters the last step refused for pages / full-module slots
        self._last_admit_step: dict[int, int] = {}
        self.fair = config.policy == "fair"
        self.vtc = VirtualTokenCounter(config.prompt_token_weight, config.output_token_weight)
        self._queued: dict[str, int] = {}  # tenant -> its waiting + swapped sequences

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.wait_since_step = self.num_steps
        group = seq.group
        self.vtc.arrive(group.tenant_id, group.tenant_weight, self._queued)
        self._enqueued(seq)
        self.waiting.append(seq)

    def _enqueued(self, seq: Sequence) -> None:
        tenant = seq.group.tenant_id
        self._queued[tenant] = self._queued.get(tenant, 0) + 1

    def _dequeued(self, seq: Sequence) -> None:
        tenant = seq.group.tenant_id
        left = self._queued[tenant] - 1
        if left:
            self._queued[tenant] = left
        else:
            del self._queued[tenant]
            self.vtc.left(tenant)

    def finish(self, seq: Sequence, finish_reason: str, stop_reason: str | int | None = None) -> None:
        """End ``seq`` (no-op when it ended already): it leaves its queue, gives back its blocks
        and adapter pin (the reset path) and keeps its tokens, with ``finish_reason``
        (``"stop"``, ``"length"``, ``"abort"``, ``"error"``) and ``stop_reason``."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._reset(seq, SequenceStatus.FINISHED)
        seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        if seq.num_pending_tokens:  # tokens of steps launched after the one it stopped at
            del seq.token_ids[-seq.num_pending_tokens:]
            del seq.output_token_ids[-seq.num_pending_tokens:]
            seq.num_pending_tokens = 0

    def finish_group(self, group: RequestGroup, finish_reason: str) -> None:
        """End every unfinished sequence of ``group`` (abort, failed adapter read)."""
        for seq in group.seqs:
            self.finish(seq, finish_reason)

    def _detach(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queue it is in (a running one also drops its adapter pin)."""
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self._dequeued(seq)
        elif seq in self.waiting:  # an unforked sibling of an n > 1 group is in no queue
            self.waiting.remove(seq)
            self._dequeued(seq)

    def _reset(self, seq: Sequence, status: SequenceStatus) -> None:
        """The one reset path of recompute preemption, finish and abort: ``seq`` leaves its
        queue, gives back every block (device, host swap, block hashes) and counts 0 computed
        tokens; its tokens stay."""
        self._detach(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.status = status

    # -- the return half of a step -----------------------------------------
    def commit(self, batch: ScheduledBatch) -> None:
        """The step ``batch`` was launched: its tokens count as computed, and each sequence that
        samples one token gets a placeholder for it (``PLACEHOLDER_TOKEN``, replaced by
        :meth:`update_from_output`), so the next step can be scheduled before the host sees
        the token (async scheduling; the sync engine calls it too, just before the update).
        A group's first sample with ``n > 1`` (a fork) gets no placeholder."""
        for item in batch.seqs:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if item.num_samples == 1:
                seq.append_token(PLACEHOLDER_TOKEN)
                seq.num_pending_tokens += 1

    def update_from_output(self, batch: ScheduledBatch, result: StepResult) -> StepUpdate:
        """Apply the results of committed step ``batch`` (:meth:`commit`) to its sequences
        (those that finished since, e.g. aborted or stopped one step earlier, are skipped; a
        sequence preempted since still gets its token): replace the placeholders by the
        sampled tokens, hash the blocks that became full, keep the prompt logprobs, fork
        ``n > 1`` groups at their first sample, finish sequences (EOS, stop token or string,
        length, a token the grammar refuses). ``result.samples[i]`` /
        ``result.prompt_logprobs[i]`` belong to ``batch.seqs[i]``."""
        touched: dict[str, RequestGroup] = {}
        cache_full_blocks, running, finished = self.kv.cache_full_blocks, SequenceStatus.RUNNING, SequenceStatus.FINISHED
        # Sliding window: blocks no later query reads go back to the pool now, not at the next allocation
        # (a launched step still reading them runs before any later step that reuses them: stream order).
        free_outside_window = self.kv.free_blocks_outside_window if self.kv.sliding_window is not None else None
        generated = 0
        for item, samples, plp in zip(batch.seqs, result.samples, result.prompt_logprobs):
            seq = item.seq
            if seq.status is finished:
                continue
            group = seq.group
            if item.num_samples == 1:  # the placeholder of this step: the oldest pending one
                index = len(seq.token_ids) - seq.num_pending_tokens
                seq.token_ids[index] = seq.output_token_ids[index - seq.num_prompt_tokens] = samples[0].token_id
                seq.num_pending_tokens -= 1
            if seq.status is running:
                cache_full_blocks(seq)
                if free_outside_window is not None:
                    free_outside_window(seq)
            if plp is not None:  # plp[k] is for prompt token start + 1 + k; keep the missing ones
                group.prompt_logprobs.extend(plp[len(group.prompt_logprobs) - 1 - item.start_position:])
                if plp:
                    touched[group.request_id] = group
            if samples:
                if len(samples) > 1:
                    seq.append_token(samples[0].token_id)
                    self._fork(seq, samples)
                elif not group.forked:
                    group.forked = True  # n == 1: its only sequence is the group's output
                self._accept_token(seq, samples[0])
                generated += len(samples)
                touched[group.request_id] = group
        return StepUpdate([(g, g.is_finished) for g in touched.values()], generated)

    def _fork(self, parent: Sequence, samples: list[SampledToken]) -> None:
        """The group's other ``n - 1`` sequences start running on the parent's blocks, each with
        its own first sample."""
        group = parent.group
        group.forked = True
        for child, sample in zip(group.seqs[1:], samples[1:]):
            self._pin(child)  # the parent's adapter, resident and pinned: it cannot fail
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent, child)
            self._start_running(child)
            child.append_token(sample.token_id)
            self._accept_token(child, sample)

    def _accept_token(self, seq: Sequence, sample: SampledToken) -> None:
        """The host's part of a token already in ``seq.token_ids``: grammar, logprobs, text, stop."""
        if seq.grammar is not None and not seq.grammar.accept(sample.token_id):
            # The mask allows only grammar tokens, so this means a bug: end the sequence, say so.
            logger.error("request %s: token %d refused by its grammar after %d tokens; sequence aborted",
                         seq.group.request_id, sample.token_id, seq.grammar.num_accepted_tokens)
            self.finish(seq, "abort")
            return
        seq.cumulative_logprob += sample.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(sample.top_logprobs or {sample.token_id: sample.logprob})
        state = seq.text_state
        state.update(sample.token_id)
        if state.finished:
            self.finish(seq, state.finish_reason, state.stop_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def running_adapters(self) -> set[int]:
        return {s.group.lora_int_id for s in self.running if s.group.lora_int_id}

    def tenant_stats(self) -> tuple[TenantServiceStats, ...]:
        """Per tenant (every tenant seen so far): queued and running sequences, tokens served,
        the virtual counter. Tenant ids are the caller's; sorted by id."""
        running: dict[str, int] = {}
        for seq in self.running:
            running[seq.group.tenant_id] = running.get(seq.group.tenant_id, 0) + 1
        vtc = self.vtc
        return tuple(TenantServiceStats(t, vtc.weights.get(t, 1.0), self._queued.get(t, 0), running.get(t, 0),
                                        vtc.prompt_served.get(t, 0), vtc.output_served.get(t, 0), vtc.counter(t))
                     for t in sorted(vtc.counters))

    # -- one step ---------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        planned: list[ScheduledSeq] = []
        preempted = self._schedule_running(planned, budget)
        budget -= sum(p.num_new_tokens for p in planned)
        failures: tuple[AdapterLoadFailure, ...] = ()
        if not preempted:
            gate = _AdapterGate(self.pins, self.running_adapters(), self.config)
            self._age(gate)
            with self.pins.batched_installs() if self.pins is not None else contextlib.nullcontext():
                budget = self._schedule_swapped(planned, budget, gate)
                self._schedule_waiting(planned, budget, gate)
            self._prefetch(gate)
            self._resource_blocked = gate.resource_blocked
            if gate.drain_over:
                self._drain = None
            failures = self._fail_adapters(gate.failed)
        return ScheduledBatch(tuple(planned), self.kv.take_pending(), preempted, failures)

    def _plan(self, seq: Sequence, budget: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        num_tokens = len(seq.token_ids)
        n = min(num_tokens - start, budget)
        group = seq.group
        samples = 0
        if start + n == num_tokens:
            samples = group.params.n if (group.params.n > 1 and not group.forked) else 1
        # Prompt logprobs cover prompt tokens 1..; the chunk predicts tokens start+1..start+n and
        # is asked for them when the next missing one (``have``) is among them, so that the list
        # grows exactly once per prompt token, also when a preempted prompt is recomputed in
        # chunks that start elsewhere (the engine keeps only the missing tail).
        have = len(group.prompt_logprobs) if group.prompt_logprobs is not None else 0
        wants_plp = (group.prompt_logprobs is not None and seq.index == 0 and have < seq.num_prompt_tokens
                     and start + 1 <= have <= start + n)
        # Service of this step for the tenant: prompt positions computed for the first time
        # (not cached, not a recomputation after preemption) and the sampled tokens.
        fresh = 0
        if seq.num_charged_prompt_tokens < seq.num_prompt_tokens:
            end = min(start + n, seq.num_prompt_tokens)
            fresh = max(0, end - max(start, seq.num_charged_prompt_tokens))
            seq.num_charged_prompt_tokens = max(seq.num_charged_prompt_tokens, end)
        if fresh or samples:
            self.vtc.charge(group.tenant_id, fresh, samples)
        return ScheduledSeq(seq, start, n, samples, wants_plp, self.kv.block_ids(seq))

    def _schedule_running(self, planned: list[ScheduledSeq], budget: int) -> int:
        preempted = 0
        queue = deque(self.running)
        try_allocate_slots, running = self.kv.try_allocate_slots, SequenceStatus.RUNNING
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not try_allocate_slots(seq, n):
                victim = self._preemption_victim(seq, queue)
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not running:
                continue
            planned.append(self._plan(seq, budget))
            budget -= n
        return preempted

    def _age(self, gate: _AdapterGate) -> None:
        """Aging rule: drain running adapters for a request blocked on a slot (or on weight pages or full-module
        slots) too long: one at a time, the next once the previous one has drained while the starved adapter
        still does not fit."""
        if self._drain is not None:
            victim, starved, for_resources = self._drain
            pending = any(s.group.lora_int_id == starved for q in (self.waiting, self.swapped) for s in q)
            if starved in gate.active or not pending:
                self._drain = None
            else:  # until the starved adapter runs: the victim admits nothing, the freed slot is kept
                if victim not in gate.active and not gate.resources_fit(starved):
                    # drained, and its pages were not enough: the next running adapter drains too
                    victim = self._drain_victim(exclude=starved) or victim
                    self._drain = (victim, starved, for_resources)
                gate.draining, gate.reserved_for, gate.reserve_all = self._drain
                gate.prefetch(starved)  # asked first: the admission scan's lookahead must not leave it unread
                return
        blocked = self._resource_blocked
        if len(gate.active) < self.config.max_loras and not blocked:
            return
        oldest = None
        still_blocked: dict[int, bool] = {}  # refused for resources last step and still not fitting now
        for queue in (self.swapped, self.waiting):
            for i, seq in enumerate(queue):
                if i >= self.config.max_waiting_scan:
                    break
                lora = seq.group.lora_int_id
                if not gate.blocked_on_slot(lora, blocked):
                    continue
                if len(gate.active) < self.config.max_loras:
                    if lora not in still_blocked:
                        still_blocked[lora] = not gate.resources_fit(lora)
                    if not still_blocked[lora]:
                        continue
                if oldest is None or seq.wait_since_step < oldest.wait_since_step:
                    oldest = seq
        if oldest is None or self.num_steps - oldest.wait_since_step <= self.config.max_adapter_wait_steps:
            return
        starved = oldest.group.lora_int_id
        victim = self._drain_victim(exclude=starved)
        if victim is None:  # no running adapter holds anything to give
            return
        self._drain = (victim, starved, not gate.resources_fit(starved))
        gate.draining, gate.reserved_for, gate.reserve_all = self._drain
        gate.prefetch(starved)

    def _drain_victim(self, exclude: int) -> int | None:
        """The running adapter (not ``exclude``) with the fewest running sequences, ties broken by the oldest last
        admission (it empties soonest); None when no other adapter runs."""
        running_per_adapter: dict[int, int] = {}
        for seq in self.running:
            lora = seq.group.lora_int_id
            if lora and lora != exclude:
                running_per_adapter[lora] = running_per_adapter.get(lora, 0) + 1
        if not running_per_adapter:
            return None
        return min(running_per_adapter, key=lambda a: (running_per_adapter[a], self._last_admit_step.get(a, 0)))

    def _preemption_victim(self, seq: Sequence, unplanned: deque[Sequence]) -> Sequence:
        """Whom to preempt so ``seq`` fits: never a sequence already planned this step. The
        newest running one (``fair``: the newest of the most-served tenant among ``seq`` and
        the running sequences not planned yet)."""
        if not self.fair:
            return self.running[-1]
        counter = self.vtc.counter
        candidates = [seq, *unplanned]  # in running order, oldest first
        top = max(counter(s.group.tenant_id) for s in candidates)
        return next(s for s in reversed(candidates) if counter(s.group.tenant_id) == top)

    def _pin(self, seq: Sequence) -> None:
        """Pin ``seq``'s adapter (nothing for the base model): the first step of starting it, before any other
        state changes, so that a pin that raises (``AdapterError``: a read from disk failed) leaves nothing to
        undo. :meth:`_start_running` follows."""
        if self.pins is not None and seq.group.lora_int_id:
            self.pins.pin(seq.group.lora_int_id)

    def _unpin(self, seq: Sequence) -> None:
        if self.pins is not None and seq.group.lora_int_id:
            self.pins.unpin(seq.group.lora_int_id)

    def _start_running(self, seq: Sequence) -> None:
        """``seq`` (its adapter pinned: :meth:`_pin`) joins the running queue."""
        if seq.group.lora_int_id:
            self._last_admit_step[seq.group.lora_int_id] = self.num_steps
        if seq.group.first_scheduled_time is None:
            seq.group.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unpin(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        if self.kv.can_swap_out(seq):
            self._detach(seq)
            self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self._enqueued(seq)
            self.swapped.append(seq)
        else:  # recompute: the reset path, then first in the waiting queue
            self._reset(seq, SequenceStatus.WAITING)
            seq.wait_since_step = self.num_steps
            self._enqueued(seq)
            self.waiting.appendleft(seq)

    def _schedule_swapped(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> int:
        """Resume swapped sequences oldest first; one whose adapter cannot start now is skipped in place (as a
        waiting one is: a drained adapter's sequence at the head must not hold back the one the drain is for),
        the first that the budget or the KV blocks cannot take stops the scan."""
        for seq in list(itertools.islice(self.swapped, self.config.max_waiting_scan)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not gate.admits(seq.group.lora_int_id, swapped=True):
                continue
            if not self.kv.can_swap_in(seq, n):
                break
            try:
                self._pin(seq)
            except AdapterError as exc:
                gate.fail(seq.group.lora_int_id, str(exc))
                continue
            self.swapped.remove(seq)
            self._dequeued(seq)
            self.kv.swap_in(seq)
            self.kv.allocate_slots(seq, n)
            self._start_running(seq)
            gate.admitted(seq.group.lora_int_id)
            planned.append(self._plan(seq, budget))
            budget -= n
        return budget

    def _admit(self, seq: Sequence, planned: list[ScheduledSeq], budget: int,
               gate: _AdapterGate) -> ScheduledSeq | None:
        """Admit waiting ``seq`` (its adapter admitted by ``gate``) with its cached prefix; returns
        its planned work (also appended to ``planned``), None when its KV blocks do not fit (then
        nothing changes but its adapter's residence) or its adapter's read failed (``gate.fail``)."""
        try:
            self._pin(seq)  # first: a pin that raises leaves nothing to undo
        except AdapterError as exc:
            gate.fail(seq.group.lora_int_id, str(exc))  # its requests fail at the end of the step
            return None
        computed = None if seq.group.params.prompt_logprobs is not None else self.kv.get_computed_blocks(seq)
        hit = computed.num_tokens if computed is not None else 0
        n = min(seq.num_tokens - hit, budget)
        if not self.kv.allocate_new_computed(seq, computed, n):
            self._unpin(seq)  # resident now, unpinned: the next step's admission finds it ready
            return None  # the lookup had no side effects: retried next step, counted once when admitted
        if seq.index == 0 and seq.num_preemptions == 0:  # the first admission only
            seq.group.num_cached_tokens = hit
        self._dequeued(seq)
        self._start_running(seq)
        gate.admitted(seq.group.lora_int_id)
        item = self._plan(seq, budget)
        planned.append(item)
        return item

    def _schedule_waiting(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> None:
        if self.fair:
            self._schedule_waiting_fair(planned, budget, gate)
            return
        self._schedule_waiting_fcfs(planned, budget, gate)

    def _schedule_waiting_fair(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> None:
        """VTC: repeatedly the least-served backlogged tenant's oldest admissible request. ``max_waiting_scan``
        bounds the adapter questions (``gate.admits``) per step: a request whose adapter was already refused this
        step is passed over without one, so one tenant's flood of requests on a blocked adapter cannot use up the
        scan and starve the other tenants."""
        per_tenant: dict[str, deque[Sequence]] = {}
        for seq in self.waiting:
            per_tenant.setdefault(seq.group.tenant_id, deque()).append(seq)
        counter = self.vtc.counter
        # ties: the tenant whose oldest waiting request came first
        heap = [(counter(t), q[0].wait_since_step, i, t) for i, (t, q) in enumerate(per_tenant.items())]
        heapq.heapify(heap)
        admitted = False
        scanned = 0
        refused: set[int] = set()  # adapters gate.admits refused this step (it does not change its mind in a step)
        max_seqs, max_scan = self.config.max_num_seqs, self.config.max_waiting_scan
        while heap and budget > 0 and len(self.running) < max_seqs and scanned < max_scan:
            _, _, order, tenant = heapq.heappop(heap)
            queue = per_tenant[tenant]
            while queue and scanned < max_scan:
                seq = queue.popleft()
                lora = seq.group.lora_int_id
                if lora in refused:
                    continue
                scanned += 1
                if gate.admits(lora):
                    break
                refused.add(lora)
            else:
                continue  # nothing of this tenant can start now
            item = self._admit(seq, planned, budget, gate)
            if item is None and seq.group.lora_int_id in gate.failed:  # its read failed: it fails at the step's end
                if queue:
                    heapq.heappush(heap, (counter(tenant), queue[0].wait_since_step, order, tenant))
                continue
            if item is None:
                break  # KV blocks: nobody overtakes this request
            admitted = True
            budget -= item.num_new_tokens
            if queue:
                heapq.heappush(heap, (counter(tenant), queue[0].wait_since_step, order, tenant))
        if admitted:
            keep = [s for s in self.waiting if s.status is SequenceStatus.WAITING]
            self.waiting.clear()
            self.waiting.extend(keep)

    def _schedule_waiting_fcfs(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> None:
        """FCFS over at most ``max_waiting_scan`` entries; adapter-blocked ones are skipped in place."""
        skipped: list[Sequence] = []
        scanned = 0
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and scanned < self.config.max_waiting_scan):
            seq = self.waiting[0]
            scanned += 1
            if not gate.admits(seq.group.lora_int_id):
                skipped.append(self.waiting.popleft())
                continue
            item = self._admit(seq, planned, budget, gate)
            if item is None and seq.group.lora_int_id in gate.failed:  # its read failed: it fails at the step's end
                skipped.append(self.waiting.popleft())
                continue
            if item is None:
                break
            self.waiting.popleft()
            budget -= item.num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _prefetch(self, gate: _AdapterGate) -> None:
        """Ask readiness (which starts a background read) for the adapters of queued requests that
        the admission scan did not reach (it stops at the token budget or ``max_num_seqs``), in
        queue order: swapped, then the first ``max_waiting_scan`` waiting. Bounded like every
        readiness question by ``max_lookahead_loras`` distinct adapters per step (the host cache
        size), so prefetched adapters never evict each other before they are pinned."""
        if self.pins is None:
            return
        limit = self.config.max_waiting_scan
        for queue in (self.swapped, self.waiting):
            for i, seq in enumerate(queue):
                if i >= limit or gate.lookahead_full():
                    return
                lora = seq.group.lora_int_id
                if lora and lora not in gate.active:
                    gate.prefetch(lora)

    def _fail_adapters(self, failed: dict[int, str]) -> tuple[AdapterLoadFailure, ...]:
        """Finish every waiting and swapped sequence of each failed adapter (none of them runs:
        a running adapter is resident, so it never fails)."""
        failures = []
        for lora, error in failed.items():
            seqs = tuple(s for queue in (self.waiting, self.swapped) for s in queue if s.group.lora_int_id == lora)
            for seq in seqs:
                self.finish(seq, "error")
            failures.append(AdapterLoadFailure(lora, error, seqs))
        return tuple(failures)
