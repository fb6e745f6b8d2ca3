"""Fair service across tenants (issue 21): the Virtual Token Counter policy, in counted
scheduler steps with a fake model runner (``sched_sim``). Service is measured from the
planned batches (prompt tokens computed the first time, output tokens sampled; weights 1 and 2),
not from the scheduler's counters.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_sim import Sim, closed_loop, make_scheduler

from loraplex.engine.fairness import TenantShare, VirtualTokenCounter


def p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _flood_and_trickle(policy: str, flood: bool) -> list[int]:
    """Tenant A keeps 200 requests outstanding (closed loop, 8-24 output tokens); tenant B
    sends one request every 20 steps ("one per second"). Returns B's TTFTs in steps."""
    sim = Sim(make_scheduler(max_num_seqs=64, budget=4096, policy=policy))
    rng = random.Random(0)
    if flood:
        for client in range(200):
            closed_loop(sim, f"A{client}", start=0, tenant="A", prompt_tokens=16, max_tokens=rng.randint(8, 24))
    trickle = [sim.submit(f"B{i}", at=100 + 20 * i, tenant="B", prompt_tokens=16, max_tokens=16) for i in range(100)]
    sim.run(100 + 20 * 100 + 40)
    return [r.ttft_steps for r in trickle]


def test_trickling_tenant_keeps_its_ttft_under_a_flood():
    alone = p99(_flood_and_trickle("fair", flood=False))
    assert alone == 1
    assert p99(_flood_and_trickle("fair", flood=True)) <= 2 * alone
    assert p99(_flood_and_trickle("fcfs", flood=True)) > 20 * alone  # behind A's queue: the fault


def _two_backlogged(policy: str, weights: tuple[float, float], steps: int = 2400) -> tuple[Sim, int]:
    """A (200 outstanding) and B (100 outstanding), both always backlogged, random shapes."""
    sim = Sim(make_scheduler(max_num_seqs=32, budget=256, policy=policy))
    rng = random.Random(1)
    for tenant, clients, weight in (("A", 200, weights[0]), ("B", 100, weights[1])):
        for client in range(clients):
            closed_loop(sim, f"{tenant}{client}", start=0, tenant=tenant, weight=weight,
                        prompt_tokens=rng.randint(4, 64), max_tokens=rng.randint(4, 48))
    sim.run(steps)
    return sim, 200  # warm-up steps to skip


def _window_ratios(sim: Sim, warmup: int, window: int = 200) -> list[float]:
    ratios = []
    for first in range(warmup, len(sim.service) - window + 1, window):
        a = sim.weighted_service("A", first, first + window)
        b = sim.weighted_service("B", first, first + window)
        ratios.append(a / b)
    return ratios


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_backlogged_tenants_split_service_by_weight(weights):
    sim, warmup = _two_backlogged("fair", weights)
    expected = weights[0] / weights[1]
    ratios = _window_ratios(sim, warmup)
    assert len(ratios) == 11
    assert all(abs(r / expected - 1) <= 0.10 for r in ratios), ratios
    assert {s.tenant_id: s.weight for s in sim.scheduler.tenant_stats()} == {"A": weights[0], "B": weights[1]}


def test_fcfs_gives_the_bigger_queue_more():
    sim, warmup = _two_backlogged("fcfs", (1.0, 1.0))
    assert min(_window_ratios(sim, warmup)) > 1.5  # A holds 2/3 of the queue: far from 1:1


