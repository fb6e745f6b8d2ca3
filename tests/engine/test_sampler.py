"""Sampler tests against independent references.

Distributions are compared with an exact pure-Python computation of the
filtered distribution; penalties with a per-token loop of the OpenAI / CTRL
formulas; logprobs with ``torch.log_softmax``.
"""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
)
from loraplex.engine.sampling_params import SamplingParams

NUM_DRAWS = 20_000
MAX_ABS_ERROR = 0.015
# V = 8 logits with a tie (ids 1 and 2) so tie handling at the boundaries is exercised.
LOGITS_V8 = [2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0]


def _row(params: SamplingParams, prompt=(), output=(), seed: int | None = None, eos=()) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), generator, set(eos))


def _sample(logits: torch.Tensor, rows: list[SamplingRow]):
    batch = SamplingBatch.build(rows, logits.shape[1], "cpu")
    return Sampler()(logits, batch)


# --- pure-Python references -----------------------------------------------------


def _softmax(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [0.0 if v == -math.inf else math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def _penalized_reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (1.0 if count > 0 else 0.0)
    return out


def _filtered_distribution(logits: list[float], p: SamplingParams) -> list[float]:
    """Exact sampling distribution: temperature, min-p, top-k, top-p, ties kept."""
    scaled = [v / p.temperature for v in logits]
    probs = _softmax(scaled)
    keep = [q >= p.min_p * max(probs) for q in probs]
    if p.top_k:
        kth = sorted((v for v, k in zip(scaled, keep) if k), reverse=True)[min(p.top_k, sum(keep)) - 1]
        keep = [k and v >= kth for v, k in zip(scaled, keep)]
    probs = _softmax([v if k else -math.inf for v, k in zip(scaled, keep)])
    if p.top_p < 1.0:
        mass, last = 0.0, None
        for q in sorted(probs, reverse=True):
            mass, last = mass + q, q
            if mass >= p.top_p:
                break
        keep = [q >= last and q > 0 for q in probs]
        probs = _softmax([math.log(q) if k else -math.inf for q, k in zip(probs, keep)])
    return probs


def _empirical(token_ids: list[int], vocab_size: int) -> list[float]:
    counts = torch.bincount(torch.tensor(token_ids), minlength=vocab_size)
    return (counts.double() / len(token_ids)).tolist()


# --- distributions ----------------------------------------------------------------

DISTRIBUTION_CASES = {
    "temperature_1": SamplingParams(),
    "temperature_0.5": SamplingParams(temperature=0.5),
    "temperature_2": SamplingParams(temperature=2.0),
    "top_k_3": SamplingParams(top_k=3),
    "top_k_2_tie_keeps_both": SamplingParams(top_k=2),
    "top_p_0.75": SamplingParams(top_p=0.75),
    "top_p_0.35_tie_keeps_both": SamplingParams(top_p=0.35),
    "min_p_0.3": SamplingParams(min_p=0.3),
    "combo_t0.7_k5_p0.8_minp0.05": SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05),
    "combo_t1.5_k6_p0.9": SamplingParams(temperature=1.5, top_k=6, top_p=0.9),
    "combo_t1.3_minp0.2_p0.7": SamplingParams(temperature=1.3, min_p=0.2, top_p=0.7),
    # min-p after temperature keeps token 5 (ratio exp(-2/1.3) = 0.21); before it would drop it (0.14).
    "combo_t1.3_minp0.2_k7": SamplingParams(temperature=1.3, min_p=0.2, top_k=7),
}


@pytest.mark.parametrize("name", list(DISTRIBUTION_CASES))
def test_empirical_distribution_matches_exact_filtered_distribution(name):
    params = DISTRIBUTION_CASES[name]
    torch.manual_seed(1000 + len(name))
    logits = torch.tensor([LOGITS_V8] * NUM_DRAWS, dtype=torch.float32)
    out = _sample(logits, [_row(params) for _ in range(NUM_DRAWS)])
    expected = _filtered_distribution(LOGITS_V8, params)
    observed = _empirical(out.token_ids, 8)
    for token, (e, o) in enumerate(zip(expected, observed)):
        assert abs(e - o) < MAX_ABS_ERROR, (name, token, expected, observed)
        if e == 0.0:
            assert o == 0.0, (name, token, observed)


def test_reference_keeps_ties_so_cases_exercise_them():
    """Guards the test cases: the tie cases really keep more than k / the crossing token."""
    assert sum(q > 0 for q in _filtered_distribution(LOGITS_V8, SamplingParams(top_k=2))) == 3
    # p(token 0) ~ 0.30 < 0.35, so the nucleus needs token 1, and token 2 ties with it.
    assert sum(q > 0 for q in _filtered_distribution(LOGITS_V8, SamplingParams(top_p=0.35))) == 3


def test_seeded_rows_have_the_same_distribution():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02)
    num_draws = 8_000
    logits = torch.tensor([LOGITS_V8] * num_draws, dtype=torch.float32)
    out = _sample(logits, [_row(params, seed=s) for s in range(num_draws)])
    expected = _filtered_distribution(LOGITS_V8, params)
    observed = _empirical(out.token_ids, 8)
    # 8k draws: std <= 0.0056, so 0.025 is > 4 sigma.
    assert max(abs(e - o) for e, o in zip(expected, observed)) < 0.025, (expected, observed)


