"""The store interface, both implementations: expiry, counters, rate-limit windows,
and Redis degrading to "no cache" and recovering (with a real redis-server)."""

from __future__ import annotations

import pytest

from loraplex.platform.cache import CACHE_PREFIX, LookupCache, MemoryStore, RedisStore
from loraplex.platform.limits import RateLimiter
from loraplex.platform.errors import RateLimited


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        return MemoryStore()
    return RedisStore(request.getfixturevalue("redis_server").url)


def test_get_set_delete_incr(store):
    store.set("loraplex:t:a", "1", ttl_s=30)
    assert store.get("loraplex:t:a") == "1"
    store.delete("loraplex:t:a", "loraplex:t:missing")
    assert store.get("loraplex:t:a") is None
    assert [store.incr("loraplex:t:n", 2, 30), store.incr("loraplex:t:n", 3, 30)] == [2, 5]
    assert store.available()


def test_memory_store_expiry():
    clock = Clock()
    store = MemoryStore(clock)
    store.set("k", "v", ttl_s=5)
    store.incr("n", 1, ttl_s=5)
    clock.now += 4.9
    assert store.get("k") == "v" and store.incr("n", 1, ttl_s=5) == 2  # incr keeps the first expiry
    clock.now += 0.2
    assert store.get("k") is None and store.get("n") is None


def test_lookup_cache_reads_through_and_counts():
    cache = LookupCache(MemoryStore(), ttl_s=60)
    loads = []
    for _ in range(3):
        assert cache.get_or_load("x", lambda: loads.append(1) or {"v": 1}) == {"v": 1}
    assert (len(loads), cache.hits, cache.misses) == (1, 2, 1)
    assert cache.get_or_load("none", lambda: None) is None
    assert cache.get_or_load("none", lambda: None) is None
    assert cache.misses == 3  # None is not cached
    cache.invalidate("x")
    cache.get_or_load("x", lambda: loads.append(1) or {"v": 2})
    assert len(loads) == 2


def test_rate_limiter_sliding_window_and_retry_after():
    clock = Clock(6000.0 + 45.0)  # 45 s into the minute starting at 6000
    limiter = RateLimiter(MemoryStore(), clock)

    def admit(tenant_id=1, rpm=2, tpm=None, tokens=0):
        return limiter.admit(tenant_id=tenant_id, requests_per_minute=rpm, tokens_per_minute=tpm, completions=1,
                             tokens=tokens)

    admit()
    admit()
    with pytest.raises(RateLimited) as info:
        admit()
    # the next minute starts in 15 s, but both completions stay in the window until 30 s into it
    # (2 * (1 - 30/60) = 1 carried): a fixed window would have said 15 and let a burst of 4 through
    assert info.value.retry_after_s == 45 and info.value.headers() == {"Retry-After": "45"}
    admit(tenant_id=2)  # other tenant unaffected
    clock.now = 6060.0  # next minute: the previous one still counts whole
    with pytest.raises(RateLimited) as info:
        admit()
    assert info.value.retry_after_s == 30 and "used 2 completions in the last 60 s" in info.value.message
    clock.now = 6090.0  # half of it has slid out: floor(2 * 0.5) = 1 carried, one more fits
    admit()
    with pytest.raises(RateLimited):
        admit()
    assert limiter.used(1) == (2, 0)

    clock.now = 6180.0  # the minute before (6120) is empty
    admission = admit(rpm=None, tpm=100, tokens=100)
    with pytest.raises(RateLimited) as info:
        admit(rpm=None, tpm=100, tokens=1)
    # next minute, once 1 - 99/100 of it has passed: 60.6 s -> 61
    assert info.value.retry_after_s == 61 and "tokens_per_minute=100" in info.value.message
    limiter.settle(admission, 60)  # 40 reserved tokens given back
    assert limiter.used(1) == (1, 60)
    admit(rpm=None, tpm=100, tokens=40)
    assert limiter.used(1) == (2, 100)
    clock.now = 6240.0 + 15.0  # 45 of the previous minute's 60 s still in the window: 75 tokens carried
    assert limiter.used(1) == (2, 75)  # 2 * 0.75 = 1.5 completions carried, counted as 2 (rounded up)
    admit(rpm=None, tpm=100, tokens=25)
    with pytest.raises(RateLimited) as info:
        admit(rpm=None, tpm=100, tokens=1)
    assert info.value.retry_after_s == 1  # 100 - 25 - 1 = 74 < 75 carried: one more second slides 1.67 out


def test_redis_down_degrades_and_recovery_flushes_cached_lookups(redis_server):
    store = RedisStore(redis_server.url, retry_s=0.0)
    cache = LookupCache(store, ttl_s=60)
    cache.get_or_load("key:abc", lambda: {"tenant": 1})
    assert store.get(CACHE_PREFIX + "key:abc") is not None
    live_client = store._client
    import redis

    store._client = redis.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2,
                                retry=None)
    assert cache.get_or_load("key:abc", lambda: {"tenant": "db"}) == {"tenant": "db"}  # miss -> database
    assert not store.available()
    assert store.incr("loraplex:rl:x", 1, 60) == 1 and store.incr("loraplex:rl:x", 1, 60) == 2  # in-process
    cache.invalidate("key:abc")  # missed by Redis
    store._client = live_client
    assert store.available()
    assert store.get(CACHE_PREFIX + "key:abc") is None  # flushed on recovery, not resurrected
