"""Next-token sampling for one engine step (vLLM V1 ``Sampler`` order).

The engine builds one :class:`SamplingBatch` per step from one
:class:`SamplingRow` per sequence that needs a next token, then calls
``Sampler()(logits, batch)``. All per-row settings become ``[B]`` tensors once
per step; token counts for penalties are built with ``scatter_add`` from
padded id tensors (no per-token Python loops).

Processing order for ``logits [B, V] float32``:

1. ``raw = log_softmax(logits)``; returned logprobs always refer to this raw
   model distribution (before penalties, temperature and filtering), as in
   vLLM's default ``logprobs_mode="raw_logprobs"``.
1b. Structured output: logits of tokens the row's grammar bitmask does not
   allow are set to ``-inf`` (``grammar_bitmask``; see
   :mod:`loraplex.engine.structured_output`). Unconstrained rows' bitmask rows
   are all ones, so they are unchanged.
2. min_tokens: while ``len(output_token_ids) < params.min_tokens`` the logits
   of the row's EOS ids and ``params.stop_token_ids`` are set to ``-inf``
   (EOS is masked even with ``ignore_eos``: min_tokens asks for that many
   non-stop tokens; ignore_eos only means EOS never ends generation, which the
   engine's stop checker handles).
3. Penalties: CTRL repetition penalty (Keskar et al. 2019) over prompt and
   output tokens, then the OpenAI frequency/presence penalties over output
   tokens.
4. Greedy rows (``temperature < 1e-5``, as vLLM) take ``argmax`` of the
   penalized logits; ties go to the lowest token id.
5. Other rows: divide by temperature, then min-p, top-k, top-p, then sample.

Filtering rules (ties are kept, so every rule is a threshold on the logit and
the result does not depend on how a sort orders equal values):

- min-p: keep ``p_i >= min_p * max_j p_j`` (``p`` = softmax after temperature).
- top-k: keep every token whose logit is ``>=`` the k-th largest logit (ties
  with the k-th token are all kept, so more than k tokens may survive).
- top-p (Holtzman et al. 2019), applied to the distribution renormalised over
  the tokens that survived min-p and top-k: sort descending; the nucleus is
  the shortest prefix whose probability mass reaches ``top_p`` (the token that
  crosses the threshold is included); then every token whose probability
  equals that of the last nucleus token is kept too. ``top_p == 1`` keeps all.

Sampling uses the exponential race (Gumbel-max in disguise):
``token = argmax_i p_i / q_i`` with ``q_i ~ Exp(1)`` i.i.d., which picks ``i``
with probability ``p_i``. ``q`` for a row with a generator is drawn from that
generator only (``V`` draws per step), so a seeded row's tokens depend only on
its own seed and logits, never on the other rows of the batch. Greedy rows
draw nothing. Rows without a generator share one draw from torch's default
generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.host_copy import host_to_device, tensor_to_device
from loraplex.engine.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5

# One position's top log-probabilities: token id -> logprob (natural log).
TopLogprobs = dict[int, float]


@dataclass
class SamplingRow:
    """One sequence that needs a next token this step.

    - ``params``: the request's sampling parameters.
    - ``prompt_token_ids``: prompt ids (repetition penalty looks at them).
    - ``output_token_ids``: ids generated so far (penalties, min_tokens).
    - ``generator``: per-request generator on the logits' device, seeded from
      ``params.seed`` by the engine and advanced only by the sampler
      (``None``: use torch's default generator).
    - ``eos_token_ids``: the model's EOS ids (masked while min_tokens is not reached).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    eos_token_ids: set[int] = field(default_factory=set)


@dataclass
class PenaltyTensors:
    """Penalty inputs of a batch in which at least one row uses a penalty.

    ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``:
    ``[B] float32`` (neutral 1, 0, 0 on rows without that penalty).
    ``output_token_counts``: ``[B, V] float32``, occurrences of each id in the
    row's output. ``seen_mask``: ``[B, V] bool``, id occurs in prompt or output.
    """

    repetition_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    output_token_counts: torch.Tensor
    seen_mask: torch.Tensor


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for ``B`` rows over a vocabulary of ``V`` ids.

    Build it with :meth:`build`. Optional tensors are ``None`` when no row of
    the batch uses the feature, so the sampler skips that work.

    - ``temperature``: ``[B] float32`` (1.0 on greedy rows).
    - ``greedy``: ``[B] bool``; ``all_greedy`` is True when every row is greedy.
    - ``min_p``: ``[B] float32`` or None. ``top_k``: ``[B] int64`` in ``[1, V]``
      (``V`` = disabled) or None. ``top_p``: ``[B] float32`` or None.
    - ``banned_mask``: ``[B, V] bool`` (min_tokens: EOS/stop ids) or None.
    - ``penalties``: :class:`PenaltyTensors` or None.
    - ``generators``: per-row generator or None; ``num_logprobs``: per-row
      ``params.logprobs``.
    - ``grammar_bitmask``: ``[B, ceil(V/32)] int32`` on the logits' device
      (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed; ``-1`` words on
      unconstrained rows) or None; set by the model runner after :meth:`build`.
    """

    vocab_size: int
    temperature: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    banned_mask: torch.Tensor | None
    penalties: PenaltyTensors | None
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    grammar_bitmask: torch.Tensor | None = None
    greedy_rows: tuple[bool, ...] = ()  # ``greedy`` on the host (no device read while sampling)

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Turn ``rows`` into tensors on ``device``.

        Raises ``ValueError`` when ``rows`` is empty, ``vocab_size < 1``, or a
        token id (prompt, output, EOS, stop_token_ids) is outside ``[0, vocab_size)``.
        """
        if not rows:
            raise ValueError("SamplingBatch.build: rows must not be empty")
        if vocab_size < 1:
            raise ValueError(f"SamplingBatch.build: vocab_size={vocab_size!r} must be >= 1")
        if all(_is_plain_greedy(row) for row in rows):
            return cls._plain_greedy(rows, vocab_size, device)
        params = [row.params for row in rows]
        greedy = [p.temperature < GREEDY_TEMPERATURE_EPS for p in params]
        return cls(
            vocab_size=vocab_size,
            temperature=_float_tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            greedy=host_to_device(greedy, torch.bool, device),
            all_greedy=all(greedy),
            min_p=_min_p_tensor(params, greedy, device),
            top_k=_top_k_tensor(params, greedy, vocab_size, device),
            top_p=_top_p_tensor(params, greedy, device),
            banned_mask=_banned_mask(rows, vocab_size, device),
            penalties=_penalty_tensors(rows, vocab_size, device),
            generators=[row.generator for row in rows],
            num_logprobs=[p.logprobs for p in params],
            greedy_rows=tuple(greedy),
        )

    @classmethod
    def _plain_greedy(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """The batch :meth:`build` gives when every row is greedy without penalties
        or an active min_tokens mask, built without per-row tensors."""
        num_rows = len(rows)
        return cls(
            vocab_size=vocab_size,
            temperature=torch.ones(num_rows, dtype=torch.float32, device=device),
            greedy=torch.ones(num_rows, dtype=torch.bool, device=device),
            all_greedy=True,
            min_p=None,
            top_k=None,
            top_p=None,
            banned_mask=None,
            penalties=None,
            generators=[row.generator for row in rows],
            num_logprobs=[row.params.logprobs for row in rows],
            greedy_rows=(True,) * num_rows,
        )


@dataclass
class SamplerOutput:
    """Result of one sampling step for ``B`` rows.

    - ``token_ids``: ``[B]`` sampled ids.
    - ``logprobs``: per row, the ``params.logprobs`` largest entries of the raw
      ``log_softmax(logits)`` in descending order, followed by the sampled
      token if it is not among them (so it is always present); ``None`` when
      ``params.logprobs is None``.
    - ``sampled_logprobs``: ``[B]`` raw logprob of each sampled token.
    """

    token_ids: list[int]
    logprobs: list[TopLogprobs | None]
    sampled_logprobs: list[float]


class Sampler:
    """Picks the next token of every row (see the module docstring for the order)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        ``logits``: ``[B, V] float32`` model output for the last position of
        each row; not modified. Raises ``ValueError`` on a wrong dtype or shape.
        """
        raw_logprobs, token_ids = self.sample_on_device(logits, batch)
        return _build_output(raw_logprobs, token_ids, batch.num_logprobs)

    def sample_on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The device half of :meth:`__call__`, reading nothing back to the host:
        ``(raw logprobs [B, V] float32, sampled ids [B] int64)``."""
        _check_logits(logits, batch)
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        # Only the grammar and banned masks work in place; every later stage returns a new tensor.
        masked = logits
        if batch.banned_mask is not None or batch.grammar_bitmask is not None:
            masked = apply_banned_mask(apply_token_bitmask_(logits.clone(), batch.grammar_bitmask), batch.banned_mask)
        processed = apply_penalties(masked, batch.penalties)
        return raw_logprobs, _select_tokens(processed, batch)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Structured-output mask, in place; ``logits [B, V] fp32``, ``bitmask [B, ceil(V/32)] int32``.

    Semantics: ``logits[b, t] = -inf`` where bit ``t % 32`` of ``bitmask[b, t // 32]`` is 0.
    """
    if bitmask is None:
        return logits
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def apply_banned_mask(logits: torch.Tensor, banned_mask: torch.Tensor | None) -> torch.Tensor:
    """Set banned logits to ``-inf`` in place; ``logits [B, V] fp32``, ``banned_mask [B, V] bool``.

    Semantics: ``logits[b, t] = -inf`` where ``banned_mask[b, t]``.
    """
    if banned_mask is None:
        return logits
    return logits.masked_fill_(banned_mask, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors | None) -> torch.Tensor:
    """Repetition (CTRL), then frequency and presence (OpenAI) penalties.

    ``logits``: ``[B, V] float32``; returns a new ``[B, V] float32`` tensor.
    Semantics: ``l = seen ? (l > 0 ? l / rep : l * rep) : l``;
    ``l -= frequency * count + presence * (count > 0)``.
    """
    if penalties is None:
        return logits
    rep = penalties.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(penalties.seen_mask, penalized, logits)
    counts = penalties.output_token_counts
    logits = logits - penalties.frequency_penalty.unsqueeze(1) * counts
    return logits - penalties.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop tokens much less likely than the best one.

    ``logits [B, V] fp32`` (temperature already applied), ``min_p [B] fp32``.
    Semantics: ``logits[b, t] = -inf`` where ``p[b, t] < min_p[b] * max_t p[b, t]``,
    ``p = softmax(logits[b])``.
    """
    if min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p filtering with one sort; ties at either boundary are kept.

    ``logits [B, V] fp32``, ``top_k [B] int64`` in ``[1, V]``, ``top_p [B] fp32`` in ``(0, 1]``.
    Semantics: ``logits[b, t] = -inf`` where ``logits[b, t] < max(c_k[b], c_p[b])``;
    ``c_k`` = k-th largest logit, ``c_p`` = logit of the last token of the
    top-p nucleus of ``softmax`` over the tokens kept by top-k (see module docstring).
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    cutoff = torch.full_like(sorted_logits[:, :1], float("-inf"))
    if top_k is not None:
        cutoff = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
    if top_p is not None:
        cutoff = torch.maximum(cutoff, _top_p_cutoff(sorted_logits, top_p))
    return logits.masked_fill(logits < cutoff, float("-inf"))


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TopLogprobs]:
    """Top-``num_top`` entries of each row plus that row's ``token_ids`` entry.

    ``logprobs``: ``[N, V] float32`` log-probabilities; ``token_ids``: ``[N] int64``.
    Each dict lists the ``num_top`` largest entries in descending order, then
    ``token_ids[n]`` if it was not among them. Raises ``ValueError`` when
    ``num_top < 0``.
    """
    if num_top < 0:
        raise ValueError(f"top_logprobs: num_top={num_top!r} must be >= 0")
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return [
        _top_dict(ids, values, token_id, value)
        for ids, values, token_id, value in zip(top_ids.tolist(), top_values.tolist(), token_ids.tolist(), chosen)
    ]


# --- batch construction helpers ------------------------------------------------


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy, no penalty, and min_tokens already reached (nothing to mask)."""
    p = row.params
    return (p.temperature < GREEDY_TEMPERATURE_EPS and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and len(row.output_token_ids) >= p.min_tokens)


def _float_tensor(values: list[float], device: torch.device | str) -> torch.Tensor:
    return host_to_device(values, torch.float32, device)


def _min_p_tensor(params: list[SamplingParams], greedy: list[bool], device) -> torch.Tensor | None:
    values = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    return _float_tensor(values, device) if any(values) else None


def _top_k_tensor(params: list[SamplingParams], greedy: list[bool], vocab_size: int, device) -> torch.Tensor | None:
    values = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    if all(v == vocab_size for v in values):
        return None
    return host_to_device(values, torch.int64, device)


def _top_p_tensor(params: list[SamplingParams], greedy: list[bool], device) -> torch.Tensor | None:
    values = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    return _float_tensor(values, device) if any(v < 1.0 for v in values) else None


def _banned_mask(rows: list[SamplingRow], vocab_size: int, device) -> torch.Tensor | None:
    banned = [
        sorted(set(row.eos_token_ids) | set(row.params.stop_token_ids))
        if len(row.output_token_ids) < row.params.min_tokens
        else []
        for row in rows
    ]
    if not any(banned):
        return None
    return _id_presence(_padded_ids(banned, vocab_size, "eos/stop_token_ids", device), vocab_size)


def _penalty_tensors(rows: list[SamplingRow], vocab_size: int, device) -> PenaltyTensors | None:
    params = [row.params for row in rows]
    uses_rep = [p.repetition_penalty != 1.0 for p in params]
    uses_out = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or r for p, r in zip(params, uses_rep)]
    if not any(uses_out):
        return None
    output_ids = _padded_ids([row.output_token_ids if u else [] for row, u in zip(rows, uses_out)],
                             vocab_size, "output_token_ids", device)
    prompt_ids = _padded_ids([row.prompt_token_ids if u else [] for row, u in zip(rows, uses_rep)],
                             vocab_size, "prompt_token_ids", device)
    counts = _id_counts(output_ids, vocab_size)
    return PenaltyTensors(
        repetition_penalty=_float_tensor([p.repetition_penalty for p in params], device),
        frequency_penalty=_float_tensor([p.frequency_penalty for p in params], device),
        presence_penalty=_float_tensor([p.presence_penalty for p in params], device),
        output_token_counts=counts,
        seen_mask=(counts > 0) | _id_presence(prompt_ids, vocab_size),
    )


def _padded_ids(id_lists: list[list[int]], vocab_size: int, what: str, device) -> torch.Tensor:
    """``[B, L] int64`` ids padded with ``vocab_size`` (a dump column dropped later).

    Raises ``ValueError`` naming ``what`` when an id is outside ``[0, vocab_size)``.
    """
    width = max(1, max(len(ids) for ids in id_lists))
    padded = torch.full((len(id_lists), width), vocab_size, dtype=torch.int64)
    for b, ids in enumerate(id_lists):
        if ids:
            padded[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    real = padded[torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)]
    bad = real[(real < 0) | (real >= vocab_size)]
    if bad.numel():
        raise ValueError(f"SamplingBatch.build: {what} contains id {int(bad[0])}, outside [0, {vocab_size})")
    return tensor_to_device(padded, device)


def _id_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V] float32`` occurrences of each id (padding column dropped)."""
    counts = torch.zeros(padded_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _id_presence(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return _id_counts(padded_ids, vocab_size) > 0


# --- sampling helpers -----------------------------------------------------------


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    expected = (batch.num_rows, batch.vocab_size)
    if logits.dim() != 2 or tuple(logits.shape) != expected:
        raise ValueError(f"Sampler: logits.shape={tuple(logits.shape)} must be {expected} ([B, V])")
    if logits.dtype != torch.float32:
        raise ValueError(f"Sampler: logits.dtype={logits.dtype} must be torch.float32")


def _select_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``[B] int64``: argmax on greedy rows, exponential-race sample elsewhere."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    scaled = apply_min_p(logits / batch.temperature.unsqueeze(1), batch.min_p)
    probs = torch.softmax(apply_top_k_top_p(scaled, batch.top_k, batch.top_p), dim=-1)
    random_ids = (probs / _exponential_noise(probs, batch)).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_ids, random_ids)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``[B, V] float32`` i.i.d. Exp(1) draws; a seeded row draws from its own generator only."""
    noise = torch.empty_like(probs)
    greedy = batch.greedy_rows or batch.greedy.tolist()
    if any(g is None and not is_greedy for g, is_greedy in zip(batch.generators, greedy)):
        noise.exponential_()
    for b, (generator, is_greedy) in enumerate(zip(batch.generators, greedy)):
        if generator is not None and not is_greedy:
            noise[b].exponential_(generator=generator)
    # Exp(1) can round to 0; keep p / q finite so argmax stays meaningful.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _top_p_cutoff(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` logit of the last nucleus token; ``sorted_logits [B, V]`` descending."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1.0)
    keep &= sorted_logits > float("-inf")
    last = (keep.sum(dim=-1, keepdim=True) - 1).clamp_min(0)
    return sorted_logits.gather(1, last)


def _build_output(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]) -> SamplerOutput:
    if all(n is None for n in num_logprobs):  # no top logprobs asked: only the sampled tokens' values
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=[None] * len(sampled), sampled_logprobs=sampled)
    max_top = max((n for n in num_logprobs if n is not None), default=0)
    tops = top_logprobs(raw_logprobs, token_ids, max_top)
    ids = token_ids.tolist()
    sampled = [top[token_id] for top, token_id in zip(tops, ids)]
    logprobs = [None if n is None else _truncate_top(top, n, token_id)
                for top, n, token_id in zip(tops, num_logprobs, ids)]
    return SamplerOutput(token_ids=ids, logprobs=logprobs, sampled_logprobs=sampled)


def _top_dict(ids: list[int], values: list[float], token_id: int, value: float) -> TopLogprobs:
    top = dict(zip(ids, values))
    top.setdefault(token_id, value)
    return top


def _truncate_top(top: TopLogprobs, num_top: int, token_id: int) -> TopLogprobs:
    """First ``num_top`` entries of a descending dict, plus ``token_id``."""
    items = list(top.items())
    kept = dict(items[:num_top])
    kept.setdefault(token_id, top[token_id])
    return kept
