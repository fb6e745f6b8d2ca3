"""A counted-step driver for the scheduler with a fake model runner (no model, no clock).

Each ``Sim.step()`` = arrivals due at this step are queued -> ``Scheduler.schedule()`` ->
a fake step result (token 7 for every planned sample) -> ``Scheduler.commit`` and
``Scheduler.update_from_output``
(as the engine does: tokens computed, blocks hashed, a sample appended, the sequence
finished after ``max_tokens`` outputs through its text state, here the ``SimRequest``).
Service is measured here from the batches themselves (independent of the scheduler's own
counters): prompt tokens computed the first time, output tokens sampled.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.engine.model_runner import SampledToken, StepResult
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import RequestGroup, Sequence

_ids = itertools.count(1)


@dataclass(eq=False)
class SimRequest:
    name: str
    tenant: str
    lora: int
    prompt_tokens: int
    max_tokens: int
    arrival_step: int
    seq: Sequence | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    on_finish: Callable[["SimRequest"], None] | None = None

    def __post_init__(self) -> None:
        self.num_outputs = 0
        self.finished = False
        self.finish_reason = self.stop_reason = None

    def update(self, token_id: int) -> None:
        """The text state's part: count the token, finish at ``max_tokens``."""
        self.num_outputs += 1
        if self.num_outputs >= self.max_tokens:
            self.finished, self.finish_reason = True, "length"

    @property
    def ttft_steps(self) -> int:
        """Steps taken from arrival to the first token (alone and short: 1, the prefill step)."""
        return self.first_token_step - self.arrival_step

    @property
    def duration_steps(self) -> int:
        return self.finish_step - self.arrival_step


@dataclass
class Sim:
    scheduler: Scheduler
    now: int = 0  # steps taken
    arrivals: dict[int, list[SimRequest]] = field(default_factory=lambda: defaultdict(list))
    requests: list[SimRequest] = field(default_factory=list)
    # per step: tenant -> (prompt tokens computed first time, output tokens sampled)
    service: list[dict[str, list[int]]] = field(default_factory=list)
    lora_outputs: list[dict[int, int]] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    num_preempted: int = 0

    def submit(self, name: str, *, at: int | None = None, lora: int = 0, prompt_tokens: int = 4,
               max_tokens: int = 32, tenant: str = "", weight: float = 1.0, on_finish=None) -> SimRequest:
        """Queue a request before step ``at`` (default: the next step)."""
        at = self.now if at is None else at
        self.weights[tenant] = weight
        req = SimRequest(name, tenant, lora, prompt_tokens, max_tokens, at, on_finish=on_finish)
        self.requests.append(req)
        self.arrivals[at].append(req)
        return req

    def _enqueue(self, req: SimRequest) -> None:
        lora = LoRARequest(f"lora{req.lora}", req.lora, f"/adapters/{req.lora}") if req.lora else None
        base = next(_ids) * 1000
        tokens = list(range(base, base + req.prompt_tokens))
        group = RequestGroup(req.name, None, tokens, SamplingParams(max_tokens=req.max_tokens), lora,
                             f"v{req.lora}" if req.lora else None)
        group.tenant_id, group.tenant_weight = req.tenant, self.weights[req.tenant]
        seq = Sequence(next(_ids), group, 0, list(tokens), req.prompt_tokens, None, req)
        group.seqs.append(seq)
        req.seq = seq
        self.scheduler.add(seq)

    def step(self):
        for req in self.arrivals.pop(self.now, []):
            self._enqueue(req)
        self.now += 1
        batch = self.scheduler.schedule()
        self.num_preempted += batch.num_preempted
        served: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        outputs: dict[int, int] = defaultdict(int)
        for item in batch.seqs:
            seq, req = item.seq, item.seq.text_state
            start, end = item.start_position, item.start_position + item.num_new_tokens
            fresh = max(0, min(end, seq.num_prompt_tokens) - max(start, getattr(req, "_prompt_done", 0)))
            req._prompt_done = max(getattr(req, "_prompt_done", 0), min(end, seq.num_prompt_tokens))
            served[req.tenant][0] += fresh
            if item.num_samples:
                served[req.tenant][1] += 1
                outputs[req.lora] += 1
                if req.first_token_step is None:
                    req.first_token_step = self.now
        result = StepResult([[SampledToken(7, 0.0, None)] * item.num_samples for item in batch.seqs],
                            [None] * len(batch.seqs))
        self.scheduler.commit(batch)
        update = self.scheduler.update_from_output(batch, result)
        for group, finished in update.groups:
            req = group.seqs[0].text_state
            if finished:
                req.finish_step = self.now
                if req.on_finish is not None:
                    req.on_finish(req)
        self.service.append(dict(served))
        self.lora_outputs.append(dict(outputs))
        return batch

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def weighted_service(self, tenant: str, first: int, last: int, prompt_w: float = 1.0,
                         output_w: float = 2.0) -> float:
        """Weighted tokens served to ``tenant`` in steps ``[first, last)`` (0-based step index)."""
        total = 0.0
        for served in self.service[first:last]:
            p, o = served.get(tenant, (0, 0))
            total += prompt_w * p + output_w * o
        return total


def make_scheduler(pins=None, *, max_loras: int = 4, max_num_seqs: int = 256, budget: int = 4096,
                   num_blocks: int = 8192, block_size: int = 4, prefix_caching: bool = False,
                   **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_loras, 4096, **config), kv, pins)


def closed_loop(sim: Sim, name: str, *, start: int, **kw) -> None:
    """A client that sends its next request the step after the previous one finished."""
    counter = itertools.count()

    def again(req: SimRequest) -> None:
        sim.submit(f"{name}-{next(counter)}", at=sim.now, on_finish=again, **kw)

    sim.submit(f"{name}-{next(counter)}", at=start, on_finish=again, **kw)
