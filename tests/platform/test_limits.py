"""Rate limits that hold (issue 14, items 7, 8, 10): tokens_per_minute reserved atomically
under concurrency, completions (prompts x n) counted against requests_per_minute with a cap
on prompts per request, and a Redis outage (killed and restarted inside one minute) that
does not double a window. Each with the in-process store and a real redis-server; the
limiter's clock is fixed, so no test races a minute boundary."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading

import openai
import pytest
from platform_testlib import RedisProcess, new_tenant, start_redis

from loraplex.platform.cache import MemoryStore, RedisStore
from loraplex.platform.errors import InvalidRequest, RateLimited
from loraplex.platform.limits import RateLimiter

WINDOW_NOW_S = 6000.0 + 10.0  # 10 s into a one-minute window


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def store_kind(request):
    if request.param == "memory":
        return None
    return request.getfixturevalue("redis_server")


def make_store(redis: RedisProcess | None, **kwargs):
    return RedisStore(redis.url, **kwargs) if redis is not None else MemoryStore()


def admit(limiter, *, rpm=None, tpm=None, completions=1, tokens=0, tenant_id=1):
    return limiter.admit(tenant_id=tenant_id, requests_per_minute=rpm, tokens_per_minute=tpm,
                         completions=completions, tokens=tokens)


# -- item 7: tokens_per_minute under concurrency ----------------------------------------------------
def test_token_reservations_hold_under_100_concurrent_threads(store_kind):
    limiter = RateLimiter(make_store(store_kind), clock=Clock(WINDOW_NOW_S))
    outcomes: list[str] = []
    barrier = threading.Barrier(100)

    def one() -> None:
        barrier.wait()
        try:
            admit(limiter, tpm=500, tokens=28)
            outcomes.append("ok")
        except RateLimited:
            outcomes.append("429")

    threads = [threading.Thread(target=one) for _ in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("ok") == 500 // 28 == 17 and outcomes.count("429") == 83
    assert limiter.used(1) == (17, 17 * 28)


@pytest.fixture(params=["memory", "redis"])
def live(request, serve):
    if request.param == "memory":
        live = serve()
    else:
        live = serve(redis_url=request.getfixturevalue("redis_server").url)
    live.ctx.limiter = RateLimiter(live.ctx.store, clock=Clock(WINDOW_NOW_S))
    return live


def test_tokens_per_minute_500_admits_17_of_100_concurrent_requests_of_28_tokens(live):
    key = new_tenant(live, "acme", tokens_per_minute=500)
    prompt = list(range(10, 30))  # 20 prompt tokens + max_tokens 8 = 28 reserved, 28 used (ignore_eos)

    async def run() -> list:
        client = openai.AsyncOpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(
                client.completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
                for _ in range(100)), return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(run())
    accepted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(accepted) == 17 and len(refused) == 83, [type(r) for r in results]
    assert {r.usage.total_tokens for r in accepted} == {28}
    assert "tokens_per_minute=500" in refused[0].message
    assert live.ctx.limiter.used(1) == (17, 17 * 28)  # the first tenant of a fresh registry has id 1


def test_settled_window_counts_the_tokens_used_not_reserved(live):
    key = new_tenant(live, "acme", tokens_per_minute=1000)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    prompt = list(range(10, 30))  # 20 tokens: each request reserves 20 + 30
    used = sum(client.completions.create(model="tiny", prompt=prompt, max_tokens=30, seed=s).usage.total_tokens
               for s in range(3))
    assert live.ctx.limiter.used(1) == (3, used)


# -- item 8: completions count, prompts per request capped -------------------------------------------
def test_300_prompts_times_n_4_do_not_count_once_against_requests_per_minute_2(serve):
    live = serve(max_prompts_per_request=300)
    live.ctx.limiter = RateLimiter(live.ctx.store, clock=Clock(WINDOW_NOW_S))
    key = new_tenant(live, "acme", requests_per_minute=2)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:  # 1,200 completions can never fit 2 per minute
        client.completions.create(model="tiny", prompt=["hi"] * 300, n=4, max_tokens=1)
    assert info.value.code == "request_too_large" and "1200 completions" in info.value.message
    two = client.completions.create(model="tiny", prompt=["hi", "yo"], max_tokens=1)  # 2 completions
    assert len(two.choices) == 2
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert "requests_per_minute=2" in limited.value.message


def test_n_counts_against_requests_per_minute(serve):
    live = serve()
    live.ctx.limiter = RateLimiter(live.ctx.store, clock=Clock(WINDOW_NOW_S))
    key = new_tenant(live, "acme", requests_per_minute=2)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    assert len(client.completions.create(model="tiny", prompt="hi", n=2, max_tokens=1).choices) == 2
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert live.ctx.limiter.used(1)[0] == 2


def test_prompts_per_request_are_capped(serve):
    live = serve()  # default max_prompts_per_request = 128
    key = new_tenant(live, "acme")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=["hi"] * 300, n=4, max_tokens=1)
    assert info.value.code == "too_many_prompts" and info.value.param == "prompt"
    assert "300 prompts" in info.value.message and "at most 128" in info.value.message
    assert len(client.completions.create(model="tiny", prompt=["hi"] * 128, max_tokens=1).choices) == 128


def test_a_request_larger_than_the_whole_limit_is_400_not_429():
    limiter = RateLimiter(MemoryStore(), clock=Clock(WINDOW_NOW_S))
    with pytest.raises(InvalidRequest) as info:
        admit(limiter, rpm=2, completions=1200)
    assert info.value.code == "request_too_large"
    with pytest.raises(InvalidRequest):
        admit(limiter, tpm=500, tokens=501)
    assert limiter.used(1) == (0, 0)  # nothing counted


# -- item 10: Redis killed and restarted inside one minute --------------------------------------------
def restart_redis_on(port: int) -> RedisProcess:
    process = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save",
                                "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis as redis_lib

    client = redis_lib.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return RedisProcess(port, process)
        except redis_lib.ConnectionError:
            threading.Event().wait(0.05)
    process.kill()
    pytest.fail("redis-server did not restart")


def admit_all(limiter, rpm: int, attempts: int) -> int:
    admitted = 0
    for _ in range(attempts):
        try:
            admit(limiter, rpm=rpm)
            admitted += 1
        except RateLimited:
            pass
    return admitted


def test_redis_killed_and_restarted_within_a_minute_does_not_double_requests_per_minute_60():
    redis = start_redis()
    monotonic = Clock(100.0)
    store = RedisStore(redis.url, retry_s=5.0, clock=monotonic)
    limiter = RateLimiter(store, clock=Clock(WINDOW_NOW_S))
    restarted = None
    try:
        assert admit_all(limiter, rpm=60, attempts=30) == 30  # counted in Redis
        redis.kill()
        assert admit_all(limiter, rpm=60, attempts=60) == 30  # in-process, from the last count seen (30)
        assert not store.available()
        restarted = restart_redis_on(redis.port)  # comes back empty
        monotonic.now += 6.0  # past retry_s: the next call tries Redis again
        assert admit_all(limiter, rpm=60, attempts=60) == 0  # the outage's counts were merged back
        assert store.available()
        assert limiter.used(1)[0] == 60
        import redis as redis_lib

        assert int(redis_lib.Redis(port=redis.port).get(f"loraplex:rl:1:req:{int(WINDOW_NOW_S // 60) * 60}")) == 60
    finally:
        redis.kill()
        if restarted is not None:
            restarted.kill()


def test_outage_seen_by_one_process_merges_with_what_others_counted(redis_server):
    """Redis stayed up for process B while A could not reach it: the merged count is
    B's count plus what A admitted alone (not the larger of the two)."""
    import redis as redis_lib

    monotonic = Clock(100.0)
    store_a = RedisStore(redis_server.url, retry_s=5.0, clock=monotonic)
    limiter_a = RateLimiter(store_a, clock=Clock(WINDOW_NOW_S))
    limiter_b = RateLimiter(RedisStore(redis_server.url), clock=Clock(WINDOW_NOW_S))
    assert admit_all(limiter_a, rpm=60, attempts=10) == 10
    live_client = store_a._client
    store_a._client = redis_lib.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2)
    assert admit_all(limiter_a, rpm=60, attempts=15) == 15  # A alone: 10 seen + 15
    assert admit_all(limiter_b, rpm=60, attempts=20) == 20  # B in Redis: 10 + 20
    store_a._client = live_client
    monotonic.now += 6.0
    assert limiter_a.used(1)[0] == 45  # merged: Redis 30 + 15 admitted by A during its outage
    assert admit_all(limiter_a, rpm=60, attempts=30) == 15


def test_in_process_windows_do_not_accumulate():
    monotonic, wall = Clock(0.0), Clock(WINDOW_NOW_S)
    store = MemoryStore(monotonic)
    limiter = RateLimiter(store, clock=wall)
    for _ in range(1000):  # 1,000 minutes of one request each
        admit(limiter, rpm=60, tokens=5)
        monotonic.now += 60
        wall.now += 60
    assert len(store) <= 2 * 4  # (requests, tokens) of the windows not yet past their 120 s expiry
