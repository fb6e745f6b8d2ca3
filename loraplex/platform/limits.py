"""Per-tenant rate limits: ``requests_per_minute`` and ``tokens_per_minute`` over a sliding
one-minute window, enforced by reservation.

Sliding window counter (the approximation of the ``limits`` library's
``SlidingWindowCounterRateLimiter`` and of Cloudflare's rate limiter): counts are kept per
fixed minute (UTC minute boundaries), and at time ``now`` the window's usage is
``current + ceil(previous * (1 - elapsed / 60))`` where ``elapsed`` is the time since the
current minute began, i.e. the previous minute's count weighted by how much of it the
last 60 s still cover. Right after a minute boundary the previous minute still counts whole,
so a burst at the end of one minute is not followed by a whole limit's worth at the start of
the next (fixed windows allowed twice a limit within a second). The counter assumes the
previous minute's use was spread evenly: some 60 s spans can still see up to about twice a
limit (e.g. 19 at requests_per_minute=10 for a burst at 59.9 s followed by steady retries).

Admission (:meth:`RateLimiter.admit`) reserves, in one atomic step of the store (a Lua
script in Redis, a lock in-process), both

- ``completions`` = prompts x ``n`` against ``requests_per_minute``, and
- ``tokens`` = prompt tokens + ``max_tokens`` per completion against ``tokens_per_minute``,

in the current minute's counters, against the limit minus the previous minute's weighted
share, and refuses the request (429, ``Retry-After`` = seconds until that much of the
window has slid by, if nothing else is used meanwhile) without changing either counter when
one of them would go over its limit. So concurrent requests can never overshoot a limit.
When the request ends, :meth:`RateLimiter.settle` gives back the reserved tokens it did not
use (in the minute where they were reserved). A request that could never fit (more
completions or tokens than the whole per-minute limit) gets 400 ``request_too_large``
instead of a 429 that retrying cannot cure.

Own code rather than the ``limits`` library: that library's ``hit(cost)`` checks one
limit at a time (no atomic check of two limits together), cannot give tokens back, and
has no fallback that carries a window's count across a Redis outage; the store
(:mod:`loraplex.platform.cache`) provides those three. The window algorithm is the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loraplex.platform.cache import NAMESPACE, Store
from loraplex.platform.errors import InvalidRequest, RateLimited


@dataclass(frozen=True)
class Admission:
    """What :meth:`RateLimiter.admit` reserved for one request (settle it exactly once)."""

    tenant_id: int
    window_start_s: int
    completions: int
    reserved_tokens: int


def reserved_tokens(prompt_lens: Sequence[int], *, n: int, max_tokens: int | None, max_model_len: int) -> int:
    """Tokens a request may use at most: every prompt once plus ``max_tokens`` per completion
    (without ``max_tokens``: up to ``max_model_len`` per completion)."""
    return sum(length + n * (max_tokens if max_tokens is not None else max(0, max_model_len - length))
               for length in prompt_lens)


def _carried(previous: int, weight: float) -> int:
    """The previous minute's count still inside the window, rounded up (an integer limit check
    ``current + carried + amount <= limit`` then equals the real-valued one; rounding down let a
    full previous minute count one less just after the boundary). The 1e-9 keeps float noise
    (100 * 0.75 = 75.00000000000001) from adding one."""
    return math.ceil(previous * weight - 1e-9)


class RateLimiter:
    """Reservation-based per-tenant limits (see the module docstring); ``clock`` = wall seconds."""

    WINDOW_S = 60

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock

    def _window(self) -> tuple[int, float]:
        """(start of the current minute in epoch seconds, share of the previous minute still inside the
        sliding window: ``1 - elapsed / 60``)."""
        now = self._clock()
        start = int(now // self.WINDOW_S) * self.WINDOW_S
        return start, 1.0 - (now - start) / self.WINDOW_S

    def _retry_after_s(self, start: int, weight: float, previous: int, current: int, amount: int,
                       limit: int) -> int:
        """Whole seconds (>= 1) until ``amount`` more fits under ``limit``, if nothing else is used meanwhile."""
        now = start + (1.0 - weight) * self.WINDOW_S
        if current + amount <= limit:  # within this minute, once the previous one's share has slid out
            wait_until = start + self.WINDOW_S * (1.0 - (limit - current - amount) / max(previous, 1))
        else:  # next minute, once enough of this one's count has slid out
            wait_until = start + self.WINDOW_S * (2.0 - (limit - amount) / max(current, 1))
        return max(1, math.ceil(wait_until - now - 1e-9))

    def _keys(self, tenant_id: int, start: int) -> tuple[str, str]:
        return f"{NAMESPACE}rl:{tenant_id}:req:{start}", f"{NAMESPACE}rl:{tenant_id}:tok:{start}"

    def admit(self, *, tenant_id: int, requests_per_minute: int | None, tokens_per_minute: int | None,
              completions: int, tokens: int) -> Admission:
        """Reserve ``completions`` and ``tokens`` in the current window.

        Raises ``InvalidRequest`` (400, code ``request_too_large``) when the request alone is over
        a limit, ``RateLimited`` (429 with ``retry_after_s``) when the window has no room left.
        """
        if requests_per_minute is not None and completions > requests_per_minute:
            raise InvalidRequest(
                f"This request asks for {completions} completions (prompts x n) but requests_per_minute="
                f"{requests_per_minute} counts completions: send fewer prompts or a smaller n.",
                param="n", code="request_too_large")
        if tokens_per_minute is not None and tokens > tokens_per_minute:
            raise InvalidRequest(
                f"This request may use {tokens} tokens (prompt tokens + max_tokens per completion) but "
                f"tokens_per_minute={tokens_per_minute}: lower max_tokens, n or the prompt.",
                param="max_tokens", code="request_too_large")
        start, weight = self._window()
        req_key, tok_key = self._keys(tenant_id, start)
        prev_requests, prev_tokens = self._previous(tenant_id, start)
        carried = (_carried(prev_requests, weight), _carried(prev_tokens, weight))
        limits = [None if limit is None else max(0, limit - carry)
                  for limit, carry in zip((requests_per_minute, tokens_per_minute), carried)]
        result = self.store.reserve([req_key, tok_key], [completions, tokens], limits, self.WINDOW_S * 2)
        if not result.admitted:
            used_requests, used_tokens = result.values
            requests_full = requests_per_minute is not None and used_requests + completions > limits[0]
            tokens_full = tokens_per_minute is not None and used_tokens + tokens > limits[1]
            # Retry-After: until every limit that refused has room (the longer wait when both did).
            retry_after_s = max(
                self._retry_after_s(start, weight, prev_requests, used_requests, completions, requests_per_minute)
                if requests_full else 1,
                self._retry_after_s(start, weight, prev_tokens, used_tokens, tokens, tokens_per_minute)
                if tokens_full else 1)
            if requests_full:
                raise RateLimited(f"Rate limit reached: requests_per_minute={requests_per_minute} (used "
                                  f"{used_requests + carried[0]} completions in the last 60 s, this request needs "
                                  f"{completions}); retry in {retry_after_s} s.", retry_after_s=retry_after_s)
            raise RateLimited(f"Rate limit reached: tokens_per_minute={tokens_per_minute} (used or reserved "
                              f"{used_tokens + carried[1]} in the last 60 s, this request may use {tokens}); retry in "
                              f"{retry_after_s} s.", retry_after_s=retry_after_s)
        return Admission(tenant_id, start, completions, tokens)

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Give back the reserved tokens ``admission`` did not use (or charge any it used beyond)."""
        delta = used_tokens - admission.reserved_tokens
        if delta:
            _, tok_key = self._keys(admission.tenant_id, admission.window_start_s)
            self.store.incr(tok_key, delta, self.WINDOW_S * 2)

    def charge(self, *, tenant_id: int, tokens: int) -> None:
        """Charge ``tokens`` used without an admission to the current minute."""
        start, _ = self._window()
        self.store.incr(self._keys(tenant_id, start)[1], tokens, self.WINDOW_S * 2)

    def _previous(self, tenant_id: int, start: int) -> tuple[int, int]:
        """(completions, tokens) counted in the minute before the one starting at ``start``."""
        req_key, tok_key = self._keys(tenant_id, start - self.WINDOW_S)
        return max(0, int(self.store.get(req_key) or 0)), max(0, int(self.store.get(tok_key) or 0))

    def used(self, tenant_id: int) -> tuple[int, int]:
        """(completions, tokens) counted in the sliding window ending now (reserved tokens included)."""
        start, weight = self._window()
        req_key, tok_key = self._keys(tenant_id, start)
        prev_requests, prev_tokens = self._previous(tenant_id, start)
        return (int(self.store.get(req_key) or 0) + _carried(prev_requests, weight),
                int(self.store.get(tok_key) or 0) + _carried(prev_tokens, weight))