def test_penalized_distribution_matches_reference():
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.4,
                            frequency_penalty=0.3, presence_penalty=0.5)
    prompt, output = [0, 3], [1, 1, 5]
    torch.manual_seed(7)
    logits = torch.tensor([LOGITS_V8] * NUM_DRAWS, dtype=torch.float32)
    out = _sample(logits, [_row(params, prompt, output) for _ in range(NUM_DRAWS)])
    expected = _filtered_distribution(_penalized_reference(LOGITS_V8, prompt, output, params), params)
    observed = _empirical(out.token_ids, 8)
    assert max(abs(e - o) for e, o in zip(expected, observed)) < MAX_ABS_ERROR, (expected, observed)


def test_top_k_top_p_masks_exact_sets_with_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 5.0, 1.0, 1.0]])
    top_k = torch.tensor([2, 1, 4])
    top_p = torch.tensor([1.0, 0.3, 0.99])
    kept = apply_top_k_top_p(logits, top_k, top_p) > float("-inf")
    expected = [[True, True, True, False],  # k=2: tie for 2nd place -> 3 kept
                [True, True, True, True],  # all equal -> all tie with the k-th / nucleus token
                [False, True, True, True]]  # nucleus {1, 2} and 3 ties with 2
    assert kept.tolist() == expected


# --- penalties --------------------------------------------------------------------


def test_penalties_match_loop_reference():
    gen = torch.Generator().manual_seed(3)
    vocab = 16
    logits = torch.randn(4, vocab, generator=gen) * 3
    cases = [
        (SamplingParams(repetition_penalty=1.7), [1, 2, 2, 9], [3, 3, 1]),
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [4, 5], [5, 5, 5, 6, 15]),
        (SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.3), [0, 7], [7, 8, 8, 0]),
        (SamplingParams(), [1, 2], [3]),
    ]
    rows = [_row(p, prompt, output) for p, prompt, output in cases]
    batch = SamplingBatch.build(rows, vocab, "cpu")
    got = apply_penalties(logits.clone(), batch.penalties)
    for b, (p, prompt, output) in enumerate(cases):
        expected = _penalized_reference(logits[b].tolist(), prompt, output, p)
        torch.testing.assert_close(got[b], torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    out = _sample(logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [])])
    assert out.token_ids == [1]  # 5 / 2 = 2.5 < 4


# --- greedy, seeds ----------------------------------------------------------------


