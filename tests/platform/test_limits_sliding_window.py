"""Found by a hostile review (session 6), rate limits over a sliding window (loraplex/platform/limits.py).

The previous minute's weighted share was rounded down (floor), so just after a minute boundary
the share of a full previous minute counted one less than the limit: at requests_per_minute=2,
two requests at 59.9 s and a third at 60.05 s were all admitted (3 in 0.15 s), although the
429 given at 59.9 s said Retry-After 45 (30 s into the next minute, when one of the two has slid
out). Reference: the sliding-window-counter definition (weighted previous count + current count
+ amount <= limit, real-valued, as the ``limits`` library computes it), brute-forced over time (fixed).

A refund settled while Redis is up is not mirrored in the in-process fallback (the mirror is
only ever raised), so a Redis outage later in the same minute refuses requests that fit, and the
merge after the outage writes the stale count back into Redis (fixed: a give-back is taken off
the mirror too, never below what Redis answered).

When both limits are reached, Retry-After was the requests limit's wait alone: retrying then was
refused again by tokens_per_minute (fixed).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from loraplex.platform.cache import MemoryStore
from loraplex.platform.errors import RateLimited
from loraplex.platform.limits import RateLimiter


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def admit(limiter, rpm, completions=1):
    return limiter.admit(tenant_id=1, requests_per_minute=rpm, tokens_per_minute=None, completions=completions,
                         tokens=0)


def test_full_previous_minute_still_counts_whole_just_after_the_boundary():
    clock = Clock(6059.9)
    limiter = RateLimiter(MemoryStore(), clock)
    admit(limiter, 2)
    admit(limiter, 2)
    with pytest.raises(RateLimited) as info:
        admit(limiter, 2)
    assert info.value.retry_after_s == 31  # 6090.0 - 6059.9 = 30.1 -> 31
    clock.now = 6060.05  # 2 * (1 - 0.05 / 60) = 1.998 of the previous minute still in the window
    with pytest.raises(RateLimited):
        admit(limiter, 2)
    assert limiter.used(1) == (2, 0)


@pytest.mark.parametrize("seed", range(3))
def test_retry_after_is_the_first_whole_second_at_which_the_request_fits(seed):
    """Retry-After (s) against the real-valued window: refused at now + s - 1, admitted at now + s."""
    rng = random.Random(seed)
    for _ in range(300):
        limit = rng.randint(1, 40)
        clock = Clock(6000.0 + rng.uniform(0, 59.9))
        limiter = RateLimiter(MemoryStore(), clock)
        previous = rng.randint(0, limit)
        for _ in range(previous):
            admit(limiter, limit)
        clock.now = 6060.0 + rng.choice([0.0, 30.0, rng.uniform(0, 59.9)])
        current = 0
        while True:
            try:
                admit(limiter, limit)
                current += 1
            except RateLimited:
                break
        amount = rng.randint(1, limit)
        t0 = clock.now
        try:
            admit(limiter, limit, amount)
            continue
        except RateLimited as exc:
            retry_after_s = exc.retry_after_s

        def fits(t: float) -> bool:  # exact sliding-window counter, nothing else used meanwhile
            if t < 6120.0:
                return previous * (1 - (t - 6060.0) / 60) + current + amount <= limit + 1e-9
            return current * (1 - (t - 6120.0) / 60) + amount <= limit + 1e-9

        first = next(s for s in range(1, 200) if fits(t0 + s))
        assert retry_after_s == first, (limit, previous, current, amount, t0)


def test_a_refund_settled_in_redis_still_counts_during_a_later_outage():
    """tokens_per_minute=1000: 1000 reserved, 900 given back (100 used), both in Redis; then Redis becomes
    unreachable. The window holds 100 tokens, so 500 more fit; the in-process mirror kept 1000 (it is only
    ever raised) and refused them, and merged the stale 1000 back into Redis afterwards."""
    import redis as redis_lib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
    from platform_testlib import start_redis

    from loraplex.platform.cache import RedisStore

    redis = start_redis()
    try:
        monotonic = Clock(100.0)
        store = RedisStore(redis.url, retry_s=5.0, clock=monotonic)
        limiter = RateLimiter(store, clock=Clock(6010.0))

        def admit_tokens(tokens):
            return limiter.admit(tenant_id=1, requests_per_minute=None, tokens_per_minute=1000, completions=1,
                                 tokens=tokens)

        limiter.settle(admit_tokens(1000), 100)
        assert limiter.used(1) == (1, 100)
        live_client = store._client
        store._client = redis_lib.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2)
        admit_tokens(500)  # the window holds 100 + 500 <= 1000
        store._client = live_client
        monotonic.now += 6.0  # past retry_s: merged back
        assert limiter.used(1) == (2, 600)
    finally:
        redis.kill()


def test_retry_after_waits_for_both_limits_when_both_are_reached():
    """requests_per_minute=2 and tokens_per_minute=31: at 61.39 s the window holds 2 completions and 27
    tokens (previous minute) and the request needs 1 completion and 27 tokens. The 429 said Retry-After
    29 (when a completion slides out) but then 14 tokens are still in the window and 14 + 27 > 31: it
    must be the time until both fit."""
    clock = Clock(6010.0)
    limiter = RateLimiter(MemoryStore(), clock)

    def admit_both(tokens):
        return limiter.admit(tenant_id=1, requests_per_minute=2, tokens_per_minute=31, completions=1,
                             tokens=tokens)

    admit_both(27)
    admit_both(0)
    clock.now = 6061.0
    with pytest.raises(RateLimited) as info:
        admit_both(27)
    retry_after_s = info.value.retry_after_s
    clock.now += retry_after_s
    admit_both(27)  # fits once Retry-After has passed
    clock.now = 6061.0 + retry_after_s - 1  # and not a second earlier (real-valued window)
    used_requests, used_tokens = 2 * (1 - (clock.now - 6060.0) / 60), 27 * (1 - (clock.now - 6060.0) / 60)
    assert used_requests + 1 > 2 or used_tokens + 27 > 31
