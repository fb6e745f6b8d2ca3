"""A tenant flooding the fair scheduler must not starve the others (counted steps, fake runner).

Tenant C runs one long request on adapter 1 (max_loras=1: it holds the only slot). Tenant A then queues
``max_waiting_scan`` (256) requests on adapter 2, which cannot start while C runs. Tenant B sends base-model
requests: they need no slot, the KV cache and max_num_seqs have room. Under ``policy="fair"`` B's counter equals
A's (lifted on arrival; A is not served), A's oldest request is older, so A's queue is scanned first and uses the
whole per-step scan budget on its blocked requests: B got no token until C's request ended (never within 100
steps; with 255 A requests B's first token came in 1 step). The scan now asks about each refused adapter once a
step and passes over the rest of its requests.
"""

from __future__ import annotations

from sched_sim import Sim, make_scheduler
from test_scheduler_admission import FakePins


def _b_first_tokens(num_flood: int) -> list[int | None]:
    pins = FakePins(ready={1, 2})
    sim = Sim(make_scheduler(pins, max_loras=1, max_num_seqs=64, budget=4096, policy="fair"))
    sim.submit("C-long", at=0, lora=1, tenant="C", prompt_tokens=8, max_tokens=400)
    for i in range(num_flood):
        sim.submit(f"A{i}", at=1, lora=2, tenant="A", prompt_tokens=8, max_tokens=8)
    trickle = [sim.submit(f"B{i}", at=2 + 5 * i, tenant="B", prompt_tokens=8, max_tokens=8) for i in range(10)]
    sim.run(100)
    return [r.ttft_steps if r.first_token_step is not None else None for r in trickle]


def test_flood_below_the_scan_limit_does_not_delay_base_requests():
    assert _b_first_tokens(255) == [1] * 10


def test_flood_of_blocked_requests_does_not_starve_another_tenant():
    ttfts = _b_first_tokens(256)
    assert all(t is not None and t <= 2 for t in ttfts), ttfts

