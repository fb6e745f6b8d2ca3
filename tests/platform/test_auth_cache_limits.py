"""Keys, caching and rate limits, with the in-process store and with a real redis-server:
revocation is immediate (cache invalidated), 429 with Retry-After, and serving survives
Redis being killed mid-run."""

from __future__ import annotations


import openai
import pytest
from platform_testlib import new_tenant

PROMPT = "The quick brown"


@pytest.fixture(params=["memory", "redis"])
def live(request, serve):
    if request.param == "memory":
        return serve()
    redis = request.getfixturevalue("redis_server")
    live = serve(redis_url=redis.url, redis_retry_s=0.5)
    live.redis = redis
    return live


def test_revoked_key_is_refused_at_once(live):
    key = new_tenant(live, "acme")
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    client.models.list()
    assert live.ctx.cache.hits >= 1  # the second lookup came from the cache
    with live.admin() as admin:
        keys = admin.get("/admin/tenants/acme/keys").json()
        assert [set(k) for k in keys] == [{"id", "prefix", "created_at", "revoked_at"}]
        assert key.startswith(keys[0]["prefix"]) and key not in str(keys)
        assert admin.delete(f"/admin/tenants/acme/keys/{keys[0]['id']}").status_code == 204
        assert admin.get("/admin/tenants/acme/keys").json()[0]["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_deleted_tenant_keys_stop_working_and_limits_apply_at_once(live):
    key = new_tenant(live, "acme")
    with live.tenant(key) as client, live.admin() as admin:
        assert client.get("/v1/models").status_code == 200
        assert admin.patch("/admin/tenants/acme", json={"requests_per_minute": 1}).json()["requests_per_minute"] == 1
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 429
        assert admin.delete("/admin/tenants/acme").status_code == 204
        assert client.get("/v1/models").status_code == 401
        assert admin.get("/admin/tenants/acme").status_code == 404


def test_requests_per_minute_gives_429_with_retry_after(live):
    key = new_tenant(live, "acme", requests_per_minute=2)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    for _ in range(2):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    retry_after = int(info.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 90  # sliding window: 2 completions fit again 90 s after this minute began at the latest
    assert info.value.code == "rate_limit_exceeded" and "requests_per_minute=2" in info.value.message
    other = openai.OpenAI(api_key=new_tenant(live, "other", requests_per_minute=2), base_url=live.url + "/v1",
                          max_retries=0)
    assert other.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_tokens_per_minute_gives_429(live):
    key = new_tenant(live, "acme", tokens_per_minute=30)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    prompt_tokens = first.usage.prompt_tokens
    assert first.usage.total_tokens == prompt_tokens + 8
    # reserved: prompt + max_tokens; 30 - (prompt + 8) tokens are left in this window
    left = 30 - first.usage.total_tokens
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=left - prompt_tokens + 1)
    assert "tokens_per_minute=30" in info.value.message
    assert int(info.value.response.headers["Retry-After"]) >= 1
    with pytest.raises(openai.BadRequestError) as too_large:  # could never fit in one minute
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=31 - prompt_tokens)
    assert too_large.value.code == "request_too_large"


def test_serving_survives_redis_being_killed(serve, redis_server):
    live = serve(redis_url=redis_server.url, redis_retry_s=5.0)
    store = live.ctx.store
    store._clock = lambda: 0.0  # frozen: the retry window never passes during the requests below
    key = new_tenant(live, "acme", requests_per_minute=100)
    client = openai.OpenAI(api_key=key, base_url=live.url + "/v1", max_retries=0, timeout=30)
    client.models.list()
    client.models.list()
    assert live.ctx.cache.stats()["available"] is True and live.ctx.cache.hits >= 1
    assert store.redis_failures == 0
    redis_server.kill()
    for _ in range(3):
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        assert response.usage.completion_tokens >= 1
    # A dead Redis costs one failed call per retry window, not one per operation: the first
    # failure (possibly one per thread racing it) marks it down, later operations skip it.
    assert 1 <= store.redis_failures <= 2
    assert store.skipped_while_down >= 3 * 2  # per request: key lookup + rate-limit counter at least
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert live.ctx.usage.flush()  # usage is written by a background writer
    with live.admin() as admin:
        stats = admin.get("/admin/stats").json()
        assert stats["cache"]["available"] is False
        assert stats["tenants"] == [{"tenant": "acme", "requests": 3, "prompt_tokens": 3 * response.usage.prompt_tokens,
                                     "completion_tokens": stats["tenants"][0]["completion_tokens"]}]
        # writes still invalidate: revoking a key while Redis is down is immediate too
        key_id = admin.get("/admin/tenants/acme/keys").json()[0]["id"]
        assert admin.delete(f"/admin/tenants/acme/keys/{key_id}").status_code == 204
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_redis_recovery_does_not_resurrect_revoked_keys(serve, redis_server):
    """A key revoked while this process could not reach Redis must not come back from the
    entry Redis still holds once it is reachable again (the cache is flushed on recovery)."""
    import redis as redis_lib

    live = serve(redis_url=redis_server.url, redis_retry_s=5.0)
    key = new_tenant(live, "acme")
    with live.tenant(key) as client, live.admin() as admin:
        assert client.get("/v1/models").status_code == 200
        store = live.ctx.store
        now_s = [0.0]
        store._clock = lambda: now_s[0]
        # Simulate an outage seen by this process only: point the client at a dead port.
        original = store._client
        store._client = redis_lib.Redis(host="127.0.0.1", port=1, socket_timeout=0.2, socket_connect_timeout=0.2,
                                        retry=None)
        key_id = admin.get("/admin/tenants/acme/keys").json()[0]["id"]
        assert admin.delete(f"/admin/tenants/acme/keys/{key_id}").status_code == 204
        assert client.get("/v1/models").status_code == 401
        store._client = original  # Redis "comes back", still holding the old cached entry
        now_s[0] += 5.0  # the retry window has passed
        assert client.get("/v1/models").status_code == 401
        assert not store._down and not store._needs_flush  # Redis was asked again, and flushed first
