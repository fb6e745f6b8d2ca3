"""Shared state outside the database: a read-through lookup cache, per-tenant
rate-limit counters and live engine stats.

One small interface, :class:`Store`, with two implementations:

- :class:`MemoryStore`: in-process (used when ``LORAPLEX_REDIS_URL`` is unset);
- :class:`RedisStore`: Redis. When Redis fails at run time it logs once, serves
  cache misses (every lookup goes to the database), keeps counters in a
  :class:`MemoryStore`, retries after ``retry_s`` and, once Redis answers again,
  deletes every cached lookup (invalidations may have been missed meanwhile)
  before trusting it. Nothing is lost: the database stays the source of truth.

Counters (rate-limit windows, ``Store.incr`` / ``Store.reserve``) survive an outage
without doubling a window: every value Redis returns is mirrored into the in-process
fallback, so during the outage the fallback goes on from the last count seen (plus what
this process admits meanwhile); when Redis answers again, each counter changed during the
outage is merged back as ``max(redis + admitted meanwhile, local total)`` (Redis may have
restarted empty, or kept counting for other processes).

On top: :class:`LookupCache` (JSON values with a TTL, hit/miss counts); the rate limiter
lives in :mod:`loraplex.platform.limits`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

    def reserve(self, keys: Sequence[str], amounts: Sequence[int], limits: Sequence[int | None],
                ttl_s: float) -> Reservation:
        """Atomically: if ``value(key) + amount <= limit`` for every key with a limit, add every
        amount (counters created at 0 with expiry ``ttl_s``); else change nothing."""
        ...

    def available(self) -> bool:
        """False while a remote backend is unreachable."""
        ...


@dataclass(frozen=True)
class Reservation:
    """Outcome of :meth:`Store.reserve`: ``values`` are the counters after the call
    (unchanged when not ``admitted``), in the order of the keys."""

    admitted: bool
    values: tuple[int, ...]


class MemoryStore:
    """Thread-safe in-process :class:`Store` with per-key expiry (monotonic clock). Expired
    keys are swept every ``SWEEP_S`` of writes (rate-limit windows are never read again)."""

    SWEEP_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._data: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._next_sweep = clock() + self.SWEEP_S

    def __len__(self) -> int:
        """Keys held, expired ones not yet swept included."""
        return len(self._data)

    def _sweep(self, now: float) -> None:
        """Drop expired keys once per ``SWEEP_S`` (call with the lock held)."""
        if now < self._next_sweep:
            return
        for key in [k for k, (_, expires) in self._data.items() if expires <= now]:
            del self._data[key]
        self._next_sweep = now + self.SWEEP_S

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._live(key)

    def set(self, key: str, value: str, ttl_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._sweep(now)
            self._data[key] = (value, now + ttl_s)

    def delete(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)

    def incr(self, key: str, amount: int, ttl_s: float) -> int:
        with self._lock:
            self._sweep(self._clock())
            current = self._live(key)
            expires = self._data[key][1] if current is not None else self._clock() + ttl_s
            value = int(current or 0) + amount
            self._data[key] = (str(value), expires)
            return value

    def reserve(self, keys: Sequence[str], amounts: Sequence[int], limits: Sequence[int | None],
                ttl_s: float) -> Reservation:
        with self._lock:
            values = [int(self._live(k) or 0) for k in keys]
            for value, amount, limit in zip(values, amounts, limits, strict=True):
                if limit is not None and value + amount > limit:
                    return Reservation(False, tuple(values))
            now = self._clock()
            self._sweep(now)
            for i, (key, amount) in enumerate(zip(keys, amounts, strict=True)):
                expires = self._data[key][1] if key in self._data else now + ttl_s
                values[i] += amount
                self._data[key] = (str(values[i]), expires)
            return Reservation(True, tuple(values))

    def lower_by(self, key: str, amount: int, floor: int, ttl_s: float) -> int:
        """Counter ``key`` minus ``amount`` (>= 0), but not below ``floor``; return the new value."""
        with self._lock:
            self._sweep(self._clock())
            current = self._live(key)
            expires = self._data[key][1] if current is not None else self._clock() + ttl_s
            new = max(int(current or 0) - amount, floor)
            self._data[key] = (str(new), expires)
            return new

    def raise_to(self, key: str, value: int, ttl_s: float) -> int:
        """Set counter ``key`` to ``max(current, value)``; return the new value."""
        with self._lock:
            self._sweep(self._clock())
            current = self._live(key)
            expires = self._data[key][1] if current is not None else self._clock() + ttl_s
            new = max(int(current or 0), value)
            self._data[key] = (str(new), expires)
            return new

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


# KEYS: counters; ARGV: amounts (n), limits (n, -1 = none), ttl in ms. Returns {admitted, values...}.
_RESERVE_LUA = """
local n = #KEYS
local values = {}
for i = 1, n do values[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
for i = 1, n do
  local limit = tonumber(ARGV[n + i])
  if limit >= 0 and values[i] + tonumber(ARGV[i]) > limit then
    table.insert(values, 1, 0)
    return values
  end
end
for i = 1, n do
  values[i] = redis.call('INCRBY', KEYS[i], ARGV[i])
  if redis.call('PTTL', KEYS[i]) < 0 then redis.call('PEXPIRE', KEYS[i], ARGV[2 * n + 1]) end
end
table.insert(values, 1, 1)
return values
"""
# KEYS[1]: a counter; ARGV: added during the outage, local total, ttl in ms. Returns the merged value.
_MERGE_LUA = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local merged = math.max(current + tonumber(ARGV[1]), tonumber(ARGV[2]))
redis.call('SET', KEYS[1], merged)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return merged
"""


class RedisStore:
    """:class:`Store` backed by Redis, degrading to "no cache" while Redis is unreachable
    (counters: see the module docstring).

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
        self._clock = clock
        self._retry_s = retry_s
        self._down = False
        self._down_until = 0.0
        self._needs_flush = False
        self._lock = threading.Lock()
        self._reserve = self._client.register_script(_RESERVE_LUA)
        self._merge = self._client.register_script(_MERGE_LUA)
        # counter key -> (local value when the outage began, ttl_s): counters changed in the fallback
        self._outage_base: dict[str, tuple[int, float]] = {}
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
        result = self.reserve([key], [amount], [None], ttl_s)
        return result.values[0]

    def reserve(self, keys: Sequence[str], amounts: Sequence[int], limits: Sequence[int | None],
                ttl_s: float) -> Reservation:
        ms = max(1, int(ttl_s * 1000))
        args = [*amounts, *(-1 if lim is None else lim for lim in limits), ms]

        def remote(client) -> Reservation:
            out = [int(v) for v in self._reserve(keys=list(keys), args=args, client=client)]
            result = Reservation(bool(out[0]), tuple(out[1:]))
            # Mirror for an outage. Raised only (replies of concurrent calls arrive in any order, and a
            # mirror too high only refuses early), except by a give-back: it is taken off the mirror too,
            # never below what Redis answered (else a refund settled in Redis would be lost in an outage).
            for key, amount, value in zip(keys, amounts, result.values, strict=True):
                if result.admitted and amount < 0:
                    self._fallback.lower_by(key, -amount, value, ttl_s)
                else:
                    self._fallback.raise_to(key, value, ttl_s)
            return result

        def local(fallback: MemoryStore) -> Reservation:
            with self._lock:
                for key in keys:
                    if key not in self._outage_base:
                        self._outage_base[key] = (int(fallback.get(key) or 0), ttl_s)
            return fallback.reserve(keys, amounts, limits, ttl_s)

        return self._call(remote, default=None, fallback=local)

    def available(self) -> bool:
        return bool(self._call(lambda c: c.ping(), default=False))

    def _call(self, op, *, default, fallback=None):
        if self._down and self._clock() < self._down_until:
            self.skipped_while_down += 1
            return fallback(self._fallback) if fallback else default
        try:
            if self._needs_flush:
                self._flush_cache()
            if self._outage_base:
                self._merge_counters()
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

    def _merge_counters(self) -> None:
        """Push the counters changed during an outage back into Redis (see the module docstring)."""
        with self._lock:
            pending = dict(self._outage_base)
        for key, (base, ttl_s) in pending.items():
            total = int(self._fallback.get(key) or 0)
            merged = self._merge(keys=[key], args=[total - base, total, max(1, int(ttl_s * 1000))],
                                 client=self._client)
            self._fallback.raise_to(key, int(merged), ttl_s)
            with self._lock:
                self._outage_base.pop(key, None)
        if pending:
            logger.info("merged %d rate-limit counters kept in-process during the Redis outage", len(pending))

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


STATS_KEY = NAMESPACE + "stats:engine"


def publish_stats(store: Store, stats: dict[str, Any], ttl_s: float) -> None:
    """Store the latest engine stats (read by the console and /admin/stats)."""
    store.set(STATS_KEY, json.dumps(stats), ttl_s)


def read_stats(store: Store) -> dict[str, Any] | None:
    """The latest published engine stats, or None."""
    raw = store.get(STATS_KEY)
    return json.loads(raw) if raw else None