def test_returning_tenant_is_lifted_not_credited_for_idle_time():
    vtc = VirtualTokenCounter(1.0, 2.0)
    vtc.arrive("A", 1.0, {})
    vtc.charge("A", 100, 50)  # A alone: 200 weighted tokens
    assert vtc.counter("A") == 200
    vtc.arrive("B", 1.0, {"A": 3})  # B arrives while A is backlogged: lifted to A's counter
    assert vtc.counter("B") == 200
    vtc.charge("B", 10, 0)
    vtc.left("B")
    vtc.charge("A", 0, 100)  # A keeps being served while B is idle
    vtc.arrive("B", 1.0, {"A": 1})  # B returns: no credit banked for its idle time
    assert vtc.counter("B") == 400
    vtc.arrive("C", 2.0, {})  # nobody backlogged: lifted to the last tenant that left (B at 210)
    assert vtc.counter("C") == 210
    vtc.charge("C", 20, 0)
    assert vtc.counter("C") == 220  # weight 2 halves the counter's growth
    with pytest.raises(ValueError, match="weight"):
        TenantShare("x", 0)


def test_fair_policy_keeps_adapter_aging_bound():
    """Issue 14's starvation bound holds under the fair policy: tenant X floods adapters 1-4 (12
    closed-loop clients each, 4 slots), tenant Y sends one request for adapter 5."""
    from test_scheduler_admission import FakePins

    pins = FakePins(ready={1, 2, 3, 4, 5})
    sim = Sim(make_scheduler(pins, max_loras=4, max_adapter_wait_steps=32, policy="fair"))
    for lora in range(1, 5):
        for client in range(12):
            closed_loop(sim, f"a{lora}c{client}", start=(12 * (lora - 1) + client) * 32 // 48, lora=lora,
                        tenant="X")
    fifth = sim.submit("fifth", at=200, lora=5, tenant="X")  # same tenant: only aging can help it
    sim.run(400)
    assert fifth.ttft_steps <= 32 + 33 + 1


def test_fair_policy_with_preemption_and_prefix_cache_serves_everyone():
    """KV blocks run out (preemption by recompute) and prompts share prefixes; every request
    finishes, no block leaks, and the backlogged tenants still split service evenly."""
    sim = Sim(make_scheduler(max_num_seqs=32, budget=64, num_blocks=96, block_size=4, prefix_caching=True,
                             policy="fair"))
    rng = random.Random(2)
    for tenant, clients in (("A", 40), ("B", 10)):
        for client in range(clients):
            closed_loop(sim, f"{tenant}{client}", start=0, tenant=tenant, prompt_tokens=rng.randint(8, 40),
                        max_tokens=rng.randint(8, 40))
    sim.run(1500)
    assert sim.num_preempted > 0
    stats = {s.tenant_id: s for s in sim.scheduler.tenant_stats()}
    a = stats["A"].prompt_tokens_served + 2 * stats["A"].output_tokens_served
    b = stats["B"].prompt_tokens_served + 2 * stats["B"].output_tokens_served
    assert abs(a / b - 1) <= 0.10
    finished = [r for r in sim.requests if r.finish_step is not None]
    assert len(finished) > 200


# -- the VTC bound over random arrival patterns ---------------------------------------------------

BLOCKS, BLOCK_SIZE, MAX_PROMPT, MAX_OUTPUT = 64, 4, 48, 24


