"""Engine-side request state.

A *request group* is what a user submitted (one prompt, ``n`` completions).
A *sequence* is the scheduling unit: one stream of tokens with its own block
table. A group starts with one sequence; when its prompt is computed and
``n > 1``, the scheduler forks ``n - 1`` more that share the prompt's KV blocks.

Token bookkeeping of one sequence (positions)::

    | prompt tokens ............ | output tokens ...... |
    | computed (KV in cache) ................ | new     |
    0                          num_computed_tokens     num_tokens

Each step the scheduler advances ``num_computed_tokens`` towards
``num_tokens``; when they meet, the model's logits at the last position give
the next token, which is appended (so ``num_tokens`` grows by one).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.outputs import TopLogprobs
from loraplex.engine.sampling_params import SamplingParams


# A sampled token the host has not seen yet (async scheduling): appended when its step is
# launched, replaced by the real id when the step's result is applied.
PLACEHOLDER_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream (its block table is the KV cache manager's, keyed by ``seq_id``).

    After construction only the scheduler changes a sequence (``Scheduler.schedule`` and
    ``Scheduler.update_from_output``; see docs/ARCHITECTURE.md, "Post-step state").

    ``token_ids`` is prompt + output; ``output_token_ids`` is the same output
    kept as its own list (no slicing per step). Generated tokens are added with
    :meth:`append_token`, which grows both. ``sampling_row`` is the model
    runner's per-sequence sampling input, built once on the first sample.
    ``grammar`` is the sequence's structured-output matcher
    (:class:`~loraplex.engine.structured_output.GrammarState`) or None; it
    has accepted exactly ``output_token_ids`` (kept across preemption).
    """

    seq_id: int
    group: "RequestGroup"
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    text_state: Any
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    logprobs: list[TopLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    grammar: Any = None
    wait_since_step: int = 0  # scheduler step at which it last entered the waiting queue
    num_charged_prompt_tokens: int = 0  # prompt positions already charged to the tenant (fair policy)
    num_pending_tokens: int = 0  # trailing PLACEHOLDER_TOKENs: sampled on the device, not yet seen by the host
    output_token_ids: list[int] = field(init=False)
    sampling_row: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.output_token_ids = self.token_ids[self.num_prompt_tokens:]

    def append_token(self, token_id: int) -> None:
        """Add one generated token (to ``token_ids`` and ``output_token_ids``)."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class RequestGroup:
    """A submitted request: one prompt, ``params.n`` completions, one adapter."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    lora_version: str | None
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TopLogprobs | None] | None = None
    num_cached_tokens: int = 0
    forked: bool = False
    tenant_id: str = ""  # who is served (fair scheduling); "" = the anonymous tenant
    tenant_weight: float = 1.0  # the tenant's share weight (> 0)
    first_scheduled_time: float | None = None  # time.monotonic() of the first admission (queueing delay)
    lora_int_id: int = field(init=False)  # the adapter's id, 0 for the base model

    def __post_init__(self) -> None:
        self.lora_int_id = self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def is_finished(self) -> bool:
        if self.params.n == 1:
            return self.seqs[0].status is SequenceStatus.FINISHED
        return self.forked and all(s.status is SequenceStatus.FINISHED for s in self.seqs)
