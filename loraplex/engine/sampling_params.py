"""Per-request sampling parameters, as in vLLM's ``SamplingParams``.

Validated once at construction: a bad value raises ``ValueError`` naming the
field and the value, before the request reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.structured_params import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    Fields follow vLLM / the OpenAI API:

    - ``n``: number of completions sampled from the same prompt (they share the
      prompt's KV blocks).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_p``: nucleus sampling, keep the smallest set of tokens whose
      probability mass reaches ``top_p`` (Holtzman et al. 2019). 1.0 disables.
    - ``top_k``: keep the ``top_k`` most likely tokens; 0 or -1 disables.
    - ``min_p``: drop tokens whose probability is below ``min_p`` times the
      most likely token's. 0 disables.
    - ``seed``: per-request random seed; the same seed gives the same tokens
      whatever else is in the batch.
    - ``presence_penalty`` / ``frequency_penalty``: OpenAI semantics, subtracted
      from the logits of tokens already generated (once / per occurrence).
    - ``repetition_penalty``: CTRL-style (Keskar et al. 2019) over prompt and
      generated tokens: positive logits divided by it, negative multiplied.
    - ``stop``: strings that end generation; the stop string is not included
      in the output text.
    - ``stop_token_ids``: token ids that end generation (in addition to EOS).
    - ``ignore_eos``: keep generating after EOS.
    - ``max_tokens``: maximum number of generated tokens; ``None`` means up to
      ``max_model_len``.
    - ``min_tokens``: EOS and ``stop_token_ids`` are masked until this many
      tokens have been generated.
    - ``logprobs``: number of top log-probabilities returned per generated
      token (the sampled token's logprob is always included); ``None`` = none.
    - ``prompt_logprobs``: same for each prompt token (from the second on),
      computed once per prompt token. Such a request skips the prefix-cache
      lookup and recomputes its whole prompt (prefix-cached KV holds no logits):
      it costs one full prefill of the prompt plus a ``[chunk tokens, vocab]``
      logits matmul per prefill chunk; its blocks still feed the prefix cache.
    - ``skip_special_tokens``: leave special tokens out of the decoded text.
    - ``output_kind``: ``"cumulative"`` returns the request's state after every
      step; ``"delta"`` returns after every step only what is new since the
      previous output (new token ids, text, logprobs, text ends; the server
      streams these); ``"final_only"`` returns the whole state once, when
      finished (the offline :class:`~loraplex.LLM` uses it; text is then decoded once).
    - ``structured_outputs``: a :class:`StructuredOutputsParams` (JSON schema,
      JSON object, regex, choice or EBNF grammar, as vLLM) the output must
      follow; ``None`` = unconstrained. Not combinable with ``ignore_eos`` or
      ``min_tokens > 0`` (the grammar decides where EOS may come).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", self.n, "must be >= 1"),
            (self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (or -1 to disable)"),
            (0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
             "must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             self.prompt_logprobs, "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings"),
            (self.output_kind in ("cumulative", "delta", "final_only"), "output_kind", self.output_kind,
             "must be 'cumulative', 'delta' or 'final_only'"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams or None"),
            (self.structured_outputs is None or not self.ignore_eos, "ignore_eos", self.ignore_eos,
             "cannot be combined with structured_outputs (the grammar decides where EOS may come)"),
            (self.structured_outputs is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
             "must be 0 with structured_outputs (the grammar decides where EOS may come)"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r}: {rule}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0
