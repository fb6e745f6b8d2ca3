"""Iteration-level scheduler (continuous batching, Orca / vLLM style).

There are no prefill and decode phases: every step moves each scheduled
sequence's ``num_computed_tokens`` towards ``num_tokens`` under one token
budget (``max_num_batched_tokens``). Running sequences go first (oldest
first), so decodes keep flowing while long prompts are chunked (chunked
prefill); then swapped sequences (FIFO); then waiting sequences are admitted
FCFS while budget, ``max_num_seqs`` and KV blocks allow.

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

Readiness is asked for at most ``max_lookahead_loras`` distinct adapters per
step (the host cache size), so prefetches never evict each other before they
are pinned. An adapter whose read fails fails exactly its waiting and swapped
requests (``ScheduledBatch.failures``); everyone else keeps running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from loraplex.adapters.errors import AdapterError
from loraplex.engine.kv_cache_manager import BlockCopies, KVCacheManager
from loraplex.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's work in a step: compute tokens
    ``[start_position, start_position + num_new_tokens)``; sample
    ``num_samples`` next tokens from the last one (0 while a prompt chunk
    does not reach the end; ``n`` when a group forks). Read-only after the
    scheduler builds it (not frozen: a frozen dataclass costs ~4x more to
    build, once per running sequence per step)."""

    seq: Sequence
    start_position: int
    num_new_tokens: int
    num_samples: int
    prompt_logprobs: bool


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
    ``max_lookahead_loras``: distinct adapters (not yet running) asked for readiness per step,
    at most; keep it <= the host adapter cache size so prefetched adapters are not evicted
    by later prefetches before they are pinned."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_model_len: int
    max_waiting_scan: int = 256
    max_lookahead_loras: int = 8


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


class _AdapterGate:
    """One step's adapter admission: the running adapters, readiness answers, failed adapters."""

    def __init__(self, pins: AdapterPins | None, active: set[int], config: SchedulerConfig) -> None:
        self.pins = pins
        self.active = active
        self.max_loras = config.max_loras
        self.max_lookahead = config.max_lookahead_loras
        self.ready: dict[int, bool] = {}
        self.failed: dict[int, str] = {}

    def admits(self, lora: int) -> bool:
        """Whether a sequence on adapter ``lora`` (0 = base model) may start running now."""
        if not lora or lora in self.active:
            return True
        ready = self._is_ready(lora)  # asked even when no slot is free: a prefetch ahead of time
        return ready and len(self.active) < self.max_loras

    def admitted(self, lora: int) -> None:
        if lora:
            self.active.add(lora)

    def _is_ready(self, lora: int) -> bool:
        if self.pins is None:
            return True
        if lora in self.failed:
            return False
        known = self.ready.get(lora)
        if known is not None:
            return known
        if len(self.ready) >= self.max_lookahead:
            return False
        try:
            ready = self.pins.ensure_ready(lora)
        except AdapterError as exc:
            self.failed[lora] = str(exc)
            ready = False
        self.ready[lora] = ready
        return ready


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, pins: AdapterPins | None = None) -> None:
        self.config = config
        self.kv = kv
        self.pins = pins
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self._stop_running(seq)
            self.kv.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.kv.drop_swapped(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def add_forked(self, seq: Sequence) -> None:
        """A child of a group fork; it already shares the parent's blocks."""
        self._start_running(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def running_adapters(self) -> set[int]:
        return {s.group.lora_int_id for s in self.running if s.group.lora_int_id}

    # -- one step ---------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        planned: list[ScheduledSeq] = []
        preempted = self._schedule_running(planned, budget)
        budget -= sum(p.num_new_tokens for p in planned)
        failures: tuple[AdapterLoadFailure, ...] = ()
        if not preempted:
            gate = _AdapterGate(self.pins, self.running_adapters(), self.config)
            budget = self._schedule_swapped(planned, budget, gate)
            self._schedule_waiting(planned, budget, gate)
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
        return ScheduledSeq(seq, start, n, samples, wants_plp)

    def _schedule_running(self, planned: list[ScheduledSeq], budget: int) -> int:
        preempted = 0
        queue = deque(self.running)
        try_allocate_slots, running = self.kv.try_allocate_slots, SequenceStatus.RUNNING
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not try_allocate_slots(seq, n):
                victim = self.running[-1]
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

    def _start_running(self, seq: Sequence) -> None:
        if self.pins is not None and seq.group.lora_int_id:
            self.pins.pin(seq.group.lora_int_id)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.pins is not None and seq.group.lora_int_id:
            self.pins.unpin(seq.group.lora_int_id)

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        seq.num_preemptions += 1
        if self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.block_hashes = []
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _schedule_swapped(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not gate.admits(seq.group.lora_int_id) or not self.kv.can_swap_in(seq, n):
                break
            self.swapped.popleft()
            self.kv.swap_in(seq)
            self.kv.allocate_slots(seq, n)
            self._start_running(seq)
            gate.admitted(seq.group.lora_int_id)
            planned.append(self._plan(seq, budget))
            budget -= n
        return budget

    def _schedule_waiting(self, planned: list[ScheduledSeq], budget: int, gate: _AdapterGate) -> None:
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
            hit = 0 if seq.group.params.prompt_logprobs is not None else self.kv.compute_prefix_hit(seq)
            if seq.index == 0 and seq.group.num_cached_tokens == 0:
                seq.group.num_cached_tokens = hit
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(seq, n):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                seq.block_hashes = []
                break
            self.waiting.popleft()
            self.kv.allocate_slots(seq, n)
            self._start_running(seq)
            gate.admitted(seq.group.lora_int_id)
            planned.append(self._plan(seq, budget))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _fail_adapters(self, failed: dict[int, str]) -> tuple[AdapterLoadFailure, ...]:
        """Finish every waiting and swapped sequence of each failed adapter (none of them runs:
        a running adapter is resident, so it never fails)."""
        failures = []
        for lora, error in failed.items():
            seqs = tuple(s for queue in (self.waiting, self.swapped) for s in queue if s.group.lora_int_id == lora)
            for seq in seqs:
                self.finish(seq)
            failures.append(AdapterLoadFailure(lora, error, seqs))
        return tuple(failures)
