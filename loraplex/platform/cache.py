"""Shared state outside the database: a read-through lookup cache, per-tenant
rate-limit counters and live engine stats.

One small interface, :class:`Store`, with two implementations:

- :class:`MemoryStore`: in-process (used when ``LORAPLEX_REDIS_URL`` is unset);
- :class:`RedisStore`: Redis. When Redis fails at run time it logs once, serves
  cache misses (every lookup goes to the database), keeps counters in a
  :class:`MemoryStore`, retries after ``retry_s`` and, once Redis answers again,
  deletes every cached lookup (invalidations may have been missed meanwhile)
  before trusting it. Nothing is lost: the database stays the source of truth.

On top: :class:`LookupCache` (JSON values with a TTL, hit/miss counts) and
:class:`RateLimiter` (fixed one-minute windows, HTTP 429 with ``Retry-After``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from loraplex.platform.errors import RateLimited

logger = logging.getLogger(__name__)

NAMESPACE = "loraplex:"
CACHE_PREFIX = NAMESPACE + "cache:"


class Store(Protocol):
    """Key-value operations the platform needs (keys are full names, values strings)."""

    def get(self, key: str) -> str | None: ...

    def set(self, key: str, value: str, ttl_s: float) -> None: ...

    def delete(self, *keys: str) -> None: ...

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        """Add ``amount`` to an integer counter (created at 0 with expiry ``ttl_s``); return the new value."""
        ...

    def available(self) -> bool:
        """False while a remote backend is unreachable."""
        ...


class MemoryStore:
    """Thread-safe in-process :class:`Store` with per-key expiry (monotonic clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._data: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._live(key)

    def set(self, key: str, value: str, ttl_s: float) -> None:
        with self._lock:
            self._data[key] = (value, self._clock() + ttl_s)

    def delete(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``."""
        with self._lock:
            for key in [k for k in self._data if k.startswith(prefix)]:
                del self._data[key]

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        with self._lock:
            current = self._live(key)
            expires = self._data[key][1] if current is not None else self._clock() + ttl_s
            value = int(current or 0) + amount
            self._data[key] = (str(value), expires)
            return value

    def available(self) -> bool:
        return True

    def _live(self, key: str) -> str | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= self._clock():
            del self._data[key]
            return None
        return item[0]


class RedisStore:
    """:class:`Store` backed by Redis, degrading to "no cache" while Redis is unreachable.

    ``clock`` (seconds, monotonic) times the ``retry_s`` window. Counters: ``redis_failures``
    (operations that tried Redis and failed) and ``skipped_while_down`` (operations answered
    without trying Redis because the retry window had not passed).
    """

    def __init__(self, url: str, *, retry_s: float = 5.0, timeout_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        # No client-side retries: a dead Redis must cost one timeout per retry_s, not seconds per call.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            decode_responses=True, retry=Retry(NoBackoff(), 0))
        self._fallback = MemoryStore()
        self._retry_s = retry_s
        self._down = False
        self._down_until = 0.0
        self._needs_flush = False
        self._lock = threading.Lock()
        self._clock = clock
        self.redis_failures = 0
        self.skipped_while_down = 0

    def get(self, key: str) -> str | None:
        if key.startswith(CACHE_PREFIX):
            return self._call(lambda c: c.get(key), default=None)
        return self._call(lambda c: c.get(key), default=None, fallback=lambda f: f.get(key))

    def set(self, key: str, value: str, ttl_s: float) -> None:
        ms = max(1, int(ttl_s * 1000))
        if key.startswith(CACHE_PREFIX):
            self._call(lambda c: c.set(key, value, px=ms), default=None)
        else:
            self._call(lambda c: c.set(key, value, px=ms), default=None,
                       fallback=lambda f: f.set(key, value, ttl_s))

    def delete(self, *keys: str) -> None:
        if not keys:
            return
        if self._call(lambda c: c.delete(*keys), default=None) is None:
            # Missed invalidation: flush all cached lookups when Redis is back.
            self._needs_flush = True
        self._fallback.delete(*keys)

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        ms = max(1, int(ttl_s * 1000))

        def remote(client) -> int:
            pipe = client.pipeline()
            pipe.incrby(key, amount)
            pipe.pexpire(key, ms, nx=True)
            return int(pipe.execute()[0])

        return self._call(remote, default=None, fallback=lambda f: f.incr(key, amount, ttl_s))

    def available(self) -> bool:
        return bool(self._call(lambda c: c.ping(), default=False))

    def _call(self, op, *, default, fallback=None):
        if self._down and self._clock() < self._down_until:
            self.skipped_while_down += 1
            return fallback(self._fallback) if fallback else default
        try:
            if self._needs_flush:
                self._flush_cache()
            result = op(self._client)
        except self._errors as exc:
            self._mark_down(exc)
            return fallback(self._fallback) if fallback else default
        if self._down:
            self._down = False
            logger.warning("Redis is reachable again")
        return result

    def _flush_cache(self) -> None:
        keys = list(self._client.scan_iter(match=CACHE_PREFIX + "*", count=500))
        if keys:
            self._client.delete(*keys)
        self._needs_flush = False
        logger.info("flushed %d cached lookups from Redis (invalidations may have been missed)", len(keys))

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            was_up = not self._down
            self.redis_failures += 1
            self._down = True
            self._down_until = self._clock() + self._retry_s
            self._needs_flush = True
        if was_up:
            logger.warning("Redis unavailable (%s): serving without cache, retrying every %.1f s",
                           exc, self._retry_s)


def make_store(redis_url: str | None, *, retry_s: float = 5.0) -> Store:
    """A :class:`RedisStore` for ``redis_url``, else a :class:`MemoryStore`."""
    return RedisStore(redis_url, retry_s=retry_s) if redis_url else MemoryStore()


class LookupCache:
    """Read-through cache of JSON-serialisable lookups under ``loraplex:cache:<key>``."""

    def __init__(self, store: Store, ttl_s: float) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.hits = 0
        self.misses = 0

    def get_or_load(self, key: str, load: Callable[[], Any]) -> Any:
        """The cached value of ``key``, else ``load()`` (cached unless it returns None)."""
        raw = self.store.get(CACHE_PREFIX + key)
        if raw is not None:
            self.hits += 1
            return json.loads(raw)
        self.misses += 1
        value = load()
        if value is not None:
            self.store.set(CACHE_PREFIX + key, json.dumps(value), self.ttl_s)
        return value

    def invalidate(self, *keys: str) -> None:
        """Forget ``keys`` (call after every write that changes what they cache)."""
        self.store.delete(*(CACHE_PREFIX + k for k in keys))

    def stats(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "available": self.store.available(),
                "backend": type(self.store).__name__}


class RateLimiter:
    """Per-tenant requests- and tokens-per-minute limits over fixed one-minute windows.

    A request is refused (HTTP 429, ``Retry-After`` = seconds to the next window) when the
    tenant already made ``requests_per_minute`` requests this window, or already used
    ``tokens_per_minute`` tokens (prompt + completion, counted when a request finishes).
    """

    WINDOW_S = 60

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock

    def _window(self) -> tuple[int, int]:
        now = self._clock()
        start = int(now // self.WINDOW_S) * self.WINDOW_S
        return start, max(1, int(start + self.WINDOW_S - now + 0.999))

    def check_request(self, *, tenant_id: int, requests_per_minute: int | None,
                      tokens_per_minute: int | None) -> None:
        """Count one request; raise :class:`RateLimited` when a limit is reached."""
        start, retry_after_s = self._window()
        if tokens_per_minute is not None:
            used = int(self.store.get(f"{NAMESPACE}rl:{tenant_id}:tok:{start}") or 0)
            if used >= tokens_per_minute:
                raise RateLimited(f"Rate limit reached: tokens_per_minute={tokens_per_minute} "
                                  f"(used {used}); retry in {retry_after_s} s.", retry_after_s=retry_after_s)
        if requests_per_minute is not None:
            count = self.store.incr(f"{NAMESPACE}rl:{tenant_id}:req:{start}", 1, self.WINDOW_S * 2)
            if count > requests_per_minute:
                raise RateLimited(f"Rate limit reached: requests_per_minute={requests_per_minute}; "
                                  f"retry in {retry_after_s} s.", retry_after_s=retry_after_s)

    def add_tokens(self, *, tenant_id: int, tokens: int) -> None:
        """Charge ``tokens`` to the tenant's current window."""
        start, _ = self._window()
        self.store.incr(f"{NAMESPACE}rl:{tenant_id}:tok:{start}", tokens, self.WINDOW_S * 2)


STATS_KEY = NAMESPACE + "stats:engine"


def publish_stats(store: Store, stats: dict[str, Any], ttl_s: float) -> None:
    """Store the latest engine stats (read by the console and /admin/stats)."""
    store.set(STATS_KEY, json.dumps(stats), ttl_s)


def read_stats(store: Store) -> dict[str, Any] | None:
    """The latest published engine stats, or None."""
    raw = store.get(STATS_KEY)
    return json.loads(raw) if raw else None