def _worst_backlogged_spread(policy: str, weights: list[int], arrivals) -> tuple[float, float]:
    """Run ``arrivals`` (tenant index, step, prompt tokens, output tokens) to the end; returns the
    largest range of S_f - S_g (weight-normalised service) over an interval where tenants f and g
    are both backlogged, and the theorem's bound for this configuration."""
    w_p, w_q = 1.0, 2.0
    sim = Sim(make_scheduler(max_num_seqs=8, budget=32, num_blocks=BLOCKS, block_size=BLOCK_SIZE, policy=policy))
    tenants = [f"t{i}" for i in range(len(weights))]
    for i, (t, at, prompt, output) in enumerate(arrivals):
        t %= len(tenants)
        sim.submit(f"r{i}", at=at, tenant=tenants[t], weight=float(weights[t]), prompt_tokens=prompt,
                   max_tokens=output)
    normalised = {t: 0.0 for t in tenants}
    history = []  # per step: (normalised service so far, tenants backlogged after the step)
    while any(r.finish_step is None for r in sim.requests):
        assert sim.now < 5000, "requests must all finish"
        sim.step()
        backlogged = {t for t in tenants if sim.scheduler._queued.get(t)}
        for t, (p, o) in sim.service[-1].items():
            normalised[t] += (w_p * p + w_q * o) / weights[tenants.index(t)]
        history.append((dict(normalised), backlogged))
    worst = 0.0
    for f in tenants:
        for g in tenants:
            if f >= g:
                continue
            lo = hi = None  # range of S_f - S_g over the current joint-backlog interval
            for served, backlogged in history:
                if f in backlogged and g in backlogged:
                    d = served[f] - served[g]
                    lo, hi = (d, d) if lo is None else (min(lo, d), max(hi, d))
                    worst = max(worst, hi - lo)
                else:
                    lo = hi = None
    return worst, 2 * max(w_p * MAX_PROMPT, w_q * BLOCKS * BLOCK_SIZE) / min(weights)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=2, max_size=3),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 150), st.integers(1, MAX_PROMPT),
                          st.integers(1, MAX_OUTPUT)), min_size=4, max_size=120))
def test_service_difference_of_backlogged_tenants_is_bounded(weights, arrivals):
    """Sheng et al.'s Theorem: while two tenants are both backlogged, the difference of their
    weight-normalised service stays within 2 * max(w_p * L_prompt, w_q * M) (M = tokens the
    KV cache holds), whatever the arrival pattern."""
    worst, bound = _worst_backlogged_spread("fair", weights, arrivals)
    assert worst <= bound


def test_fcfs_breaks_the_bound_the_fair_policy_keeps():
    """The checker above can fail: t0 queues 80 requests before t1's 20 (equal weights)."""
    arrivals = [(0, 0, 24, 16)] * 80 + [(1, 0, 24, 16)] * 20
    fcfs, bound = _worst_backlogged_spread("fcfs", [1, 1], arrivals)
    fair, _ = _worst_backlogged_spread("fair", [1, 1], arrivals)
    assert fcfs > 2 * bound and fair <= bound


def test_engine_fair_policy_same_outputs_and_per_tenant_service(tiny_llama_dir):
    """The tiny model through ``LLMEngine``: the fair policy changes who goes first, never what
    is generated; tenants' served tokens are exact; every output reports its queueing time."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.sampling_params import SamplingParams

    def run(policy: str):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=64, block_size=4,
                                        num_kv_blocks=48, max_num_seqs=3, scheduling_policy=policy))
        for i in range(6):
            tenant = TenantShare("A" if i < 4 else "B", 2.0 if i < 4 else 1.0)
            engine.add_request(f"r{i}", [5 + i] * (6 + i), SamplingParams(temperature=0.0, max_tokens=5 + i,
                                                                          ignore_eos=True), tenant=tenant)
        finished, order = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    order.append(out.request_id)
        return engine, finished, order

    fcfs_engine, fcfs, fcfs_order = run("fcfs")
    fair_engine, fair, fair_order = run("fair")
    assert {k: v.outputs[0].token_ids for k, v in fair.items()} == {k: v.outputs[0].token_ids for k, v in fcfs.items()}
    assert fcfs_order.index("r4") > fair_order.index("r4")  # B's first request no longer waits behind A's
    stats = {s.tenant_id: s for s in fair_engine.get_stats().tenants}
    assert (stats["A"].prompt_tokens_served, stats["A"].output_tokens_served) == (6 + 7 + 8 + 9, 5 + 6 + 7 + 8)
    assert (stats["B"].prompt_tokens_served, stats["B"].output_tokens_served) == (10 + 11, 9 + 10)
    assert stats["A"].weight == 2.0 and stats["A"].num_waiting == stats["A"].num_running == 0
    assert fair_engine.get_stats().scheduling_policy == "fair"
    assert all(out.queued_s is not None and out.queued_s >= 0 for out in fair.values())