def test_greedy_rows_take_argmax_in_mixed_batch():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 40, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3), SamplingParams(temperature=0.0, top_p=0.1),
              SamplingParams(temperature=1e-6), SamplingParams(seed=5), SamplingParams(temperature=0.0)]
    out = _sample(logits, [_row(p, seed=p.seed) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    for b in (0, 2, 3, 5):
        assert out.token_ids[b] == argmax[b]


def test_greedy_tie_picks_lowest_id():
    out = _sample(torch.tensor([[0.0, 2.0, 2.0, 1.0]]), [_row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [1]


def _seeded_run(seed: int, others: list[SamplingParams], position: int, steps: int = 15) -> list[int]:
    """Tokens of a seeded row over ``steps`` steps placed among ``others``."""
    logits_gen = torch.Generator().manual_seed(99)
    target = _row(SamplingParams(temperature=1.0, top_p=0.95, seed=seed), seed=seed)
    other_rows = [_row(p, seed=p.seed) for p in others]
    tokens = []
    for _ in range(steps):
        step_logits = torch.randn(len(others) + 1, 50, generator=logits_gen) * 0.3
        rows = other_rows[:position] + [target] + other_rows[position:]
        target_logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(len(tokens)))
        step_logits[position] = target_logits[0]
        out = _sample(step_logits, rows)
        tokens.append(out.token_ids[position])
        target.output_token_ids.append(tokens[-1])
    return tokens


def test_seeded_row_reproducible_and_independent_of_batch():
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=3, top_k=4), SamplingParams()]
    alone = _seeded_run(1234, [], 0)
    assert _seeded_run(1234, [], 0) == alone
    assert _seeded_run(1234, others, 0) == alone
    assert _seeded_run(1234, others, 2) == alone
    assert _seeded_run(1234, list(reversed(others)), 4) == alone
    assert _seeded_run(1234, others[:1], 1) == alone
    assert _seeded_run(4321, others, 1) != alone


def test_unseeded_rows_vary():
    logits = torch.zeros(1, 32)
    tokens = {_sample(logits, [_row(SamplingParams())]).token_ids[0] for _ in range(30)}
    assert len(tokens) > 5


# --- logprobs ---------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_include_sampled_token():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(4, 30, generator=gen)
    logits[3, :3] = torch.tensor([9.0, 8.0, 7.0])
    params = [SamplingParams(logprobs=None), SamplingParams(logprobs=0, temperature=2.0),
              SamplingParams(logprobs=5, top_k=3),
              SamplingParams(logprobs=2, temperature=0.0, repetition_penalty=100.0)]
    # Row 3: tokens 0 and 1 are in the prompt, so the huge penalty makes greedy pick token 2, not in the top 2.
    rows = [_row(params[0]), _row(params[1], seed=1), _row(params[2]), _row(params[3], prompt=[0, 1])]
    out = _sample(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[0] is None
    assert out.token_ids[3] == 2
    for b, token in enumerate(out.token_ids):
        assert out.sampled_logprobs[b] == pytest.approx(reference[b, token].item(), abs=1e-5)
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    top5 = reference[2].argsort(descending=True)[:5].tolist()
    assert list(out.logprobs[2])[:5] == top5
    assert out.token_ids[2] in out.logprobs[2] and len(out.logprobs[2]) == 5 + (out.token_ids[2] not in top5)
    assert list(out.logprobs[3]) == [0, 1, 2]
    for b in (1, 2, 3):
        for token, value in out.logprobs[b].items():
            assert value == pytest.approx(reference[b, token].item(), abs=1e-5)


# --- min_tokens -------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens():
    eos, stop_id = 0, 1
    logits = torch.tensor([[10.0, 9.0, 1.0, 0.5]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id])
    for num_out, expected in [(0, 2), (2, 2), (3, eos)]:
        out = _sample(logits, [_row(params, output=[3] * num_out, eos=[eos])])
        assert out.token_ids == [expected]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert _sample(logits, [_row(ignore, output=[3], eos=[eos])]).token_ids == [1]
    # Random rows never draw a masked token, and the raw logprob still reports it.
    torch.manual_seed(0)
    random_params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[stop_id], logprobs=1)
    out = _sample(logits.repeat(2000, 1), [_row(random_params, eos=[eos]) for _ in range(2000)])
    assert set(out.token_ids) == {2, 3}
    assert next(iter(out.logprobs[0])) == eos


# --- errors -----------------------------------------------------------------------


def test_bad_inputs_raise_typed_errors():
    rows = [_row(SamplingParams())]
    with pytest.raises(ValueError, match="rows"):
        SamplingBatch.build([], 8, "cpu")
    with pytest.raises(ValueError, match="output_token_ids contains id 8"):
        SamplingBatch.build([_row(SamplingParams(presence_penalty=1.0), output=[8])], 8, "cpu")
    with pytest.raises(ValueError, match="prompt_token_ids contains id -1"):
        SamplingBatch.build([_row(SamplingParams(repetition_penalty=1.1), prompt=[-1])], 8, "cpu")
    batch = SamplingBatch.build(rows, 8, "cpu")
    with pytest.raises(ValueError, match="logits.shape"):
        Sampler()(torch.zeros(1, 9), batch)
    with pytest.raises(ValueError, match="logits.dtype"):
        Sampler()(torch.zeros(1, 8, dtype=torch.float16), batch)


def test_batch_skips_unused_features():
    batch = SamplingBatch.build([_row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5))], 8, "cpu")
    assert batch.all_greedy and batch.top_k is None and batch.top_p is None and batch.penalties is None
    batch = SamplingBatch.build([_row(SamplingParams(top_k=3)), _row(SamplingParams())], 8, "cpu")
    assert batch.top_k.tolist() == [3, 8] and batch.top_p is None and batch.min_p is None
