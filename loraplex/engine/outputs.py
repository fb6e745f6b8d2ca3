"""Outputs returned by the engine, as in vLLM's ``RequestOutput``."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

# One position's top log-probabilities: token id -> logprob (natural log).
TopLogprobs = dict[int, float]


def _pickled_by_position(cls):
    """Pickle ``cls`` (a dataclass) as its constructor and its fields' values in order, instead of the
    default class-and-state form: half the time to pickle and under half to unpickle (measured: 128
    one-token delta outputs, 559 -> 288 us and 406 -> 151 us). The engine process sends every step's
    outputs to the server process this way."""
    values = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))

    def __reduce__(self):
        return cls, values(self)

    cls.__reduce__ = __reduce__
    return cls


@_pickled_by_position
@dataclass(slots=True)  # built per request and step: slots make that and the attribute reads cheaper
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``text`` and ``token_ids`` are cumulative (everything generated so far), or, with
    ``SamplingParams.output_kind == "delta"``, what is new since the request's previous
    output (then ``logprobs`` and ``token_text_ends`` are the new entries too, the ends
    still counted in characters of the whole text; ``cumulative_logprob``,
    ``finish_reason`` and ``stop_reason`` are the current values in every mode).
    ``logprobs[i]`` holds the top log-probabilities at generated position i,
    always including the sampled token. ``finish_reason`` is ``None`` while
    running, then ``"stop"`` (EOS, stop string or stop token) or ``"length"``
    (max_tokens or max_model_len) or ``"abort"``, or ``"error"`` when the request
    failed (``RequestOutput.error`` says why). ``stop_reason`` is the stop
    string or stop token id that ended it, if any. ``token_text_ends[i]`` (when
    logprobs were asked for) is the length of the text produced by tokens ``0..i``
    (it may pass ``len(text)`` while text is held back from streaming; see
    :attr:`~loraplex.engine.detokenizer.SequenceTextState.token_text_ends`).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TopLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_text_ends: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@_pickled_by_position
@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step.

    ``prompt_logprobs[i]`` is ``None`` for the first prompt token and the top
    log-probabilities of prompt token i given tokens < i otherwise (in every output kind
    the whole list so far, shared with the engine: read it, do not change it).
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    ``error`` is set (and every completion's ``finish_reason`` is ``"error"``) when
    the request failed while queued, e.g. its adapter's files could not be read.
    ``queued_s``: seconds from ``add_request`` to its first scheduling step (``None`` until then).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TopLogprobs | None] | None = None
    lora_name: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queued_s: float | None = None
